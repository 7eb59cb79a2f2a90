"""MLA: HF weight split, materialised vs absorbed vs a float64 HF oracle; paged latent decode
through the shared base (`mla_decode_base`: against absorbed attention, fp8 latents, unowned
pages, batch independence) and what only the XLA reference has (split-KV partials, gradients);
every validation error.

Inputs are built in numpy and handed to the ops as numpy arrays: on a CPU every eager jnp op
costs a compilation, and compiling is what makes these tests slow.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.merge import merge_partials
from attn.mla import (
    absorb_query,
    expand_output,
    mla_absorbed_attention,
    mla_naive_attention,
    mla_paged_decode,
    mla_paged_decode_partials,
    split_kv_b,
)
from tests.attn.mla_decode_base import MlaDecodeTests, paged, quantize
from tests.utils import AttentionTestBase, assert_close, rng

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def _randn(gen, shape, dtype=F32, scale=1.0):
    """Fresh standard-normal numpy array (bf16 / fp8 through ml_dtypes)."""
    return (gen.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _inputs(gen, b, t, s, n, dn, r, l, dtype=F32):
    return (_randn(gen, (b, t, n, dn), dtype), _randn(gen, (b, t, n, r), dtype),
            _randn(gen, (b, s, l), dtype), _randn(gen, (b, s, r), dtype))


def _weights(gen, n, dn, dv, l, dtype=F32):
    """`kv_b_proj.weight` as HF stores it, and its per-head split."""
    kv_b = _randn(gen, (n * (dn + dv), l), dtype, scale=l**-0.5)
    return kv_b, *split_kv_b(kv_b, n, dn, dv)


def _oracle(q_nope, q_pe, c_kv, k_pe, kv_b, dn, scale, *, q_offset, kv_lengths, causal):
    """HF's MLA attention (`DeepseekV3Attention`), written out in float64 numpy."""
    q_nope, q_pe, c_kv, k_pe, kv_b = map(_f64, (q_nope, q_pe, c_kv, k_pe, kv_b))
    b, t, n, _ = q_nope.shape
    s = c_kv.shape[1]
    kv = (c_kv @ kv_b.T).reshape(b, s, n, -1)  # kv_b_proj(c_kv).view(B, S, N, Dn + Hv)
    k = np.concatenate([kv[..., :dn], np.repeat(k_pe[:, :, None], n, 2)], -1)
    q = np.concatenate([q_nope, q_pe], -1)
    scores = np.einsum("btnh,bsnh->bnts", q, k) * scale
    q_pos = np.asarray(q_offset).reshape(-1, 1) + np.arange(t)  # [B, T]
    keys = np.arange(s)
    visible = keys[None, None, :] < np.asarray(kv_lengths)[:, None, None]
    if causal:
        visible = visible & (keys[None, None, :] <= q_pos[..., None])
    scores = np.where(visible[:, None], scores, -np.inf)
    lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    out = np.einsum("bnts,bsnv->btnv", np.exp(scores - lse[..., None]), kv[..., dn:])
    return out, lse.transpose(0, 2, 1)


class TestXla(MlaDecodeTests):
    """Paged latent decode through the shared base (`mla_decode_base`)."""

    implementation = "xla"


def test_split_kv_b_is_hf_view():
    gen = rng()
    n, dn, dv, l, s = 3, 5, 7, 11, 4
    kv_b, w_uk, w_uv = _weights(gen, n, dn, dv, l)
    c_kv = _randn(gen, (s, l))
    assert w_uk.shape == (n, dn, l) and w_uv.shape == (n, dv, l)
    kv = (c_kv @ kv_b.T).reshape(s, n, dn + dv)  # HF: kv_b_proj(c_kv).view(T, N, Dn + Hv)
    assert_close(np.einsum("sl,nhl->snh", c_kv, w_uk), kv[..., :dn])
    assert_close(np.einsum("sl,nvl->snv", c_kv, w_uv), kv[..., dn:])


# One set of attention dims for every prefill test, so the compiled programs are shared.
DIMS = dict(b=2, t=4, s=10, n=3, dn=8, r=4, dv=6, l=16)
CHUNKED = dict(q_offset=[6, 2], kv_lengths=[10, 6])  # 4 new tokens after cached prefixes 6 and 2


