"""Every notebook runs top to bottom in a Jupyter kernel (nbclient) at its CPU-sized setting, and
its `.ipynb` holds the same cells as its jupytext percent script (the reviewed source)."""

import os
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.py"))


def _read(path: Path):
    import jupytext

    return jupytext.read(path)


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_and_cpu_sized(path):
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --sync {path}`"
    assert _cells(_read(ipynb)) == _cells(_read(path)), (
        f"{ipynb.name} and {path.name} differ: run `jupytext --sync {path}`")
    code = "\n".join(c.source for c in _read(path).cells if c.cell_type == "code")
    if re.search(r"^GPU = ", code, re.M):  # the setting named at the top stays CPU-sized
        assert re.search(r"^GPU = False$", code, re.M), f"{path.name}: GPU must be False in CI"


def _execute(path: Path) -> str:
    """Run the notebook in a fresh kernel from its own folder; its stream output."""
    from nbclient import NotebookClient

    nb = _read(path)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


def _ratio(out: str, label: str) -> float:
    return float(re.search(rf"{re.escape(label)}:.*\(([\d.]+) of dense\)", out)[1])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    # A notebook on real weights (SmolLM2) runs real-sized forwards: XLA's full optimisation and
    # its default CPU emitters pay for themselves there (the classic emitters at full
    # optimisation make heads and quickstart take over a third longer). One on tiny random
    # models compiles more than it runs, like the tiny-shape tests, and keeps their cheap
    # compile settings (conftest): state_pools and serving run a quarter faster in them.
    if "load_pretrained(" in path.read_text():
        monkeypatch.delenv("JAX_DISABLE_MOST_OPTIMIZATIONS", raising=False)
        monkeypatch.setenv("XLA_FLAGS", re.sub(r"\s*--xla_cpu_use_fusion_emitters=\S+", "",
                                               os.environ.get("XLA_FLAGS", "")))
    out = _execute(path)
    if path.stem == "kv_policies":  # the paged step must reproduce dense attention
        err = float(out.split("max |paged - dense| =")[1].split()[0])
        assert err < 1e-4, out
    if path.stem == "quickstart":  # streaming heads hold fewer pages; fp8 pages are smaller
        window = _ratio(out, "all heads window")
        headwise = _ratio(out, "head-wise (half the heads)")
        assert window < headwise < _ratio(out, "layers 10-19 window") < 1, out
        assert _ratio(out, "dense, fp8 pages") < 0.3, out  # float32 -> e4m3 + scales
    if path.stem == "state_pools":  # the byte accounting equals the engine's, on both tiny models
        assert len(re.findall(r"engine (\d+) bytes, request_bytes \1 bytes", out)) == 2, out
    if path.stem == "heads":  # scored heads keep at least the passkeys every-other heads keep
        hits = {m[1].strip(): int(m[2]) for m in re.finditer(r"^ *([\w ]+): (\d+)/\d+ passkeys",
                                                           out, re.M)}
        assert set(hits) == {"dense", "every other", "scored", "trained"}, out
        assert hits["scored"] >= hits["every other"], out
    if path.stem == "serving":  # every configuration served every request
        lines = re.findall(r"^ *(uniform|headwise|fp8): +[\d.]+ tok/s, \d+ preemptions, peak",
                           out, re.M)
        assert sorted(lines) == ["fp8", "headwise", "uniform"], out
    if path.stem == "kernel_roofline":
        assert re.search(r"^decode: \d+ rows", out, re.M), out
