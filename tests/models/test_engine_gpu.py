"""The engine on the GPU: the same requests through `implementation="auto"` (the Triton kernels:
paged prefill and decode, GDN chunked prefill and decode pools, conv1d, MLA decode) and through
`"xla"` (the references), stepped in lockstep; every step's next-token logits must agree.

Tiny random models of three state kinds: Llama (attention pages, with a streaming policy in the
mix), Qwen3-Next (GDN slot pools + gated attention) and DeepSeek-V3 (MLA latent pages).
"""

import jax
import numpy as np
import pytest

import models
from models.engine import Engine, Policy, Request, SamplingParams
from tests.models import tiny

pytestmark = pytest.mark.gpu
SHAPE = dict(batch_slots=2, max_len=256, page_size=8, chunk=16, num_pages=24)


def _model(family, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"gpu_{family}"))
    if family == "llama":
        tiny.save_tiny("llama", path, ids=tiny.token_ids(1, 4))
    else:
        tiny.save_hybrid(family, path)
    return models.from_pretrained(path, progress=False)


def _requests(model, engine, seed):
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=6)
    policy = None
    if engine.layer_kinds.count("attention") and "mla" not in engine.layer_kinds:
        policy = Policy.streaming(len(model.layers), engine.num_kv_heads, window=12, sinks=4)
    lengths = (5, 37, 20)
    return [Request([int(t) for t in rng.integers(0, tiny.VOCAB, n)], params,
                    policy if i == 1 else None) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "deepseek_v3"])
def test_triton_engine_matches_xla_engine(family, tmp_path_factory):
    assert jax.default_backend() == "gpu"
    model = _model(family, tmp_path_factory)
    engines = {impl: Engine(model, **SHAPE, implementation=impl) for impl in ("auto", "xla")}
    reqs = {impl: [e.add(r) for r in _requests(model, e, seed=5)] for impl, e in engines.items()}
    compared = 0
    while not engines["xla"].idle:
        rows = [r.row for r in engines["xla"].slots if r is not None]
        for e in engines.values():
            e.step()
        got, want = (np.asarray(engines[i].last_logits) for i in ("auto", "xla"))
        for row in rows:
            scale = np.abs(want[row]).max()
            np.testing.assert_allclose(got[row], want[row], atol=2e-2 * scale, rtol=0,
                                       err_msg=f"{family} row {row} step {compared}")
        compared += 1
        outs = [[r.output for r in reqs[i]] for i in ("auto", "xla")]
        if outs[0] != outs[1]:  # a near-tie took another token: later logits are not comparable
            break
    assert compared >= 5
    if engines["xla"].idle:  # every page back (GDN layers hold no pages)
        e = engines["auto"]
        assert np.all(e.free_pages()[list(e.paged_layers)] == e.num_pages - 1)