def _attention_case(gen, dtype=F32):
    b, t, s, n, dn, r, dv, l = DIMS.values()
    kv_b, w_uk, w_uv = _weights(gen, n, dn, dv, l, dtype)
    return kv_b, (*_inputs(gen, b, t, s, n, dn, r, l, dtype), w_uk, w_uv)


def _offsets(q_offset, kv_lengths):
    return dict(q_offset=q_offset if isinstance(q_offset, int) else np.array(q_offset, np.int32),
                kv_lengths=None if kv_lengths is None else np.array(kv_lengths, np.int32))


@pytest.mark.parametrize("fn", [mla_naive_attention, mla_absorbed_attention],
                         ids=["naive", "absorbed"])
def test_matches_float64_hf_oracle(fn):
    """Chunked prefill after per-row cached prefixes, ragged kv lengths, Hv != Dn."""
    kv_b, args = _attention_case(rng())
    scale = (DIMS["dn"] + DIMS["r"]) ** -0.5 * 1.3  # an mscale² factor, as DeepSeek's YaRN
    out, lse = fn(*args, scale=scale, **_offsets(**CHUNKED))
    exp_out, exp_lse = _oracle(*args[:4], kv_b, DIMS["dn"], scale, causal=True, **CHUNKED)
    assert out.dtype == F32 and lse.dtype == F32 and out.shape == (2, 4, 3, DIMS["dv"])
    assert_close(out, exp_out)
    assert_close(lse, exp_lse)


ATTN_CASES = [  # id, dtype, causal, q_offset, kv_lengths
    ("chunked-f32", F32, True, *CHUNKED.values()),
    ("noncausal-padding-row-f32", F32, False, [0, 0], [10, 0]),
    ("prefill-from-0-bf16", BF16, True, 0, None),
]


@pytest.mark.parametrize("name,dtype,causal,q_offset,kv_lengths", ATTN_CASES,
                         ids=[c[0] for c in ATTN_CASES])
def test_absorbed_equals_naive(name, dtype, causal, q_offset, kv_lengths):
    _, args = _attention_case(rng(), dtype)
    kw = dict(scale=0.35, causal=causal, **_offsets(q_offset, kv_lengths))
    out, lse = mla_absorbed_attention(*args, **kw)
    ref_out, ref_lse = mla_naive_attention(*args, **kw)
    assert out.dtype == dtype and ref_out.dtype == dtype
    AttentionTestBase.check_output(out, lse, ref_out, ref_lse, dtype=dtype)
    visible = np.ones(2) if kv_lengths is None else np.array(kv_lengths)
    visible = np.broadcast_to(visible[:, None, None], lse.shape)
    AttentionTestBase.check_masked_rows(out, lse, visible)


