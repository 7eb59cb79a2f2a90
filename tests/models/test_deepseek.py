"""DeepSeek-V3 / V2-Lite vs transformers: logits (f32, 160 tokens, YaRN), absorbed MLA with a paged
latent cache (prefill chunks + decode) vs the full forward, FP8 `weight_scale_inv` checkpoints,
routers, strict loading and the convert CLI."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

import models
from attn.mla import absorb_query, expand_output, mla_absorbed_attention, mla_paged_decode
from experiments import convert
from kv.mla import create_latent_pool, gather_latent, latent_slot_mapping, write_latent
from models.config import ConfigError, HFConfig
from models.convert import registry
from models.convert.loader import abstract_model, flat_params
from models.families import deepseek
from models.layers import deepseek_moe
from tests.models import tiny
from tests.utils import assert_close, rng

BASE = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
            initializer_range=0.1, rms_norm_eps=1e-5)


def _yarn(**kw):  # factor 4 over 64 original positions: the 160 tokens run past it
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1, **kw}


CASES = {
    # Dense layer 0, MoE layers 1-2: sigmoid + correction bias, 4 groups keep 2, renormalised,
    # scaled; q LoRA; attention biases; interleaved rope; cos/sin factor != 1 (mscale ratio);
    # a large rms_norm_eps, which q_a / kv_a norms must not use (their eps is fixed at 1e-6).
    "v3-moe": ("v3", dict(q_lora_rank=32, rms_norm_eps=0.02, n_shared_experts=1, n_group=4,
                          topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                          rope_interleave=True, attention_bias=True,
                          rope_parameters=_yarn(mscale=1.0, mscale_all_dim=0.8))),
    # V2-Lite: q_proj (no q LoRA), complex rope, softmax greedy router, 2 shared experts, MLP
    # biases, mscale = mscale_all_dim (cos/sin factor 1, softmax scale mscale²).
    "v2-lite-moe": ("v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                               routed_scaling_factor=1.5, mlp_bias=True,
                               rope_parameters=_yarn(mscale=0.707, mscale_all_dim=0.707))),
    # Dense only; rotate-half rope (rope_interleave False); YaRN attention factor 0.1 ln f + 1.
    "v3-dense": ("v3", dict(q_lora_rank=32, first_k_dense_replace=3, rope_interleave=False,
                            rope_parameters=_yarn(mscale_all_dim=1.0))),
}


def _hf_classes(kind):
    t = tiny._transformers()
    return {"v3": (t.DeepseekV3ForCausalLM, t.DeepseekV3Config),
            "v2": (t.DeepseekV2ForCausalLM, t.DeepseekV2Config)}[kind]


def _save(kind, path, *, seed=0, **overrides):
    """Build, perturb (norms, biases, correction bias) and save a tiny model; reference logits
    from the model reloaded from disk with eager attention."""
    model_cls, config_cls = _hf_classes(kind)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **overrides})).eval()
    tiny.perturb(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    model = model_cls.from_pretrained(path, attn_implementation="eager").eval()
    ids = tiny.token_ids(2, 160)
    return ids, tiny.hf_logits(model, ids)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`{case: (dir, ids, hf_logits)}` for every entry of CASES."""
    out = {}
    for case, (kind, overrides) in CASES.items():
        path = str(tmp_path_factory.mktemp(case))
        out[case] = (path, *_save(kind, path, **overrides))
    return out


@pytest.fixture(scope="module")
def loaded(saved):
    """`{case: model}` loaded once through `models.from_pretrained`."""
    return {case: models.from_pretrained(path, progress=False) for case, (path, *_) in
            saved.items()}


def _params(model):
    return {k: np.asarray(v[...]) for k, v in flat_params(nnx.state(model)).items()}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, saved, loaded):
    path, ids, expected = saved[case]
    model, report = models.from_pretrained(path, progress=False, return_report=True)
    assert type(model).family == {"v3": "deepseek_v3", "v2": "deepseek_v2"}[CASES[case][0]]
    assert set(report.consumed.values()) == {1} and not report.ignored
    mlp = model.cfg.mlp_types
    assert mlp == (("dense",) * 3 if case == "v3-dense" else ("dense", "moe", "moe"))
    got = loaded[case](jnp.asarray(ids, jnp.int32))
    assert got.shape == expected.shape and got.dtype == jnp.float32
    assert_close(got, expected, atol=tiny.TOLERANCE, rtol=0)


