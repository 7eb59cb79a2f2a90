"""Tensor-parallel engine (`Engine(mesh=...)`) against the one-device engine, on 4 CPU devices.

JAX fixes its CPU device count when it starts, so the sharded checks run in one subprocess with
`--xla_force_host_platform_device_count=4` (this module run as a script: `_worker`); each pytest
case reads that run's verdict for its own check. A check builds a tiny random model whose head
counts split over 4 devices, runs the same requests (prompts longer than a chunk, more requests
than slots, so chunked prefill, mixed prefill / decode steps and slot reuse are all in) through
a one-device engine and a 4-way tensor-parallel one, and requires identical tokens (greedy and
sampled rows: each device samples its rows with the rows' own keys), next-token logits within
float32 rounding, the state split by head on the mesh (one device holds `K / 4` heads of every
page pool, `Nv / 4` of every GDN ssm pool), with split weights every routed MoE layer expert
parallel (one device holds `E / 4` experts of every stack, the router whole; the caller's model
untouched), the page tables equal to the host mirror, every page free at the end, and no new
compilation for a second batch.

Head and expert counts the mesh axis does not divide raise a ValueError naming the count (also
checked in the worker: it needs the 4 devices); the in-process tests cover the errors a 1-device
mesh shows, the expert-count check on its own, and the dispatch's split by expert: the partial
outputs of expert shards add up to the whole layer's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils import report_verdicts, run_worker

NUM_DEVICES = 4
VOCAB = 256
SHAPE = dict(batch_slots=2, max_len=64, page_size=8, chunk=16, implementation="xla")
LENGTHS, MAX_TOKENS = (37, 5, 20, 9, 14), (6, 5, 4, 7, 6)
TEMPERATURES = (0.0, 0.0, 0.9, 0.0, 0.7)  # sampled rows: the same keys, the same tokens
LOGIT_TOL = 1e-5  # f32: split reductions reorder sums of ~1e-1 terms (measured ~1e-7)

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_parameters=_ROPE)
# family -> HF-style config. Layer 1 of Qwen3 slides over 24 positions (layer windows apply);
# Qwen3-Next: GDN layer (Nk4 / Nv8) with a MoE (4 experts + shared), gated attention layer;
# DeepSeek-V3: MLA (N4, q LoRA) with a MoE layer.
CONFIGS = {
    "llama": ("llama", _LLAMA),
    "qwen3": ("qwen3", dict(_LLAMA, head_dim=16, use_sliding_window=True, sliding_window=24,
                            max_window_layers=1)),
    "qwen3_next": ("qwen3_next", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=8,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=512,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=4, linear_num_value_heads=8, rms_norm_eps=1e-6,
        rope_parameters=dict(_ROPE, partial_rotary_factor=0.5), intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, mlp_only_layers=[1])),
    "deepseek_v3": ("deepseek_v3", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        max_position_embeddings=512, rms_norm_eps=1e-6, q_lora_rank=16, n_group=2,
        topk_group=1, rope_interleave=True, rope_parameters=_ROPE)),
}
# name -> (config, shard_weights, batch slots). With 4 slots each device samples one row.
CASES = {
    "llama": ("llama", True, 4),
    "llama-whole-weights": ("llama", False, 4),
    "qwen3-sliding": ("qwen3", True, 4),
    "qwen3_next-gdn-moe": ("qwen3_next", True, 2),
    "deepseek_v3-mla-moe": ("deepseek_v3", True, 2),
    "qwen3_next-whole-weights": ("qwen3_next", False, 2),
}
SLOW = {"qwen3-sliding", "llama-whole-weights", "qwen3_next-whole-weights"}  # covered elsewhere


def build(name: str, seed: int = 0, **overrides):
    """A random-weight float32 model of `CONFIGS[name]` (no checkpoint). Weights are scaled up
    from the init's 0.02 so greedy picks are decided by clear logit gaps."""
    import models.families  # noqa: F401  (registers the families)
    from models.config import HFConfig
    from models.convert.registry import get_family

    family, cfg = CONFIGS[name]
    fam = get_family(family)
    config = fam.config_from_hf(HFConfig(dict(cfg, **overrides), source=f"test:{name}"))
    model = fam.model_cls(config, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda x: x * 4 if x.ndim >= 2 else x, params)
    return nnx.merge(graphdef, params)


def _prompts():
    gen = np.random.default_rng(3)
    return [[int(t) for t in gen.integers(0, VOCAB, n)] for n in LENGTHS]


