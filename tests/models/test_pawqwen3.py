"""PawQwen3 (elastic Qwen3) against transformers' Qwen3 and independent numpy / torch replicas.

transformers has no PawQwen3 class, so the checkpoints are tiny random HF Qwen3 models with the
PawQwen3 router tensors and config fields added (the LCM-Lab layout). The references are built
here from the seed spec (§1.3 routing, §1.5 per-head masks), not from our modules: routing in
numpy, attention as dense softmax with explicit per-head token masks inside HF's own Qwen3
forward (a registered attention function). Only the XAttention block mask comes from
`attn.xattention.xattn_estimate`, which has its own tests.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import models
from attn.xattention import xattn_estimate
from models.config import ConfigError, HFConfig
from models.convert import CheckpointError
from models.families import pawqwen3 as paw
from tests.models import tiny
from tests.utils import assert_close

LAYERS, K, N, HEAD_DIM = 2, 2, 4, 16  # tiny.base_config("qwen3")
CODES = {"full": 0, "xattn": 1, "streaming": -1}
ROUTER = "model.layers.{i}.self_attn.mask_allocator."
LINEARS = {"cls_feat_extractor": ((0, HEAD_DIM, 4 * HEAD_DIM), (2, 4 * HEAD_DIM, HEAD_DIM)),
           "cls_router_head_agnostic": ((0, HEAD_DIM, 4 * HEAD_DIM), (2, 4 * HEAD_DIM, HEAD_DIM),
                                        (4, HEAD_DIM, 2))}
TRAINING_EXTRAS = ("model.sparsity_lambda_1", "model.sparsity_lambda_2",
                   "model.layers.0.self_attn.mask_allocator.log_temp")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One tiny HF Qwen3 checkpoint `(dir, eager hf model, ids [2, 160], logits)` for all tests."""
    path = tmp_path_factory.mktemp("qwen3")
    model, ids, logits = tiny.save_tiny("qwen3", str(path), ids=tiny.token_ids(2, 160))
    return path, model, ids, logits


# ---------------------------------------------------------------------------------------------
# Independent replicas (numpy, float64)


def np_pool(k_pre, length):
    """§1.3 boundary pooling of one request's `[T, K, H]` keys: mean(concat(first n, last n))."""
    x = k_pre[:length]
    n = min(100, length)
    return np.concatenate([x[:n], x[length - n:]], axis=0).mean(axis=0)


def np_router_logits(w, i, pooled):
    """§1.3 router MLP on `[..., H]` from HF-named tensors `w` of layer `i`."""
    def lin(x, name):
        p = ROUTER.format(i=i) + name
        return x @ w[p + ".weight"].astype(np.float64).T + w[p + ".bias"]

    def silu(x):
        return x / (1.0 + np.exp(-x))

    h = lin(silu(lin(pooled, "cls_feat_extractor.0")), "cls_feat_extractor.2")
    h = silu(lin(silu(lin(h, "cls_router_head_agnostic.0")), "cls_router_head_agnostic.2"))
    return lin(h, "cls_router_head_agnostic.4")


def np_static_decisions(log_alpha):
    """HF's deterministic hard-concrete gate (zero the round(E[#zeros]) smallest) as 0 / 1."""
    x01 = 0.1 / 1.2
    p_zero = np.clip(1 / (1 + np.exp(-((2 / 3) * np.log(x01 / (1 - x01)) - log_alpha))),
                     1e-6, 1 - 1e-6)
    num_zeros = int(np.round(p_zero.sum()))
    z = np.ones(len(log_alpha), np.int32)
    z[np.argsort(log_alpha, kind="stable")[:num_zeros]] = 0
    return z


def capture_k_pre(hf_model, ids):
    """Per layer, HF's keys after k_norm and before RoPE: `[B, T, K, H]` float64."""
    import torch

    store, hooks = {}, []
    for i, layer in enumerate(hf_model.model.layers):
        hooks.append(layer.self_attn.k_norm.register_forward_hook(
            lambda mod, inp, out, i=i: store.__setitem__(i, out.detach().double().numpy())))
    try:
        with torch.no_grad():
            hf_model(torch.as_tensor(ids))
    finally:
        for h in hooks:
            h.remove()
    return store


