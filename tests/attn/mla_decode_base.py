"""The shared test base of `attn.mla.mla_paged_decode`, and the builders of its tests.

`paged` scatters contiguous latents `[B, S, L + R]` into a pool whose unowned pages are NaN;
the oracle is absorbed MLA attention (`mla_absorbed_attention`, itself checked against a float64
HF oracle in `test_mla.py`) over the contiguous latents. A backend's test class subclasses
`MlaDecodeTests` and sets `implementation` (and `config`, and `fp8_tolerance` where fp8 tiles
widen to float16); each check asks the op first whether the backend takes the case
(`mla_paged_decode.reasons`): if it does, it must match; if not, the call must raise
`NotImplementedError` naming those reasons.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.mla import absorb_query, expand_output, mla_absorbed_attention, mla_paged_decode
from kv import fp8
from tests.utils import AttentionTestBase, assert_close, case_id, rng

F32, BF16 = jnp.float32, jnp.bfloat16


def randn(gen, shape, dtype=F32, scale=1.0):
    """Fresh standard-normal numpy array (bf16 / fp8 through ml_dtypes): numpy inputs keep the
    ops' eager calls from compiling one jnp op at a time."""
    return (gen.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def paged(gen, latent, lengths, page_size, layout, num_pages):
    """Scatter contiguous latents `[B, S, L+R]` into a pool; every unowned page is NaN.

    Returns numpy `(pages [num_pages, P, L+R], block_tables [B, max_pages], owned [num_pages])`
    with `-1` past each row's used pages; page 0 stays null (and NaN).
    """
    b, s, lr = latent.shape
    max_pages = s // page_size
    ids = np.arange(1, num_pages) if layout == "uniform" else gen.permutation(num_pages - 1) + 1
    table, next_id = np.full((b, max_pages), -1, np.int32), 0
    for row, n in enumerate(lengths):
        used = -(-int(n) // page_size)
        table[row, :used] = ids[next_id:next_id + used]
        next_id += used
    pages = np.full((num_pages, page_size, lr), np.nan, np.float32)
    pages[table[table >= 0]] = latent.astype(np.float32).reshape(b, max_pages, page_size, lr)[
        table >= 0]
    owned = np.zeros(num_pages, bool)
    owned[table[table >= 0]] = True
    return pages.astype(latent.dtype), table, owned


def quantize(pages, sub_block):
    """`kv.fp8.quantize` over the token axis: one scale per (page, sub-block), as numpy."""
    q, scales = fp8.quantize(jnp.asarray(pages), sub_block, axis=-2)
    return np.array(q), np.array(scales)


@functools.partial(jax.jit, static_argnames=("scale",))
def absorbed_oracle(q_nope, q_pe, latent, lengths, w_uk, w_uv, *, scale):
    """Absorbed attention of one query at position `length - 1` over the contiguous latent."""
    l = w_uk.shape[-1]
    out, lse = mla_absorbed_attention(
        q_nope[:, None], q_pe[:, None], latent[..., :l], latent[..., l:], w_uk, w_uv,
        scale=scale, q_offset=jnp.maximum(lengths - 1, 0), kv_lengths=lengths)
    return out[:, 0], lse[:, 0]


DECODE_CASES = [  # L, R, B, N, P, max_pages, lengths, layout, num_splits
    (512, 64, 1, 2, 4, 3, [9], "random", 3),
    (256, 32, 3, 3, 4, 4, [1, 16, 0], "uniform", 1),
    (64, 16, 4, 5, 8, 3, [24, 0, 13, 1], "random", 3),
    (48, 24, 3, 4, 4, 5, [7, 20, 5], "random", 3),
]


class MlaDecodeTests(AttentionTestBase):
    """Checks every backend of `mla_paged_decode` passes (or refuses with reasons)."""

    implementation: str = "xla"
    config = None
    # (out, lse) tolerance against the dequantised pages where fp8 tiles widen to a type
    # narrower than float32 (None: float32's).
    fp8_tolerance: tuple[float, float] | None = None

    def call(self, *args, **options):
        """`mla_paged_decode` on this backend, or None after checking it refuses with its
        reasons."""
        kw = dict(implementation=self.implementation, config=self.config)
        reasons = mla_paged_decode.reasons(self.implementation, *args, config=self.config,
                                           **options)
        if reasons:
            with pytest.raises(NotImplementedError, match=re.escape(reasons[0])):
                mla_paged_decode(*args, **kw, **options)
            return None
        return mla_paged_decode(*args, **kw, **options)

    def check_fp8(self, out, lse, exp_out, exp_lse):
        if self.fp8_tolerance is None:
            self.check_output(out, lse, exp_out, exp_lse)
            return
        out_tol, lse_tol = self.fp8_tolerance
        assert_close(out, exp_out, atol=out_tol, rtol=out_tol, err_msg="out")
        assert_close(lse, exp_lse, atol=lse_tol, rtol=lse_tol, allow_neg_inf=True, err_msg="lse")

    @pytest.mark.parametrize(
        "l,r,b,n,p,max_pages,lengths,layout,num_splits", DECODE_CASES,
        ids=[case_id(L=c[0], R=c[1], B=c[2], P=c[4], splits=c[8]) + f"-{c[7]}"
             for c in DECODE_CASES])
    def test_matches_absorbed_attention(self, l, r, b, n, p, max_pages, lengths, layout,
                                        num_splits):
        """Lengths 1, not a multiple of P, full, and 0 (padding); every unowned page is NaN."""
        gen = rng()
        dn, dv = 16, 8
        w_uk = randn(gen, (n, dn, l), scale=l**-0.5)
        w_uv = randn(gen, (n, dv, l), scale=l**-0.5)
        q_nope, q_pe = randn(gen, (b, n, dn)), randn(gen, (b, n, r))
        latent = randn(gen, (b, max_pages * p, l + r))
        lengths = np.array(lengths, np.int32)
        pages, table, _ = paged(gen, latent, lengths, p, layout, num_pages=b * max_pages + 2)
        scale = (dn + r) ** -0.5
        got = self.call(absorb_query(q_nope, w_uk), q_pe, pages, table, lengths, kv_lora_rank=l,
                        scale=scale, num_splits=num_splits)
        if got is None:
            return
        o_lat, lse = got
        assert o_lat.shape == (b, n, l) and o_lat.dtype == F32 and lse.dtype == F32
        ref_out, ref_lse = absorbed_oracle(q_nope, q_pe, latent, lengths, w_uk, w_uv,
                                           scale=scale)
        self.check_output(expand_output(o_lat, w_uv), lse, ref_out, ref_lse)
        self.check_masked_rows(o_lat, lse, np.broadcast_to(lengths[:, None], (b, n)))

    def test_fp8_latent_equals_dequantised_copy(self):
        """e4m3 latent pages with fp32 scales (NaN on unowned pages): the XLA decode of the
        dequantised pages, and within e4m3's error of the unquantised ones."""
        gen = rng()
        b, n, l, r, p, max_pages, sub_block = 3, 4, 64, 16, 8, 3, 4
        latent = randn(gen, (b, max_pages * p, l + r), scale=3.0)
        lengths = np.array([17, 0, 5], np.int32)
        pages, table, owned = paged(gen, latent, lengths, p, "random", num_pages=12)
        q8, scales = quantize(np.where(owned[:, None, None], pages, 0), sub_block)
        q8[~owned], scales[~owned] = np.nan, np.nan  # unowned pages and their scales: NaN
        deq = np.repeat(scales, sub_block, axis=1)[..., None] * q8.astype(np.float32)
        q_lat, q_pe = randn(gen, (b, n, l)), randn(gen, (b, n, r))
        kw = dict(kv_lora_rank=l, scale=0.1, num_splits=3)
        got = self.call(q_lat, q_pe, q8, table, lengths, latent_scales=scales, **kw)
        if got is None:
            return
        out, lse = got
        exp_out, exp_lse = mla_paged_decode(q_lat, q_pe, deq, table, lengths,
                                            implementation="xla", **kw)
        self.check_fp8(out, lse, exp_out, exp_lse)
        self.check_masked_rows(out, lse, np.broadcast_to(lengths[:, None], (b, n)))
        full_out = np.asarray(mla_paged_decode(q_lat, q_pe, pages, table, lengths,
                                               implementation="xla", **kw)[0])
        rel = np.linalg.norm(np.asarray(out) - full_out) / np.linalg.norm(full_out)
        assert rel < 0.1, f"fp8 relative error {rel:.3g}"  # e4m3 keeps 3 mantissa bits

    def test_unowned_pages_change_nothing_and_batch_rows_are_independent(self):
        """NaN or huge finite garbage in unowned pages: bitwise the same (so two runs are too);
        each row's result does not depend on its neighbours (a permuted batch)."""
        gen = rng()
        b, n, l, r, p, max_pages = 3, 2, 32, 8, 4, 4
        latent = randn(gen, (b, max_pages * p, l + r), BF16)
        lengths = np.array([6, 0, 13], np.int32)
        pages, table, owned = paged(gen, latent, lengths, p, "random", num_pages=14)
        q_lat, q_pe = randn(gen, (b, n, l), BF16), randn(gen, (b, n, r), BF16)
        kw = dict(kv_lora_rank=l, scale=0.2, num_splits=3)
        got = self.call(q_lat, q_pe, pages, table, lengths, **kw)
        if got is None:
            return
        nan_out, nan_lse = map(np.asarray, got)
        assert nan_out.dtype == BF16
        other = np.where(owned[:, None, None], pages, 1e4).astype(BF16)  # huge, finite garbage
        out, lse = map(np.asarray, self.call(q_lat, q_pe, other, table, lengths, **kw))
        np.testing.assert_array_equal(nan_out.astype(np.float32), out.astype(np.float32))
        np.testing.assert_array_equal(nan_lse, lse)
        self.check_masked_rows(out, lse, np.broadcast_to(lengths[:, None], (b, n)))
        perm = np.array([2, 0, 1])
        perm_out, perm_lse = map(np.asarray, self.call(
            q_lat[perm], q_pe[perm], pages, table[perm], lengths[perm], **kw))
        np.testing.assert_array_equal(perm_out.astype(np.float32), out[perm].astype(np.float32))
        np.testing.assert_array_equal(perm_lse, lse[perm])