def test_gradients_absorbed_equal_naive_and_finite_on_masked_rows():
    gen = rng()
    _, args = _attention_case(gen)
    cot = _randn(gen, (2, 4, 3, DIMS["dv"]))
    kw = dict(scale=0.3, **_offsets([5, 0], [10, 0]))  # row 1 sees nothing

    def grads(fn):
        loss = lambda *a: jnp.sum(fn(*a, **kw)[0] * cot)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)

    ref_grads = grads(mla_naive_attention)
    for name, g, rg in zip(["q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv"],
                           grads(mla_absorbed_attention), ref_grads):
        assert_close(g, rg, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")
        if name.startswith("q"):
            assert not np.asarray(g)[1].any(), "a row with no key has no gradient"


@jax.jit
def _partials_case(q_lat, q_pe, pages, table, lengths):
    kw = dict(kv_lora_rank=q_lat.shape[-1], scale=0.2)
    partials = mla_paged_decode_partials(q_lat, q_pe, pages, table, lengths, num_splits=3, **kw)
    # Row 1's split 1 is its pages 2..3 (tokens 8..15): one split over a table holding just them.
    sub = mla_paged_decode(q_lat[1:2], q_pe[1:2], pages, table[1:2, 2:4],
                           jnp.array([8], jnp.int32), **kw)
    return partials, merge_partials(*partials), sub, mla_paged_decode(
        q_lat, q_pe, pages, table, lengths, num_splits=1, **kw)


def test_split_kv_partials():
    """Splits are page-aligned per row; merged 3-split partials equal 1 split; empty: 0 / -inf."""
    gen = rng()
    b, n, l, r, p, max_pages = 3, 2, 32, 8, 4, 6
    latent = _randn(gen, (b, max_pages * p, l + r))
    lengths = np.array([1, 23, 9], np.int32)  # 1, 6 and 3 pages: 1, 2 and 1 page per split
    pages, table, _ = paged(gen, latent, lengths, p, "random", num_pages=20)
    q_lat, q_pe = _randn(gen, (b, n, l)), _randn(gen, (b, n, r))
    (o, lse), merged, (sub_o, sub_lse), one = map(
        lambda x: jax.tree.map(np.asarray, x), _partials_case(q_lat, q_pe, pages, table, lengths))
    assert o.shape == (b, n, 3, l) and lse.shape == (b, n, 3)
    expected = np.array([[1, 0, 0], [1, 1, 1], [1, 1, 1]], bool)  # row 0 has one page only
    np.testing.assert_array_equal(np.isfinite(lse), np.broadcast_to(expected[:, None], lse.shape))
    assert not o[~np.isfinite(lse)].any()
    assert_close(o[1, :, 1], sub_o[0])
    assert_close(lse[1, :, 1], sub_lse[0])
    AttentionTestBase.check_output(*merged, *one)


def test_decode_gradient_is_finite_and_zero_on_padding_rows():
    gen = rng()
    b, n, l, r, p, max_pages = 2, 2, 16, 8, 4, 3
    latent = _randn(gen, (b, max_pages * p, l + r))
    lengths = np.array([5, 0], np.int32)
    pages, table, _ = paged(gen, latent, lengths, p, "random", num_pages=8)  # NaN pages
    q_lat, q_pe, cot = _randn(gen, (b, n, l)), _randn(gen, (b, n, r)), _randn(gen, (b, n, l))
    loss = lambda q, qp, pg: jnp.sum(mla_paged_decode(
        q, qp, pg, table, lengths, kv_lora_rank=l, scale=0.3, num_splits=3)[0] * cot)
    grads = [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q_lat, q_pe, pages)]
    for g in grads:
        assert np.isfinite(g).all()
    assert not grads[0][1].any() and not grads[1][1].any()
    assert grads[0][0].any()


def _bad_attention():
    gen = rng(0)
    q_nope, q_pe, c_kv, k_pe = _inputs(gen, 2, 3, 5, 4, 8, 4, 16)
    _, w_uk, w_uv = _weights(gen, 4, 8, 6, 16)
    good = dict(q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w_uk=w_uk, w_uv=w_uv)
    i32 = np.int32
    cases = [  # (id, changes, error, match)
        ("q_nope-rank", dict(q_nope=q_nope[0]), ValueError, r"q_nope must have shape \[B T N Dn\]"),
        ("q_pe-int", dict(q_pe=q_pe.astype(i32)), TypeError, "q_pe.dtype"),
        ("q_pe-heads", dict(q_pe=q_pe[:, :, :2]), ValueError, "q_pe.shape"),
        ("k_pe-S", dict(k_pe=k_pe[:, :4]), ValueError, "k_pe.shape"),
        ("c_kv-B", dict(c_kv=c_kv[:1], k_pe=k_pe[:1]), ValueError, r"c_kv.shape\[0\]=1"),
        ("k_pe-R", dict(k_pe=k_pe[..., :3]), ValueError, r"k_pe.shape\[-1\]=3"),
        ("w_uk", dict(w_uk=w_uk[:, :7]), ValueError, "w_uk.shape"),
        ("w_uv", dict(w_uv=w_uv[..., :8]), ValueError, "w_uv.shape"),
        ("scale-neg", dict(scale=-1.0), ValueError, "scale=-1.0"),
        ("scale-str", dict(scale="x"), TypeError, "scale='x'"),
        ("scale-vec", dict(scale=np.ones(2)), ValueError, "scale must be a scalar"),
        ("q_offset-float", dict(q_offset=1.5), TypeError, "q_offset=1.5"),
        ("q_offset-shape", dict(q_offset=np.zeros(3, i32)), ValueError, "q_offset.shape"),
        ("q_offset-dtype", dict(q_offset=np.zeros(2)), TypeError, "q_offset.dtype"),
        ("kv_lengths-B", dict(kv_lengths=np.zeros(3, i32)), ValueError,
         r"kv_lengths.shape\[0\]=3"),
        ("kv_lengths-dtype", dict(kv_lengths=np.zeros(2)), TypeError, "kv_lengths.dtype"),
        ("xla-only", dict(implementation="xla"), TypeError, "implementation"),
    ]
    return good, cases


