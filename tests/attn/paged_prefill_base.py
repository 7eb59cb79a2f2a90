"""The shared test base of `attn.dense.paged_prefill_attention`, and the builders of its tests.

`problem` scatters each row's tokens over random pages (different per KV head), leaves the rest
of the table -1, and reports which pages a row owns; the backend under test runs on the pool with
every page no row owns NaN-poisoned (the null page 0 included), the XLA reference on the clean
pool. A backend's test class subclasses `PagedPrefillTests` and sets `implementation` (and
`config`); each check asks the op first whether the backend takes the case
(`paged_prefill_attention.reasons`): if it does, the output must match the reference and fully
masked rows give exactly 0 / -inf; if not, the call must raise `NotImplementedError` naming those
reasons. The reference itself is checked against dense attention on a gathered copy in
`test_paged_prefill.py`.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import paged_prefill_attention
from kv import fp8
from tests.utils import AttentionTestBase, assert_close, case_id, poison, randn, rng


def problem(gen, *, t, prefixes, kh, g, h=16, hv=16, p=16, dtype=jnp.float32, lengths=None):
    """Random q, pages and per-head tables for rows with the given cached prefixes.

    Returns `(q, k_pages, v_pages, tables, q_offset, kv_lengths, owned)`; `owned` is `[K, pages]`.
    """
    b = len(prefixes)
    q_offset = np.asarray(prefixes, np.int32)
    kv_lengths = q_offset + t if lengths is None else np.asarray(lengths, np.int32)
    max_pages = -(-int(max(q_offset.max() + t, kv_lengths.max())) // p) + 1  # one spare column
    num_pages = b * max_pages + 2
    tables = np.full((b, kh, max_pages), -1, np.int32)
    owned = np.zeros((kh, num_pages), bool)
    for i in range(kh):
        ids = gen.permutation(num_pages - 1)[: b * max_pages].reshape(b, max_pages) + 1
        for r in range(b):
            used = -(-int(kv_lengths[r]) // p)
            tables[r, i, :used] = ids[r, :used]
            owned[i, ids[r, :used]] = True
    q = randn(gen, (b, t, kh * g, h), dtype)
    k_pages = randn(gen, (kh, num_pages, p, h), dtype)
    v_pages = randn(gen, (kh, num_pages, p, hv), dtype)
    return q, k_pages, v_pages, jnp.asarray(tables), q_offset, kv_lengths, owned


def window_sinks(gen, b, kh, s):
    """Per (row, head) windows in [-1, s) (<= 0: full) and sinks in [0, 24)."""
    return (gen.integers(-1, max(s, 2), (b, kh)).astype(np.int32),
            gen.integers(0, 24, (b, kh)).astype(np.int32))


def owned_tokens(owned, tables, kv_lengths, p):
    """`[K, pages, P]`: `owned`, less each row's tokens past its length in its last page (stale
    slots a real pool may hold: poisoned, they prove the length mask covers the K/V loads)."""
    keep = np.repeat(owned[:, :, None], p, axis=2)
    tables = np.asarray(tables)
    for r, length in enumerate(np.asarray(kv_lengths)):
        for i, page in enumerate(tables[r, :, length // p] if length % p else ()):
            if page >= 0:  # a -1 hole is no page at all
                keep[i, page, length % p:] = False
    return keep


# (T, prefixes of the two rows, G, window + sinks): chunk lengths 1, 7, 64, 65; prefixes 0, 63,
# 129; group sizes 1, 4, 7; every case has two rows at different offsets.
EDGES = [
    (1, (0, 5), 1, False),
    (1, (129, 63), 7, True),
    (7, (63, 0), 4, True),
    (64, (0, 129), 1, True),
    (64, (129, 17), 4, False),
    (65, (63, 0), 7, True),
    (65, (0, 63), 4, False),
]



class PagedPrefillTests(AttentionTestBase):
    """Checks every backend of `paged_prefill_attention` passes (or refuses with reasons)."""

    implementation: str = "xla"
    config = None

    def check(self, q, kp, vp, tables, q_offset, kv_lengths, owned, *, dtype=None, keep=None,
              k_scales=None, v_scales=None, default_config=False, **opts):
        """This backend on the pool poisoned outside `keep` (default `owned`: pages; or a
        `[K, pages, P]` token mask) against the reference on the clean pool, with `config`
        (`default_config`: the backend's heuristic). Returns which (row, query, head) see a key,
        or None when the backend refuses the case."""
        config = None if default_config else self.config
        keep = owned if keep is None else keep
        scale_keep = keep if keep.ndim == 2 else keep.any(-1)
        bad_scales = {n: None if s is None else poison(s, scale_keep)
                      for n, s in (("k_scales", k_scales), ("v_scales", v_scales))}
        args = (q, poison(kp, keep, 0.0) if kp.dtype == jnp.float8_e4m3fn else poison(kp, keep),
                poison(vp, keep, 0.0) if vp.dtype == jnp.float8_e4m3fn else poison(vp, keep),
                tables, q_offset, kv_lengths)
        reasons = paged_prefill_attention.reasons(self.implementation, *args, config=config,
                                                  **bad_scales, **opts)
        if reasons:
            with pytest.raises(NotImplementedError, match=re.escape(reasons[0])):
                paged_prefill_attention(*args, implementation=self.implementation,
                                        config=config, **bad_scales, **opts)
            return None
        out, lse = paged_prefill_attention(*args, implementation=self.implementation,
                                           config=config, **bad_scales, **opts)
        exp_out, exp_lse = paged_prefill_attention(
            q, kp, vp, tables, q_offset, kv_lengths, implementation="xla", k_scales=k_scales,
            v_scales=v_scales, **opts)
        tol = {} if dtype is not None else dict(atol=2e-5, rtol=2e-5)
        assert_close(out, exp_out, dtype=dtype, err_msg="out", **tol)
        assert_close(lse, exp_lse, dtype=dtype, allow_neg_inf=True, err_msg="lse")
        sees = np.isfinite(np.asarray(exp_lse))
        self.check_masked_rows(out, lse, sees)
        return sees

    @pytest.mark.parametrize("t,prefixes,g,windowed", EDGES, ids=[
        case_id(T=c[0], prefix=c[1][0], G=c[2]) + ("-window-sinks" if c[3] else "-full")
        for c in EDGES])
    def test_edges_match_reference(self, t, prefixes, g, windowed):
        gen = rng()
        kh = 2
        q, kp, vp, tables, off, lens, owned = problem(gen, t=t, prefixes=prefixes, kh=kh, g=g)
        opts = dict(scale=0.3)
        if windowed:
            opts["window"], opts["sinks"] = window_sinks(gen, len(prefixes), kh, int(lens.max()))
        self.check(q, kp, vp, tables, off, lens, owned, **opts)

    def test_padding_rows_and_short_lengths(self):
        """Row 1 is padding (length 0: 0 / -inf); row 0's cache ends inside the chunk, so its
        late queries see only the keys before the length; row 2 has a window of 1, no sinks."""
        gen = rng()
        q, kp, vp, tables, off, lens, owned = problem(gen, t=20, prefixes=(40, 10, 33), kh=1,
                                                      g=3, lengths=(50, 0, 53))
        window = np.array([[0], [0], [1]], np.int32)
        sees = self.check(q, kp, vp, tables, off, lens, owned, scale=0.25, window=window)
        if sees is not None:
            assert not sees[1].any() and sees[0].all() and sees[2].all()

    def test_streaming_head_reads_no_recycled_page(self):
        """Head 0 keeps only its sink page and the pages its window needs; the rest are -1 and
        NaN. The result equals the full table's (those keys were invisible anyway)."""
        gen = rng()
        p, t, prefix = 16, 16, 112
        q, kp, vp, tables, off, lens, owned = problem(gen, t=t, prefixes=(prefix,), kh=2, g=2,
                                                      p=p)
        window, sinks = np.array([[20, 0]], np.int32), np.array([[5, 0]], np.int32)
        # Queries sit at 112..127 and see keys > 92 in head 0: pages 5..7 and the sink page 0.
        recycled = np.asarray(tables).copy()
        dropped = recycled[0, 0, 1:5].copy()
        recycled[0, 0, 1:5] = -1
        keep = owned.copy()
        keep[0, dropped] = False
        self.check(q, kp, vp, jnp.asarray(recycled), off, lens, owned, keep=keep, scale=0.3,
                   window=window, sinks=sinks)

    @pytest.mark.parametrize("sub_block", [4, 16])
    def test_fp8_pages(self, sub_block):
        """e4m3 pages and fp32 scales, NaN scales on unowned pages (a dequantised NaN must not
        leak either)."""
        gen = rng()
        kh = 2
        q, kp, vp, tables, off, lens, owned = problem(gen, t=24, prefixes=(40, 7), kh=kh, g=3,
                                                      dtype=jnp.bfloat16)
        kq, ks = fp8.quantize(poison(kp, owned, 0.0), sub_block)
        vq, vs = fp8.quantize(poison(vp, owned, 0.0), sub_block)
        window, sinks = window_sinks(gen, 2, kh, 64)
        self.check(q, kq, vq, tables, off, lens, owned, dtype=jnp.bfloat16, scale=0.25,
                   window=window, sinks=sinks, k_scales=ks, v_scales=vs)

    def test_bf16_default_config_uniform_window(self):
        """bf16, odd head dims, one int window and sinks for every row and head, the backend's
        default launch config."""
        gen = rng()
        q, kp, vp, tables, off, lens, owned = problem(gen, t=33, prefixes=(100, 0), kh=1, g=4,
                                                      dtype=jnp.bfloat16, h=32, hv=24)
        self.check(q, kp, vp, tables, off, lens, owned, dtype=jnp.bfloat16, window=40, sinks=3,
                   default_config=True)
