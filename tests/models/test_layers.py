"""Layers against transformers' own functions: rope types, rope layouts, norms, MoE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import models.layers.moe as moe_lib
import models.layers.rope as rope_lib
from models.config import ConfigError, HFConfig
from models.layers.attention import AttentionConfig
from models.layers.linear import activation
from models.layers.norms import gated_rms_norm, rms_norm
from tests.models import tiny
from tests.utils import assert_close, randn, rng

HEAD_DIM = 16


def _hf_config(rope_parameters, **kw):
    t = tiny._transformers()
    return t.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                         max_position_embeddings=128, rope_parameters=dict(rope_parameters), **kw)


ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16},
    "yarn-notrunc-af": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 48,
                        "truncate": False, "attention_factor": 1.3},
    "yarn-partial": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                     "partial_rotary_factor": 0.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.5 * i for i in range(8)]},
}


@pytest.mark.parametrize("seq_len", [100, 300], ids=["short", "long"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_inv_freq_matches_hf(case, seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(ROPE_CASES[case], rope_theta=10000.0)
    hf_cfg = _hf_config(params)
    if params["rope_type"] == "default":
        dim = HEAD_DIM
        expected = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
        expected_af = 1.0
    else:
        expected, expected_af = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, None,
                                                                         seq_len=seq_len)
    cfg = rope_lib.rope_from_hf(HFConfig(hf_cfg.to_dict()), head_dim=HEAD_DIM)
    got, af = rope_lib.inv_freq(cfg, seq_len)
    assert_close(got, expected.numpy(), atol=0, rtol=2e-6)
    assert af == pytest.approx(float(expected_af), rel=1e-6)


def test_dynamic_rope_depends_on_length():
    cfg = rope_lib.RopeConfig(rotary_dim=16, rope_type="dynamic", factor=2.0,
                              max_position_embeddings=128)
    short, _ = rope_lib.inv_freq(cfg, 100)
    long, _ = rope_lib.inv_freq(cfg, 300)
    base, _ = rope_lib.inv_freq(rope_lib.RopeConfig(rotary_dim=16), None)
    np.testing.assert_allclose(short, base, rtol=1e-6)
    assert (np.asarray(long)[1:] < np.asarray(base)[1:]).all()


def _positions(b, t, offset=1000):
    return jnp.asarray(np.stack([np.arange(t) + offset * i for i in range(b)]), jnp.int32)


@pytest.mark.parametrize("case", ["default", "yarn"])
def test_neox_rope_matches_hf(case):
    from transformers.models.llama import modeling_llama as ml

    hf_cfg = _hf_config(dict(ROPE_CASES[case], rope_theta=10000.0))
    x = randn(rng(), (2, 37, 3, HEAD_DIM))
    pos = _positions(2, 37)
    cos, sin = ml.LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.tensor(np.asarray(pos)))
    xt = torch.tensor(np.asarray(x)).transpose(1, 2)  # HF: [B, n, T, H]
    expected, _ = ml.apply_rotary_pos_emb(xt, xt, cos, sin)
    cfg = rope_lib.rope_from_hf(HFConfig(hf_cfg.to_dict()), head_dim=HEAD_DIM)
    assert_close(rope_lib.rotate(cfg, x, pos), expected.transpose(1, 2).numpy(), atol=1e-5)


def test_partial_rope_matches_qwen3_next():
    t = tiny._transformers()
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    hf_cfg = t.Qwen3NextConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                "partial_rotary_factor": 0.25})
    x = randn(rng(), (2, 21, 2, HEAD_DIM))
    pos = _positions(2, 21)
    cos, sin = mq.Qwen3NextRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.tensor(np.asarray(pos)))
    xt = torch.tensor(np.asarray(x)).transpose(1, 2)
    expected, _ = mq.apply_rotary_pos_emb(xt, xt, cos, sin)
    cfg = rope_lib.rope_from_hf(HFConfig(hf_cfg.to_dict()), head_dim=HEAD_DIM)
    assert cfg.rotary_dim == 4
    out = rope_lib.rotate(cfg, x, pos)
    assert_close(out, expected.transpose(1, 2).numpy(), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[..., 4:], np.asarray(x)[..., 4:])


def test_interleaved_rope_is_complex_rotation():
    gen = rng()
    x = randn(gen, (2, 9, 3, 12))
    pos = _positions(2, 9, offset=50)  # float64 reference: keep f32 angle rounding small
    cfg = rope_lib.RopeConfig(rotary_dim=8, theta=500.0, layout="interleaved")
    out = np.asarray(rope_lib.rotate(cfg, x, pos))
    xn = np.asarray(x, np.float64)
    z = xn[..., 0:8:2] + 1j * xn[..., 1:8:2]
    inv = 500.0 ** (-np.arange(0, 8, 2) / 8)
    z = z * np.exp(1j * np.asarray(pos)[..., None, None] * inv)
    expected = xn.copy()
    expected[..., 0:8:2], expected[..., 1:8:2] = z.real, z.imag
    assert_close(out, expected.astype(np.float32), atol=1e-5)


def test_rope_config_errors():
    with pytest.raises(ConfigError, match="rotary_dim=7 must be even"):
        rope_lib.RopeConfig(rotary_dim=7)
    with pytest.raises(ConfigError, match="rope_type='bogus'"):
        rope_lib.RopeConfig(rotary_dim=8, rope_type="bogus")
    with pytest.raises(ConfigError, match="original_max_position_embeddings is required"):
        rope_lib.RopeConfig(rotary_dim=8, rope_type="yarn", factor=2.0)
    with pytest.raises(ConfigError, match="layout='gptj'"):
        rope_lib.RopeConfig(rotary_dim=8, layout="gptj")
    with pytest.raises(ConfigError, match="rope_type='mrope2'"):
        rope_lib.rope_from_hf(HFConfig({"rope_scaling": {"type": "mrope2"}}), head_dim=8)
    with pytest.raises(ConfigError, match="short_factor has 3 entries"):
        rope_lib.RopeConfig(rotary_dim=8, rope_type="longrope", original_max_position_embeddings=8,
                            short_factor=(1.0,) * 3, long_factor=(1.0,) * 4)


def test_legacy_rope_scaling_is_parsed():
    hf = HFConfig({"rope_theta": 5e5, "max_position_embeddings": 4096,
                   "rope_scaling": {"type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 1024}})
    cfg = rope_lib.rope_from_hf(hf, head_dim=64)
    assert (cfg.rope_type, cfg.theta, cfg.factor, cfg.original_max_position_embeddings) == \
        ("yarn", 5e5, 4.0, 1024)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_norms_match_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextRMSNorm,
        Qwen3NextRMSNormGated,
    )

    gen = rng()
    x, z, w = randn(gen, (3, 5, 32), dtype), randn(gen, (3, 5, 32), dtype), randn(gen, (32,), dtype)
    tdt = torch.float32 if dtype == jnp.float32 else torch.bfloat16
    to_t = lambda a: torch.tensor(np.asarray(a.astype(jnp.float32))).to(tdt)
    plain, zc, gated = LlamaRMSNorm(32, eps=1e-5), Qwen3NextRMSNorm(32, eps=1e-5), \
        Qwen3NextRMSNormGated(32, eps=1e-5)
    with torch.no_grad():
        for m in (plain, zc, gated):
            m.weight.copy_(to_t(w))
            m.to(tdt)
        expected = [plain(to_t(x)), zc(to_t(x)), gated(to_t(x), to_t(z))]
    got = [rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5, zero_centered=True),
           gated_rms_norm(x, z, w, 1e-5)]
    for g, e in zip(got, expected):
        assert g.dtype == dtype
        assert_close(g, e.float().numpy(), dtype=dtype)


def _moe_inputs(gen, m, d, i, e, k, *, used=None):
    x = randn(gen, (m, d))
    logits = randn(gen, (m, e))
    if used is not None:  # only these experts get tokens; the others must stay untouched
        logits = jnp.where(jnp.isin(jnp.arange(e), jnp.asarray(used)), logits, -1e9)
    ids, w = moe_lib.topk_softmax(logits, k, normalize=True)
    weights = [randn(gen, (e, d, i), scale=0.2), randn(gen, (e, d, i), scale=0.2),
               randn(gen, (e, i, d), scale=0.2)]
    return x, ids, w, weights


MOE_CASES = {"M1-E8-k2": (1, 8, 2, None), "M37-E8-k2": (37, 8, 2, None),
             "M50-E16-k3-sparse": (50, 16, 3, [1, 5, 6, 14]), "M200-E1-k1": (200, 1, 1, None)}
DISPATCH_CASES = [(c, "tiles") for c in MOE_CASES] + \
    [(c, "ragged_dot") for c in ("M37-E8-k2", "M50-E16-k3-sparse")]


@pytest.mark.parametrize(("case", "dispatch"), DISPATCH_CASES,
                         ids=[f"{c}-{d}" for c, d in DISPATCH_CASES])
def test_moe_dispatch_matches_dense(case, dispatch):
    m, e, k, used = MOE_CASES[case]
    x, ids, w, (wg, wu, wd) = _moe_inputs(rng(), m, 16, 24, e, k, used=used)
    fn = jax.jit(lambda *a: moe_lib.moe_sorted(*a, dispatch=dispatch))
    expected = moe_lib.moe_dense(x, ids, w, wg, wu, wd)
    assert_close(fn(x, ids, w, wg, wu, wd), expected, atol=1e-5)


def test_moe_tiles_gradients_match_dense():
    x, ids, w, (wg, wu, wd) = _moe_inputs(rng(), 21, 8, 12, 6, 2)
    loss = lambda fn: lambda x, wg, wd: jnp.sum(jnp.sin(fn(x, ids, w, wg, wu, wd)))
    tiles = lambda *a: moe_lib.moe_sorted(*a, dispatch="tiles")

    @jax.jit
    def grads(x, wg, wd):
        return (jax.grad(loss(tiles), (0, 1, 2))(x, wg, wd),
                jax.grad(loss(moe_lib.moe_dense), (0, 1, 2))(x, wg, wd))

    for g, e in zip(*grads(x, wg, wd)):
        assert_close(g, e, atol=1e-5)


def test_moe_nan_in_unused_expert_does_not_leak():
    x, ids, w, (wg, wu, wd) = _moe_inputs(rng(), 30, 8, 12, 6, 2, used=[0, 2, 3])
    fn = jax.jit(lambda *a: moe_lib.moe_sorted(*a, dispatch="tiles"))
    expected = fn(x, ids, w, wg, wu, wd)
    got = fn(x, ids, w, wg.at[5].set(jnp.nan), wu, wd.at[5].set(jnp.nan))  # expert 5: no token
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_moe_block_matches_hf_qwen3_moe():
    from flax import nnx

    t = tiny._transformers()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    e, d, i, k = 8, 32, 16, 2
    hf_cfg = t.Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=i, num_experts=e,
                              num_experts_per_tok=k, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(hf_cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape))
    router = moe_lib.SoftmaxTopKRouter(d, e, k, normalize=True, rngs=nnx.Rngs(0))
    experts = moe_lib.SwiGLUExperts(d, i, e, rngs=nnx.Rngs(0))
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2I, D], gate rows first
    router.proj.kernel[...] = jnp.asarray(block.gate.weight.detach().numpy().T)
    experts.gate_proj[...] = jnp.asarray(gate_up[:, :i].transpose(0, 2, 1))
    experts.up_proj[...] = jnp.asarray(gate_up[:, i:].transpose(0, 2, 1))
    experts.down_proj[...] = jnp.asarray(block.experts.down_proj.detach().numpy()
                                         .transpose(0, 2, 1))
    x = randn(rng(), (2, 33, d))
    with torch.no_grad():
        expected = block(torch.tensor(np.asarray(x))).numpy()
    got = nnx.jit(lambda m, x: m(x))(moe_lib.MoE(router, experts), x)
    assert_close(got, expected, atol=1e-5)


def test_moe_shared_expert_gate():
    from flax import nnx

    from models.layers.linear import GatedMLP, Linear

    d = 16
    rngs = nnx.Rngs(1)
    block = moe_lib.MoE(moe_lib.SoftmaxTopKRouter(d, 4, 2, normalize=False, rngs=rngs),
                        moe_lib.SwiGLUExperts(d, 8, 4, dispatch="dense", rngs=rngs),
                        shared=GatedMLP(d, 8, rngs=rngs), shared_gate=Linear(d, 1, rngs=rngs))
    x = randn(rng(), (5, d))

    @nnx.jit
    def both(block, x):
        ids, w = block.router(x)
        expected = moe_lib.moe_dense(x, ids, w, block.experts.gate_proj[...],
                                     block.experts.up_proj[...], block.experts.down_proj[...]) \
            + jax.nn.sigmoid(block.shared_gate(x)) * block.shared(x)
        return block(x), expected

    assert_close(*both(block, x), atol=1e-6)


def test_layer_errors():
    with pytest.raises(ValueError, match="dispatch='bogus'"):
        moe_lib.moe_sorted(*(jnp.zeros((1, 1)),) * 6, dispatch="bogus")
    with pytest.raises(ValueError, match="hidden_act='bogus'"):
        activation("bogus")
    with pytest.raises(ConfigError, match="num_heads=6 must be divisible by .*num_kv_heads=4"):
        AttentionConfig(dim=8, num_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(ConfigError, match="qk_norm='l2'"):
        AttentionConfig(dim=8, num_heads=2, num_kv_heads=2, head_dim=8, qk_norm="l2")
    with pytest.raises(ConfigError, match="rotary_dim=16 exceeds head_dim=8"):
        AttentionConfig(dim=8, num_heads=2, num_kv_heads=2, head_dim=8,
                        rope=rope_lib.RopeConfig(rotary_dim=16))
