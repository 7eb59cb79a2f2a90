"""Paged decode: every backend through the shared base (`paged_decode_base`: the dense and
float64 oracles over uniform and per-head tables, streaming heads with recycled (-1) pages,
per-row policies, fp8 pages, the GQA grid, edge lengths, poisoned memory), and what only the XLA
reference has: split-KV partials, gradients, `gather_pages`, every validation error.

Compiles dominate the run time on a CPU, so most tests share one set of shapes (`B`, `K`, `G`, `H`,
`HV`, `M`) and vary data only (lengths, tables, per-head window / sinks arrays).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attn.paged_decode import gather_pages, paged_decode, paged_decode_partials
from kv import fp8
from tests.attn.paged_decode_base import (
    HV,
    B,
    N,
    PagedDecodeTests,
    make_case,
    numpy_oracle,
    streaming_window_sinks,
)
from tests.utils import AttentionTestBase, assert_close, case_id, rng


class TestXla(PagedDecodeTests):
    implementation = "xla"


class TestReferenceOnly(AttentionTestBase):
    """What the XLA reference alone has: `gather_pages`, split-KV partials, gradients."""

    def test_gather_pages_reads_back_every_token(self):
        """Every token of every row, from uniform and per-head tables (-1 entries unread)."""
        for per_head in (False, True):
            case = make_case(rng(), per_head=per_head)
            keys = np.asarray(gather_pages(case.k_pages, jnp.asarray(case.table)), np.float32)
            live = np.arange(keys.shape[1])[None, :] < case.lengths[:, None]  # [B, S]
            np.testing.assert_array_equal(keys[live], np.asarray(case.k, np.float32)[live])
        kq, ks = fp8.quantize(jnp.asarray(np.nan_to_num(np.asarray(case.k_pages))), 4)
        table = jnp.asarray(case.table)
        k_deq = np.asarray(gather_pages(kq, table, ks))  # dequantised inside, in float32
        assert k_deq.dtype == np.float32
        np.testing.assert_array_equal(k_deq, np.asarray(gather_pages(fp8.dequantize(kq, ks),
                                                                     table)))

    @pytest.mark.parametrize("num_splits", [1, 2, 7], ids=lambda s: case_id(splits=s))
    def test_split_kv(self, num_splits):
        gen = rng()
        window, sinks = streaming_window_sinks()
        case = make_case(gen, per_head=True, recycle=True, window=window, sinks=sinks)
        out, lse = paged_decode(*case.args, **case.mask_kw)
        out_s, lse_s = paged_decode(*case.args, **case.mask_kw, num_splits=num_splits)
        self.check_output(out_s, lse_s, out, lse)

        o, lse_p = paged_decode_partials(*case.args, **case.mask_kw, num_splits=num_splits)
        assert o.shape == (B, N, num_splits, HV) and o.dtype == jnp.float32
        assert lse_p.shape == (B, N, num_splits)
        o, lse_p = np.asarray(o), np.asarray(lse_p)
        empty = np.isneginf(lse_p)
        assert (o[empty] == 0).all() and np.isfinite(o).all()
        if num_splits > 1:
            assert empty.any() and (~empty[:, :, 1]).any()  # short rows leave splits empty
        # Each split is attention over its own page-aligned piece of [0, length).
        keys_per_split = -(-case.lengths // num_splits)
        per_split = np.maximum(-(-keys_per_split // 16) * 16, 16)
        for j in range(num_splits):
            lo, hi = j * per_split, np.minimum((j + 1) * per_split, case.lengths)
            ref_o, ref_lse = numpy_oracle(case.q, case.k, case.v, case.lengths, window, sinks,
                                          lo=lo, hi=hi)
            assert_close(o[:, :, j], ref_o, atol=1e-5, rtol=1e-5)
            assert_close(lse_p[:, :, j], ref_lse, allow_neg_inf=True)

    def test_gradients_are_finite(self):
        """Padding rows and NaN-poisoned pages give finite gradients, 0 on memory not owned."""
        gen = rng()
        case = make_case(gen, per_head=True)
        table, lengths = jnp.asarray(case.table), jnp.asarray(case.lengths)
        w = jnp.asarray(gen.standard_normal((B, N, HV), np.float32))

        def loss_paged(q, kp, vp):
            out, _ = paged_decode(q, kp, vp, table, lengths, **case.mask_kw)
            return jnp.sum(out * w)

        dq, dk, dv = jax.grad(loss_paged, argnums=(0, 1, 2))(case.q, case.k_pages, case.v_pages)
        for name, g in (("dq", dq), ("dk_pages", dk), ("dv_pages", dv)):
            assert np.isfinite(np.asarray(g)).all(), name
        assert (np.asarray(dk)[~case.owned] == 0).all()
        assert (np.asarray(dv)[~case.owned] == 0).all()
        assert (np.abs(np.asarray(dq)).sum(-1) > 0).sum() > 0  # not vacuously zero


def _inputs(**over):
    """Valid numpy inputs (validation only reads shapes and dtypes: nothing compiles)."""
    base = dict(
        q=np.zeros((2, 8, 16), np.float32),
        k_pages=np.zeros((4, 5, 16, 16), np.float32),
        v_pages=np.zeros((4, 5, 16, 8), np.float32),
        block_tables=np.zeros((2, 4, 3), np.int32),
        kv_lengths=np.zeros((2,), np.int32),
    )
    base.update(over)
    return base


def _call(fn=paged_decode, **over):
    kw = _inputs(**{k: v for k, v in over.items() if k in _inputs()})
    rest = {k: v for k, v in over.items() if k not in kw}
    return fn(kw["q"], kw["k_pages"], kw["v_pages"], kw["block_tables"], kw["kv_lengths"], **rest)


FP8_PAGES = np.zeros((4, 5, 16, 16), ml_dtypes.float8_e4m3fn)
SCALES = np.ones((4, 5, 4), np.float32)


@pytest.mark.parametrize(
    ("over", "error", "match"),
    [
        (dict(q=np.zeros((2, 8), np.float32)), ValueError, "q must have shape"),
        (dict(q=np.zeros((2, 8, 16), np.int32)), TypeError, "q.dtype=int32"),
        (dict(k_pages=np.zeros((4, 5, 16), np.float32)), ValueError, "k_pages must have shape"),
        (dict(v_pages=np.zeros((4, 5, 16, 8), np.int8)), TypeError, "v_pages.dtype=int8"),
        (dict(k_pages=np.zeros((4, 5, 16, 16), ml_dtypes.float8_e5m2)), TypeError,
         "k_pages.dtype=float8_e5m2"),
        (dict(v_pages=np.zeros((4, 6, 16, 8), np.float32)), ValueError, "v_pages.shape"),
        (dict(v_pages=np.zeros((4, 5, 8, 8), np.float32)), ValueError, "v_pages.shape"),
        (dict(q=np.zeros((2, 8, 32), np.float32)), ValueError, r"q.shape\[-1\] \(H\)=32"),
        (dict(q=np.zeros((2, 6, 16), np.float32)), ValueError, "num_heads N=6"),
        (dict(k_pages=np.zeros((4, 0, 16, 16), np.float32),
              v_pages=np.zeros((4, 0, 16, 8), np.float32)), ValueError, "num_pages=0"),
        (dict(block_tables=np.zeros((2, 4, 3), np.int64)), TypeError, "block_tables.dtype"),
        (dict(block_tables=np.zeros((2, 4), np.int32)), ValueError, "block_tables must have"),
        (dict(block_tables=np.zeros((2, 2, 3), np.int32)), ValueError, "block_tables.shape"),
        (dict(block_tables=np.zeros((3, 4, 3), np.int32)), ValueError, "block_tables.shape"),
        (dict(kv_lengths=np.zeros((2,), np.float32)), TypeError, "kv_lengths.dtype"),
        (dict(kv_lengths=np.zeros((3,), np.int32)), ValueError, "kv_lengths.shape"),
        (dict(kv_lengths=np.zeros((2, 1), np.int32)), ValueError, "kv_lengths must have shape"),
        (dict(k_pages=FP8_PAGES), ValueError, "needs k_scales"),
        (dict(k_scales=SCALES), ValueError, "k_scales given but k_pages"),
        (dict(v_pages=FP8_PAGES[..., :8], v_scales=SCALES.astype(np.float16)), TypeError,
         "v_scales.dtype=float16"),
        (dict(k_pages=FP8_PAGES, k_scales=SCALES[:, :4]), ValueError, "k_scales.shape"),
        (dict(k_pages=FP8_PAGES, k_scales=SCALES[0]), ValueError, "k_scales must have shape"),
        (dict(k_pages=FP8_PAGES, k_scales=np.ones((4, 5, 3), np.float32)), ValueError,
         "must divide the page size P=16"),
        (dict(num_splits=0), ValueError, "num_splits=0"),
        (dict(num_splits=2.0), TypeError, "num_splits=2.0"),
        (dict(scale=-1.0), ValueError, "scale=-1.0"),
        (dict(scale=float("nan")), ValueError, "scale=nan"),
        (dict(scale="0.1"), TypeError, "scale='0.1'"),
        (dict(window=np.zeros((3,), np.int32)), ValueError, r"window.shape=\(3,\)"),
        (dict(window=np.zeros((9, 9), np.int32)), ValueError, r"or \[B, K\]="),
        (dict(window=np.zeros((4,), np.float32)), TypeError, "window.dtype=float32"),
        (dict(window=1.5), TypeError, "window=1.5"),
        (dict(window=True), TypeError, "window=True"),
        (dict(window=2**40), ValueError, "does not fit int32"),
        (dict(sinks=-1), ValueError, "sinks=-1"),
        (dict(sinks=np.zeros((4,), np.int64)), TypeError, "sinks.dtype=int64"),
        (dict(implementation="cuda"), ValueError, "implementation='cuda'"),
        (dict(implementation="mosaic"), NotImplementedError, "implementation='mosaic'"),
        (dict(block_tables=jax.ShapeDtypeStruct((2, 4, 2**28), jnp.int32)), ValueError,
         "int32 addressing"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input(over, error, match):
    with pytest.raises(error, match=match):
        _call(**over)
    if "implementation" in over:  # the partials are XLA only
        error, match = TypeError, "implementation"
    with pytest.raises(error, match=match):
        _call(paged_decode_partials, **{"num_splits": 1, **over})


def test_bad_input_int32_pool_and_gather():
    huge = jax.ShapeDtypeStruct((8, 2**22, 16, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="int32 addressing"):
        _call(k_pages=huge, v_pages=huge, q=np.zeros((2, 8, 128), np.float32),
              block_tables=np.zeros((2, 8, 3), np.int32))
    pages, table = np.zeros((4, 5, 16, 16), np.float32), np.zeros((2, 4, 3), np.int32)
    with pytest.raises(TypeError, match="block_tables.dtype=int64"):
        gather_pages(pages, table.astype(np.int64))
    with pytest.raises(ValueError, match="block_tables.shape"):
        gather_pages(pages, table[:, :2])
    with pytest.raises(ValueError, match="needs scales"):
        gather_pages(FP8_PAGES, table)
    with pytest.raises(ValueError, match="scales given"):
        gather_pages(pages, table, SCALES)
    with pytest.raises(TypeError, match="dtype=int32"):
        gather_pages(pages, table, dtype=jnp.int32)
    with pytest.raises(ValueError, match="int32 addressing"):
        gather_pages(pages, jax.ShapeDtypeStruct((2**12, 4, 2**12), jnp.int32))
    with pytest.raises(TypeError, match="num_splits=None"):
        paged_decode_partials(*_inputs().values(), num_splits=None)