@pytest.mark.parametrize("fn", [mla_naive_attention, mla_absorbed_attention],
                         ids=["naive", "absorbed"])
@pytest.mark.parametrize("case", _bad_attention()[1], ids=lambda c: c[0])
def test_attention_bad_input(fn, case):
    good, _ = _bad_attention()
    _, changes, error, match = case
    with pytest.raises(error, match=match):
        fn(**{**good, "scale": 0.5, **changes})


def _bad_decode():
    gen = rng(0)
    b, n, l, r, p = 2, 3, 16, 8, 4
    q_lat, q_pe = _randn(gen, (b, n, l)), _randn(gen, (b, n, r))
    pages = _randn(gen, (5, p, l + r))
    table, lengths = np.ones((b, 2), np.int32), np.array([3, 5], np.int32)
    q8, scales = quantize(pages, 2)
    good = dict(q_lat=q_lat, q_pe=q_pe, latent_pages=pages, block_tables=table,
                kv_lengths=lengths, kv_lora_rank=l, scale=0.5)
    fp8 = dict(latent_pages=q8, latent_scales=scales)
    cases = [  # (id, changes, error, match)
        ("rank-float", dict(kv_lora_rank=16.0), TypeError, "kv_lora_rank=16.0"),
        ("rank-zero", dict(kv_lora_rank=0), ValueError, "kv_lora_rank=0"),
        ("splits-zero", dict(num_splits=0), ValueError, "num_splits=0"),
        ("scale-zero", dict(scale=0.0), ValueError, "scale=0.0"),
        ("scale-nan", dict(scale=float("nan")), ValueError, "scale=nan"),
        ("q_lat-rank", dict(q_lat=q_lat[None]), ValueError, r"q_lat must have shape \[B N L\]"),
        ("pages-rank", dict(latent_pages=pages[0]), ValueError, "latent_pages must have shape"),
        ("table-rank", dict(block_tables=table[0]), ValueError, "block_tables must have shape"),
        ("q_lat-int", dict(q_lat=q_lat.astype(np.int32)), TypeError, "q_lat.dtype"),
        ("q_pe-int", dict(q_pe=q_pe.astype(np.int32)), TypeError, "q_pe.dtype"),
        ("table-float", dict(block_tables=table.astype(F32)), TypeError, "block_tables.dtype"),
        ("L-mismatch", dict(kv_lora_rank=12), ValueError, r"q_lat.shape\[-1\]=16"),
        ("no-rope", dict(latent_pages=pages[..., :l]), ValueError, r"last dim L \+ R"),
        ("q_pe-R", dict(q_pe=q_pe[..., :4]), ValueError, "q_pe.shape"),
        ("table-B", dict(block_tables=table[:1]), ValueError, r"block_tables.shape\[0\]=1"),
        ("kv_lengths-B", dict(kv_lengths=lengths[:1]), ValueError, r"kv_lengths.shape\[0\]=1"),
        ("kv_lengths-float", dict(kv_lengths=lengths.astype(F32)), TypeError,
         "kv_lengths.dtype"),
        ("pages-int", dict(latent_pages=pages.astype(np.int32)), TypeError,
         "latent_pages.dtype=int32"),
        ("fp8-no-scales", dict(latent_pages=q8), TypeError, "needs latent_scales"),
        ("scales-no-fp8", dict(latent_scales=scales), TypeError, "latent_pages.dtype=float32"),
        ("scales-rank", dict(fp8, latent_scales=scales[0]), ValueError,
         "latent_scales must have shape"),
        ("scales-dtype", dict(fp8, latent_scales=scales.astype(BF16)), TypeError,
         "latent_scales.dtype"),
        ("scales-pages", dict(fp8, latent_scales=scales[:4]), ValueError,
         r"latent_scales.shape\[0\]=4"),
        ("scales-sub-block", dict(fp8, latent_scales=np.ones((5, 3), np.float32)), ValueError,
         r"page size P=4 must be divisible by latent_scales.shape\[1\]=3"),
        ("impl-unknown", dict(implementation="cuda"), ValueError, "implementation="),
        ("impl-mosaic", dict(implementation="mosaic"), NotImplementedError, "implementation="),
    ]
    return good, cases


