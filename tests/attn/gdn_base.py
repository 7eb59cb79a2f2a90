"""The shared test base of the Gated DeltaNet ops (`gdn_chunked`, `gdn_prefill_pool`,
`gdn_decode_pool`), and the builders of their tests.

The oracle is `naive64`, the gated delta rule written from the paper's recurrence in float64
numpy, one token at a time. A backend's test class subclasses `GdnTests` and sets
`implementation`; each check asks the op first whether the backend takes the case
(`op.reasons`): if it does, the results must match the oracle (and the slot-pool contract: padding
rows give 0, stale or NaN slots nobody carries change nothing, bitwise); if not, the call must
raise `NotImplementedError` naming those reasons. Shapes are small (H = Hv = 16, GVA 2) and
shared, so each jitted call compiles once per shape.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import gdn
from tests.utils import assert_close, case_id, poison, rng

H = HV = 16
NK, NV = 2, 4  # GVA ratio 2 unless a test says otherwise
C = 64  # the chunk every backend supports
SLOTS = 8
_STATIC = ("scale", "use_qk_l2norm", "chunk_size", "implementation")


def randn(gen, shape, scale=1.0):
    return (gen.standard_normal(shape) * scale).astype(np.float32)


def inputs(gen, b, t, nk=NK, nv=NV, h=H, hv=HV, dtype=np.float32):
    """Random q, k, v and realistic gates (per-token decay mostly 0.7..0.99, as hf_parity.md).

    numpy arrays: slicing them in tests compiles nothing."""
    q, k, v = (randn(gen, s).astype(dtype) for s in ((b, t, nk, h), (b, t, nk, h), (b, t, nv, hv)))
    x = randn(gen, (b, t, nv)) + gen.uniform(-3.0, 0.0, nv)  # a + dt_bias
    g = -gen.uniform(0.05, 1.0, nv) * np.log1p(np.exp(x))
    beta = 1 / (1 + np.exp(-randn(gen, (b, t, nv))))
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def random_state(gen, rows, nv=NV, h=H, hv=HV):
    return randn(gen, (rows, nv, h, hv), scale=0.5)


def cu_seqlens_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def naive64(q, k, v, g, beta, h0=None, scale=None, use_qk_l2norm=True):
    """Float64 numpy gated delta rule written from the paper's recurrence, one token at a time."""
    q, k, v, g, beta = (np.asarray(x).astype(np.float64) for x in (q, k, v, g, beta))
    b, t, nk, h = q.shape
    nv, hv = v.shape[2:]
    if use_qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q * (h ** -0.5 if scale is None else scale)
    heads = np.arange(nv) // (nv // nk)  # value head -> key head
    s = np.zeros((b, nv, h, hv)) if h0 is None else np.asarray(h0, np.float64).copy()
    out = np.zeros((b, t, nv, hv))
    for i in range(t):
        qi, ki, vi = q[:, i, heads], k[:, i, heads], v[:, i]
        s = s * np.exp(g[:, i])[..., None, None]
        u = beta[:, i, :, None] * (vi - np.einsum("bnhv,bnh->bnv", s, ki))
        s = s + ki[..., :, None] * u[..., None, :]
        out[:, i] = np.einsum("bnhv,bnh->bnv", s, qi)
    return out, s


def pool_case(gen, t):
    """Batch of 4 rows: slots 5, 0 (padding), 2 (a fresh request), 7; every slot holds an old
    state."""
    xs = inputs(gen, 4, t)
    pool = randn(gen, (SLOTS, NV, H, HV), scale=0.5)
    slot_ids = np.asarray([5, 0, 2, 7], np.int32)
    has_init = np.asarray([True, True, False, True])
    return xs, pool, slot_ids, has_init


