"""Elastic attention (PawQwen3) through the generation engine, on a tiny random PawQwen3.

The model (random weights, block 16 via `testing_small_blocks`, XAttention retrieval heads and
streaming sparse heads, sink 16 + window 32) is built in memory; its random routers give mixed
decisions. The engine prefills each prompt in one routed chunk (block-sparse attention over the
chunk), then decodes streaming heads as sink + window heads on the pages and the others full.
References: the elastic full forward `model(ids, lengths=...)` (decisions and first token), and
for later tokens repeated full forwards whose attend runs `ElasticAttend` on the prompt part and
dense attention with the request's per-head windows on the generated positions.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.dense import attention
from models import engine as engine_mod
from models.config import HFConfig
from models.engine import Engine, Policy, Request, SamplingParams
from models.families import pawqwen3 as paw
from models.families.qwen3 import Qwen3ForCausalLM
from tests.models import tiny
from tests.utils import assert_close

SINK, LOCAL = tiny.PAW_SINK, tiny.PAW_LOCAL
FIELDS, SHAPE = tiny.PAW_FIELDS, tiny.PAW_ENGINE_SHAPE
WIDTH = 96  # reference forwards run at one padded width (one compile)
STREAM = -1


@pytest.fixture(scope="module")
def model():
    cfg = dict(tiny.base_config("qwen3"), architectures=["PawQwen3ForCausalLM"], **FIELDS)
    return paw.PawQwen3ForCausalLM(paw.config_from_hf(HFConfig(cfg, source="tiny")),
                                   rngs=nnx.Rngs(0))


def prompts(lengths, seed=3):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, tiny.VOCAB, n)] for n in lengths]


def padded(rows):
    ids = np.zeros((len(rows), WIDTH), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    return jnp.asarray(ids)


def streaming(z):
    """`[L, K]` bool: heads whose decision maps to streaming (z = 0 under toggle streaming)."""
    return np.asarray(z) == 0


@dataclasses.dataclass(frozen=True)
class _PromptElasticAttend:
    """Reference attend: `ElasticAttend` on the first `n` tokens (queries and keys), dense
    attention with the per-head sink + window of the routed streaming heads after them."""

    n: jnp.ndarray  # [] int32 prompt length

    def __call__(self, spec, qkv, state=None):
        lengths = jnp.reshape(self.n, (1,)).astype(jnp.int32)
        o_prompt, z = paw.ElasticAttend(lengths=lengths, implementation="xla")(spec, qkv)
        stream = z[0] == 0
        o_dense, _ = attention(qkv.q, qkv.k, qkv.v, causal=True, scale=spec.scale,
                               window=jnp.where(stream, LOCAL, 0).astype(jnp.int32),
                               sinks=jnp.where(stream, SINK, 0).astype(jnp.int32),
                               implementation="xla")
        prompt = (jnp.arange(qkv.q.shape[1]) < self.n)[None, :, None, None]
        return jnp.where(prompt, o_prompt, o_dense), z


@nnx.jit
def _reference_logits(model, ids, n):
    positions = jnp.arange(WIDTH, dtype=jnp.int32)[None]
    hidden, _ = model.forward(ids, positions, attend=_PromptElasticAttend(n))
    return model.logits(hidden)


def reference_elastic(model, prompt, n):
    """Greedy continuation: prompt elastic (routed, block-sparse), generated tokens dense with
    the routed streaming heads as sink + window heads."""
    ids = list(prompt)
    for _ in range(n):
        logits = _reference_logits(model, padded([ids]), jnp.int32(len(prompt)))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


def reference_dense(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        logits = model(padded([ids]), elastic=False, implementation="xla")
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt):]


def poison(engine):
    """NaN into every page of every pool (the null page included)."""
    engine.states = engine.states._replace(pools=[
        jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), p) for p in engine.states.pools])


def run_checked(engine):
    """Step to the end, checking after every step that the host page mirror equals the device."""
    while not engine.idle:
        engine.step()
        held = engine.pages_held().sum(axis=0)
        assert np.array_equal(engine.free_pages(), engine.num_pages - 1 - held)
    assert np.all(engine.free_pages() == engine.num_pages - 1)  # nothing leaked


def test_dense_backbone_greedy_equals_full_forward(model):
    """Without `elastic`, a PawQwen3 runs through the engine as its dense Qwen3 backbone."""
    engine = Engine(model, **SHAPE)
    ps = prompts([70, 9], seed=7)  # 70 > chunk: chunked prefill
    outs = engine.generate(ps, SamplingParams(max_tokens=4))
    assert outs == [reference_dense(model, p, 4) for p in ps]


def test_elastic_engine_matches_elastic_forward(model):
    """Decisions = the router's, first token = argmax of the elastic forward (logits close),
    later tokens = the prompt-elastic / windowed-dense reference, all from NaN-poisoned pages;
    streaming heads give pages back; prompts of different lengths share one compiled step per
    kind."""
    engine = Engine(model, elastic=True, **SHAPE)
    poison(engine)
    ps = prompts([63, 41, 58, 30])
    lengths = jnp.asarray([len(p) for p in ps], jnp.int32)
    full_logits, z = model(padded(ps), lengths=lengths, return_decisions=True,
                           implementation="xla")
    z = np.asarray(z)  # [L, B, K]
    assert streaming(z).any() and not streaming(z).all(), z  # mixed decisions
    one = model(jnp.asarray([ps[1]], jnp.int32), implementation="xla")  # unpadded forward
    assert_close(one[0, -1], full_logits[1, len(ps[1]) - 1], atol=1e-4, rtol=0)

    before = dict(engine_mod.TRACES)
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=8))) for p in ps]
    first_logits = {}
    while not engine.idle:
        engine.step()
        for req in reqs:
            if len(req.output) == 1 and req.id not in first_logits:
                first_logits[req.id] = np.asarray(engine.last_logits[req.row])
        if reqs[0] in engine.slots:  # cached tokens and pages [L, K] of the 63-token request
            last = reqs[0].cached, engine.pages_held()[reqs[0].row]
        assert np.array_equal(engine.free_pages(),
                              engine.num_pages - 1 - engine.pages_held().sum(axis=0))
    assert np.all(engine.free_pages() == engine.num_pages - 1)
    mixed, decode = (engine_mod.TRACES[k] - before.get(k, 0) for k in ("mixed", "decode"))
    assert mixed <= 1 and decode <= 1, (mixed, decode)  # no recompiles across prompt lengths

    for b, (p, req) in enumerate(zip(ps, reqs)):
        np.testing.assert_array_equal(req.decisions, z[:, b], err_msg=f"request {b}")
        want = np.asarray(full_logits[b, len(p) - 1])
        assert req.output[0] == int(np.argmax(want)), b
        assert_close(first_logits[req.id], want, atol=1e-4, rtol=0)
        assert req.output == reference_elastic(model, p, 8), b

    # Streaming heads released pages: the 63-token request at its last step (69 tokens).
    cached, final = last
    full = -(-cached // SHAPE["page_size"])
    stream = streaming(z[:, 0])
    assert cached == len(ps[0]) + 6, cached
    assert np.all(final[~stream] == full) and np.all(final[stream] < full), final


def test_elastic_preemption_recomputes_without_leaks(model):
    """Pools too small for two growing requests: the later one is preempted after it generated
    tokens, re-routed (same decisions) and recomputed; nothing leaks (pages poisoned with NaN
    first; host mirror = device after every step; all free at the end), and (prompt re-prefilled
    elastically, generated tokens as a dense windowed chunk) its tokens stay the reference's."""
    ps = prompts([40, 44], seed=11)
    engine = Engine(model, elastic=True, **SHAPE)
    poison(engine)
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=24))) for p in ps]
    run_checked(engine)
    assert engine.stats["preemptions"] >= 1
    late = max(reqs, key=lambda r: r.preemptions)
    assert late.preemptions >= 1 and late.prefill_tokens > len(late.prompt)
    _, z = model(padded(ps), lengths=jnp.asarray([40, 44], jnp.int32), return_decisions=True,
                 implementation="xla")
    for b, req in enumerate(reqs):
        np.testing.assert_array_equal(req.decisions, np.asarray(z)[:, b])
        assert req.output == reference_elastic(model, ps[b], 24), b


def test_elastic_errors(model):
    engine = Engine(model, elastic=True, **SHAPE)
    with pytest.raises(ValueError, match=r"prompt of 65 tokens exceeds chunk=64"):
        engine.add(Request(prompts([65])[0], SamplingParams(max_tokens=2)))
    policy = Policy.dense(2, 2)
    with pytest.raises(ValueError, match=r"request policy 'dense' is not allowed"):
        engine.add(Request([1, 2, 3], SamplingParams(max_tokens=2), policy))
    with pytest.raises(ValueError, match=r"elastic=True derives .* got policy 'dense'"):
        Engine(model, elastic=True, policy=policy, **SHAPE)
    plain = Qwen3ForCausalLM(model.cfg, rngs=nnx.Rngs(0))  # a Qwen3 mixer, no router
    with pytest.raises(ValueError, match=r"elastic=True needs elastic attention layers .*"
                                         r"layers \[0, 1\] of Qwen3ForCausalLM"):
        Engine(plain, elastic=True, **SHAPE)
