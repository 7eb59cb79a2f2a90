"""Generation engine on tiny random Llama / Qwen3 models: greedy == full-forward greedy, chunked
prefill and continuous batching, preemption without leaks, no recompiles, sampling, FP8 KV."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.engine import Engine, Policy, Request, SamplingParams, sample
from tests.models import tiny

PAGE = 8


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"engine_{request.param}"))
    overrides = {}
    if request.param == "qwen3":  # layer 1 slides over 24 positions: layer windows apply too
        overrides = dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)
    tiny.save_tiny(request.param, path, ids=tiny.token_ids(1, 4), **overrides)
    return models.from_pretrained(path, progress=False)


def reference_greedy(model, prompt, n):
    """Greedy continuation by repeated full forwards (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        logits = model(jnp.asarray([ids], jnp.int32))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt):]


def prompts(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, tiny.VOCAB, n)) for n in lengths]


def test_greedy_equals_full_forward_with_chunks_and_joins(model):
    """5 requests over 2 slots (join / leave), prompts longer than a chunk (chunked prefill),
    decode steps mixed into prefill steps, different max_tokens so requests leave apart."""
    engine = Engine(model, batch_slots=2, max_len=64, page_size=PAGE, chunk=16,
                    implementation="xla")
    ps = prompts([37, 5, 20, 1, 16])
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=m)))
            for p, m in zip(ps, [6, 9, 3, 7, 5])]
    engine.run()
    assert all(r.done for r in reqs)
    for p, r in zip(ps, reqs):
        assert r.output == reference_greedy(model, p, r.params.max_tokens), r.id
    assert engine.stats["mixed_steps"] > 0 and engine.stats["decode_steps"] > 0
    assert np.all(engine.free_pages() == engine.num_pages - 1)  # every page came back
    assert np.all(engine.pages_held() == 0)


def test_preemption_recomputes_same_tokens_and_leaks_nothing(model):
    """Pools too small for both requests at once: the younger is preempted, recomputed later,
    and produces the same greedy tokens; the host mirror matches the device counts."""
    ps = prompts([30, 26], seed=5)
    expected = [reference_greedy(model, p, 12) for p in ps]
    # Each request needs ceil(42 / 8) = 6 pages per head; 9 allocatable cannot hold both.
    engine = Engine(model, batch_slots=2, max_len=48, page_size=PAGE, chunk=16, num_pages=10,
                    implementation="xla")
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=12))) for p in ps]
    while not engine.idle:
        engine.step()
        held = engine.pages_held().sum(axis=0)
        assert np.array_equal(engine.free_pages(), engine.num_pages - 1 - held)
    assert engine.stats["preemptions"] >= 1 and reqs[1].preemptions >= 1
    assert [r.output for r in reqs] == expected
    assert np.all(engine.free_pages() == engine.num_pages - 1)


def test_streaming_policy_recycles_and_matches_windowed_forward(model):
    """A streaming (window + sinks) request keeps only sink + window pages and equals a full
    forward of a model whose every layer has that window."""
    layers, heads = engine_shape(model)
    policy = Policy.streaming(layers, heads, window=12, sinks=4)
    engine = Engine(model, batch_slots=1, max_len=80, page_size=4, chunk=16,
                    implementation="xla")
    p = prompts([50], seed=7)[0]
    req = engine.add(Request(p, SamplingParams(max_tokens=8), policy))
    peak = 0
    while not engine.idle:
        engine.step()
        peak = max(peak, int(engine.pages_held().max()))
    # sinks 1 page + window 12 (3 pages) + partial pages; a full head would hold 15 pages.
    assert peak <= 1 + 3 + 1 + 16 // 4
    windowed = _with_window(model, 12, 4)
    assert req.output == reference_greedy(windowed, p, 8)


def engine_shape(model):
    return len(model.layers), model.layers[0].mixer.cfg.num_kv_heads


def _with_window(model, window, sinks):
    import dataclasses

    from flax import nnx

    graphdef, state = nnx.split(model)
    clone = nnx.merge(graphdef, state)
    for layer in clone.layers:
        spec = layer.mixer.spec
        layer.mixer.spec = dataclasses.replace(spec, window=window, sinks=sinks)
    return clone