def _run(engine):
    """Every prompt through `engine`; `(outputs, last logits [B, V])`."""
    from models.engine import Request, SamplingParams

    reqs = [engine.add(Request(p, SamplingParams(max_tokens=m, temperature=t, seed=i)))
            for i, (p, m, t) in enumerate(zip(_prompts(), MAX_TOKENS, TEMPERATURES))]
    engine.run()
    return [r.output for r in reqs], np.asarray(engine.last_logits)


def _check(name: str) -> None:
    """One case of `CASES` on the worker's 4 devices; raises AssertionError on a mismatch."""
    import kv
    from models import engine as engine_mod
    from models.engine import Engine

    config, shard_weights, slots = CASES[name]
    model = build(config)
    mesh = jax.make_mesh((NUM_DEVICES,), ("tp",))  # explicit axes: the engine uses them as auto
    shape = dict(SHAPE, batch_slots=slots)
    one = Engine(model, **shape)
    tp = Engine(model, mesh=mesh, shard_weights=shard_weights, **shape)
    want, want_logits = _run(one)
    got, got_logits = _run(tp)
    assert got == want, f"{name}: tokens {got} != one device {want}"
    err = float(np.max(np.abs(got_logits - want_logits)))
    assert err <= LOGIT_TOL * max(1.0, float(np.max(np.abs(want_logits)))), f"{name}: {err=}"
    for layer, pool in enumerate(tp.states.pools):
        local = {kv.PagePool: lambda p: p.k, kv.SlotPool: lambda p: p.ssm}.get(type(pool))
        if local is None:  # MLA latent: whole on every device
            assert pool.pages.sharding.is_fully_replicated, f"{name}: layer {layer}"
            continue
        full, shard = local(pool).shape, local(pool).addressable_shards[0].data.shape
        dim = 0 if isinstance(pool, kv.PagePool) else 1
        assert shard[dim] * NUM_DEVICES == full[dim], f"{name}: layer {layer} {shard} of {full}"
    q_kernel = next(x for p, x in jax.tree_util.tree_flatten_with_path(tp._params)[0]
                    if "kernel" in str(p) and ("q_proj" in str(p) or "q_b_proj" in str(p)))
    assert q_kernel.sharding.is_fully_replicated == (not shard_weights), name
    _check_experts_split(name, model, tp, shard_weights)
    tp.check_page_tables()
    assert not tp.kv_usage()["pages"].any(), f"{name}: pages left after the run"
    traces = dict(engine_mod.TRACES)
    again, _ = _run(tp)
    assert again == want and dict(engine_mod.TRACES) == traces, f"{name}: recompiled or differs"


def _check_experts_split(name: str, model, tp, shard_weights: bool) -> None:
    """With split weights every MoE layer of the stepped model is expert parallel and each
    device holds `E / 4` experts of every routed stack (router whole); else all whole. The
    caller's model is not changed."""
    from models.engine import sharding

    stepped = nnx.merge(tp._graphdef.graphdef, tp._params)
    layers = sharding.moe_layers(stepped)
    assert bool(layers) == (CASES[name][0] in ("qwen3_next", "deepseek_v3")), name
    for i, moe in layers.items():
        assert (moe.expert_parallel is not None) == shard_weights, f"{name}: layer {i}"
        assert all(m.expert_parallel is None for m in sharding.moe_layers(model).values()), name
        stacks = jax.tree.leaves(nnx.state(moe.experts))
        assert stacks and all(a.ndim == 3 for a in stacks), f"{name}: layer {i}"
        for a in stacks:
            local = a.addressable_shards[0].data.shape
            want = a.shape[0] // NUM_DEVICES if shard_weights else a.shape[0]
            assert local == (want, *a.shape[1:]), f"{name}: layer {i} stack {local} of {a.shape}"
        router = jax.tree.leaves(nnx.state(moe.router))
        assert all(a.sharding.is_fully_replicated for a in router), f"{name}: layer {i} router"


def _check_errors() -> None:
    """Head and expert counts 4 devices do not divide raise a ValueError naming the value."""
    from models.engine import Engine

    mesh = jax.make_mesh((NUM_DEVICES,), ("tp",))
    for config, overrides, message in (
            ("llama", dict(num_key_value_heads=2), "num_kv_heads=2 is not divisible by the "
                                                   "mesh axis 'tp' of size 4"),
            ("llama", dict(num_attention_heads=6, num_key_value_heads=6),
             "num_heads=6 is not divisible"),
            ("qwen3_next", dict(num_experts=6), "layer 0 (moe): num_experts=6 is not divisible "
                                                "by the mesh axis 'tp' of size 4")):
        model = build(config, **overrides)
        try:
            Engine(model, mesh=mesh, **SHAPE)
        except ValueError as e:
            assert message in str(e), str(e)
        else:
            raise AssertionError(f"no error for {overrides}")