def token_masks(modes, block_mask, length, cfg):
    """§1.5 per-head visibility `[B, N, T, T]` of a request of `length` tokens (q_len == kv_len).

    full: causal; streaming: key blocks `< sink_blocks` or within `local_blocks` of the query's
    block (diagonal included); xattn: the XAttention mask's block; always token-causal.
    """
    t = np.arange(length)
    qb, kb = t[:, None] // cfg["block_size"], t[None, :] // cfg["block_size"]
    causal = t[None, :] <= t[:, None]
    stream = (kb < cfg["sink_blocks"]) | ((qb - cfg["local_blocks"] < kb) & (kb <= qb))
    out = np.zeros(modes.shape + (length, length), bool)
    for b, n in np.ndindex(modes.shape):
        mode = modes[b, n]
        vis = (np.ones_like(causal) if mode == 0 else stream if mode == -1
               else block_mask[b, n][qb, kb])
        out[b, n] = vis & causal
    return out


def reference_logits(hf_model, ids, cfg, decide):
    """HF Qwen3's forward with each layer's attention replaced by masked dense attention.

    `decide(layer, pooled [B, K, H]) -> z [B, K]`. Returns `(logits, z [L, B, K])`.
    """
    import torch
    from transformers import AttentionInterface

    k_pre, decisions = {}, {}
    hooks = [layer.self_attn.k_norm.register_forward_hook(
        lambda mod, inp, out, i=i: k_pre.__setitem__(i, out.detach().double().numpy()))
        for i, layer in enumerate(hf_model.model.layers)]

    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        layer = module.layer_idx
        q, k, v = (x.detach().double().numpy() for x in (query, key, value))  # [B, N|K, T, H]
        b, _, t, _ = q.shape
        pooled = np.stack([np_pool(k_pre[layer][r], t) for r in range(b)])
        z = decide(layer, pooled)
        decisions[layer] = z
        modes = np.repeat(np.where(z == 1, CODES[cfg["retrieval_mode"]],
                                   CODES[cfg["toggle_type"]]), N // K, axis=1)
        _, block_mask = xattn_estimate(
            jnp.asarray(query.numpy().transpose(0, 2, 1, 3)),
            jnp.asarray(key.numpy().transpose(0, 2, 1, 3)), block_size=cfg["block_size"],
            stride=cfg["xattn_stride"], threshold=cfg["xattn_threshold"])
        mask = token_masks(modes, np.asarray(block_mask), t, cfg)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
        s = np.where(mask, np.einsum("bnth,bnsh->bnts", q, k) * scaling, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("bnts,bnsh->btnh", p / p.sum(-1, keepdims=True), v)
        return torch.from_numpy(o.astype(np.float32)), None

    AttentionInterface.register("pawqwen3_reference", attend)
    hf_model.set_attn_implementation("pawqwen3_reference")
    try:
        logits = tiny.hf_logits(hf_model, ids)
    finally:
        hf_model.set_attn_implementation("eager")
        for h in hooks:
            h.remove()
    return logits, np.stack([decisions[i] for i in range(LAYERS)])


# ---------------------------------------------------------------------------------------------
# Checkpoint writing


def router_tensors(seed, *, forced=None):
    """Random router weights of every layer (HF names, torch `[out, in]`); `forced=1` makes
    every decision retrieval (last layer weight 0, bias favouring class 1)."""
    gen = np.random.default_rng(seed)
    out = {}
    for i in range(LAYERS):
        for seq, layers in LINEARS.items():
            for j, fan_in, fan_out in layers:
                p = f"{ROUTER.format(i=i)}{seq}.{j}"
                out[p + ".weight"] = (gen.standard_normal((fan_out, fan_in))
                                      / np.sqrt(fan_in)).astype(np.float32)
                out[p + ".bias"] = (0.1 * gen.standard_normal(fan_out)).astype(np.float32)
        if forced is not None:
            p = f"{ROUTER.format(i=i)}cls_router_head_agnostic.4"
            out[p + ".weight"] = np.zeros((2, HEAD_DIM), np.float32)
            out[p + ".bias"] = np.array([-30.0, 30.0] if forced else [30.0, -30.0], np.float32)
    return out


def center_router(w, k_pre, lengths):
    """Shift each layer's class-1 bias so that its decisions on `k_pre` split half / half."""
    for i in range(LAYERS):
        pooled = np.stack([np_pool(k_pre[i][b], n) for b, n in enumerate(lengths)])
        logits = np_router_logits(w, i, pooled)
        w[f"{ROUTER.format(i=i)}cls_router_head_agnostic.4.bias"][1] -= \
            np.median(logits[..., 1] - logits[..., 0])


def write_paw(base_dir, path, fields, tensors, *, drop=(), log_alphas=None):
    """Copy the Qwen3 checkpoint to `path` as a PawQwen3 one: config fields, router tensors,
    per-layer `attn_mask_log_alphas`, training-only extras; `drop` removes tensors by name."""
    shutil.copytree(base_dir, path, dirs_exist_ok=True)
    with open(path / "config.json") as f:
        cfg = json.load(f)
    cfg.update(architectures=["PawQwen3ForCausalLM"], enable_lambda_task=False, topk_k=32,
               suggested_threshold=None, **fields)
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)
    weights = load_file(path / "model.safetensors")
    weights.update(tensors)
    for i in range(LAYERS):
        la = np.full(K, 4.5) if log_alphas is None else np.asarray(log_alphas[i])
        weights[f"model.layers.{i}.self_attn.attn_mask_log_alphas"] = la.astype(np.float32)
    for name in TRAINING_EXTRAS:
        weights[name] = np.zeros((1,), np.float32)
    for name in drop:
        del weights[name]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


ROUTED = dict(enable_ada_sparsity=True, use_softmax=True, pooling_mode="ctx_q")


# ---------------------------------------------------------------------------------------------
# Tests


def test_all_retrieval_equals_qwen3(base, tmp_path):
    """Router forced to z = 1 with retrieval_mode full: the model is plain Qwen3 (transformers).
    toggle_type xattn, so a wrong decision would change the logits."""
    base_dir, _, ids, expected = base
    write_paw(base_dir, tmp_path, dict(ROUTED, retrieval_mode="full", toggle_type="xattn",
                                       xattn_threshold=0.5), router_tensors(0, forced=1))
    model, report = models.from_pretrained(tmp_path, progress=False, return_report=True)
    assert type(model).family == "pawqwen3" and model.cfg.block_size == 128
    assert set(report.consumed.values()) == {1}
    assert sorted(report.ignored) == sorted(TRAINING_EXTRAS)
    logits, z = model(jnp.asarray(ids, jnp.int32), return_decisions=True)
    assert z.shape == (LAYERS, 2, K) and z.dtype == jnp.int32 and bool((z == 1).all())
    assert_close(logits, expected, atol=tiny.TOLERANCE, rtol=0)
    dense = model(jnp.asarray(ids, jnp.int32), elastic=False)  # the backbone, via DenseAttend
    assert_close(dense, expected, atol=tiny.TOLERANCE, rtol=0)


def test_router_decisions_match_replica(base, tmp_path):
    """z of every layer = the numpy §1.3 replica (boundary pooling of HF's k_norm output per
    request, MLP, argmax), with ragged lengths. (full, full) keeps the model equal to Qwen3, so
    HF's keys are the model's keys at every layer."""
    base_dir, hf_model, ids, expected = base
    lengths = (160, 130)
    k_pre = capture_k_pre(hf_model, ids)
    w = router_tensors(1)
    center_router(w, k_pre, lengths)
    write_paw(base_dir, tmp_path, dict(ROUTED, retrieval_mode="full", toggle_type="full"), w)
    model = models.from_pretrained(tmp_path, progress=False)
    logits, z = model(jnp.asarray(ids, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                      return_decisions=True)
    want = np.stack([np_router_logits(w, i, np.stack(
        [np_pool(k_pre[i][b], n) for b, n in enumerate(lengths)])).argmax(-1)
        for i in range(LAYERS)])
    np.testing.assert_array_equal(np.asarray(z), want)
    assert 0 < want.mean() < 1, want  # mixed decisions: the comparison can fail
    assert_close(logits[0], expected[0], atol=tiny.TOLERANCE, rtol=0)
    assert_close(logits[1, :130], expected[1, :130], atol=tiny.TOLERANCE, rtol=0)
    np.testing.assert_array_equal(np.asarray(model.router_decisions(
        jnp.asarray(ids, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32))), want)


SMALL = dict(block_size=16, longctx_testing_small_blocks=True, xattn_stride=8,
             xattn_threshold=0.6, sink_size=16, local_window_size=40)
MIXED = {
    # Router decides; heads are XAttention (z = 1) or streaming (z = 0).
    "router-xattn-streaming": dict(ROUTED, retrieval_mode="xattn", toggle_type="streaming"),
    # Static log-alphas; full (z = 1) or XAttention (z = 0); HF's default sigmoid router
    # (use_softmax False) is in the file and ignored.
    "static-full-xattn": dict(enable_ada_sparsity=False, retrieval_mode="full",
                              toggle_type="xattn"),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_decisions_equal_masked_dense_reference(base, tmp_path, case):
    """Logits with mixed per-head modes = HF Qwen3 with dense attention under the §1.5 token
    masks of each head (block 16, 150 tokens: a partial last block, sink 1 + local 3 blocks)."""
    base_dir, hf_model, _, _ = base
    ids = tiny.token_ids(2, 150, seed=5)
    fields = dict(MIXED[case], **SMALL)
    log_alphas = None
    if fields["enable_ada_sparsity"]:
        w = router_tensors(2)
        center_router(w, capture_k_pre(hf_model, ids), (150, 150))

        def decide(layer, pooled):
            return np_router_logits(w, layer, pooled).argmax(-1)
    else:
        w = {name: (v[:1] if name.endswith("head_agnostic.4.weight") or
                    name.endswith("head_agnostic.4.bias") else v)
             for name, v in router_tensors(2).items()}  # the sigmoid router: one logit
        log_alphas = [[6.0, -6.0], [-6.0, 6.0]]

        def decide(layer, pooled):
            return np.broadcast_to(np_static_decisions(np.asarray(log_alphas[layer])),
                                   pooled.shape[:2])
    write_paw(base_dir, tmp_path, fields, w, log_alphas=log_alphas)
    model = models.from_pretrained(tmp_path, progress=False)
    assert (model.cfg.sink_blocks, model.cfg.local_blocks) == (1, 3)
    cfg = dict(fields, sink_blocks=1, local_blocks=3)
    expected, want_z = reference_logits(hf_model, ids, cfg, decide)
    logits, z = model(jnp.asarray(ids, jnp.int32), return_decisions=True)
    np.testing.assert_array_equal(np.asarray(z), want_z)
    assert 0 < want_z.mean() < 1, want_z
    assert_close(logits, expected, atol=tiny.TOLERANCE, rtol=0)
    dense = tiny.hf_logits(hf_model, ids)
    assert np.abs(dense - expected).max() > 1e-2  # the sparse modes really change the logits


def _hf(**fields):
    cfg = dict(tiny.base_config("qwen3"), architectures=["PawQwen3ForCausalLM"])
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=10000.0, **fields)
    return HFConfig(cfg, source="tiny/config.json")


def test_config_defaults_are_hf(base):
    cfg = paw.config_from_hf(_hf(**{k: 1 for k in paw.TRAINING_ONLY_KEYS}))
    for name, value in paw.HF_DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    assert cfg.xattn_threshold == 0.8 and cfg.toggle_type == "streaming"
    assert (cfg.sink_blocks, cfg.local_blocks) == (1, 8)
    assert not cfg.testing_small_blocks
    fd = paw.config_from_hf(_hf(local_window_size=2048, toggle_type="xattn", xattn_threshold=0.9,
                                **ROUTED))
    assert fd.xattn_threshold == 0.9 and fd.local_blocks == 16  # the config value, not 0.8
    assert paw.PawQwen3Config.from_dict(fd.to_dict()) == fd


CONFIG_ERRORS = {
    "toggle-unknown": (dict(toggle_type="bogus"), r"toggle_type='bogus' must be one of"),
    "retrieval-unknown": (dict(retrieval_mode="dense"), r"retrieval_mode='dense' must be one of"),
    "pair-xattn-full": (dict(retrieval_mode="xattn", toggle_type="full"),
                        r"\(retrieval_mode, toggle_type\)=\('xattn', 'full'\) is not supported"),
    "pair-full-topk": (dict(toggle_type="topk"),
                       r"\(retrieval_mode, toggle_type\)=\('full', 'topk'\) is not supported"),
    "block-64": (dict(block_size=64), r"block_size=64 must be 128 .*testing_small_blocks"),
    "block-48-testing": (dict(block_size=48, longctx_testing_small_blocks=True),
                         r"block_size=48 must be a power of two"),
    "stride": (dict(block_size=16, longctx_testing_small_blocks=True, xattn_stride=32),
               r"block_size=16 must be divisible by PawQwen3Config.xattn_stride=32"),
    "threshold": (dict(xattn_threshold=1.5), r"xattn_threshold=1.5 must be a float in \(0, 1\]"),
    "norm": (dict(xattn_norm=0), r"xattn_norm=0.0 must be a positive float"),
    "window": (dict(local_window_size=0), r"local_window_size=0 must be a positive int"),
    "sink": (dict(sink_size=-1), r"sink_size=-1 must be an int >= 0"),
    "pooling": (dict(enable_ada_sparsity=True, use_softmax=True),
                r"pooling_mode='first_token' must be 'ctx_q'"),
    "pooling-unknown": (dict(pooling_mode="mean"), r"pooling_mode='mean' must be one of"),
    "sigmoid-router": (dict(enable_ada_sparsity=True, pooling_mode="ctx_q"),
                       r"use_softmax=False \(the sigmoid router\) is not implemented"),
    "ada-type": (dict(enable_ada_sparsity="yes"), r"enable_ada_sparsity='yes' must be bool"),
    "sliding": (dict(use_sliding_window=True, sliding_window=32, max_window_layers=1),
                r"has sliding layers"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors(case):
    fields, match = CONFIG_ERRORS[case]
    with pytest.raises(ConfigError, match=match):
        paw.config_from_hf(_hf(**fields))


def test_config_direct_construction_errors():
    cfg = paw.config_from_hf(_hf())
    kwargs = cfg.to_dict()
    kwargs["attention"] = cfg.attention
    with pytest.raises(ValueError, match=r"PawQwen3Config.block_size=256 must be 128"):
        paw.PawQwen3Config(**dict(kwargs, block_size=256))
    with pytest.raises(ValueError, match=r"use_softmax=1 must be a bool"):
        paw.PawQwen3Config(**dict(kwargs, use_softmax=1))
    small = paw.PawQwen3Config(**dict(kwargs, block_size=32, testing_small_blocks=True,
                                      sink_size=0))
    assert (small.sink_blocks, small.local_blocks) == (0, 32)


def test_static_decisions_match_hard_concrete_replica():
    gen = np.random.default_rng(3)
    cases = [gen.normal(0.0, 3.0, 8) for _ in range(20)]
    cases += [np.array([6.0, -6.0]), np.array([4.5, 4.5, 4.5]), np.array([-4.0, -4.0, 2.0]),
              np.full(4, -10.0)]
    decide = jax.jit(paw.static_decisions)
    for la in cases:
        got = np.asarray(decide(jnp.asarray(la, jnp.float32)))
        np.testing.assert_array_equal(got, np_static_decisions(la), err_msg=str(la))
    assert np.asarray(paw.static_decisions(jnp.full(4, -10.0))).sum() == 0
    assert np.asarray(paw.static_decisions(jnp.full(4, 4.5))).sum() == 4


NAME = "model.layers.{i}.self_attn."
LOAD_ERRORS = {
    "missing-router": (dict(drop=(f"{ROUTER.format(i=1)}cls_router_head_agnostic.4.bias",)),
                       r"missing tensors \(1\):\s+model\.layers\.1\.self_attn\.mask_allocator\."
                       r"cls_router_head_agnostic\.4\.bias"),
    "missing-log-alphas": (dict(drop=(f"{NAME.format(i=0)}attn_mask_log_alphas",)),
                           r"missing tensors \(1\):\s+model\.layers\.0\.self_attn\."
                           r"attn_mask_log_alphas"),
    "unexpected": (dict(extra={f"{ROUTER.format(i=0)}cls_router_head_agnostic.6.weight":
                               np.zeros((2, 2), np.float32)}),
                   r"unexpected tensors \(1\):\s+'model\.layers\.0\.self_attn\.mask_allocator\."
                   r"cls_router_head_agnostic\.6\.weight"),
    "misshaped": (dict(extra={f"{ROUTER.format(i=0)}cls_router_head_agnostic.4.weight":
                              np.zeros((1, HEAD_DIM), np.float32)}),
                  r"mis-shaped tensors \(1\):\s+'model\.layers\.0\.self_attn\.mask_allocator\."
                  r"cls_router_head_agnostic\.4\.weight' .*"
                  r"router/cls_router_head_agnostic/layers/4/kernel needs \[16, 2\]"),
}


@pytest.mark.parametrize("case", list(LOAD_ERRORS))
def test_strict_loading_names_router_tensors(base, tmp_path, case):
    spec, match = LOAD_ERRORS[case]
    tensors = dict(router_tensors(0), **spec.get("extra", {}))
    write_paw(base[0], tmp_path, ROUTED, tensors, drop=spec.get("drop", ()))
    with pytest.raises(CheckpointError, match=match):
        models.from_pretrained(tmp_path, progress=False)


def test_forward_argument_errors(base, tmp_path):
    write_paw(base[0], tmp_path, ROUTED, router_tensors(0))
    model = models.from_pretrained(tmp_path, progress=False)
    ids = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(NotImplementedError, match="segment_ids"):
        model(ids, segment_ids=jnp.zeros((2, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"lengths=\[9, 2\] must lie in \[0, T=8\]"):
        model(ids, lengths=jnp.asarray([9, 2], jnp.int32))
    with pytest.raises(ValueError, match=r"lengths must be integer \[B\]=\(2,\)"):
        model(ids, lengths=jnp.asarray([3], jnp.int32))
    with pytest.raises(ValueError, match="need elastic=True"):
        model(ids, elastic=False, return_decisions=True)
    with pytest.raises(TypeError, match="input_ids.dtype=float32"):
        model(jnp.zeros((2, 8), jnp.float32))


def test_convert_cli_round_trip(base, tmp_path):
    """`python -m experiments.convert` on a PawQwen3 checkpoint: the orbax copy is bitwise."""
    from experiments import convert

    src = tmp_path / "paw"
    write_paw(base[0], src, ROUTED, router_tensors(3))
    dst = tmp_path / "orbax"
    assert convert.main([str(src), str(dst), "--quiet"]) == 0
    restored, direct = models.load(dst), models.from_pretrained(src, progress=False)
    ids = jnp.asarray(base[2][:1, :40])
    np.testing.assert_array_equal(np.asarray(restored(ids)), np.asarray(direct(ids)))