@dataclasses.dataclass(frozen=True)
class _LatentCacheAttend:
    """Engine-style MLA attend: writes this chunk's `[c_kv ‖ k_pe]` into a paged latent pool by
    slot mapping, then attends with absorbed queries: prefill chunks over the gathered latent
    (`mla_absorbed_attention`), one-token decode steps with `mla_paged_decode` (2 splits)."""

    offset: jax.Array  # [B] tokens already cached
    table: jax.Array  # [B, max_pages] page ids

    def mla_attend(self, spec, proj, pool):
        b, t = proj.c_kv.shape[:2]
        slots = latent_slot_mapping(self.table, self.offset, jnp.full((b,), t, jnp.int32),
                                    num_tokens=t, page_size=pool.page_size)
        pool = write_latent(pool, proj.c_kv, proj.k_pe, slots)
        lengths = self.offset + t
        if t == 1:
            q_lat = absorb_query(proj.q_nope[:, 0], proj.w_uk)
            o_lat, _ = mla_paged_decode(q_lat, proj.q_pe[:, 0], pool.pages, self.table, lengths,
                                        kv_lora_rank=spec.kv_lora_rank, scale=spec.scale,
                                        num_splits=2)
            return expand_output(o_lat, proj.w_uv)[:, None], pool
        latent = gather_latent(pool, self.table)  # [B, S, L + R]
        lr = spec.kv_lora_rank
        o, _ = mla_absorbed_attention(proj.q_nope, proj.q_pe, latent[..., :lr], latent[..., lr:],
                                      proj.w_uk, proj.w_uv, scale=spec.scale,
                                      q_offset=self.offset, kv_lengths=lengths)
        return o, pool


@nnx.jit
def _cached_step(model, ids, offset, table, pools):
    positions = offset[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)
    hidden, pools = model.forward(ids, positions, attend=_LatentCacheAttend(offset, table),
                                  states=pools)
    return model.logits(hidden), pools


def test_absorbed_latent_cache_prefill_and_decode_equal_full_forward(saved, loaded):
    _, ids, expected = saved["v3-moe"]
    model = loaded["v3-moe"]
    a = model.cfg.attention
    page, pages_per_row = 16, 10  # 160 tokens per row
    # Non-contiguous, interleaved pages; page 0 is the null page and never in a table.
    table = jnp.asarray(1 + rng(3).permutation(2 * pages_per_row).reshape(2, pages_per_row),
                        jnp.int32)
    pools = [create_latent_pool(num_pages=1 + 2 * pages_per_row, page_size=page,
                                kv_lora_rank=a.kv_lora_rank, rope_dim=a.qk_rope_head_dim,
                                dtype=jnp.float32) for _ in model.layers]
    # Poison every page: only slots written before they are read may reach the output.
    pools = [p.replace(pages=jnp.full_like(p.pages, jnp.nan)) for p in pools]
    ids = jnp.asarray(ids, jnp.int32)
    chunks = [(0, 75), (75, 150)] + [(t, t + 1) for t in range(150, 160)]  # prefill, decode
    got = []
    for start, stop in chunks:
        offset = jnp.full((2,), start, jnp.int32)
        logits, pools = _cached_step(model, ids[:, start:stop], offset, table, pools)
        got.append(logits)
    assert_close(jnp.concatenate(got, axis=1), expected, atol=tiny.TOLERANCE, rtol=0)
    for pool in pools:  # the attend above really ran: every token's latent row was written
        pages = np.asarray(pool.pages)
        assert np.isfinite(pages[1:]).all() and np.isnan(pages[0]).all()


def test_full_forward_refuses_packed_sequences(loaded):
    ids = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(NotImplementedError, match="MLA layers do not support packed"):
        loaded["v3-dense"](ids, segment_ids=jnp.zeros((1, 8), jnp.int32))


