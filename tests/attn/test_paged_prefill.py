"""Chunked prefill over paged KV (`attn.dense.paged_prefill_attention`), XLA reference: the
shared base (`paged_prefill_base`: edge chunk lengths and prefixes, padding rows, streaming
heads with recycled pages, fp8 pages, poisoned memory), the reference against dense attention on
a gathered copy (an independent formulation), and every validation error."""

import jax.numpy as jnp
import numpy as np
import pytest

from attn import dense
from attn.dense import paged_prefill_attention
from attn.paged_decode.reference import gather_pages
from tests.attn.paged_prefill_base import PagedPrefillTests, problem, window_sinks
from tests.utils import assert_close, rng


class TestXla(PagedPrefillTests):
    implementation = "xla"


def test_reference_is_dense_attention_on_the_gathered_cache():
    """Independent formulation: gather the pages, then `attn.dense.attention` row by row."""
    gen = rng()
    kh, g = 2, 2
    q, kp, vp, tables, off, lens, _ = problem(gen, t=9, prefixes=(30, 3), kh=kh, g=g)
    window, sinks = window_sinks(gen, 2, kh, 40)
    out, lse = paged_prefill_attention(q, kp, vp, tables, off, lens, window=window, sinks=sinks,
                                       implementation="xla")
    k, v = gather_pages(kp, tables), gather_pages(vp, tables)  # [B, S, K, H]
    for r in range(2):
        exp_out, exp_lse = dense.attention(
            q[r:r + 1], k[r:r + 1], v[r:r + 1], q_offset=int(off[r]), window=window[r],
            sinks=sinks[r], kv_lengths=lens[r:r + 1], implementation="xla")
        assert_close(out[r:r + 1], exp_out)
        assert_close(lse[r:r + 1], exp_lse, allow_neg_inf=True)


def test_validation_errors():
    gen = rng()
    q, kp, vp, tables, off, lens, _ = problem(gen, t=3, prefixes=(4, 1), kh=2, g=2)
    call = paged_prefill_attention
    with pytest.raises(ValueError, match="q must have shape"):
        call(q[0], kp, vp, tables, off, lens)
    with pytest.raises(TypeError, match="q.dtype"):
        call(q.astype(jnp.int32), kp, vp, tables, off, lens)
    with pytest.raises(ValueError, match="num_heads N=3 must be divisible"):
        call(q[:, :, :3], kp, vp, tables, off, lens)
    with pytest.raises(ValueError, match="block_tables.shape"):
        call(q, kp, vp, tables[:, :1], off, lens)
    with pytest.raises(TypeError, match="block_tables.dtype"):
        call(q, kp, vp, tables.astype(jnp.int16), off, lens)
    with pytest.raises(ValueError, match="v_pages.shape"):
        call(q, kp, vp[:, :1], tables, off, lens)
    with pytest.raises(ValueError, match="q head dim H"):
        call(q[..., :8], kp, vp, tables, off, lens)
    with pytest.raises(ValueError, match="q_offset=-1"):
        call(q, kp, vp, tables, -1, lens)
    with pytest.raises(ValueError, match=r"q_offset=\[-2, 0\]"):
        call(q, kp, vp, tables, np.array([-2, 0], np.int32), lens)
    with pytest.raises(TypeError, match="q_offset"):
        call(q, kp, vp, tables, 1.5, lens)
    with pytest.raises(TypeError, match="kv_lengths"):
        call(q, kp, vp, tables, off, 7)
    with pytest.raises(ValueError, match="kv_lengths.*must lie in"):
        call(q, kp, vp, tables, off, np.array([4, 10_000], np.int32))
    with pytest.raises(ValueError, match="window.shape"):
        call(q, kp, vp, tables, off, lens, window=np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match="sinks=-1"):
        call(q, kp, vp, tables, off, lens, sinks=-1)
    with pytest.raises(ValueError, match=r"sinks=\[\[0, -3\]"):
        call(q, kp, vp, tables, off, lens, sinks=np.array([[0, -3], [0, 0]], np.int32))
    with pytest.raises(TypeError, match="window"):
        call(q, kp, vp, tables, off, lens, window="full")
    with pytest.raises(ValueError, match="needs k_scales"):
        call(q, kp.astype(jnp.float8_e4m3fn), vp, tables, off, lens)
    with pytest.raises(TypeError, match="scale"):
        call(q, kp, vp, tables, off, lens, scale="big")
    with pytest.raises(ValueError, match="implementation"):
        call(q, kp, vp, tables, off, lens, implementation="cuda")
