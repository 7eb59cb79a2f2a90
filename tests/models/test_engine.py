"""Generation engine on tiny random Llama / Qwen3 models: greedy == full-forward greedy, chunked
prefill and continuous batching, preemption without leaks, no recompiles, sampling, FP8 KV.

Most tests share one engine shape (2 slots, pages of 8, chunks of 16, 11 allocatable pages per
head: too few for two 42-token requests, so preemption is in the mix) and so one pair of compiled
steps.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from attn.dense import attention
from models import engine as engine_mod
from models.engine import Engine, Policy, Request, SamplingParams, sample
from tests.models import tiny

SHAPE = dict(batch_slots=2, max_len=256, page_size=8, chunk=16, num_pages=12,
             implementation="xla")
WIDTH = 64  # reference forwards run at one padded width (causal: padding after is invisible)


def _load(kind, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"engine_{kind}"))
    overrides = {}
    if kind == "qwen3":  # layer 1 slides over 24 positions: layer windows apply too
        overrides = dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)
    tiny.save_tiny(kind, path, ids=tiny.token_ids(1, 4), **overrides)
    return models.from_pretrained(path, progress=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _load("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _load("qwen3", tmp_path_factory)


@dataclasses.dataclass(frozen=True)
class _PolicyAttend:
    """Full-forward attend with a per-layer, per-head window / sinks policy (the reference)."""

    policy: Policy

    def __call__(self, spec, qkv, state=None):
        o, _ = attention(qkv.q, qkv.k, qkv.v, causal=True, scale=spec.scale,
                         window=jnp.asarray(self.policy.window[spec.layer]),
                         sinks=jnp.asarray(self.policy.sinks[spec.layer]), implementation="xla")
        return o, state


def reference_greedy(model, prompt, n, policy=None):
    """Greedy continuation by repeated full forwards (no cache), optionally under `policy`."""
    ids = list(prompt)
    for _ in range(n):
        padded = np.zeros((1, WIDTH), np.int32)
        padded[0, :len(ids)] = ids
        if policy is None:
            logits = model(jnp.asarray(padded))
        else:
            positions = jnp.arange(WIDTH, dtype=jnp.int32)[None]
            hidden, _ = model.forward(jnp.asarray(padded), positions,
                                      attend=_PolicyAttend(policy))
            logits = model.logits(hidden)
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


def prompts(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, tiny.VOCAB, n)] for n in lengths]


def run_checked(engine):
    """Step to the end, checking after every step that the host page mirror equals the device."""
    while not engine.idle:
        engine.step()
        held = engine.pages_held().sum(axis=0)
        assert np.array_equal(engine.free_pages(), engine.num_pages - 1 - held)
    assert np.all(engine.free_pages() == engine.num_pages - 1)  # nothing leaked
    assert engine.kv_usage()["total_bytes"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_equals_full_forward(family, request):
    """5 requests over 2 slots (join / leave), prompts longer than a chunk (chunked prefill),
    decode tokens mixed into prefill steps, pools too small for two long requests (preemption),
    different max_tokens so requests leave apart."""
    model = request.getfixturevalue(family)
    engine = Engine(model, **SHAPE)
    ps = prompts([37, 33, 5, 1, 16])
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=m)))
            for p, m in zip(ps, [12, 12, 9, 7, 5])]
    run_checked(engine)
    assert all(r.done for r in reqs)
    for p, r in zip(ps, reqs):
        assert r.output == reference_greedy(model, p, r.params.max_tokens), r.id
    assert engine.stats["mixed_steps"] > 0 and engine.stats["decode_steps"] > 0
    assert engine.stats["preemptions"] >= 1
    assert sum(r.preemptions for r in reqs) == engine.stats["preemptions"]


def test_preempted_request_resumes_with_same_tokens(llama):
    ps = prompts([34, 30], seed=5)
    expected = [reference_greedy(llama, p, 12) for p in ps]
    engine = Engine(llama, **SHAPE)  # each needs 6 of the 11 pages per head
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=12))) for p in ps]
    run_checked(engine)
    assert reqs[0].preemptions == 0 and reqs[1].preemptions >= 1
    assert reqs[1].prefill_tokens > len(ps[1])  # it was recomputed
    assert [r.output for r in reqs] == expected


def test_streaming_policy_recycles_and_matches_windowed_forward(llama):
    """A window + sinks request keeps sink + window pages only, and equals a full forward of the
    model with that window in every layer; a head-wise request beside it keeps full heads."""
    layers, heads = len(llama.layers), llama.layers[0].mixer.cfg.num_kv_heads
    engine = Engine(llama, **SHAPE)
    p, q = prompts([50, 20], seed=7)
    streaming = Policy.streaming(layers, heads, window=16, sinks=8)
    headwise = Policy.headwise(layers, heads, window=12, sinks=4)
    assert headwise.window.tolist() == [[0, 12], [0, 12]]  # half the KV heads stream
    stream = engine.add(Request(p, SamplingParams(max_tokens=8), streaming))
    head = engine.add(Request(q, SamplingParams(max_tokens=8), headwise))
    peak = np.zeros((layers, heads), np.int64)
    while not engine.idle:
        engine.step()
        if engine.slots[0] is stream:
            peak = np.maximum(peak, engine.pages_held()[0])
    # sink page + 16-token window (2 pages) + the page being filled; a full head holds 8.
    assert peak.max() <= 4
    assert stream.output == reference_greedy(llama, p, 8, streaming)
    assert head.output == reference_greedy(llama, q, 8, headwise)
    assert head.output != reference_greedy(llama, q, 8)  # the window changed something
    assert np.all(engine.free_pages() == engine.num_pages - 1)


def test_no_recompiles_over_200_decode_steps(llama):
    """Joins, leaves, chunked prefill, streaming and dense requests, greedy and sampled rows:
    after warm-up, no trace."""
    layers, heads = len(llama.layers), llama.layers[0].mixer.cfg.num_kv_heads
    engine = Engine(llama, **SHAPE)
    streaming = Policy.streaming(layers, heads, window=16, sinks=8)  # holds <= 4 pages
    a, b, c, d = prompts([9, 20, 25, 5], seed=9)
    engine.add(Request(a, SamplingParams(max_tokens=245), streaming))
    engine.add(Request(b, SamplingParams(max_tokens=30)))
    drawn = engine.add(Request(d, SamplingParams(max_tokens=3, temperature=0.5, seed=2)))
    while not drawn.done:  # warm-up: mixed and decode steps with a sampled row ...
        engine.step()
    for _ in range(2):  # ... and decode steps of greedy rows only (no vocabulary sort)
        engine.step()
    assert engine.stats["mixed_steps"] and engine.stats["decode_steps"]
    before = dict(engine_mod.TRACES)
    decode_steps = engine.stats["decode_steps"]
    engine.add(Request(c, SamplingParams(max_tokens=30, temperature=0.7, seed=1)))  # late join
    engine.run()
    assert engine.stats["decode_steps"] - decode_steps >= 200
    assert dict(engine_mod.TRACES) == before
    assert np.all(engine.free_pages() == engine.num_pages - 1)


def test_sampling_seeded_and_reproducible(llama):
    engine = Engine(llama, **SHAPE)
    p = prompts([12], seed=11)[0]
    hot = SamplingParams(temperature=1.5, top_k=50, top_p=0.9, seed=4, max_tokens=10)
    a, b = engine.generate([p, p], hot)
    assert a == b  # same seed and positions in two slots of one step
    c = engine.generate([p], SamplingParams(temperature=1.5, seed=5, max_tokens=10))[0]
    assert c != a
    greedy = engine.generate([p], SamplingParams(max_tokens=10))[0]
    assert greedy == reference_greedy(llama, p, 10)


def test_stop_token_ends_request(llama):
    engine = Engine(llama, **SHAPE)
    p = prompts([10], seed=13)[0]
    free_run = reference_greedy(llama, p, 8)
    stop = free_run[3]
    out = engine.generate([p], SamplingParams(max_tokens=8, stop_tokens=(stop,)))[0]
    assert out == free_run[:free_run.index(stop) + 1]


def test_sample_top_k_and_top_p_restrict_support():
    logits = jax.random.normal(jax.random.key(0), (4, 64)) * 3
    keys = jax.random.split(jax.random.key(1), 200).reshape(50, 4)
    top2 = np.argsort(-np.asarray(logits), axis=-1)[:, :2]
    ones = jnp.ones((4,), jnp.float32)
    fn = jax.jit(sample)
    drawn_k = np.stack([np.asarray(fn(logits, k, ones, jnp.full((4,), 2), ones)) for k in keys])
    assert all(set(drawn_k[:, b]) <= set(top2[b]) for b in range(4))
    assert all(len(set(drawn_k[:, b])) == 2 for b in range(4))  # both are drawn
    drawn_p = np.stack([np.asarray(fn(logits, k, ones, jnp.zeros((4,), jnp.int32),
                                      jnp.full((4,), 1e-6))) for k in keys])
    assert np.all(drawn_p == np.argmax(np.asarray(logits), -1))  # tiny nucleus = argmax


def test_sample_greedy_rows_take_the_argmax_with_or_without_a_drawing_row():
    """`draw=False` (every row greedy) is the argmax; with `draw=True` a greedy row next to a
    drawing row still gets its argmax, and the drawing row draws (not its argmax every time)."""
    logits = jax.random.normal(jax.random.key(2), (3, 64)) * 3
    best = np.argmax(np.asarray(logits), -1)
    no_limit, whole = jnp.zeros((3,), jnp.int32), jnp.ones((3,), jnp.float32)
    fn = jax.jit(sample, static_argnames="draw")
    keys = jax.random.split(jax.random.key(3), 30).reshape(10, 3)
    for draw in (False, True):
        greedy = np.asarray(fn(logits, keys[0], jnp.zeros((3,)), no_limit, whole, draw=draw))
        assert np.all(greedy == best), draw
    hot = jnp.asarray([0.0, 5.0, 0.0])
    mixed = np.stack([np.asarray(fn(logits, k, hot, no_limit, whole)) for k in keys])
    assert np.all(mixed[:, [0, 2]] == best[[0, 2]])
    assert len(set(mixed[:, 1])) > 1


def test_fp8_kv_close_to_full_precision(llama):
    """Next-token KL of the FP8-KV engine against the bf16-KV and f32-KV engines after a 40-token
    prompt (f32 model; only the page dtype differs)."""
    p = prompts([40], seed=17)[0]
    logp = {}
    for name, dtype in (("f32", None), ("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        engine = Engine(llama, **SHAPE, kv_dtype=dtype)
        engine.generate([p], SamplingParams(max_tokens=1))
        logp[name] = jax.nn.log_softmax(engine.last_logits[0])

    def kl(a, b):
        return float(jnp.sum(jnp.exp(logp[a]) * (logp[a] - logp[b])))

    kls = {f"{a}||{b}": kl(a, b) for a, b in (("bf16", "fp8"), ("f32", "fp8"), ("f32", "bf16"))}
    print("\nnext-token KL, tiny llama, 40-token prompt: "
          + ", ".join(f"KL({k}) = {v:.3e}" for k, v in kls.items()))
    assert 0 < kls["bf16||fp8"] < 0.05 and 0 < kls["f32||fp8"] < 0.05
    assert kls["f32||bf16"] < kls["f32||fp8"]  # e4m3 (3 mantissa bits) is coarser than bf16 (7)


def test_engine_errors(llama):
    with pytest.raises(ValueError, match="chunk=0"):
        Engine(llama, chunk=0)
    with pytest.raises(ValueError, match="layer 0 has a object mixer"):
        Engine(_FakeModel())
    engine = Engine(llama, **SHAPE)
    with pytest.raises(ValueError, match="exceeds max_len=256"):
        engine.add(Request([1] * 250, SamplingParams(max_tokens=7)))
    with pytest.raises(ValueError, match="non-empty prompt"):
        engine.add(Request([]))
    with pytest.raises(ValueError, match=r"policy shape \(1, 1\)"):
        engine.add(Request([1], SamplingParams(max_tokens=2), policy=Policy.dense(1, 1)))
    with pytest.raises(ValueError, match="num_pages=1"):
        Engine(llama, num_pages=1)
    with pytest.raises(ValueError, match="sinks must be >= 0"):
        Policy(np.zeros((1, 1)), -np.ones((1, 1)))
    for bad, match in ((dict(temperature=-1), "temperature=-1"), (dict(top_p=0), "top_p=0"),
                       (dict(top_k=-1), "top_k=-1"), (dict(max_tokens=0), "max_tokens=0")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    small = Engine(llama, **{**SHAPE, "num_pages": 3})
    small.add(Request([1] * 30, SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="KV pools too small"):
        small.run()


class _FakeModel:
    def __init__(self):
        self.layers = [dataclasses.make_dataclass("Layer", [("mixer", object)])(object())]
