"""Generation engine on tiny random hybrid and MLA models: Qwen3-Next and Qwen3.5 (Gated DeltaNet
+ gated attention), DeepSeek-V3 and V2 (MLA, MoE).

Greedy generation through the engine must equal greedy by repeated full forwards (`model(ids)`,
no cache) with chunked prefill (prompts longer than the 16-token chunk), continuous batching (5
requests of different lengths over 2 slots) and preemption (11 allocatable pages per head: too
few for two long requests), with every pool poisoned with NaN beforehand (GDN slots and pages
are read only after they are written, or as selected zeros). After the run every page is free
again and every GDN slot of a row is back to zero. One engine shape per family (so one pair of
compiled steps); the reference forwards run batched at one padded width.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kv
import models
from attn.dense import attention
from models import engine as engine_mod
from models.engine import Engine, Policy, Request, SamplingParams
from models.layers.attention import Attention, AttentionConfig
from models.layers.gdn import GatedDeltaNet, GDNConfig
from tests.models import tiny

SHAPE = dict(batch_slots=2, max_len=256, page_size=8, chunk=16, num_pages=12,
             implementation="xla")
WIDTH = 64  # reference forwards run at one padded width (causal: padding after is invisible)
ROWS = 5  # ... and batch
FAMILIES = ["qwen3_next", "qwen3_5", "deepseek_v3", "deepseek_v2"]

@pytest.fixture(scope="module")
def load(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            path = str(tmp_path_factory.mktemp(f"engine_{family}"))
            tiny.save_hybrid(family, path)
            cache[family] = models.from_pretrained(path, progress=False)
        return cache[family]

    return get


@dataclasses.dataclass(frozen=True)
class _PolicyAttend:
    """Full-forward attend with a per-layer, per-head window / sinks policy (`[L, K]` arrays; GDN
    layers use their default mix: no `gdn_mix` here)."""

    window: jax.Array
    sinks: jax.Array

    def __call__(self, spec, qkv, state=None):
        o, _ = attention(qkv.q, qkv.k, qkv.v, causal=True, scale=spec.scale,
                         window=self.window[spec.layer], sinks=self.sinks[spec.layer],
                         implementation="xla")
        return o, state


@nnx.jit
def _policy_logits(model, ids, window, sinks):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    hidden, _ = model.forward(ids, positions, attend=_PolicyAttend(window, sinks))
    return model.logits(hidden)


def reference_greedy(model, prompts, steps, policy=None):
    """Greedy continuations of every prompt by repeated full forwards (no cache), batched (always
    `ROWS` rows, so every call shares one compiled forward)."""
    ids = [list(p) for p in prompts]
    for _ in range(steps):
        padded = np.zeros((ROWS, WIDTH), np.int32)
        for i, row in enumerate(ids):
            padded[i, :len(row)] = row
        if policy is None:
            logits = model(jnp.asarray(padded))
        else:
            logits = _policy_logits(model, jnp.asarray(padded), jnp.asarray(policy.window),
                                    jnp.asarray(policy.sinks))
        last = np.asarray([len(row) - 1 for row in ids])
        nxt = np.asarray(jnp.argmax(logits[np.arange(len(ids)), last], axis=-1))
        for row, tok in zip(ids, nxt):
            row.append(int(tok))
    return [row[len(p):] for row, p in zip(ids, prompts)]


def prompts(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, tiny.VOCAB, n)] for n in lengths]


def poison(engine):
    """NaN into every page of every pool and every GDN slot (the null ones included)."""
    engine.states = engine.states._replace(pools=[
        jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), p) for p in engine.states.pools])


def gdn_pools(engine):
    return [p for p in engine.states.pools if isinstance(p, kv.SlotPool)]


def run_checked(engine):
    """Step to the end, checking after every step that the host page mirror equals the device and
    the GDN state bytes follow the occupied slots."""
    per_slot = engine.kv_usage()["state_capacity_bytes"] // engine.batch_slots
    while not engine.idle:
        engine.step()
        held = engine.pages_held().sum(axis=0)
        free = engine.free_pages()
        paged = list(engine.paged_layers)
        assert np.array_equal(free[paged], engine.num_pages - 1 - held[paged])
        busy = sum(s is not None for s in engine.slots)
        assert np.array_equal(engine.kv_usage()["state_bytes"], busy * per_slot)
    usage = engine.kv_usage()
    assert np.all(engine.free_pages()[list(engine.paged_layers)] == engine.num_pages - 1)
    assert usage["total_bytes"] == 0 and not usage["pages"].any()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_full_forward(family, load):
    """5 requests over 2 slots (join / leave), prompts longer than a chunk (chunked prefill),
    decode tokens mixed into prefill steps, pools too small for two long requests (preemption:
    the preempted request is recomputed from a zeroed GDN state and resumes with the same tokens),
    poisoned pools; afterwards every page is free and every row's GDN slot is zero."""
    model = load(family)
    engine = Engine(model, **SHAPE)
    kinds = set(engine.layer_kinds)
    assert kinds == ({"gdn", "attention"} if family.startswith("qwen") else {"mla"})
    poison(engine)
    ps = prompts([37, 33, 5, 1, 16])
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=m)))
            for p, m in zip(ps, [12, 12, 9, 7, 5])]
    run_checked(engine)
    expected = reference_greedy(model, ps, 12)
    for r, want in zip(reqs, expected):
        assert r.done and r.output == want[:r.params.max_tokens], r.id
    assert engine.stats["mixed_steps"] > 0 and engine.stats["decode_steps"] > 0
    assert engine.stats["preemptions"] >= 1 and reqs[1].preemptions >= 1
    assert reqs[1].prefill_tokens > len(ps[1])  # it was recomputed
    for pool in gdn_pools(engine):  # both rows' slots were zeroed when their requests left
        assert not np.asarray(pool.conv[1:]).any() and not np.asarray(pool.ssm[1:]).any()
    assert len(gdn_pools(engine)) == (1 if family.startswith("qwen") else 0)