def _fp8_quantize(w, block):
    """Block-wise e4m3 quantisation as DeepSeek stores it: `w ≈ q · scale_inv[i//bo, j//bi]`."""
    (rows, cols), (bo, bi) = w.shape, block
    so, si = -(-rows // bo), -(-cols // bi)
    padded = np.zeros((so * bo, si * bi), np.float32)
    padded[:rows, :cols] = np.abs(w)
    scale = np.maximum(padded.reshape(so, bo, si, bi).max(axis=(1, 3)), 1e-12) / 448.0
    full = np.repeat(np.repeat(scale, bo, 0), bi, 1)[:rows, :cols]
    q = np.clip(w / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scale.astype(np.float32)


def _fp8_tensor(q):
    return torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)


def _write_checkpoint(src, dst, tensors, config_update=None):
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config_update or {})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))


def _read_checkpoint(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_fp8_weight_scale_inv_checkpoint(saved, loaded, tmp_path):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    src, ids, _ = saved["v3-moe"]
    block = [32, 24]  # not square, and partial blocks along both axes (e.g. 24 x 64 kv_a)
    skip = ["lm_head", "kv_b_proj"]
    fp8, deq = {}, {}
    for name, w in _read_checkpoint(src).items():
        module = name.removesuffix(".weight")
        if (name.startswith("model.layers.") and name.endswith(".weight") and w.ndim == 2
                and not name.endswith("mlp.gate.weight") and not module.endswith("kv_b_proj")):
            q, s = _fp8_quantize(w.numpy(), block)
            fp8[name], fp8[f"{module}.weight_scale_inv"] = _fp8_tensor(q), torch.from_numpy(s)
            deq[name] = _dequantize_fp8_weight(_fp8_tensor(q), torch.from_numpy(s), block,
                                               torch.float32).contiguous()
        else:
            fp8[name] = deq[name] = w
    assert sum(k.endswith("weight_scale_inv") for k in fp8) == 3 * 4 + 3 + 2 * (3 * 8 + 3)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": block, "modules_to_not_convert": skip}
    _write_checkpoint(src, tmp_path / "fp8", fp8, {"quantization_config": quant})
    _write_checkpoint(src, tmp_path / "deq", deq)

    model, report = models.from_pretrained(tmp_path / "fp8", progress=False, return_report=True)
    assert model.cfg.fp8_block_size == (32, 24) and model.cfg.fp8_skip == tuple(skip)
    assert set(report.consumed) == set(fp8) and set(report.consumed.values()) == {1}
    reference = models.from_pretrained(tmp_path / "deq", progress=False)
    got, want = _params(model), _params(reference)
    assert got.keys() == want.keys()
    for k in got:  # dequantisation at load = HF's dequantisation, bit for bit
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert not np.array_equal(want["layers/0/mixer/o_proj/kernel"],
                              _params(loaded["v3-moe"])["layers/0/mixer/o_proj/kernel"])
    # Logits of the dequantised weights vs transformers on the same weights.
    hf = _hf_classes("v3")[0].from_pretrained(tmp_path / "deq", attn_implementation="eager")
    assert_close(reference(jnp.asarray(ids, jnp.int32)), tiny.hf_logits(hf.eval(), ids),
                 atol=tiny.TOLERANCE, rtol=0)

    bad = dict(fp8)
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    bad[name] = bad[name].T.contiguous()
    _write_checkpoint(src, tmp_path / "bad", bad, {"quantization_config": quant})
    with pytest.raises(models.CheckpointError, match=r"mis-shaped(.|\n)*kv_a_proj_with_mqa"):
        models.from_pretrained(tmp_path / "bad", progress=False)


def test_dequantize_fp8_block_matches_transformers():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = rng(0).standard_normal((300, 200)).astype(np.float32)
    q, s = _fp8_quantize(w, (128, 128))
    got = deepseek.dequantize_fp8_block(jnp.asarray(q.astype(np.float32)), jnp.asarray(s),
                                        block=(128, 128))
    want = _dequantize_fp8_weight(_fp8_tensor(q), torch.from_numpy(s), [128, 128], torch.float32)
    np.testing.assert_array_equal(np.asarray(got), want.numpy())
    assert_close(got, w, atol=0.07 * np.abs(w).max(), rtol=0)  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match=r"scale_inv.shape=\(2, 3\) must be \(3, 2\)"):
        deepseek.dequantize_fp8_block(jnp.asarray(q.astype(np.float32)), jnp.zeros((2, 3)),
                                      block=(128, 128))


