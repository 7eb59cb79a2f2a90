"""The shared test base of `attn.paged_decode.paged_decode`, and the builders of its tests.

`make_case` writes random dense q / k / v into head-major pages through per-head block tables
(unowned pages and tokens past a length NaN); `dense_oracle` (dense attention over the dense keys)
and `numpy_oracle` (a float64 loop) are the independent answers. A backend's test class
subclasses `PagedDecodeTests` and sets `implementation` (and `config`, `batch`, `group_sizes`
where the interpreter on a CPU wants smaller problems). Each check asks the op first whether the
backend takes the case (`paged_decode.reasons`): if it does, the output must match the oracle; if
not, the call must raise `NotImplementedError` naming those reasons.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention
from attn.paged_decode import paged_decode
from kv import fp8
from tests.utils import AttentionTestBase, assert_close, case_id, poison

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
    """Padding, length 1, around one and two pages, a full table, then random lengths; a batch
    under 7 rows keeps padding, 1, `P - 1`, `P + 1` and the full table first."""
    grid = [0, 1, page - 1, page, page + 1, 2 * page + 3, max_pages * page]
    if batch < len(grid):
        grid = [0, 1, page - 1, page + 1, max_pages * page, page, 2 * page + 3]
    extra = gen.integers(1, max_pages * page + 1, max(batch - len(grid), 0))
    return np.concatenate([grid, extra])[:batch].astype(np.int32)


def numpy_visible(lengths, num_keys, window, sinks) -> np.ndarray:
    """[B, K, S] visibility written straight from the conventions (query at length - 1);
    `window` / `sinks` are `[K]` or `[B, K]`."""
    lengths = np.asarray(lengths)
    s = np.arange(num_keys)[None, None, :]
    q_pos = (lengths - 1)[:, None, None]
    shape = (len(lengths), np.shape(window)[-1])
    w = np.broadcast_to(np.asarray(window), shape)[..., None]
    sk = np.broadcast_to(np.asarray(sinks), shape)[..., None]
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


def dense_pages(case: Case, pages, scales) -> jax.Array:
    """The dense `[B, S, K, H]` keys (or values) of `case`'s rows read back from fp8 `pages`
    (dequantised; 0 where a row has no page)."""
    from attn.paged_decode import gather_pages

    dense = np.asarray(gather_pages(pages, jnp.asarray(case.table), scales))
    return jnp.asarray(np.nan_to_num(dense))


class PagedDecodeTests(AttentionTestBase):
    """Checks every backend of `paged_decode` passes (or refuses with reasons)."""

    implementation: str = "xla"
    config = None
    batch: int = B  # rows of every case (`edge_lengths` picks their lengths)
    group_sizes = AttentionTestBase.group_sizes  # query heads per KV head of the GQA grid
    # (out, lse) tolerance against the dequantised pages where fp8 tiles widen to a type
    # narrower than float32 (None: float32's).
    fp8_tolerance: tuple[float, float] | None = None

    def call(self, *args, **options):
        """`paged_decode` on this backend, or None after checking it refuses with its reasons."""
        reasons = paged_decode.reasons(self.implementation, *args, config=self.config, **options)
        if reasons:
            with pytest.raises(NotImplementedError, match=re.escape(reasons[0])):
                paged_decode(*args, implementation=self.implementation, config=self.config,
                             **options)
            return None
        return paged_decode(*args, implementation=self.implementation, config=self.config,
                            **options)

    def case(self, gen, **kw) -> Case:
        return make_case(gen, batch=self.batch, **kw)

    def visible_count(self, case: Case, window, sinks, group: int = G):
        """`[B, N]` visible keys per query head."""
        counts = numpy_visible(case.lengths, case.k.shape[1], window, sinks).sum(-1)
        return np.repeat(counts, group, axis=1)

    def check_fp8(self, out, lse, exp_out, exp_lse):
        if self.fp8_tolerance is None:
            self.check_output(out, lse, exp_out, exp_lse)
            return
        out_tol, lse_tol = self.fp8_tolerance
        assert_close(out, exp_out, atol=out_tol, rtol=out_tol, err_msg="out")
        assert_close(lse, exp_lse, atol=lse_tol, rtol=lse_tol, allow_neg_inf=True, err_msg="lse")

    @pytest.mark.parametrize(
        ("per_head", "page", "dtype"),
        [pytest.param(per_head, page, dtype, id=f"{kind}-{case_id(P=page)}-{jnp.dtype(dtype)}")
         for per_head, kind, page, dtype in [
             (False, "uniform", 16, jnp.float32), (True, "per_head", 64, jnp.bfloat16)]])
    def test_matches_dense_over_gathered_keys(self, per_head, page, dtype):
        """Uniform and per-head tables (the same page id in several heads' pools), edge lengths,
        unowned memory NaN."""
        case = self.case(np.random.default_rng(0), page=page, per_head=per_head, dtype=dtype)
        got = self.call(*case.args, **case.mask_kw)
        if got is None:
            return
        out, lse = got
        assert out.dtype == dtype and lse.dtype == jnp.float32
        assert out.shape == (self.batch, K * G, HV)
        self.check_output(out, lse, *dense_oracle(case), dtype=dtype)
        self.check_masked_rows(out, lse, np.repeat(case.lengths[:, None], K * G, 1))

    def test_unowned_memory_changes_nothing(self):
        """Unowned pages and tokens past a length NaN, or huge finite values: bitwise the same
        result (so two runs agree too)."""
        case = self.case(np.random.default_rng(7), per_head=True)
        got = self.call(*case.args, **case.mask_kw)
        if got is None:
            return
        junk = dataclasses.replace(
            case, k_pages=poison(case.k_pages, case.owned, 1e4),
            v_pages=poison(case.v_pages, case.owned, -1e4))
        out2, lse2 = self.call(*junk.args, **junk.mask_kw)
        np.testing.assert_array_equal(np.asarray(out2), np.asarray(got[0]))
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(got[1]))

    def test_streaming_heads_never_read_recycled_pages(self):
        """Streaming heads whose tables are -1 outside sink + window (recycled pages); page 0 and
        the recycled pages are NaN. -1 entries are never read: replacing them with live page ids
        of other rows leaves the result bitwise unchanged."""
        gen = np.random.default_rng(1)
        window, sinks = streaming_window_sinks()
        lengths = np.array([0, 1, 4, 16, 17, 40, 77, 96], np.int32)[-self.batch:]
        case = self.case(gen, per_head=True, recycle=True, window=window, sinks=sinks,
                         lengths=lengths)
        allocated = np.arange(PAGES_PER_ROW[16])[None, :] * 16 < lengths[:, None]
        assert (case.table[:, 1][allocated] == -1).any()  # recycled pages inside the length
        got = self.call(*case.args, **case.mask_kw)
        if got is None:
            return
        out, lse = got
        self.check_output(out, lse, *dense_oracle(case))
        self.check_masked_rows(out, lse, self.visible_count(case, window, sinks))
        swapped = np.where(case.table < 0, gen.integers(1, case.owned.shape[1], case.table.shape),
                           case.table).astype(np.int32)
        out2, lse2 = self.call(case.q, case.k_pages, case.v_pages, jnp.asarray(swapped),
                               jnp.asarray(lengths), **case.mask_kw)
        np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))

    def test_per_row_window_and_sinks(self):
        """`[B, K]` window / sinks (one policy per request, as the engine passes them), against
        the float64 loop with each row's own policy."""
        gen = np.random.default_rng(2)
        case = self.case(gen, per_head=True)
        window = gen.integers(-1, 80, (self.batch, K)).astype(np.int32)
        sinks = gen.integers(0, 24, (self.batch, K)).astype(np.int32)
        got = self.call(*case.args, window=jnp.asarray(window), sinks=jnp.asarray(sinks))
        if got is None:
            return
        self.check_output(*got, *numpy_oracle(case.q, case.k, case.v, case.lengths, window,
                                              sinks))
        self.check_masked_rows(*got, self.visible_count(case, window, sinks))

    def test_scalar_window_and_sinks(self):
        """Python ints apply to every head, like the same value in a `[K]` array."""
        case = self.case(np.random.default_rng(3), window=np.full(K, 24), sinks=np.full(K, 4),
                         recycle=True)
        got = self.call(*case.args, window=24, sinks=4)
        if got is not None:
            self.check_output(*got, *dense_oracle(case))

    @pytest.mark.parametrize("sub_block", [16, 4, 1], ids=lambda s: case_id(sb=s))
    def test_fp8_pages(self, sub_block):
        """e4m3 pages with fp32 scales (NaN where nobody reads): the dense oracle on the
        dequantised keys, tightly; the unquantised keys within e4m3's error."""
        window, sinks = streaming_window_sinks()
        case = self.case(np.random.default_rng(4), per_head=True, recycle=True, window=window,
                         sinks=sinks)
        owned = jnp.asarray(case.owned)
        kq, ks = fp8.quantize(jnp.asarray(np.nan_to_num(np.asarray(case.k_pages))), sub_block)
        vq, vs = fp8.quantize(jnp.asarray(np.nan_to_num(np.asarray(case.v_pages))), sub_block)
        kq, vq, ks, vs = (poison(x, owned) for x in (kq, vq, ks, vs))  # fp8 NaN, scale NaN
        table, lengths = jnp.asarray(case.table), jnp.asarray(case.lengths)
        got = self.call(case.q, kq, vq, table, lengths, k_scales=ks, v_scales=vs, **case.mask_kw)
        if got is None:
            return
        out, lse = got
        self.check_masked_rows(out, lse, self.visible_count(case, window, sinks))
        k_deq, v_deq = dense_pages(case, kq, ks), dense_pages(case, vq, vs)
        self.check_fp8(out, lse, *dense_oracle(case, k_deq, v_deq))
        # Against the unquantised keys: e4m3 keeps ~3 bits, so errors are ~1e-2 on unit values.
        ref_out, ref_lse = dense_oracle(case)
        err = np.abs(np.asarray(out) - np.asarray(ref_out))
        assert err.max() < 0.2 and err.mean() < 0.02, (err.max(), err.mean())
        assert_close(lse, ref_lse, atol=0.1, rtol=0.02, allow_neg_inf=True)

    def test_gqa_group_sizes(self):
        """Query head n reads KV head n // G (`group_sizes`), against the float64 loop."""
        window, sinks = streaming_window_sinks()
        for group in self.group_sizes:
            case = self.case(np.random.default_rng(5), group=group, window=window, sinks=sinks,
                             per_head=True)
            got = self.call(*case.args, **case.mask_kw)
            if got is not None:
                self.check_output(*got, *numpy_oracle(case.q, case.k, case.v, case.lengths,
                                                      window, sinks), err_msg=f"G{group}")

    def test_batch_of_one(self):
        """A row alone gives its row of the batch (run-to-run identity: the bitwise check of
        `test_unowned_memory_changes_nothing`)."""
        case = self.case(np.random.default_rng(6), per_head=True)
        got = self.call(*case.args, **case.mask_kw)
        if got is None:
            return
        out, lse = got
        row = self.batch - 1
        one = self.call(case.q[row:row + 1], case.k_pages, case.v_pages,
                        jnp.asarray(case.table[row:row + 1]),
                        jnp.asarray(case.lengths[row:row + 1]), **case.mask_kw)
        assert_close(one[0][0], out[row], atol=1e-6, rtol=1e-6)
        assert_close(one[1][0], lse[row], atol=1e-6, rtol=1e-6)