def test_no_recompiles_over_200_decode_steps(model):
    engine = Engine(model, batch_slots=3, max_len=256, page_size=PAGE, chunk=16,
                    implementation="xla")
    for p, m in zip(prompts([9, 20, 4]), [210, 60, 120]):
        engine.add(Request(p, SamplingParams(max_tokens=m)))
    for _ in range(3):  # warm-up: both step shapes compiled
        engine.step()
    before = dict(engine.compiles)
    assert before == {False: 1, True: 1} or before[False] == 1
    decode_steps = engine.stats["decode_steps"]
    engine.add(Request(prompts([25], seed=9)[0], SamplingParams(max_tokens=30)))  # a late join
    engine.run()
    assert engine.stats["decode_steps"] - decode_steps >= 200
    assert engine.compiles == {False: 1, True: 1}


def test_sampling_seeded_and_reproducible(model):
    engine = Engine(model, batch_slots=2, max_len=48, page_size=PAGE, chunk=16,
                    implementation="xla")
    p = prompts([12], seed=11)[0]
    hot = SamplingParams(temperature=1.5, top_k=50, top_p=0.9, seed=4, max_tokens=10)
    a, b = engine.generate([p, p], hot)
    assert a == b  # same seed, same positions
    other = engine.generate([p], SamplingParams(temperature=1.5, seed=5, max_tokens=10))[0]
    greedy = engine.generate([p], SamplingParams(max_tokens=10))[0]
    assert a != greedy or other != greedy


def test_stop_token_ends_request(model):
    engine = Engine(model, batch_slots=1, max_len=48, page_size=PAGE, chunk=16,
                    implementation="xla")
    p = prompts([10], seed=13)[0]
    free_run = reference_greedy(model, p, 8)
    stop = free_run[3]
    out = engine.generate([p], SamplingParams(max_tokens=8, stop_tokens=(stop,)))[0]
    assert out == free_run[:free_run.index(stop) + 1]


def test_sample_top_k_and_top_p_restrict_support():
    logits = jax.random.normal(jax.random.key(0), (4, 64)) * 3
    keys = jax.random.split(jax.random.key(1), 400).reshape(100, 4)
    top2 = np.argsort(-np.asarray(logits), axis=-1)[:, :2]
    ones = jnp.ones((4,), jnp.float32)
    drawn_k = np.stack([np.asarray(sample(logits, k, ones, jnp.full((4,), 2), ones))
                        for k in keys])
    assert all(set(drawn_k[:, b]) <= set(top2[:, b]) for b in range(4))
    drawn_p = np.stack([np.asarray(sample(logits, k, ones, jnp.zeros((4,), jnp.int32),
                                          jnp.full((4,), 1e-6))) for k in keys])
    assert np.all(drawn_p == np.argmax(np.asarray(logits), -1))  # tiny nucleus = argmax


def test_fp8_kv_close_to_full_precision(model):
    """Greedy tokens under FP8 KV mostly agree; report the next-token KL vs the f32 cache."""
    p = prompts([40], seed=17)[0]
    outs, logits = {}, {}
    for name, dtype in (("f32", None), ("fp8", jnp.float8_e4m3fn)):
        engine = Engine(model, batch_slots=1, max_len=64, page_size=PAGE, chunk=16,
                        kv_dtype=dtype, implementation="xla")
        engine.generate([p], SamplingParams(max_tokens=1))
        logits[name] = engine.last_logits[0]  # next-token logits after the prompt
        outs[name] = engine.generate([p], SamplingParams(max_tokens=6))[0]
        if name == "fp8":
            usage = engine.kv_usage()
            assert usage["total_bytes"] == 0  # all freed
    lp = jax.nn.log_softmax(logits["f32"])
    lq = jax.nn.log_softmax(logits["fp8"])
    kl = float(jnp.sum(jnp.exp(lp) * (lp - lq)))
    print(f"fp8 vs f32 KV: next-token KL = {kl:.2e}, greedy agreement "
          f"{np.mean(np.array(outs['f32']) == np.array(outs['fp8'])):.2f}")
    assert kl < 0.05
    assert outs["f32"][0] == outs["fp8"][0]


def test_engine_errors(model):
    with pytest.raises(ValueError, match="chunk=0"):
        Engine(model, chunk=0)
    engine = Engine(model, batch_slots=1, max_len=16, page_size=PAGE)
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        engine.add(Request([1] * 10, SamplingParams(max_tokens=7)))
    with pytest.raises(ValueError, match="non-empty prompt"):
        engine.add(Request([]))
    with pytest.raises(ValueError, match=r"policy shape \(1, 1\)"):
        engine.add(Request([1], policy=Policy.dense(1, 1)))
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
    small = Engine(model, batch_slots=1, max_len=64, page_size=PAGE, num_pages=3)
    small.add(Request([1] * 30, SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="KV pools too small"):
        small.run()