@pytest.mark.parametrize("fn", [mla_paged_decode, mla_paged_decode_partials],
                         ids=["decode", "partials"])
@pytest.mark.parametrize("case", _bad_decode()[1], ids=lambda c: c[0])
def test_decode_bad_input(fn, case):
    good, _ = _bad_decode()
    _, changes, error, match = case
    if fn is mla_paged_decode_partials and "implementation" in changes:  # XLA only
        error, match = TypeError, "implementation"
    with pytest.raises(error, match=match):
        fn(**{**good, **changes})


def test_scale_defaults_to_the_query_head_dim():
    """`scale=None` is `(Dn + R) ** -0.5` for attention and `(L + R) ** -0.5` for latent decode,
    the query head dim of each op, as in every op."""
    good, _ = _bad_attention()
    dn, r = good["q_nope"].shape[-1], good["q_pe"].shape[-1]
    for fn in (mla_naive_attention, mla_absorbed_attention):
        got = fn(**good)[0]
        assert_close(got, fn(**good, scale=(dn + r) ** -0.5)[0])
        assert float(jnp.max(jnp.abs(got - fn(**good, scale=1.0)[0]))) > 1e-4
    good, _ = _bad_decode()
    lr = good["latent_pages"].shape[-1]
    kw = {k: v for k, v in good.items() if k != "scale"}
    assert_close(mla_paged_decode(**kw, implementation="xla")[0],
                 mla_paged_decode(**kw, scale=lr**-0.5, implementation="xla")[0])


def test_projection_bad_input():
    w = np.ones((4 * (8 + 6), 16), np.float32)
    w_uk, w_uv = split_kv_b(w, 4, 8, 6)
    with pytest.raises(ValueError, match=r"must have N\*\(Dn\+Hv\)=52 rows"):
        split_kv_b(w, 4, 7, 6)
    with pytest.raises(TypeError, match="num_heads=4.0"):
        split_kv_b(w, 4.0, 8, 6)
    with pytest.raises(ValueError, match="v_head_dim=0"):
        split_kv_b(w, 4, 8, 0)
    with pytest.raises(ValueError, match="kv_b_weight must have shape"):
        split_kv_b(w[0], 4, 8, 6)
    with pytest.raises(TypeError, match="kv_b_weight.dtype"):
        split_kv_b(w.astype(np.int32), 4, 8, 6)
    with pytest.raises(ValueError, match="q_nope.shape"):
        absorb_query(np.ones((2, 4, 7), np.float32), w_uk)
    with pytest.raises(ValueError, match="w_uk must have shape"):
        absorb_query(np.ones((2, 4, 8), np.float32), w_uk[0])
    with pytest.raises(TypeError, match="q_nope.dtype"):
        absorb_query(np.ones((2, 4, 8), np.int32), w_uk)
    with pytest.raises(ValueError, match="o_lat.shape"):
        expand_output(np.ones((2, 3, 16), np.float32), w_uv)
    with pytest.raises(ValueError, match="w_uv must have shape"):
        expand_output(np.ones((2, 4, 16), np.float32), w_uv[0])
    with pytest.raises(TypeError, match="o_lat.dtype"):
        expand_output(np.ones((2, 4, 16), np.int32), w_uv)