def test_streaming_policy_on_hybrid(load):
    """A window + sinks policy applies to the attention layer (its entries on GDN layers are
    ignored) and equals a full forward under that policy. NaN in the pools (the stale slot of its
    row, the idle neighbour's slot, unwritten pages) changes no logit bit against a clean engine;
    the idle row's GDN slot is never touched (still NaN), the busy row's is zeroed when its
    request leaves."""
    model = load("qwen3_next")
    layers = len(model.layers)
    p = prompts([45], seed=7)[0]
    logits = {}
    for poisoned in (False, True):
        engine = Engine(model, **SHAPE)
        if poisoned:
            poison(engine)
        streaming = Policy.streaming(layers, engine.num_kv_heads, window=16, sinks=8)
        req = engine.add(Request(p, SamplingParams(max_tokens=8), streaming))
        peak = np.zeros((layers, engine.num_kv_heads), np.int64)
        logits[poisoned] = []
        while not engine.idle:
            engine.step()
            logits[poisoned].append(np.asarray(engine.last_logits[0]))
            peak = np.maximum(peak, engine.pages_held()[0])
    assert all(np.isfinite(x).all() for x in logits[True])
    assert all(np.array_equal(a, b) for a, b in zip(logits[False], logits[True], strict=True))
    assert peak[1].max() <= 4 and not peak[0].any()  # sink + window + 1; GDN: no pages
    assert req.output == reference_greedy(model, [p], 8, streaming)[0]
    assert req.output != reference_greedy(model, [p], 8)[0]  # the window changed something
    for pool in gdn_pools(engine):
        assert not np.asarray(pool.ssm[1]).any() and not np.asarray(pool.conv[1]).any()
        assert np.isnan(np.asarray(pool.ssm[2])).all() and np.isnan(np.asarray(pool.conv[2])).all()


def test_no_recompiles_over_200_decode_steps(load):
    """Hybrid: joins, leaves, chunked prefill, streaming and dense requests, sampling: after
    warm-up, no trace of either step."""
    model = load("qwen3_next")
    engine = Engine(model, **SHAPE)
    streaming = Policy.streaming(len(model.layers), engine.num_kv_heads, window=16, sinks=8)
    a, b, c, d = prompts([9, 20, 25, 5], seed=9)
    engine.add(Request(a, SamplingParams(max_tokens=245), streaming))
    engine.add(Request(b, SamplingParams(max_tokens=30)))
    drawn = engine.add(Request(d, SamplingParams(max_tokens=3, temperature=0.5, seed=2)))
    while not drawn.done:  # warm-up: mixed and decode steps with a sampled row ...
        engine.step()
    for _ in range(2):  # ... and decode steps of greedy rows only
        engine.step()
    assert engine.stats["mixed_steps"] and engine.stats["decode_steps"]
    before = dict(engine_mod.TRACES)
    decode_steps = engine.stats["decode_steps"]
    engine.add(Request(c, SamplingParams(max_tokens=30, temperature=0.7, seed=1)))  # late join
    engine.run()
    assert engine.stats["decode_steps"] - decode_steps >= 200
    assert dict(engine_mod.TRACES) == before
    assert np.all(engine.free_pages()[list(engine.paged_layers)] == engine.num_pages - 1)


