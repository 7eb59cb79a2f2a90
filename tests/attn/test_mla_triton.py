"""The Triton MLA latent decode: the shared base through the op (`mla_decode_base`, interpreted
on a CPU), its launch configs (tiles, splits, page tiles against the gather, fp8 value reloads)
and partials against the reference, its default config, compiled runs on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn._op import device_facts
from attn.mla import api
from attn.mla import triton as kernel
from kv import fp8
from tests.attn.mla_decode_base import MlaDecodeTests
from tests.utils import AttentionTestBase, assert_close, case_id, poison, randn, rng

F32, BF16 = jnp.float32, jnp.bfloat16


class TestTriton(MlaDecodeTests):
    implementation = "triton"
    config = kernel.Config(block_n=16, num_splits=2)
    fp8_tolerance = (1e-2, 1e-3)  # tiles and probabilities in float16 (`Config.fp8_compute`)


def _problem(gen, *, b, n, l, r, p, max_pages, dtype, lengths):
    """Random latent pages and per-row random page ids with -1 tails.

    Returns the queries, pages, table, lengths and `keep [num_pages, P]`: True for the tokens some
    row owns (inside its length). Everything else (page 0, unowned pages, the tail of a row's last
    page) is for the caller to poison.
    """
    num_pages = b * max_pages + 2
    q_lat, q_pe = randn(gen, (b, n, l), dtype), randn(gen, (b, n, r), dtype)
    pages = randn(gen, (num_pages, p, l + r), dtype)
    ids = gen.permutation(num_pages - 1)[: b * max_pages].reshape(b, max_pages) + 1
    table = np.full((b, max_pages), -1, np.int32)
    keep = np.zeros((num_pages, p), bool)
    for row, length in enumerate(lengths):
        used = -(-length // p)
        table[row, :used] = ids[row, :used]
        tokens = np.arange(used * p) < length  # [used * P]
        keep[ids[row, :used]] = tokens.reshape(used, p)
    return (q_lat, q_pe, pages, jnp.asarray(table), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(keep))


def _reference(q_lat, q_pe, pages, table, lengths, *, l, scale, scales=None, num_splits=1,
               partials=False):
    if partials:  # XLA only
        return api.mla_paged_decode_partials(q_lat, q_pe, pages, table, lengths, kv_lora_rank=l,
                                             scale=scale, latent_scales=scales,
                                             num_splits=num_splits)
    return api.mla_paged_decode(q_lat, q_pe, pages, table, lengths, kv_lora_rank=l, scale=scale,
                                latent_scales=scales, num_splits=num_splits, implementation="xla")


CASES = [  # lengths: full, padding (0), 1, and not multiples of P
    dict(l=64, r=16, n=5, p=16, max_pages=4, lengths=[63, 0, 1, 37], splits=1, block_n=16,
         dtype=F32),
    dict(l=48, r=24, n=16, p=32, max_pages=3, lengths=[96, 0, 1, 45], splits=3, block_n=64,
         dtype=BF16),
    dict(l=32, r=32, n=20, p=16, max_pages=5, lengths=[79, 0, 1, 18], splits=3, block_n=32,
         dtype=F32),
    dict(l=64, r=32, n=16, p=32, max_pages=4, lengths=[128, 0, 33, 97], splits=2, block_n=16,
         dtype=BF16),  # page tiles: two tiles a page, the next page id read a tile ahead
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: case_id(
    L=c["l"], R=c["r"], N=c["n"], P=c["p"], J=c["splits"], BN=c["block_n"]) + "-"
    + jnp.dtype(c["dtype"]).name)
@pytest.mark.parametrize("page_tiles", [True, False], ids=["page-tiles", "gather"])
def test_kernel_matches_reference(c, page_tiles):
    """Unowned pages and padding tokens are NaN; 20 heads cover two head blocks with a tail.
    Page tiles apply where BLOCK_N divides P (else, and with page_tiles=False, the gather)."""
    gen = rng()
    l, n = c["l"], c["n"]
    q_lat, q_pe, pages, table, lengths, keep = _problem(
        gen, b=4, n=n, l=l, r=c["r"], p=c["p"], max_pages=c["max_pages"], dtype=c["dtype"],
        lengths=c["lengths"])
    pages = poison(pages, keep)
    cfg = kernel.Config(block_n=c["block_n"], num_splits=c["splits"], page_tiles=page_tiles)
    out, lse = kernel.mla_paged_decode(q_lat, q_pe, pages, table, lengths, kv_lora_rank=l,
                                       scale=0.25, config=cfg)
    exp_out, exp_lse = _reference(q_lat, q_pe, pages, table, lengths, l=l, scale=0.25)
    assert out.shape == (4, n, l) and out.dtype == c["dtype"] and lse.dtype == F32
    tol = {} if c["dtype"] == BF16 else dict(atol=1e-5, rtol=1e-5)
    assert_close(out, exp_out, **tol)
    assert_close(lse, exp_lse, allow_neg_inf=True, **tol)
    AttentionTestBase.check_masked_rows(out, lse, np.broadcast_to(lengths[:, None], (4, n)))


def test_partials_match_reference_splits():
    """Page-aligned splits per row, as the reference: same partials, empty splits 0 and -inf."""
    gen = rng()
    l, r, n, p = 32, 16, 5, 16
    lengths = [1, 90, 40, 0]  # 1, 6, 3 and 0 pages: splits of 1, 2, 1 and 1 page
    q_lat, q_pe, pages, table, lengths, keep = _problem(
        gen, b=4, n=n, l=l, r=r, p=p, max_pages=6, dtype=F32, lengths=lengths)
    pages = poison(pages, keep)
    o, lse = kernel.mla_paged_decode_partials(
        q_lat, q_pe, pages, table, lengths, kv_lora_rank=l, scale=0.3,
        config=kernel.Config(block_n=16, num_splits=3))
    exp_o, exp_lse = _reference(q_lat, q_pe, pages, table, lengths, l=l, scale=0.3,
                                num_splits=3, partials=True)
    assert o.shape == (4, n, 3, l) and lse.shape == (4, n, 3)
    finite = np.broadcast_to(np.array([[1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]], bool)[:, None],
                             (4, n, 3))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert not np.asarray(o)[~finite].any(), "an empty split's partial must be exactly 0"
    assert_close(o, exp_o, atol=1e-5, rtol=1e-5)
    assert_close(lse, exp_lse, allow_neg_inf=True, atol=1e-5, rtol=1e-5)


FP8_CASES = [
    dict(l=64, r=16, n=5, p=16, sub_block=4, splits=3, lengths=[31, 0, 1, 20], reload=True),
    dict(l=32, r=32, n=16, p=32, sub_block=32, splits=1, lengths=[64, 33, 1, 0], reload=False),
]


@pytest.mark.parametrize("c", FP8_CASES, ids=lambda c: case_id(
    L=c["l"], R=c["r"], N=c["n"], P=c["p"], SB=c["sub_block"], J=c["splits"])
    + ("-reload" if c["reload"] else ""))
def test_fp8_latent_matches_reference_on_same_pages(c):
    gen = rng()
    l = c["l"]
    q_lat, q_pe, pages, table, lengths, keep = _problem(
        gen, b=4, n=c["n"], l=l, r=c["r"], p=c["p"], max_pages=2, dtype=BF16,
        lengths=c["lengths"])
    q8, scales = fp8.quantize(pages.astype(F32) * 3.0, c["sub_block"])
    q8, scales = poison(q8, keep), poison(scales, keep.any(axis=1))  # NaN where nobody reads
    out, lse = kernel.mla_paged_decode(
        q_lat, q_pe, q8, table, lengths, kv_lora_rank=l, scale=0.2, latent_scales=scales,
        config=kernel.Config(block_n=16, num_splits=c["splits"], reload_value=c["reload"]))
    exp_out, exp_lse = _reference(q_lat, q_pe, q8, table, lengths, l=l, scale=0.2, scales=scales)
    # Tiles and probabilities go through float16 for the tensor cores: f16-level error.
    assert_close(out, exp_out, atol=1e-2, rtol=1e-2)
    assert_close(lse, exp_lse, allow_neg_inf=True, atol=1e-3, rtol=1e-3)
    AttentionTestBase.check_masked_rows(out, lse, np.broadcast_to(lengths[:, None], (4, c["n"])))


def test_config_validation():
    with pytest.raises(ValueError, match="block_n"):
        kernel.Config(block_n=48)
    with pytest.raises(ValueError, match="block_heads"):
        kernel.Config(block_heads=8)
    with pytest.raises(ValueError, match="num_splits"):
        kernel.Config(num_splits=0)
    with pytest.raises(ValueError, match="fp8_compute"):
        kernel.Config(fp8_compute="float32")


def test_default_config_fills_whole_waves():
    cfg = kernel.default_config(64, 16, 32768)
    assert (cfg.block_heads, cfg.num_splits, cfg.reload_value) == (16, 8, False)
    slots = 2 * device_facts().num_sms  # 64 rows x 8 splits = 512 programs: 1.94 waves of 264
    assert 64 * cfg.num_splits / (-(-64 * cfg.num_splits // slots) * slots) >= 0.95
    assert kernel.default_config(64, 16, 32768, fp8=True).reload_value
    wide = kernel.default_config(64, 128, 32768, fp8=True)
    assert (wide.block_heads, wide.reload_value) == (64, False)
    short = kernel.default_config(1, 16, 300)  # one split: fewer than 512 tokens
    assert short.num_splits == 1
    assert kernel.default_config(2, 5, 1 << 20, itemsize=4).block_n == 16


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16, 128])
@pytest.mark.parametrize("l,r", [(512, 64), (256, 32)], ids=["L512-R64", "L256-R32"])
def test_compiled_on_gpu(l, r, n):
    gen = rng()
    b, p, s = 6, 64, 4096
    lengths = [s, 0, 1, 2049, 3000, 63]
    q_lat, q_pe, pages, table, lengths, keep = _problem(
        gen, b=b, n=n, l=l, r=r, p=p, max_pages=s // p, dtype=BF16, lengths=lengths)
    scale = 192**-0.5
    run = jax.jit(lambda q, qp, pg, t, ln, sc: kernel.mla_paged_decode(
        q, qp, pg, t, ln, kv_lora_rank=l, scale=scale, latent_scales=sc))
    out, lse = run(q_lat, q_pe, poison(pages, keep), table, lengths, None)
    exp_out, exp_lse = _reference(q_lat, q_pe, pages, table, lengths, l=l, scale=scale)
    assert_close(out, exp_out, dtype=BF16)
    assert_close(lse, exp_lse, dtype=BF16, allow_neg_inf=True)
    AttentionTestBase.check_masked_rows(out, lse, np.broadcast_to(lengths[:, None], (b, n)))

    q8, scales = fp8.quantize(pages, 16)
    out8, lse8 = run(q_lat, q_pe, poison(q8, keep), table, lengths,
                     poison(scales, keep.any(axis=1)))
    exp8, exp_lse8 = _reference(q_lat, q_pe, q8, table, lengths, l=l, scale=scale, scales=scales)
    assert_close(out8, exp8, dtype=BF16)
    assert_close(lse8, exp_lse8, dtype=BF16, allow_neg_inf=True)
