"""Qwen3-Next / Qwen3.5 (GDN + gated attention, dense and MoE) vs transformers, f32, 160 tokens.

Tiny random HF models (3 GDN layers + 1 full-attention layer) with every norm weight and bias
perturbed and realistic GDN decays (A in U(0.05, 1), dt_bias in U(-3, 0): per-token decay mostly
0.7-0.99, so state carried across the 64-token chunk border matters). Checkpoints are written
the way the Hub has them: Qwen3.5 through the vision-language wrapper (`text_config`,
`model.language_model.*`, `model.visual.*`), plus `mtp.*` tensors, and fused 3-D experts.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from attn.conv1d import causal_conv1d_prefill_pool, causal_conv1d_update_pool
from attn.dense import attention
from attn.gdn import gdn_decode_pool, gdn_prefill_pool
from experiments import convert
from models.config import ConfigError, HFConfig
from models.convert.loader import flat_params
from models.convert.sources import CheckpointError
from models.families import qwen3_5, qwen3_next
from models.layers.gdn import GDNState, split_qkv, zero_state
from tests.models import tiny
from tests.utils import assert_close

TEXT = dict(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=512, linear_conv_kernel_dim=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            initializer_range=0.1, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              patch_size=4, num_position_embeddings=16)
VLM = "model.language_model."
LINEAR3_FULL1 = ("linear_attention",) * 3 + ("full_attention",)

# case -> (HF model class, config builder, what our config must say, names we must ignore)
CASES = {
    # Layer 1 dense (mlp_only_layers), others MoE without renormalisation; q/k/v/o biases.
    "next-moe-mixed-bias": ("Qwen3NextForCausalLM", lambda t: t.Qwen3NextConfig(
        **TEXT, **MOE, mlp_only_layers=[1], norm_topk_prob=False, attention_bias=True),
        dict(family="qwen3_next", mlp_types=("moe", "dense", "moe", "moe"), prefix="model."),
        ("mtp.fc.weight",)),
    "qwen3_5-tied": ("Qwen3_5ForCausalLM", lambda t: t.Qwen3_5TextConfig(
        **TEXT, tie_word_embeddings=True),
        dict(family="qwen3_5", mlp_types=("dense",) * 4, prefix="model.", tie=True),
        ("mtp.fc.weight",)),
    # Hub Qwen3.5-MoE: wrapper config (text_config), language_model prefix, vision tower,
    # experts as fused gate_up_proj [E, 2I, D] / down_proj [E, D, I].
    "qwen3_5_moe-vlm-fused": ("Qwen3_5MoeForConditionalGeneration", lambda t: t.Qwen3_5MoeConfig(
        text_config={**{k: v for k, v in TEXT.items() if k != "intermediate_size"}, **MOE},
        vision_config=VISION),
        dict(family="qwen3_5", mlp_types=("moe",) * 4, prefix=VLM, fused=True),
        ("model.visual.*", "mtp.fc.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight")),
}


def _perturb(model, seed: int = 0) -> None:
    """Norm weights and biases += 0.1 N(0, 1); A in U(0.05, 1); dt_bias in U(-3, 0)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-3.0, 0.0, generator=g))
            elif p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _rewrite(path: str, fuse: bool) -> None:
    """Add `mtp.*` tensors (as real checkpoints have); optionally fuse per-expert tensors into
    HF's in-memory 3-D layout (as Hub Qwen3.5-MoE files store them)."""
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    w = load_file(file)
    w["mtp.fc.weight"] = np.ones((4, 4), np.float32)
    if fuse:
        w["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = np.ones((4, 4), np.float32)
        layers = {k.split(".experts.")[0] for k in w if ".mlp.experts." in k and "mtp" not in k}
        for p in layers:
            per = {proj: [w.pop(f"{p}.experts.{e}.{proj}.weight")
                          for e in range(MOE["num_experts"])]
                   for proj in ("gate_proj", "up_proj", "down_proj")}
            w[f"{p}.experts.gate_up_proj"] = np.concatenate(
                [np.stack(per["gate_proj"]), np.stack(per["up_proj"])], axis=1)  # [E, 2I, D]
            w[f"{p}.experts.down_proj"] = np.stack(per["down_proj"])  # [E, D, I]
    save_file(w, file, metadata={"format": "pt"})


def _save(case: str, path: str):
    """Build, perturb, save and reload the HF model of `case`; `(ids, reference logits)`."""
    import torch

    t = tiny._transformers()
    cls_name, make_cfg, _, _ = CASES[case]
    cls = getattr(t, cls_name)
    torch.manual_seed(0)
    model = cls(make_cfg(t)).eval()
    _perturb(model)
    model.save_pretrained(path)
    model = cls.from_pretrained(path, attn_implementation="eager").eval()
    ids = tiny.token_ids(2, 160)
    ref = tiny.hf_logits(model, ids)
    _rewrite(path, fuse=case.endswith("fused"))
    return ids, ref


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            path = str(tmp_path_factory.mktemp(case))
            cache[case] = (path, *_save(case, path))
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, saved):
    path, ids, expected = saved(case)
    model, report = models.from_pretrained(path, progress=False, return_report=True)
    _, _, want, ignored = CASES[case]
    cfg = model.cfg
    assert type(model).family == want["family"]
    assert cfg.layer_types == LINEAR3_FULL1 and cfg.mlp_types == want["mlp_types"]
    assert cfg.checkpoint_prefix == want["prefix"]
    assert cfg.attention.rope.rotary_dim == 8  # 32 * 0.25
    assert cfg.tie_embeddings == want.get("tie", False)
    if "fused" in want:
        assert cfg.moe.fused_experts == want["fused"]
    assert set(report.consumed.values()) == {1}
    for pattern in ignored:  # the vision tower and mtp heads, nothing else
        assert any(n == pattern or (pattern.endswith("*") and n.startswith(pattern[:-1]))
                   for n in report.ignored), (pattern, report.ignored)
    assert all(n.startswith(("model.visual.", "mtp.")) for n in report.ignored)
    got = model(jnp.asarray(ids, jnp.int32))
    assert got.shape == expected.shape and got.dtype == jnp.float32
    print(f"{case}: max |logit diff| = {np.abs(np.asarray(got) - expected).max():.2e}")
    assert_close(got, expected, atol=tiny.TOLERANCE, rtol=0)