def test_accounting_shapes(load):
    """kv_bytes / kv_usage / state_bytes shapes and values on a hybrid while a request runs."""
    model = load("qwen3_next")
    engine = Engine(model, **SHAPE)
    req = engine.add(Request(prompts([20], seed=4)[0], SamplingParams(max_tokens=3)))
    assert req.row is None
    engine.step()  # 16 of 20 prompt tokens cached: 2 pages per head of the attention layer
    assert req.row == 0
    layers, heads = len(model.layers), engine.num_kv_heads
    usage = engine.kv_usage()
    assert engine.layer_kinds == ("gdn", "attention") and engine.paged_layers == (1,)
    assert usage["pages"].tolist() == [[0, 0], [2, 2]]
    assert np.array_equal(usage["bytes"], engine.kv_bytes(0))
    assert usage["bytes"].shape == (layers, heads) and usage["bytes"][1, 0] == 2 * \
        engine.page_bytes()
    assert usage["capacity_pages"].tolist() == [0, engine.num_pages - 1]
    spec = model.layers[0].mixer.spec
    slot = spec.conv_dim * (spec.conv_width - 1) * 4 + \
        spec.num_v_heads * spec.head_k_dim * spec.head_v_dim * 4
    assert engine.state_bytes().tolist() == [slot, 0]
    assert engine.state_bytes(1).tolist() == [0, 0]  # row 1 is idle
    assert usage["total_bytes"] == usage["bytes"].sum() + slot
    engine.run()
    assert engine.kv_usage()["total_bytes"] == 0


def test_engine_errors(load):
    ds = load("deepseek_v3")
    layers = len(ds.layers)
    with pytest.raises(ValueError, match="no FP8 latent cache"):
        Engine(ds, **SHAPE, kv_dtype=jnp.float8_e4m3fn)
    streaming = Policy.streaming(layers, 1, window=16, sinks=4)
    with pytest.raises(ValueError, match="layer 0, an MLA layer"):
        Engine(ds, **SHAPE, policy=streaming)
    engine = Engine(ds, **SHAPE)
    assert engine.num_kv_heads == 1 and engine.paged_layers == (0, 1)
    with pytest.raises(ValueError, match="MLA latent cache supports no sliding window"):
        engine.add(Request([1, 2], SamplingParams(max_tokens=2), streaming))
    with pytest.raises(ValueError, match=r"policy shape \(2, 2\) must be \[L, K\] = \(2, 1\)"):
        engine.add(Request([1], SamplingParams(max_tokens=2), Policy.dense(layers, 2)))
    # Abstract layers (no weights materialised): the engine refuses them before any state.
    gdn = nnx.eval_shape(lambda: GatedDeltaNet(
        GDNConfig(dim=8, num_k_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=4), layer=0,
        rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="at least one attention or MLA layer"):
        Engine(_FakeModel([gdn]))
    attn = [nnx.eval_shape(lambda i=i, k=k: Attention(
        AttentionConfig(dim=8, num_heads=k, num_kv_heads=k, head_dim=4), layer=i,
        rngs=nnx.Rngs(0))) for i, k in enumerate((1, 2))]
    with pytest.raises(ValueError, match=r"same num_kv_heads .*\{0: 1, 1: 2\}"):
        Engine(_FakeModel(attn))
    with pytest.raises(ValueError, match="layer 1 has a str mixer"):
        Engine(_FakeModel([attn[0], "not a mixer"]))


class _FakeModel:
    def __init__(self, mixers):
        layer = dataclasses.make_dataclass("Layer", [("mixer", object)])
        self.layers = [layer(m) for m in mixers]
        self.dtype = jnp.float32


@pytest.mark.slow
def test_soak_no_leaks_no_recompiles(load):
    """10^4 steps of random traffic on the hybrid (random lengths, dense / streaming / head-wise
    policies, sampling, preemption): the host page mirror equals the device after every step, no
    trace after warm-up, and at the end every page is free and every row's GDN slot is zero."""
    model = load("qwen3_next")
    engine = Engine(model, **SHAPE)
    rng = np.random.default_rng(0)
    layers, heads = len(model.layers), engine.num_kv_heads
    policies = [None, Policy.streaming(layers, heads, window=16, sinks=8),
                Policy.headwise(layers, heads, window=8, sinks=4)]

    def add():
        n = int(rng.integers(1, 49))  # prompt + output <= 88 tokens: 11 pages, all there are
        params = SamplingParams(max_tokens=int(rng.integers(1, 41)), seed=int(rng.integers(9)),
                                temperature=float(rng.choice([0.0, 0.8])))
        engine.add(Request(prompts([n], seed=int(rng.integers(1 << 30)))[0], params,
                           policies[int(rng.integers(len(policies)))]))

    for _ in range(4):
        add()
    for _ in range(5):
        engine.step()
    before = dict(engine_mod.TRACES)
    steps = 0
    while steps < 10_000:
        if len(engine.waiting) < 2:
            add()
        engine.step()
        steps += 1
        held = engine.pages_held().sum(axis=0)[1]
        assert np.array_equal(engine.free_pages()[1], engine.num_pages - 1 - held)
    engine.waiting.clear()
    engine.run()
    assert dict(engine_mod.TRACES) == before
    assert engine.stats["preemptions"] > 0
    assert np.all(engine.free_pages()[1] == engine.num_pages - 1)
    for pool in gdn_pools(engine):
        assert not np.asarray(pool.conv[1:]).any() and not np.asarray(pool.ssm[1:]).any()
