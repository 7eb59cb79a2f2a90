"""Paged decode reference: equals dense attention over the gathered keys for uniform and per-head
tables, streaming heads with recycled (-1) pages, fp8 pages, split-KV, the GQA grid and the edge
lengths; poisoned memory never leaks in; every validation error.

Compiles dominate the run time on a CPU, so most tests share one set of shapes (`B`, `K`, `G`, `H`,
`HV`, `M`) and vary data only (lengths, tables, per-head window / sinks arrays).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attn.dense import attention
from attn.paged_decode import gather_pages, paged_decode, paged_decode_partials
from kv import fp8
from tests.utils import AttentionTestBase, assert_close, case_id, poison, rng

B, K, G, H, HV = 8, 4, 2, 16, 8
N = K * G
PAGES_PER_ROW = {16: 6, 64: 3}  # max_pages M per page size P (S = 96 or 192 keys)


@dataclasses.dataclass
class Case:
    q: jax.Array  # [B, N, H]
    k: jax.Array  # [B, S, K, H] dense keys (finite everywhere; the oracle's input)
    v: jax.Array  # [B, S, K, HV]
    k_pages: jax.Array  # [K, num_pages, P, H]; unowned pages and tokens past a length are NaN
    v_pages: jax.Array
    table: np.ndarray  # [B, K, M] int32
    lengths: np.ndarray  # [B] int32
    window: np.ndarray  # [K] int32
    sinks: np.ndarray  # [K] int32
    owned: np.ndarray  # [K, num_pages] bool

    @property
    def args(self):
        return (self.q, self.k_pages, self.v_pages, jnp.asarray(self.table),
                jnp.asarray(self.lengths))

    @property
    def mask_kw(self):
        return dict(window=jnp.asarray(self.window), sinks=jnp.asarray(self.sinks))


def edge_lengths(page: int, max_pages: int, gen, batch: int = B) -> np.ndarray:
    """Padding, length 1, around one and two pages, a full table, then random lengths."""
    grid = [0, 1, page - 1, page, page + 1, 2 * page + 3, max_pages * page]
    extra = gen.integers(1, max_pages * page + 1, max(batch - len(grid), 0))
    return np.concatenate([grid, extra])[:batch].astype(np.int32)


def numpy_visible(lengths, num_keys, window, sinks) -> np.ndarray:
    """[B, K, S] visibility written straight from the conventions (query at length - 1)."""
    s = np.arange(num_keys)[None, None, :]
    q_pos = (np.asarray(lengths) - 1)[:, None, None]
    w, sk = np.asarray(window)[None, :, None], np.asarray(sinks)[None, :, None]
    return (s <= q_pos) & ((w <= 0) | (q_pos - s < w) | (s < sk))


def make_case(gen, *, page=16, per_head=False, recycle=False, dtype=jnp.float32, window=None,
              sinks=None, lengths=None, batch=B, num_kv=K, group=G, head_dim=H,
              value_dim=HV) -> Case:
    """Random dense q/k/v written into head-major pages through per-head block tables.

    Each head draws its page ids from one shuffled range [1, num_pages): with `per_head` every
    head gets its own shuffle, so ids collide across heads at different positions. Pages past a
    row's length are -1; with `recycle`, so is every page holding no key visible to that head
    (the streaming-head layout of seed 001 §2.4). Every page no table entry owns (the null page 0
    included), and every token past a row's length, is NaN.
    """
    max_pages = PAGES_PER_ROW[page]
    num_keys = max_pages * page
    num_pages = 1 + batch * max_pages + 3
    window = np.zeros(num_kv, np.int32) if window is None else np.asarray(window, np.int32)
    sinks = np.zeros(num_kv, np.int32) if sinks is None else np.asarray(sinks, np.int32)
    lengths = edge_lengths(page, max_pages, gen, batch) if lengths is None else lengths
    lengths = np.asarray(lengths, np.int32)
    f32 = np.float32
    q = gen.standard_normal((batch, num_kv * group, head_dim), f32)
    k = gen.standard_normal((batch, num_keys, num_kv, head_dim), f32)
    v = gen.standard_normal((batch, num_keys, num_kv, value_dim), f32)

    ids = gen.permutation(np.arange(1, num_pages, dtype=np.int32))
    table = np.empty((batch, num_kv, max_pages), np.int32)
    for kh in range(num_kv):
        table[:, kh] = ids[: batch * max_pages].reshape(batch, max_pages)
        if per_head:
            ids = gen.permutation(ids)
    visible = numpy_visible(lengths, num_keys, window, sinks)
    if recycle:
        needed = visible.reshape(batch, num_kv, max_pages, page).any(-1)
    else:
        needed = np.arange(max_pages)[None, None, :] * page < lengths[:, None, None]
    table = np.where(needed, table, -1).astype(np.int32)

    past = np.arange(num_keys)[None, :, None, None] >= lengths[:, None, None, None]
    kp = np.zeros((num_kv, num_pages, page, head_dim), f32)
    vp = np.zeros((num_kv, num_pages, page, value_dim), f32)
    bb, kk, jj = np.nonzero(table >= 0)
    kp[kk, table[bb, kk, jj]] = np.where(past, np.nan, k).reshape(
        batch, max_pages, page, num_kv, head_dim)[bb, jj, :, kk]
    vp[kk, table[bb, kk, jj]] = np.where(past, np.nan, v).reshape(
        batch, max_pages, page, num_kv, value_dim)[bb, jj, :, kk]
    owned = np.zeros((num_kv, num_pages), bool)
    owned[kk, table[bb, kk, jj]] = True
    return Case(
        q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype),
        k_pages=poison(jnp.asarray(kp, dtype), owned),
        v_pages=poison(jnp.asarray(vp, dtype), owned), table=table, lengths=lengths,
        window=window, sinks=sinks, owned=owned)


@jax.jit
def _dense_decode(q, k, v, lengths, window, sinks):
    out, lse = attention(q[:, None], k.astype(q.dtype), v.astype(q.dtype), q_offset=lengths - 1,
                         kv_lengths=lengths, window=window, sinks=sinks)
    return out[:, 0], lse[:, 0]


def dense_oracle(case: Case, k=None, v=None):
    """attn.dense over the dense keys: the query at position length - 1, keys past it masked."""
    return _dense_decode(case.q, case.k if k is None else k, case.v if v is None else v,
                         jnp.asarray(case.lengths), **case.mask_kw)


def numpy_oracle(q, k, v, lengths, window, sinks, lo=None, hi=None):
    """Independent float64 loop over rows and query heads (query head n reads KV head n // G);
    keys outside [lo, hi) are dropped as well when given."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, num_heads, head_dim = q.shape
    num_keys, num_kv = k.shape[1:3]
    visible = numpy_visible(lengths, num_keys, window, sinks)
    if lo is not None:
        s = np.arange(num_keys)[None, None, :]
        visible &= (s >= np.asarray(lo)[:, None, None]) & (s < np.asarray(hi)[:, None, None])
    out = np.zeros((batch, num_heads, v.shape[-1]))
    lse = np.full((batch, num_heads), -np.inf)
    for b in range(batch):
        for n in range(num_heads):
            kh = n // (num_heads // num_kv)
            vis = visible[b, kh]
            if vis.any():
                scores = k[b, vis, kh] @ q[b, n] / np.sqrt(head_dim)
                lse[b, n] = np.logaddexp.reduce(scores)
                out[b, n] = np.exp(scores - lse[b, n]) @ v[b, vis, kh]
    return out, lse


def streaming_window_sinks():
    """Per-head policy: full, a pure local window, window + sinks, the query alone + sinks."""
    return np.array([0, 5, 20, 1], np.int32), np.array([0, 0, 3, 17], np.int32)


class TestPagedDecode(AttentionTestBase):
    @pytest.mark.parametrize(
        ("per_head", "page", "dtype"),
        [pytest.param(per_head, page, dtype, id=f"{kind}-{case_id(P=page)}-{jnp.dtype(dtype)}")
         for per_head, kind, page, dtype in [
             (False, "uniform", 16, jnp.float32), (True, "per_head", 16, jnp.float32),
             (True, "per_head", 64, jnp.bfloat16), (False, "uniform", 64, jnp.bfloat16)]])
    def test_matches_dense_over_gathered_keys(self, per_head, page, dtype):
        gen = rng()
        case = make_case(gen, page=page, per_head=per_head, dtype=dtype)
        if per_head:  # the same page id lives in several heads' pools, at different places
            ids = [set(case.table[:, kh][case.table[:, kh] > 0]) for kh in range(K)]
            assert ids[0] & ids[1] and (case.table[:, 0] != case.table[:, 1]).any()
        else:
            assert (case.table == case.table[:, :1]).all()
        out, lse = paged_decode(*case.args, **case.mask_kw)
        assert out.dtype == dtype and lse.dtype == jnp.float32 and out.shape == (B, N, HV)
        self.check_output(out, lse, *dense_oracle(case), dtype=dtype)
        self.check_masked_rows(out, lse, np.repeat(case.lengths[:, None], N, 1))

        # gather_pages reads back every token of every row (page entries -1 stay unread).
        keys = np.asarray(gather_pages(case.k_pages, jnp.asarray(case.table)), np.float32)
        live = np.arange(keys.shape[1])[None, :] < case.lengths[:, None]  # [B, S]
        np.testing.assert_array_equal(keys[live], np.asarray(case.k, np.float32)[live])

        # Unowned memory: NaN or other values, the result is bitwise the same.
        junk = dataclasses.replace(
            case, k_pages=poison(case.k_pages, case.owned, 1e4),
            v_pages=poison(case.v_pages, case.owned, -1e4))
        out2, lse2 = paged_decode(*junk.args, **junk.mask_kw)
        np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))

    def test_window_sinks_and_streaming_heads(self):
        """Streaming heads whose tables are -1 outside sink + window (recycled pages); page 0 and
        the recycled pages are NaN. -1 entries are never read: replacing them with live page ids
        of other rows leaves the result bitwise unchanged."""
        gen = rng()
        window, sinks = streaming_window_sinks()
        lengths = np.array([0, 1, 4, 16, 17, 40, 77, 96], np.int32)
        case = make_case(gen, per_head=True, recycle=True, window=window, sinks=sinks,
                         lengths=lengths)
        allocated = np.arange(PAGES_PER_ROW[16])[None, :] * 16 < lengths[:, None]
        assert (case.table[:, 1][allocated] == -1).any()  # recycled pages inside the length
        assert (case.table[:, 3][allocated] == -1).any()
        out, lse = paged_decode(*case.args, **case.mask_kw)
        self.check_output(out, lse, *dense_oracle(case))
        visible = numpy_visible(lengths, case.k.shape[1], window, sinks).sum(-1)  # [B, K]
        self.check_masked_rows(out, lse, np.repeat(visible, G, axis=1))

        swapped = np.where(case.table < 0, gen.integers(1, case.owned.shape[1], case.table.shape),
                           case.table).astype(np.int32)
        out2, lse2 = paged_decode(case.q, case.k_pages, case.v_pages, jnp.asarray(swapped),
                                  jnp.asarray(lengths), **case.mask_kw)
        np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))

    def test_scalar_window_and_sinks(self):
        """Python ints apply to every head, like the same value in a [K] array."""
        gen = rng()
        case = make_case(gen, window=np.full(K, 24), sinks=np.full(K, 4), recycle=True)
        out, lse = paged_decode(*case.args, window=24, sinks=4)
        self.check_output(out, lse, *dense_oracle(case))
        full = paged_decode(*case.args, window=0)  # <= 0: full attention, as None
        out_full, _ = paged_decode(*case.args)
        np.testing.assert_array_equal(np.asarray(full[0]), np.asarray(out_full))

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

    @pytest.mark.parametrize("sub_block", [16, 4, 1], ids=lambda s: case_id(sb=s))
    def test_fp8_pages(self, sub_block):
        """Tight against the reference on the dequantised pages, looser against the originals."""
        gen = rng()
        window, sinks = streaming_window_sinks()
        case = make_case(gen, per_head=True, recycle=True, window=window, sinks=sinks)
        owned = jnp.asarray(case.owned)
        kq, ks = fp8.quantize(jnp.asarray(np.nan_to_num(np.asarray(case.k_pages))), sub_block)
        vq, vs = fp8.quantize(jnp.asarray(np.nan_to_num(np.asarray(case.v_pages))), sub_block)
        kq, vq, ks, vs = (poison(x, owned) for x in (kq, vq, ks, vs))  # fp8 NaN, scale NaN
        table, lengths = jnp.asarray(case.table), jnp.asarray(case.lengths)
        out, lse = paged_decode(case.q, kq, vq, table, lengths, k_scales=ks, v_scales=vs,
                                **case.mask_kw)
        self.check_masked_rows(out, lse, np.repeat(
            numpy_visible(case.lengths, case.k.shape[1], window, sinks).sum(-1), G, axis=1))

        deq = dataclasses.replace(case, k_pages=fp8.dequantize(kq, ks),
                                  v_pages=fp8.dequantize(vq, vs))
        self.check_output(out, lse, *paged_decode(*deq.args, **deq.mask_kw))
        k_deq = np.asarray(gather_pages(kq, table, ks))
        assert k_deq.dtype == np.float32
        np.testing.assert_array_equal(k_deq, np.asarray(gather_pages(deq.k_pages, table)))
        v_deq = np.asarray(gather_pages(deq.v_pages, table))
        # NaN (unowned, null page) only where no key is visible: zero it for the oracle.
        k_deq, v_deq = np.nan_to_num(k_deq), np.nan_to_num(v_deq)
        self.check_output(out, lse, *dense_oracle(case, jnp.asarray(k_deq), jnp.asarray(v_deq)))

        # Against the unquantised keys: e4m3 keeps ~3 bits, so errors are ~1e-2 on unit values.
        ref_out, ref_lse = dense_oracle(case)
        err = np.abs(np.asarray(out) - np.asarray(ref_out))
        assert err.max() < 0.2 and err.mean() < 0.02, (err.max(), err.mean())
        assert_close(lse, ref_lse, atol=0.1, rtol=0.02, allow_neg_inf=True)

    @pytest.mark.parametrize("group", AttentionTestBase.group_sizes, ids=lambda g: case_id(G=g))
    def test_gqa_group_sizes(self, group):
        """Query head n reads KV head n // G, against an independent float64 loop."""
        gen = rng()
        window, sinks = streaming_window_sinks()
        case = make_case(gen, group=group, window=window, sinks=sinks, per_head=True)
        out, lse = paged_decode(*case.args, **case.mask_kw)
        self.check_output(out, lse, *numpy_oracle(case.q, case.k, case.v, case.lengths, window,
                                                  sinks))

    def test_batch_of_one_and_determinism(self):
        gen = rng()
        case = make_case(gen, per_head=True)
        self.check_deterministic(paged_decode, *case.args, **case.mask_kw)
        out, lse = paged_decode(*case.args, **case.mask_kw)
        row = B - 1
        one = paged_decode(jnp.asarray(np.asarray(case.q)[row:row + 1]), case.k_pages,
                           case.v_pages, jnp.asarray(case.table[row:row + 1]),
                           jnp.asarray(case.lengths[row:row + 1]), **case.mask_kw)
        assert_close(one[0][0], out[row], atol=1e-6, rtol=1e-6)
        assert_close(one[1][0], lse[row], atol=1e-6, rtol=1e-6)

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