def test_strict_loading_ignores_mtp_only(saved, tmp_path):
    src = saved["v3-moe"][0]
    tensors = _read_checkpoint(src)
    extra = {"model.layers.3.eh_proj.weight": torch.ones(4, 4),
             "model.layers.3.mlp.experts.0.up_proj.weight": torch.ones(4, 4),
             "mtp.0.norm.weight": torch.ones(4)}
    _write_checkpoint(src, tmp_path / "mtp", {**tensors, **extra})
    _, report = models.from_pretrained(tmp_path / "mtp", progress=False, return_report=True)
    assert sorted(report.ignored) == sorted(extra)

    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    _write_checkpoint(src, tmp_path / "nobias", {k: v for k, v in tensors.items() if k != bias})
    with pytest.raises(models.CheckpointError, match=rf"missing tensors(.|\n)*{bias}"):
        models.from_pretrained(tmp_path / "nobias", progress=False)
    stray = "model.layers.1.self_attn.q_proj.weight"
    _write_checkpoint(src, tmp_path / "stray", {**tensors, stray: torch.ones(4, 4)})
    with pytest.raises(models.CheckpointError, match=rf"unexpected tensors(.|\n)*{stray}"):
        models.from_pretrained(tmp_path / "stray", progress=False)


def test_convert_cli_round_trip(saved, loaded, tmp_path):
    path = saved["v2-lite-moe"][0]
    assert convert.main([path, str(tmp_path / "ckpt"), "--quiet"]) == 0
    back, model = models.load(tmp_path / "ckpt"), loaded["v2-lite-moe"]
    assert type(back) is deepseek.DeepseekV2ForCausalLM and back.cfg == model.cfg
    got, want = _params(back), _params(model)  # the model whose logits match transformers
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_bfloat16_model_keeps_float32_correction_bias(loaded):
    family = registry.get_family("deepseek_v3")
    params = flat_params(nnx.state(abstract_model(family, loaded["v3-moe"].cfg, jnp.bfloat16)))
    assert params["layers/1/mlp/router/e_score_correction_bias"].dtype == jnp.float32
    assert params["layers/1/mixer/kv_b_proj/kernel"].dtype == jnp.bfloat16


def _combine(ids, weights, num_experts):
    """Dense `[M, E]` routing weights (order of the k choices does not matter)."""
    out = np.zeros((ids.shape[0], num_experts), np.float32)
    np.put_along_axis(out, np.asarray(ids, np.int64), np.asarray(weights, np.float32), axis=1)
    return out


@pytest.mark.parametrize("n_group,topk_group,normalize", [(4, 2, True), (1, 1, False),
                                                          (8, 3, True)],
                         ids=["g4-keep2-norm", "nogroup", "g8-keep3-norm"])
def test_v3_router_matches_transformers(n_group, topk_group, normalize):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    t = tiny._transformers()
    cfg = t.DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                             n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                             topk_group=topk_group, norm_topk_prob=normalize,
                             routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=g))
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        _, w_hf, ids_hf = router(x)
    logits = jnp.asarray(x.numpy()) @ jnp.asarray(router.weight.detach().numpy()).T
    ids, w = deepseek_moe.noaux_topk(logits, jnp.asarray(router.e_score_correction_bias.numpy()),
                                     4, n_group=n_group, topk_group=topk_group,
                                     normalize=normalize, scaling=2.5)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32
    assert_close(_combine(ids, w, 16), _combine(ids_hf.numpy(), w_hf.numpy(), 16), atol=1e-6,
                 rtol=0)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_router_matches_transformers(method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    t = tiny._transformers()
    cfg = t.DeepseekV2Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16,
                             num_experts_per_tok=6, topk_method=method, n_group=4, topk_group=2,
                             routed_scaling_factor=1.7)
    router = DeepseekV2TopkRouter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        _, w_hf, ids_hf = router(x)
    logits = jnp.asarray(x.numpy()) @ jnp.asarray(router.weight.detach().numpy()).T
    ids, w = deepseek_moe.softmax_group_topk(logits, 6, method=method, n_group=4, topk_group=2,
                                             scaling=1.7)
    assert_close(_combine(ids, w, 16), _combine(ids_hf.numpy(), w_hf.numpy(), 16), atol=1e-5,
                 rtol=0)  # f32 softmax rounding
    if method == "group_limited_greedy":  # 6 of the 8 experts in the 2 kept groups
        assert (np.asarray(w) > 0).sum(-1).max() == 6


