"""Engine soak: random traffic with NaN everywhere a request does not own, tables checked against
the host mirror after every step.

Requests of random lengths, sampling settings and policies (dense, streaming, head-wise) arrive
at random; the default policy changes now and then; the pools are small, so preemption is in the
mix. Before every step every page of every attention / MLA pool that no block table holds (the
null page included) is set to NaN on the device; after it, `Engine.check_page_tables` compares the
device tables and allocator with the host mirror entry by entry, and every logit must be finite.
At the end every page is free again. 300 steps of a tiny Llama in CI; 10^4 steps of Llama, of the
MLA DeepSeek-V3 and of the elastic PawQwen3 are `slow`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kv
import models
from models.config import HFConfig
from models.engine import Engine, EngineKV, Policy, Request, SamplingParams
from models.families import pawqwen3 as paw
from tests.models import tiny

# 2 slots, pages of 8, 11 allocatable pages per head: two long requests do not fit (preemption).
SHAPE = dict(batch_slots=2, max_len=96, page_size=8, chunk=16, num_pages=12,
             implementation="xla")


def poison_unowned(engine: Engine) -> None:
    """NaN in every page (of every head) of every paged layer that no slot's table holds."""
    states = engine.states
    table = np.asarray(states.tables.table)  # [B, Lp * K, M]
    k = engine.num_kv_heads
    pools = list(states.pools)
    for p, layer in enumerate(engine.paged_layers):
        ids = table[:, p * k:(p + 1) * k]  # [B, K, M]
        held = np.zeros((k, engine.num_pages), bool)
        for h in range(k):
            row = ids[:, h].ravel()
            held[h, row[(row >= 1) & (row < engine.num_pages)]] = True
        pool = pools[layer]
        if isinstance(pool, kv.LatentPool):  # one latent head
            keep = jnp.asarray(held[0])[:, None, None]
            pools[layer] = pool.replace(pages=jnp.where(keep, pool.pages, jnp.nan))
            continue
        keep = jnp.asarray(held)[:, :, None, None]
        new = dict(k=jnp.where(keep, pool.k, jnp.nan), v=jnp.where(keep, pool.v, jnp.nan))
        if pool.is_fp8:
            new.update(k_scale=jnp.where(keep[..., 0], pool.k_scale, jnp.nan),
                       v_scale=jnp.where(keep[..., 0], pool.v_scale, jnp.nan))
        pools[layer] = pool.replace(**new)
    engine.states = EngineKV(pools, states.tables, states.allocator)


def soak(engine: Engine, steps: int, *, seed: int, policies=(None,), max_prompt: int = 48,
         policy_changes: bool = False) -> dict:
    """Run `steps` random steps, then drain; returns counts of what happened."""
    gen = np.random.default_rng(seed)
    counts = {"steps": 0, "requests": 0, "policy_changes": 0}

    # One request alone must fit the pool: prompt + output <= every allocatable page.
    cap = min(engine.max_len, (engine.num_pages - 1) * engine.page_size)

    def add():
        n = int(gen.integers(1, max_prompt + 1))
        params = SamplingParams(max_tokens=int(gen.integers(1, cap - n + 1)),
                                seed=int(gen.integers(1 << 16)),
                                temperature=float(gen.choice([0.0, 0.9])),
                                top_k=int(gen.choice([0, 5])))
        prompt = [int(t) for t in gen.integers(0, tiny.VOCAB, n)]
        engine.add(Request(prompt, params, policies[int(gen.integers(len(policies)))]))
        counts["requests"] += 1

    def step():
        poison_unowned(engine)
        engine.step()
        engine.check_page_tables()
        logits = np.asarray(engine.last_logits)
        assert np.isfinite(logits).all(), f"step {counts['steps']}: non-finite logits"
        counts["steps"] += 1

    while counts["steps"] < steps:
        if len(engine.waiting) < 2 and gen.random() < 0.6:
            add()
        if policy_changes and gen.random() < 0.05:
            engine.policy = [p for p in policies if p is not None][
                int(gen.integers(len(policies) - 1))]
            counts["policy_changes"] += 1
        if engine.idle:
            add()
        step()
    engine.waiting.clear()
    while not engine.idle:
        step()
    assert np.all(engine.free_pages()[list(engine.paged_layers)] == engine.num_pages - 1)
    return counts


def _policies(layers: int, heads: int):
    return (None, Policy.dense(layers, heads),
            Policy.streaming(layers, heads, window=16, sinks=8),
            Policy.headwise(layers, heads, window=8, sinks=4))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("soak_llama"))
    tiny.save_tiny("llama", path, ids=tiny.token_ids(1, 4))
    return models.from_pretrained(path, progress=False)


def _run_llama(model, steps: int, seed: int) -> None:
    engine = Engine(model, **SHAPE)
    counts = soak(engine, steps, seed=seed, policy_changes=True,
                  policies=_policies(engine.num_layers, engine.num_kv_heads))
    assert engine.stats["preemptions"] > 0, counts
    assert engine.stats["decode_steps"] > 0 and engine.stats["mixed_steps"] > 0
    assert counts["policy_changes"] > 0


def test_soak_llama_300_steps(llama):
    _run_llama(llama, 300, seed=0)


@pytest.mark.slow
def test_soak_llama_10k_steps(llama):
    _run_llama(llama, 10_000, seed=1)


@pytest.mark.slow
def test_soak_llama_fp8_kv(llama):
    engine = Engine(llama, **SHAPE, kv_dtype=jnp.float8_e4m3fn)
    soak(engine, 2_000, seed=2, policies=_policies(engine.num_layers, engine.num_kv_heads))
    assert engine.stats["preemptions"] > 0


@pytest.mark.slow
def test_soak_mla_deepseek_v3(tmp_path_factory):
    """The MLA path: one latent head per layer, tables checked like the attention ones."""
    path = str(tmp_path_factory.mktemp("soak_deepseek"))
    tiny.save_hybrid("deepseek_v3", path)
    engine = Engine(models.from_pretrained(path, progress=False), **SHAPE)
    soak(engine, 10_000, seed=3)
    assert engine.stats["preemptions"] > 0


@pytest.mark.slow
def test_soak_elastic_pawqwen3():
    """The elastic path: routed one-chunk prompts, streaming heads giving pages back after
    routing, preemption re-routing; tables checked like the others."""
    cfg = dict(tiny.base_config("qwen3"), architectures=["PawQwen3ForCausalLM"], **tiny.PAW_FIELDS)
    model = paw.PawQwen3ForCausalLM(paw.config_from_hf(HFConfig(cfg, source="tiny")),
                                    rngs=nnx.Rngs(0))
    engine = Engine(model, **tiny.PAW_ENGINE_SHAPE, elastic=True)
    soak(engine, 10_000, seed=4, max_prompt=engine.chunk)
    assert engine.stats["preemptions"] > 0