@dataclasses.dataclass(frozen=True)
class _CacheAttend:
    """Engine-style attend: attention layers write k, v into a contiguous `[B, S, K, H]` cache at
    `offset`; GDN layers either carry `GDNState` (`pools=False`: the default `gdn_mix` with
    explicit state) or run on conv / ssm slot pools through `gdn_mix` (`pools=True`)."""

    offset: jax.Array  # [B] int32 tokens already processed
    slots: jax.Array  # [B] int32 slot of each row
    pools: bool = False

    def __call__(self, spec, qkv, state):
        k_cache, v_cache = state
        t = qkv.q.shape[1]
        write = jax.vmap(lambda c, x, o: jax.lax.dynamic_update_slice_in_dim(c, x, o, 0))
        k_cache = write(k_cache, qkv.k, self.offset)
        v_cache = write(v_cache, qkv.v, self.offset)
        o, _ = attention(qkv.q, k_cache, v_cache, causal=True, scale=spec.scale,
                         q_offset=self.offset, kv_lengths=self.offset + t)
        return o, (k_cache, v_cache)

    @property
    def gdn_mix(self):
        return self._pool_mix if self.pools else None

    def _pool_mix(self, spec, inputs, state):
        conv_pool, ssm_pool = state
        has_init = self.offset > 0  # a fresh request ignores whatever its slot holds
        if inputs.x.shape[1] == 1:
            y, conv_pool = causal_conv1d_update_pool(
                inputs.x[:, 0], conv_pool, self.slots, inputs.conv_weight, activation="silu",
                has_initial_state=has_init)
            q, k, v = split_qkv(spec, y[:, None])
            o, ssm_pool = gdn_decode_pool(q, k, v, inputs.g, inputs.beta, ssm_pool, self.slots,
                                          has_initial_state=has_init, scale=spec.scale,
                                          use_qk_l2norm=True)
        else:
            y, conv_pool = causal_conv1d_prefill_pool(
                inputs.x, conv_pool, self.slots, inputs.conv_weight, activation="silu",
                has_initial_state=has_init)
            q, k, v = split_qkv(spec, y)
            o, ssm_pool = gdn_prefill_pool(q, k, v, inputs.g, inputs.beta, ssm_pool, self.slots,
                                           has_initial_state=has_init, scale=spec.scale,
                                           use_qk_l2norm=True, chunk_size=spec.chunk_size)
        return o, (conv_pool, ssm_pool)


