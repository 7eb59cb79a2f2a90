"""The engine package's boundaries: it imports no model family, its adapter registry resolves
per layer kind (a family's routed adapter only for a routed engine), and refuses a second class
under a taken kind."""

import ast
import dataclasses
import pathlib
import subprocess
import sys
from typing import ClassVar

import pytest
from flax import nnx

from models.config import HFConfig
from models.engine import Engine, adapters
from models.families import pawqwen3 as paw
from models.families.pawqwen3_engine import ElasticAdapter
from tests.models import tiny

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "models" / "engine"


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                parts = list(path.relative_to(ROOT).with_suffix("").parts)[:-node.level]
                base = ".".join(parts + ([base] if base else []))
            names.update([base] + [f"{base}.{a.name}" for a in node.names])
    return names


def test_engine_source_imports_no_family():
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        bad = sorted(n for n in _imports(path) if n.startswith("models.families"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_engine_import_loads_no_family():
    """Import `models.engine` under a bare `models` package (so `models/__init__.py`, which loads
    every family, does not run): no `models.families` module may be loaded, even transitively."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('models'); pkg.__path__ = [{str(ROOT / 'models')!r}]\n"
        "sys.modules['models'] = pkg\n"
        "import models.engine\n"
        "from models.engine import Engine, Policy, Request, SamplingParams\n"
        "print(sorted(m for m in sys.modules if m.startswith('models.families')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture(scope="module")
def paw_model():
    cfg = dict(tiny.base_config("qwen3"), architectures=["PawQwen3ForCausalLM"],
               enable_ada_sparsity=True, use_softmax=True, pooling_mode="ctx_q", block_size=16,
               longctx_testing_small_blocks=True, sink_size=16, local_window_size=32)
    return paw.PawQwen3ForCausalLM(paw.config_from_hf(HFConfig(cfg, source="tiny")),
                                   rngs=nnx.Rngs(0))


def test_registry_resolves_by_kind(paw_model):
    assert {"attention", "mla", "gdn", "elastic"} <= set(adapters.ADAPTERS)
    mixer = paw_model.layers[0].mixer
    plain = adapters.resolve(paw_model, 0, mixer, routed=False)
    routed = adapters.resolve(paw_model, 0, mixer, routed=True)
    assert type(plain) is adapters.AttentionAdapter
    assert routed == ElasticAdapter(retrieval=routed.retrieval, toggle=routed.toggle, window=32,
                                    sinks=16)
    assert hash(routed) == hash(adapters.resolve(paw_model, 1, paw_model.layers[1].mixer,
                                                 routed=True))  # one compiled step per config
    shape = dict(batch_slots=1, max_len=32, page_size=8, chunk=16, implementation="xla")
    assert Engine(paw_model, **shape).layer_kinds == ("attention",) * len(paw_model.layers)
    assert Engine(paw_model, elastic=True, **shape).layer_kinds == ("elastic",) * len(
        paw_model.layers)


def test_registry_errors():
    @dataclasses.dataclass(frozen=True)
    class Clash(adapters.AttentionAdapter):
        kind: ClassVar[str] = "gdn"

    with pytest.raises(ValueError, match="adapter kind 'gdn' is already registered to GDNAdapter"):
        adapters.register_adapter(Clash)
    assert adapters.ADAPTERS["gdn"] is adapters.GDNAdapter
    with pytest.raises(ValueError, match=r"layer 3 has a int mixer; .* AttentionAdapter"):
        adapters.resolve(None, 3, 7, routed=False)