def rel_norm(a, e) -> float:
    a, e = np.asarray(jnp.asarray(a, jnp.float32), np.float64), np.asarray(e, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


@functools.cache
def _jitted(name: str):
    fn = getattr(gdn, name)
    params = inspect.signature(fn).parameters
    return jax.jit(fn, static_argnames=[n for n in _STATIC if n in params])


class GdnTests:
    """Checks every backend of the GDN ops passes (or refuses with reasons)."""

    implementation: str = "xla"
    float64_tol: float = 1e-4  # float32 results against the float64 recurrence

    def call(self, name: str, *args, **kw):
        """`attn.gdn.<name>` on this backend, jitted, as numpy; or None after checking it
        refuses with its reasons."""
        op = getattr(gdn, name)
        reasons = op.reasons(self.implementation, *args, **kw)
        if reasons:
            with pytest.raises(NotImplementedError, match=re.escape(reasons[0])):
                op(*args, implementation=self.implementation, **kw)
            return None
        out = _jitted(name)(*args, implementation=self.implementation, **kw)
        return jax.tree.map(np.asarray, out)

    def close64(self, got, want, err_msg=""):
        tol = self.float64_tol
        assert_close(got, want, atol=tol, rtol=tol, err_msg=err_msg)

    @pytest.mark.parametrize("t", [1, C - 1, C, C + 1, 200], ids=lambda t: case_id(T=t))
    def test_chunked_matches_float64(self, t):
        gen = rng()
        xs, h0 = inputs(gen, 1, t), random_state(gen, 1)
        got = self.call("gdn_chunked", *xs, initial_state=h0, use_qk_l2norm=True)
        if got is None:
            return
        (o, s), (o64, s64) = got, naive64(*xs, h0)
        assert o.dtype == np.float32 and s.dtype == np.float32
        self.close64(o, o64, "out")
        self.close64(s, s64, "final state")

    def test_chunked_without_state_gva_1_batch_2(self):
        gen = rng()
        xs = inputs(gen, 2, C + 1, nk=NV, nv=NV)
        got = self.call("gdn_chunked", *xs, use_qk_l2norm=True)
        if got is not None:
            for a, e in zip(got, naive64(*xs), strict=True):
                self.close64(a, e)

    def test_gva_maps_value_head_to_key_head_by_repeat(self):
        """Value head h reads key head h // (Nv // Nk): changing key head 1 moves only 2, 3."""
        gen = rng()
        q, k, v, g, beta = inputs(gen, 1, C + 1)
        k2 = k.copy()
        k2[:, :, 1] = randn(gen, k2[:, :, 1].shape)
        h0 = random_state(gen, 1)
        one = self.call("gdn_chunked", q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
        if one is None:
            return
        two = self.call("gdn_chunked", q, k2, v, g, beta, initial_state=h0, use_qk_l2norm=True)
        np.testing.assert_array_equal(one[0][:, :, :2], two[0][:, :, :2])
        assert np.abs(one[0][:, :, 2:] - two[0][:, :, 2:]).max() > 1e-3

    def test_varlen_equals_per_sequence_float64(self):
        """Packed sequences of 1, C - 1, 0, C and C + 1 tokens with their own states: each
        equals the float64 recurrence run on it alone; the empty one keeps its state."""
        gen = rng()
        offsets = cu_seqlens_of([1, C - 1, 0, C, C + 1])
        xs, h0 = inputs(gen, 1, int(offsets[-1])), random_state(gen, len(offsets) - 1)
        got = self.call("gdn_chunked", *xs, initial_state=h0, use_qk_l2norm=True,
                        cu_seqlens=offsets)
        if got is None:
            return
        o, s = got
        for i, (lo, hi) in enumerate(itertools.pairwise(offsets)):
            if lo == hi:
                np.testing.assert_array_equal(s[i], h0[i])
                continue
            o64, s64 = naive64(*(x[:, lo:hi] for x in xs), h0[i:i + 1])
            self.close64(o[:, lo:hi], o64, f"sequence {i}")
            self.close64(s[i:i + 1], s64, f"sequence {i} state")

    def test_bf16_inputs(self):
        """bf16 q / k / v: output in bf16, states in float32, within bf16's error (relative
        norm 3e-2) of the float64 recurrence on the same bf16 values."""
        gen = rng()
        xs, h0 = inputs(gen, 1, C + 1, dtype=jnp.bfloat16), random_state(gen, 1)
        got = self.call("gdn_chunked", *xs, initial_state=h0, use_qk_l2norm=True)
        if got is None:
            return
        (o, s), (o64, s64) = got, naive64(*xs, h0)
        assert o.dtype == jnp.bfloat16 and s.dtype == np.float32
        assert rel_norm(o, o64) <= 3e-2 and rel_norm(s, s64) <= 3e-2

    def run_pool(self, t, xs, pool, slot_ids, has_init, **kw):
        name = "gdn_decode_pool" if t == 1 else "gdn_prefill_pool"
        return self.call(name, *xs, pool, slot_ids, has_initial_state=has_init,
                         use_qk_l2norm=True, **kw)

    @pytest.mark.parametrize("t", [1, C + 1], ids=["decode", "prefill"])
    def test_pool_matches_per_request(self, t):
        xs, pool, slot_ids, has_init = pool_case(rng(), t)
        got = self.run_pool(t, xs, pool, slot_ids, has_init)
        if got is None:
            return
        o, new_pool = got
        for row, (slot, init) in enumerate(zip(slot_ids, has_init)):
            if slot == 0:
                np.testing.assert_array_equal(o[row], 0)  # padding row outputs 0
                continue
            h0 = pool[slot:slot + 1] if init else np.zeros_like(pool[:1])
            o64, s64 = naive64(*(x[row:row + 1] for x in xs), h0)
            self.close64(o[row:row + 1], o64, f"row {row}")
            self.close64(new_pool[slot:slot + 1], s64, f"slot {slot}")
        untouched = [s for s in range(1, SLOTS) if s not in slot_ids]
        np.testing.assert_array_equal(new_pool[untouched], pool[untouched])

    @pytest.mark.parametrize("t", [1, C + 1], ids=["decode", "prefill"])
    def test_pool_slots_nobody_carries_change_nothing(self, t):
        """NaN in every slot no live row carries state from: the null slot 0, the free slots and
        the stale slot of row 2, a fresh request (has_initial_state False). Bitwise the output
        and new states of a pool with zeros there (so NaN never meets a multiply by zero)."""
        xs, pool, slot_ids, has_init = pool_case(rng(), t)
        carried = np.isin(np.arange(SLOTS), slot_ids[(slot_ids > 0) & has_init])
        clean = np.where(carried[:, None, None, None], pool, 0.0).astype(np.float32)
        got = self.run_pool(t, xs, clean, slot_ids, has_init)
        if got is None:
            return
        o_b, p_b = self.run_pool(t, xs, np.asarray(poison(pool, carried)), slot_ids, has_init)
        live = slot_ids[slot_ids > 0]
        np.testing.assert_array_equal(got[0], o_b)
        np.testing.assert_array_equal(got[1][live], p_b[live])
        assert np.isfinite(o_b).all()

    @pytest.mark.parametrize("t", [1, C + 1], ids=["decode", "prefill"])
    def test_pool_batch_reorder_keeps_request_with_its_slot(self, t):
        xs, pool, slot_ids, has_init = pool_case(rng(), t)
        perm = np.asarray([2, 0, 3, 1])
        got = self.run_pool(t, xs, pool, slot_ids, has_init)
        if got is None:
            return
        o_b, p_b = self.run_pool(t, [x[perm] for x in xs], pool, slot_ids[perm], has_init[perm])
        np.testing.assert_array_equal(got[0][perm], o_b)
        np.testing.assert_array_equal(got[1][1:], p_b[1:])

    def test_prefill_pool_varlen(self):
        """Packed prefill of 3 requests on the pool: a fresh one, a padding sequence, a
        continuing one (a 1-token segment with state, as a decode inside a mixed batch)."""
        gen = rng()
        offsets = cu_seqlens_of([C - 1, C + 1, 1])
        xs = inputs(gen, 1, int(offsets[-1]))
        pool = randn(gen, (SLOTS, NV, H, HV), scale=0.5)
        slot_ids = np.asarray([3, 0, 6], np.int32)
        has_init = np.asarray([False, True, True])
        got = self.run_pool(C + 1, xs, pool, slot_ids, has_init, cu_seqlens=offsets)
        if got is None:
            return
        o, new_pool = got
        np.testing.assert_array_equal(o[:, offsets[1]:offsets[2]], 0)  # the padding sequence
        for i in (0, 2):
            h0 = pool[slot_ids[i]][None] if has_init[i] else np.zeros_like(pool[:1])
            o64, s64 = naive64(*(x[:, offsets[i]:offsets[i + 1]] for x in xs), h0)
            self.close64(o[:, offsets[i]:offsets[i + 1]], o64, f"sequence {i}")
            self.close64(new_pool[slot_ids[i]][None], s64, f"sequence {i} state")
        np.testing.assert_array_equal(new_pool[[1, 2, 4, 5, 7]], pool[[1, 2, 4, 5, 7]])