@nnx.jit(static_argnames=("pools",))
def _cached_step(model, ids, offset, slots, states, *, pools):
    positions = offset[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)
    hidden, states = model.forward(ids, positions, attend=_CacheAttend(offset, slots, pools),
                                   states=states)
    return model.logits(hidden), states


@pytest.mark.parametrize("pools", [False, True], ids=["gdn-state", "slot-pools"])
def test_cached_prefill_and_decode_equal_full_forward(pools, saved):
    """Prefill 75 + 75 tokens (each crossing a 64-token chunk border, the second from carried
    conv + ssm state), then 10 one-token decode steps: the same logits as the full forward."""
    path, ids, expected = saved("next-moe-mixed-bias")
    model = models.from_pretrained(path, progress=False)
    a = model.cfg.attention
    slots = jnp.asarray([3, 1], jnp.int32)  # rows live in slots 3 and 1 of a 5-slot pool
    states = []
    for layer in model.layers:
        if model.cfg.layer_types[layer.mixer.spec.layer] == "full_attention":
            shape = (2, 160, a.num_kv_heads, a.head_dim)
            states.append((jnp.zeros(shape), jnp.zeros(shape)))
        elif pools:  # NaN everywhere: stale slots and the null slot must not leak in
            fresh = zero_state(layer.mixer.spec, 5)
            states.append(jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tuple(fresh)))
        else:
            states.append(zero_state(layer.mixer.spec, 2))
    ids = jnp.asarray(ids, jnp.int32)
    chunks = [(0, 75), (75, 150)] + [(t, t + 1) for t in range(150, 160)]
    got = []
    for start, stop in chunks:
        offset = jnp.full((2,), start, jnp.int32)
        logits, states = _cached_step(model, ids[:, start:stop], offset, slots, states,
                                      pools=pools)
        got.append(logits)
    assert_close(jnp.concatenate(got, axis=1), expected, atol=tiny.TOLERANCE, rtol=0)
    if not pools:
        gdn_states = [s for s in states if isinstance(s, GDNState)]
        assert len(gdn_states) == 3 and gdn_states[0].ssm.dtype == jnp.float32


def test_convert_cli_round_trip(saved, tmp_path):
    path, _, _ = saved("qwen3_5_moe-vlm-fused")
    dst = tmp_path / "ckpt"
    assert convert.main([path, str(dst), "--quiet"]) == 0
    model = models.load(dst)
    assert type(model).family == "qwen3_5" and model.cfg == models.from_pretrained(
        path, progress=False).cfg
    want = flat_params(nnx.state(models.from_pretrained(path, progress=False)))
    got = flat_params(nnx.state(model))
    assert want.keys() == got.keys()
    for name, var in want.items():  # bitwise: the logits test covers from_pretrained's values
        np.testing.assert_array_equal(np.asarray(got[name][...]), np.asarray(var[...]), name)


