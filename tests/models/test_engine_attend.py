"""`Engine(model, attend=...)`: a custom attention in the engine, as in `model(ids, attend=...)`.

One attend object serves both: given a `PagedKV` (the engine) it works on the pages, given a
plain state (the full forward) it runs dense attention on the call's q, k, v. Greedy tokens of
the engine with the attend must equal greedy by repeated full forwards with the same attend, and
differ from the engine without it: the attend is used, on every layer it names, in prefill
chunks and decode steps alike.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention
from models.engine import Engine, PagedKV, Request, SamplingParams, paged_attention
from models.layers.attention import DenseAttend
from tests.models.test_engine_tp import VOCAB, build

SHAPE = dict(batch_slots=2, max_len=64, page_size=8, chunk=16, implementation="xla")
WIDTH = 64
LENGTHS, STEPS = (37, 5, 20), 6


@dataclasses.dataclass(frozen=True)
class WindowOn:
    """Sliding window + sinks on `layers`, dense elsewhere: on pages (the engine's
    `paged_attention` with the policy's window replaced) or on the call's tokens."""

    layers: tuple[int, ...]
    window: int
    sinks: int = 0

    def __call__(self, spec, qkv, state=None):
        if isinstance(state, PagedKV):
            if spec.layer in self.layers:
                state = state._replace(window=jnp.full_like(state.window, self.window),
                                       sinks=jnp.full_like(state.sinks, self.sinks))
            return paged_attention(spec, qkv, state)
        if spec.layer in self.layers:
            spec = dataclasses.replace(spec, window=self.window, sinks=self.sinks)
        return DenseAttend(implementation="xla")(spec, qkv, state)


@dataclasses.dataclass(frozen=True)
class Sharper:
    """Dense causal attention with the softmax scale times `factor`; in the engine over the
    row's keys gathered from the pages (`PagedKV.gather`), queries at `q_offset`."""

    factor: float

    def __call__(self, spec, qkv, state=None):
        scale = spec.scale * self.factor
        if isinstance(state, PagedKV):
            k, v = state.gather(qkv.q.dtype)
            o, _ = attention(qkv.q, k, v, causal=True, scale=scale, q_offset=state.q_offset,
                             kv_lengths=state.kv_lengths, implementation="xla")
            return o, state
        o, _ = attention(qkv.q, qkv.k, qkv.v, causal=True, scale=scale, implementation="xla")
        return o, state


@pytest.fixture(scope="module")
def model():
    return build("llama")


def _prompts():
    gen = np.random.default_rng(5)
    return [[int(t) for t in gen.integers(0, VOCAB, n)] for n in LENGTHS]


def _engine_greedy(model, attend):
    engine = Engine(model, attend=attend, **SHAPE)
    reqs = [engine.add(Request(p, SamplingParams(max_tokens=STEPS))) for p in _prompts()]
    engine.run()
    return [r.output for r in reqs]


def _forward_greedy(model, attend):
    """Greedy by repeated full forwards with `attend` (all prompts batched, one padded width)."""
    ids = [list(p) for p in _prompts()]
    for _ in range(STEPS):
        padded = np.zeros((len(ids), WIDTH), np.int32)
        for i, row in enumerate(ids):
            padded[i, :len(row)] = row
        logits = model(jnp.asarray(padded), attend=attend)
        last = np.asarray([len(row) - 1 for row in ids])
        for row, tok in zip(ids, np.asarray(jnp.argmax(logits[np.arange(len(ids)), last], -1))):
            row.append(int(tok))
    return [row[n:] for row, n in zip(ids, LENGTHS)]


@pytest.mark.parametrize("attend", [WindowOn(layers=(1,), window=4, sinks=1), Sharper(3.0)],
                         ids=["paged-window", "gathered-scale"])
def test_engine_attend_equals_model_attend(model, attend):
    got = _engine_greedy(model, attend)
    assert got == _forward_greedy(model, attend)
    assert got != _engine_greedy(model, None)  # the attend changed the tokens: it was used


def test_attend_errors(model):
    @dataclasses.dataclass
    class Mutable:
        def __call__(self, spec, qkv, state=None):
            return paged_attention(spec, qkv, state)

    with pytest.raises(TypeError, match="must be hashable"):
        Engine(model, attend=Mutable(), **SHAPE)
    with pytest.raises(TypeError, match="must be callable"):
        Engine(model, attend="dense", **SHAPE)

    @dataclasses.dataclass(frozen=True)
    class WithGDN(WindowOn):
        def gdn_mix(self, spec, inputs, state):
            raise AssertionError

    with pytest.raises(ValueError, match=r"has \['gdn_mix'\].*softmax attention over pages"):
        Engine(model, attend=WithGDN(layers=(), window=0), **SHAPE)

    def drops_cache(spec, qkv, cache):
        return paged_attention(spec, qkv, cache)[0], None

    engine = Engine(model, attend=drops_cache, **SHAPE)
    engine.add(Request([1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(TypeError, match="returned NoneType as its state; it must return the "
                                        "PagedKV"):
        engine.run()