def _worker() -> None:
    checks = {name: functools.partial(_check, name) for name in CASES}
    report_verdicts(checks | {"errors-not-divisible": _check_errors})


@pytest.fixture(scope="module")
def sharded_run(request):
    """One worker for the selected cases (slow ones only under `-m slow`)."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_tensor_parallel_equals_one_device"]
    return run_worker("tests.models.test_engine_tp", NUM_DEVICES, names, timeout=1200)


NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
         for n in [*CASES, "errors-not-divisible"]]


@pytest.mark.parametrize("name", NAMES)
def test_tensor_parallel_equals_one_device(sharded_run, name):
    assert sharded_run["devices"] == NUM_DEVICES
    assert sharded_run["verdicts"][name] == "ok", sharded_run["verdicts"][name]


def test_mesh_errors():
    from jax.sharding import Mesh

    from models.engine import Engine

    model = build("llama")
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="mesh_axis='model' is not an axis of the mesh"):
        Engine(model, mesh=mesh, mesh_axis="model", **SHAPE)
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        Engine(model, mesh="tp", **SHAPE)


def test_expert_count_not_divisible():
    """`check_experts` on its own (one device here: a stand-in setting of axis size 3)."""
    from types import SimpleNamespace

    from models.engine import sharding

    model = build("qwen3_next")  # E = 4 on layer 0
    tp = SimpleNamespace(axis="tp", size=3, shard_weights=True)
    with pytest.raises(ValueError, match=r"layer 0 \(moe\): num_experts=4 is not divisible by "
                                         r"the mesh axis 'tp' of size 3"):
        sharding.check_experts(model, tp)
    sharding.check_experts(model, SimpleNamespace(axis="tp", size=2, shard_weights=True))
    sharding.check_experts(model, SimpleNamespace(axis="tp", size=3, shard_weights=False))


@pytest.mark.parametrize("dispatch", ["tiles", "ragged_dot", "dense"])
def test_expert_shards_add_up_to_the_layer(dispatch):
    """What each device of expert parallelism runs: a shard of the stacks with the ids of its
    experts, the others outside the shard (on either side) and so skipped whatever their
    weight. The shards' partial outputs add up to the whole layer's; a shard no token picked
    gives exact zeros."""
    from models.layers import moe as moe_lib

    gen = np.random.default_rng(0)
    m, d, i, e, k, shards = 37, 16, 24, 8, 2, 4
    x = jnp.asarray(gen.standard_normal((m, d)), jnp.float32)
    logits = jnp.asarray(gen.standard_normal((m, e)), jnp.float32)
    logits = logits.at[:, 2:4].set(-1e9)  # shard 1 (experts 2, 3) gets no token
    ids, w = moe_lib.topk_softmax(logits, k, normalize=True)
    stacks = [jnp.asarray(0.2 * gen.standard_normal(s), jnp.float32)
              for s in ((e, d, i), (e, d, i), (e, i, d))]
    run = jax.jit(lambda *a: moe_lib.moe_sorted(*a, dispatch=dispatch))
    whole = np.asarray(run(x, ids, w, *stacks))
    local = e // shards
    parts = []
    for s in range(shards):
        rel = ids - s * local
        mine = (rel >= 0) & (rel < local)
        skip = jnp.where(jnp.arange(m)[:, None] % 2 == 0, local, -1)  # past the end, before 0
        parts.append(np.asarray(run(x, jnp.where(mine, rel, skip), w,
                                    *(a[s * local:(s + 1) * local] for a in stacks))))
    assert np.all(np.isfinite(whole)) and np.abs(whole).max() > 0.1
    np.testing.assert_array_equal(parts[1], 0.0)
    np.testing.assert_allclose(np.sum(parts, axis=0), whole, rtol=0, atol=1e-5)


def test_expert_parallel_block_on_one_device():
    """A MoE block run through `ExpertParallel` on a 1-device mesh equals the plain block (the
    shard_map plumbing: router and stacks in, one psum out)."""
    from jax.sharding import Mesh

    from models.engine import sharding
    from models.layers.moe import ExpertParallel

    model = build("deepseek_v3")
    (moe,) = sharding.moe_layers(model).values()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, 32)), jnp.float32)
    want = np.asarray(moe(x))
    moe.expert_parallel = ExpertParallel(Mesh(np.array(jax.devices()[:1]), ("tp",)), "tp")
    got = np.asarray(nnx.jit(lambda m, x: m(x))(moe, x))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


if __name__ == "__main__":
    _worker()
