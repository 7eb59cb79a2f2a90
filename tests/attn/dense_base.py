"""The shared test base of `attn.dense.attention`: every backend against the XLA reference.

A backend's test class subclasses `DenseAttentionTests` and sets `implementation` (and `config`
where the backend needs one on the CPU). Each check asks the op first whether the backend takes
the case (`attention.reasons`): if it does, values and gradients must match the reference; if
not, the call must raise `NotImplementedError` naming those reasons. So a new option (such as
`softcap`) is one case here, and each backend either passes it or says why not.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention
from tests.utils import assert_close, randn, rng

# (name, shape, options); shapes `B T S N K H Hv`, float32.
CASES = [
    ("causal", (2, 9, 9, 4, 2, 16, 16), {}),
    ("window-sinks", (1, 12, 12, 2, 1, 16, 8), dict(window=5, sinks=2)),
    ("offset-lengths", (2, 5, 11, 3, 1, 16, 16),
     dict(q_offset=np.array([6, 2], np.int32), kv_lengths=np.array([11, 7], np.int32))),
    ("non-causal", (1, 7, 10, 2, 2, 16, 16), dict(causal=False)),
]
SOFTCAPS = [1.0, 30.0]


def qkv(seed: int, shape):
    b, t, s, n, kh, h, hv = shape
    gen = rng(seed)
    return (randn(gen, (b, t, n, h)), randn(gen, (b, s, kh, h)), randn(gen, (b, s, kh, hv)))


def _loss(out_lse, weights):
    out, _ = out_lse
    return jnp.sum(out.astype(jnp.float32) * weights)


class DenseAttentionTests:
    """Checks every backend of `attn.dense.attention` passes (or refuses with reasons)."""

    implementation: str = "xla"
    config = None  # a launch config the backend needs here (e.g. Mosaic's interpreter)

    def call(self, q, k, v, **options):
        return attention(q, k, v, implementation=self.implementation, config=self.config,
                         **options)

    def check_against_reference(self, q, k, v, **options):
        reasons = attention.reasons(self.implementation, q, k, v, config=self.config, **options)
        if reasons:
            with pytest.raises(NotImplementedError, match=re.escape(reasons[0])):
                self.call(q, k, v, **options)
            return
        out, lse = self.call(q, k, v, **options)
        exp_out, exp_lse = attention(q, k, v, implementation="xla", **options)
        assert_close(out, exp_out, atol=2e-5, rtol=2e-5)
        assert_close(lse, exp_lse, atol=2e-5, rtol=2e-5, allow_neg_inf=True)
        weights = randn(rng(7), out.shape)
        got = jax.grad(lambda *a: _loss(self.call(*a, **options), weights), (0, 1, 2))(q, k, v)
        exp = jax.grad(lambda *a: _loss(attention(*a, implementation="xla", **options),
                                        weights), (0, 1, 2))(q, k, v)
        for name, g, e in zip("qkv", got, exp, strict=True):
            assert_close(g, e, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")

    @pytest.mark.parametrize("name,shape,options", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, name, shape, options):
        del name
        self.check_against_reference(*qkv(0, shape), **options)

    @pytest.mark.parametrize("softcap", SOFTCAPS, ids=[f"cap{c:g}" for c in SOFTCAPS])
    @pytest.mark.parametrize("name,shape,options", CASES[:3], ids=[c[0] for c in CASES[:3]])
    def test_softcap_matches_reference(self, name, shape, options, softcap):
        del name
        q, k, v = qkv(1, shape)
        self.check_against_reference(q * 4, k, v, softcap=softcap, **options)


def softcapped_attention_numpy(q, k, v, softcap: float, scale: float):
    """Causal GQA attention with soft-capped logits in float64 numpy (an independent formula);
    query `t` at position `t`, as `attention`'s default `q_offset=0`."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    kk = np.repeat(k, n // kh, axis=2)
    vv = np.repeat(v, n // kh, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, kk) * scale
    logits = softcap * np.tanh(logits / softcap)
    logits = np.where(np.tril(np.ones((t, s), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", p, vv)