def test_packed_segments_are_refused(saved):
    path, ids, _ = saved("qwen3_5-tied")
    model = models.from_pretrained(path, progress=False)
    ids = jnp.asarray(ids[:1, :8], jnp.int32)
    with pytest.raises(NotImplementedError, match="layer 0: Gated DeltaNet.*segment_ids"):
        model(ids, segment_ids=jnp.zeros_like(ids))


def _text_config(**overrides) -> HFConfig:
    data = {**TEXT, **MOE, "architectures": ["Qwen3NextForCausalLM"], **overrides}
    return HFConfig(data, source="test/config.json")


def test_config_defaults_follow_transformers():
    """No `layer_types`: every 4th layer is full; no partial_rotary_factor: 0.25; no
    `num_experts`: 512 (HF's Qwen3-Next default)."""
    data = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    data.update(num_hidden_layers=8, rope_theta=1e6, decoder_sparse_step=2)
    cfg = qwen3_next.config_from_hf(HFConfig(data, source="test/config.json"))
    assert cfg.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    assert cfg.mlp_types == ("dense", "moe") * 4 and cfg.moe.num_experts == 512
    assert cfg.attention.rope.rotary_dim == 8 and cfg.attention.rope.theta == 1e6
    assert cfg.attention.qk_norm == "zero_centered" and cfg.gdn.projection_layout == "grouped"
    dense = qwen3_5.config_from_hf(HFConfig(  # the wrapper's own tie flag wins
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": True,
         "text_config": {**TEXT, "tie_word_embeddings": False}}, source="test/config.json"))
    assert dense.checkpoint_prefix == VLM and dense.mlp_types == ("dense",) * 4
    assert dense.gdn.projection_layout == "split" and dense.moe is None and dense.tie_embeddings
    moe = qwen3_5.config_from_hf(HFConfig(
        {**TEXT, **MOE, "architectures": ["Qwen3_5MoeForCausalLM"], "norm_topk_prob": False},
        source="test/config.json"))
    assert moe.checkpoint_prefix == "model." and moe.mlp_types == ("moe",) * 4
    assert moe.moe.normalize and not moe.moe.fused_experts  # Qwen3.5 always renormalises


@pytest.mark.parametrize("overrides, match", [
    (dict(linear_num_value_heads=3), r"num_v_heads=3 must be divisible by .*num_k_heads=2"),
    (dict(hidden_act="gelu"), r"act='gelu': the GDN conv supports only 'silu'"),
    (dict(num_experts_per_tok=5), r"top_k=5 exceeds num_experts=4"),
    (dict(layer_types=["linear_attention"] * 3), r"layer_types has 3 entries; num_layers=4"),
    (dict(layer_types=["mamba"] * 4), r"layer_types\[i\]='mamba' must be one of"),
    (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 must be positive"),
    (dict(linear_conv_kernel_dim=1), r"conv_width=1 must be >= 2"),
], ids=["gva-divisibility", "conv-act", "top-k", "layer-count", "layer-kind", "sparse-step",
        "conv-width"])
def test_bad_config_is_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        qwen3_next.config_from_hf(_text_config(**overrides))


def test_bad_wrapper_config_is_named():
    with pytest.raises(ConfigError, match=r"text_config=3 must be an object"):
        qwen3_5.config_from_hf(HFConfig({"architectures": ["Qwen3_5ForCausalLM"],
                                         "text_config": 3}, source="c.json"))


def test_missing_and_misshaped_tensors_are_named(saved, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _, _ = saved("qwen3_5-tied")
    w = load_file(os.path.join(path, "model.safetensors"))
    del w["model.layers.2.linear_attn.A_log"]
    w["model.layers.0.linear_attn.conv1d.weight"] = np.ones((128, 1, 3), np.float32)
    save_file(w, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=r"(?s)missing tensors.*layers\.2\.linear_attn\."
                       r"A_log.*mis-shaped.*conv1d\.weight.*\[128, 1, 3\]"):
        models.from_pretrained(tmp_path, progress=False)