def _hf(**fields):
    return HFConfig({**BASE, **fields}, source="cfg.json")


def test_config_parsing():
    v3 = deepseek.config_from_hf_v3(_hf(q_lora_rank=32, n_group=2, topk_group=1))
    assert v3.moe.router == "noaux_tc" and v3.moe.normalize and v3.moe.n_group == 2
    assert v3.attention.deinterleave and v3.attention.rope.layout == "neox"
    assert v3.mlp_types == ("dense", "moe", "moe")
    v2 = deepseek.config_from_hf_v2(_hf(q_lora_rank=None, norm_topk_prob=True))
    assert v2.attention.q_lora_rank is None and v2.attention.rope.layout == "interleaved"
    assert v2.moe.router == "greedy" and not v2.moe.normalize  # HF 5 ignores V2 norm_topk_prob
    freq = deepseek.config_from_hf_v2(_hf(num_hidden_layers=5, moe_layer_freq=2))
    assert freq.mlp_types == ("dense", "dense", "moe", "dense", "moe")
    dense = deepseek.config_from_hf_v3(_hf(n_routed_experts=None))
    assert dense.moe is None and set(dense.mlp_types) == {"dense"}
    legacy = deepseek.config_from_hf_v2(HFConfig({
        **BASE, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "mscale": 0.707, "mscale_all_dim": 0.707}}))
    m = 0.1 * 0.707 * np.log(40) + 1
    assert legacy.attention.scale == pytest.approx(24 ** -0.5 * m * m)
    assert type(deepseek.DeepseekConfig.from_dict(v3.to_dict())) is deepseek.DeepseekConfig
    assert deepseek.DeepseekConfig.from_dict(v3.to_dict()) == v3


@pytest.mark.parametrize("fields,match", [
    (dict(quantization_config={"quant_method": "gptq"}), "quant_method='gptq' is not supported"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": None}),
     "per-tensor FP8 scales are not supported"),
    (dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported"),
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, num_experts_per_tok=3),
     "top_k=3 exceeds the 2 experts"),
    (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1),
     "num_experts=8 must be divisible by n_group=3"),
    (dict(num_experts_per_tok=None), "num_experts_per_tok"),
    (dict(moe_layer_freq=0), "moe_layer_freq=0 must be positive"),
], ids=["quant-method", "per-tensor-fp8", "v2-noaux", "group-capacity", "groups", "no-top-k",
        "freq"])
def test_config_errors(fields, match):
    with pytest.raises(ConfigError, match=match):
        deepseek.config_from_hf_v2(_hf(**fields))


def test_v3_group_of_one_expert_is_refused():
    with pytest.raises(ConfigError, match="at least 2"):
        deepseek.config_from_hf_v3(_hf(n_group=8, topk_group=2))


def test_skip_patterns():
    cfg = deepseek.config_from_hf_v3(_hf(n_group=2, topk_group=1, quantization_config={
        "quant_method": "fp8", "modules_to_not_convert": ["model.layers.1", "o_proj",
                                                          r"model\.layers\.\d+\.mlp\.shared.*"]}))
    assert cfg.fp8_block("model.layers.0.self_attn.q_a_proj") == (128, 128)
    assert cfg.fp8_block("model.layers.1.self_attn.q_a_proj") is None
    assert cfg.fp8_block("model.layers.11.self_attn.q_a_proj") == (128, 128)
    assert cfg.fp8_block("model.layers.0.self_attn.o_proj") is None
    assert cfg.fp8_block("model.layers.2.mlp.shared_experts.up_proj") is None


def test_missing_field_is_named():
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        deepseek.config_from_hf_v3(HFConfig({"num_hidden_layers": 2}, source="cfg.json"))
