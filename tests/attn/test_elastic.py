"""Elastic-Attention router pieces: boundary pooling, the router MLP (vs a torch replica of the HF
module), head-mode mapping, and the elastic prefill composition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from attn import dense
from attn.block_sparse import block_sparse_attention, effective_block_mask
from attn.elastic import (
    AttentionRouter,
    ctx_q_pool,
    derive_head_mask_type,
    elastic_prefill_attention,
    load_hf_state,
)
from attn.elastic import api as elastic_api
from attn.xattention import xattn_estimate
from tests.utils import AttentionTestBase, assert_close, poison, randn, rng


def _hf_pool(k):
    """HF eval formula on one request `[L, K, H]`: mean(concat(k[:n], k[-n:])), n = min(100, L)."""
    k = np.asarray(k, np.float64)
    n = min(100, k.shape[0])
    return np.concatenate([k[:n], k[-n:]]).mean(0)


@pytest.mark.parametrize("S", [300, 200, 150, 37, 1], ids=lambda s: f"S{s}")
def test_ctx_q_pool_long_and_short(S):
    k = randn(rng(), (2, S, 3, 16))
    got = ctx_q_pool(k)
    assert got.shape == (2, 3, 16) and got.dtype == jnp.float32
    assert_close(got, np.stack([_hf_pool(k[b]) for b in range(2)]), atol=1e-5, rtol=1e-5)
    if S <= 100:  # head and tail are the same keys, counted twice: the plain mean
        assert_close(got, jnp.mean(k, axis=1), atol=1e-5, rtol=1e-5)


def test_ctx_q_pool_per_length_with_poisoned_padding():
    gen = rng()
    S, lengths = 260, np.array([260, 230, 150, 60, 1, 0], np.int32)
    k = randn(gen, (len(lengths), S, 2, 8), jnp.bfloat16)
    k = poison(k, np.arange(S)[None] < lengths[:, None])
    got = jax.jit(ctx_q_pool)(k, jnp.asarray(lengths))
    assert got.dtype == jnp.bfloat16
    for b, L in enumerate(lengths):
        want = _hf_pool(k[b, :L].astype(jnp.float32)) if L else np.zeros((2, 8))
        assert_close(got[b], want, dtype=jnp.bfloat16)
    assert (np.asarray(got[-1], np.float32) == 0).all()


def _torch_router(d):
    """A torch replica of the HF / FD router (`use_softmax=True`), random weights and biases."""
    torch.manual_seed(int(rng().integers(1 << 30)))
    seq = torch.nn.Sequential
    lin, act = torch.nn.Linear, torch.nn.SiLU
    mod = torch.nn.Module()
    mod.cls_feat_extractor = seq(lin(d, 4 * d), act(), lin(4 * d, d))
    mod.cls_router_head_agnostic = seq(lin(d, 4 * d), act(), lin(4 * d, d), act(), lin(d, 2))
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0.0, 0.3)
    return mod


def test_router_matches_hf_layout_and_argmax_convention():
    d, B, K = 16, 3, 4
    hf = _torch_router(d)
    prefix = "model.layers.5.self_attn.mask_allocator."
    tensors = {prefix + name: t for name, t in hf.state_dict().items()}
    tensors[prefix + "log_temp"] = torch.zeros(())  # training-only, ignored
    router = AttentionRouter(d, rngs=nnx.Rngs(0))
    load_hf_state(router, tensors, prefix)
    # a Linear weight is [out, in] in HF, [in, out] here
    np.testing.assert_array_equal(np.asarray(router.cls_router_head_agnostic.layers[4].kernel[...]),
                                  hf.cls_router_head_agnostic[4].weight.detach().numpy().T)
    pooled = randn(rng(), (B, K, d))
    logits, z = router(pooled)
    assert logits.shape == (B, K, 2) and logits.dtype == jnp.float32
    assert z.shape == (B, K) and z.dtype == jnp.int32
    with torch.no_grad():
        x = torch.from_numpy(np.array(pooled))
        want = hf.cls_router_head_agnostic(hf.cls_feat_extractor(x)).numpy()
    assert_close(logits, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(z), np.argmax(np.asarray(logits), -1))
    # batch rows are independent; the module jits
    one_logits, one_z = nnx.jit(lambda r, p: r(p))(router, pooled[1:2])
    assert_close(one_logits, logits[1:2], atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(one_z), np.asarray(z[1:2]))
    # class index 1 = retrieval = full attention (the code's convention, not the paper's)
    last = router.cls_router_head_agnostic.layers[4]
    last.bias[...] = jnp.asarray([0.0, 1e4])
    _, z = router(pooled)
    assert (np.asarray(z) == 1).all()
    modes = derive_head_mask_type(z, "full", "streaming", 2)
    assert (np.asarray(modes) == 0).all()
    last.bias[...] = jnp.asarray([1e4, 0.0])
    modes = derive_head_mask_type(router(pooled)[1], "full", "streaming", 2)
    assert (np.asarray(modes) == -1).all()


def test_router_errors():
    with pytest.raises(ValueError, match="head_dim=0 must be a positive int"):
        AttentionRouter(0, rngs=nnx.Rngs(0))
    router = AttentionRouter(8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="must end in head_dim=8"):
        router(jnp.ones((1, 2, 16)))
    tensors = {k: v for k, v in _torch_router(8).state_dict().items()}
    del tensors["cls_feat_extractor.2.bias"]
    with pytest.raises(KeyError, match=r"cls_feat_extractor\.2\.bias"):
        load_hf_state(router, tensors)
    tensors = dict(_torch_router(16).state_dict())
    with pytest.raises(ValueError, match=r"cls_feat_extractor\.0\.weight has shape \(64, 16\); "
                                         r"expected \(32, 8\)"):
        load_hf_state(router, tensors)


Z = np.array([[1, 0, 1], [0, 0, 1]], np.int32)


@pytest.mark.parametrize("retrieval,toggle,r_code,t_code", [
    ("full", "xattn", 0, 1),
    ("full", "streaming", 0, -1),
    ("xattn", "streaming", 1, -1),
    ("xattn", "xattn", 1, 1),
    ("full", "full", 0, 0),
], ids=lambda x: str(x))
@pytest.mark.parametrize("G", [1, 3], ids=lambda g: f"G{g}")
def test_derive_head_mask_type_pairs(retrieval, toggle, r_code, t_code, G):
    got = derive_head_mask_type(jnp.asarray(Z), retrieval, toggle, G)
    assert got.dtype == jnp.int32 and got.shape == (2, 3 * G)
    want = np.repeat(np.where(Z == 1, r_code, t_code), G, axis=1)  # head n <- KV head n // G
    np.testing.assert_array_equal(np.asarray(got), want)


def test_derive_head_mask_type_under_jit_and_errors():
    fn = jax.jit(lambda z: derive_head_mask_type(z, "full", "xattn", 2))
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray([[0, 1]]))), [[1, 1, 0, 0]])
    for pair in [("streaming", "xattn"), ("xattn", "full"), ("full", "local"),
                 ("full", "triangle"), ("full", "topk"), ("none", "none"), ("streaming", "full")]:
        with pytest.raises(NotImplementedError, match="is not supported"):
            derive_head_mask_type(jnp.asarray(Z), *pair, 1)
    with pytest.raises(ValueError, match="toggle_type='sparse' must be one of"):
        derive_head_mask_type(jnp.asarray(Z), "full", "sparse", 1)
    with pytest.raises(ValueError, match="retrieval_mode='FULL' must be one of"):
        derive_head_mask_type(jnp.asarray(Z), "FULL", "xattn", 1)
    with pytest.raises(ValueError, match=r"z values \[0, 1, 2\] must be in"):
        derive_head_mask_type(jnp.asarray([[0, 1, 2]]), "full", "xattn", 1)
    with pytest.raises(TypeError, match="z.dtype"):
        derive_head_mask_type(jnp.asarray([[0.0, 1.0]]), "full", "xattn", 1)
    with pytest.raises(ValueError, match="z must have shape"):
        derive_head_mask_type(jnp.asarray([0, 1]), "full", "xattn", 1)
    with pytest.raises(ValueError, match="group_size=0 must be a positive int"):
        derive_head_mask_type(jnp.asarray(Z), "full", "xattn", 0)


def test_ctx_q_pool_errors():
    k = jnp.ones((2, 10, 2, 4))
    with pytest.raises(ValueError, match="k_pre must have shape"):
        ctx_q_pool(jnp.ones((10, 2, 4)))
    with pytest.raises(TypeError, match="k_pre.dtype"):
        ctx_q_pool(k.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"lengths.shape=\(3,\)"):
        ctx_q_pool(k, jnp.asarray([1, 2, 3]))
    with pytest.raises(ValueError, match=r"lengths=\[11, 2\] must lie in \[0, 10\]"):
        ctx_q_pool(k, jnp.asarray([11, 2]))
    with pytest.raises(TypeError, match="lengths.dtype"):
        ctx_q_pool(k, jnp.asarray([1.0, 2.0]))
    with pytest.raises(ValueError, match="boundary=0 must be positive"):
        ctx_q_pool(k, boundary=0)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-estimate", "fp8-estimate"])
def test_elastic_prefill_is_xattention_then_block_sparse(fp8, monkeypatch):
    gen = rng()
    seen = []  # the estimate's fp8 flag as elastic passes it (the masks here agree either way)
    monkeypatch.setattr(elastic_api, "xattn_estimate",
                        lambda *a, **kw: seen.append(kw["fp8"]) or xattn_estimate(*a, **kw))
    B, T, S, N, K, H, bs, st = 2, 40, 64, 4, 2, 16, 16, 4
    q, k, v = randn(gen, (B, T, N, H)), randn(gen, (B, S, K, H)), randn(gen, (B, S, K, H))
    lens = dict(q_lengths=jnp.asarray([40, 17]), kv_lengths=jnp.asarray([64, 49]))
    z = jnp.asarray([[1, 0], [0, 0]], jnp.int32)
    modes = derive_head_mask_type(z, "full", "xattn", N // K)
    kw = dict(block_size=bs, sink_blocks=1, local_blocks=2, **lens)
    out, lse = elastic_prefill_attention(q, k, v, modes, stride=st, threshold=0.3,
                                         estimate_fp8=fp8, **kw)
    assert seen == [fp8]
    _, mask = xattn_estimate(q, k, block_size=bs, stride=st, threshold=0.3, fp8=fp8, **lens)
    exp_out, exp_lse = block_sparse_attention(q, k, v, modes, mask, **kw)
    AttentionTestBase.check_output(out, lse, exp_out, exp_lse)
    # retrieval heads of request 0 are plain causal attention
    d_out, d_lse = dense.attention(q[:1], k[:1], v[:1], q_offset=S - T)
    AttentionTestBase.check_output(out[:1, :, :2], lse[:1, :, :2], d_out[:, :, :2],
                                   d_lse[:, :, :2])
    # the sparse heads really skip blocks that dense attention visits
    full = effective_block_mask(jnp.zeros((B, N), jnp.int32), num_q_tokens=T, num_kv_tokens=S,
                                block_size=bs, **lens)
    assert np.asarray(mask)[:, 2:].sum() < np.asarray(full)[:, 2:].sum()
