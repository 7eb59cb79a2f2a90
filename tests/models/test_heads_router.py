"""Router training (`models.heads.router`) on a tiny random PawQwen3 (float32, CPU).

The model (2 layers, 4 query / 2 KV heads, head dim 16, full retrieval heads, streaming sparse
heads: sink 4 + window 8 tokens) is built in memory; prompts of 28 / 32 random tokens with 4
answer tokens each, so streaming heads lose most of the prompt and the distillation KL is not 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.elastic.router import argmax_decision
from models.config import HFConfig
from models.families import pawqwen3 as paw
from models.heads import router as rt
from models.heads.data import Batch

VOCAB, T, A = 256, 40, 4
PROMPTS = (32, 28)
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    initializer_range=0.1, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    architectures=["PawQwen3ForCausalLM"], enable_ada_sparsity=True, use_softmax=True,
    pooling_mode="ctx_q", retrieval_mode="full", toggle_type="streaming", block_size=16,
    longctx_testing_small_blocks=True, xattn_stride=8, sink_size=4, local_window_size=8)


def make_model(seed: int = 0) -> paw.PawQwen3ForCausalLM:
    """Random init, final norm weight x4: sharper next-token distributions (a larger KL)."""
    cfg = paw.config_from_hf(HFConfig(dict(CONFIG), source="tiny-router"))
    model = paw.PawQwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed))
    model.norm.weight[...] = 4.0 * model.norm.weight[...]
    return model


def make_batch(seed: int = 1) -> Batch:
    gen = np.random.default_rng(seed)
    ids = np.zeros((len(PROMPTS), T), np.int32)
    pos = np.zeros((len(PROMPTS), A), np.int32)
    for i, n in enumerate(PROMPTS):
        ids[i, :n + A] = gen.integers(1, VOCAB, n + A)
        pos[i] = np.arange(n - 1, n - 1 + A)
    nxt = np.take_along_axis(ids, pos + 1, axis=1)
    valid = np.ones((len(PROMPTS), A), bool)
    valid[1, -1] = False  # a shorter answer
    needle = np.zeros_like(ids, bool)
    return Batch(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(nxt), jnp.asarray(valid),
                 jnp.asarray(needle))


def snapshot(module, filt):
    return [np.array(x) for x in jax.tree.leaves(nnx.state(module, filt))]


def test_relaxed_gate_forward_is_the_noisy_argmax_and_gradient_the_soft_one():
    gen = np.random.default_rng(0)
    logits = jnp.asarray(gen.normal(size=(3, 5, 2)), jnp.float32)
    key = jax.random.key(7)
    hard = rt.relaxed_gate(logits, key, 0.5)
    noisy = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
    np.testing.assert_array_equal(np.asarray(hard), np.argmax(np.asarray(noisy), -1))
    soft = rt.relaxed_gate(logits, key, 0.5, hard=False)
    assert ((np.asarray(soft) > 0) & (np.asarray(soft) < 1)).all()
    w = jnp.asarray(gen.normal(size=(3, 5)), jnp.float32)
    g_hard = jax.grad(lambda x: jnp.sum(w * rt.relaxed_gate(x, key, 0.5)))(logits)
    g_soft = jax.grad(lambda x: jnp.sum(w * rt.relaxed_gate(x, key, 0.5, hard=False)))(logits)
    np.testing.assert_allclose(np.asarray(g_hard), np.asarray(g_soft), rtol=1e-6)
    assert np.abs(np.asarray(g_hard)).min() > 0


@jax.default_matmul_precision("highest")  # f32 products, not TF32, on a GPU
def test_router_gradients_nonzero_and_match_finite_differences():
    """Soft gates, fixed Gumbel noise: d loss / d (routers, temperature, multipliers) against
    central differences along the gradient and random directions, and the multipliers' exact
    gradients."""
    training = rt.RouterTraining(make_model(), init_temperature=0.7, implementation="xla")
    # Multipliers small enough that the distillation and Lagrangian terms both count.
    training.lambda1[...] = jnp.float32(0.02)
    training.lambda2[...] = jnp.float32(0.05)
    batch, key, target = make_batch(), jax.random.key(3), 0.25
    graphdef, trainable, rest = nnx.split(training, rt.TRAINABLE, ...)

    @jax.jit
    def loss_of(state):
        return rt.router_loss(nnx.merge(graphdef, state, rest), batch, key, target=target,
                              hard=False)

    (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(trainable)
    assert float(metrics["kl"]) > 1e-3
    np.testing.assert_allclose(float(grads["lambda1"][...]),
                               float(metrics["sparse_fraction"]) - target, rtol=1e-5)
    np.testing.assert_allclose(float(grads["lambda2"][...]),
                               (float(metrics["sparse_fraction"]) - target) ** 2, rtol=1e-4)
    assert abs(float(grads["log_temperature"][...])) > 0
    routers = [grads["model"]["layers"][i]["mixer"]["router"] for i in range(2)]
    for i, g in enumerate(routers):
        norms = [float(jnp.linalg.norm(x)) for x in jax.tree.leaves(g)]
        assert len(norms) == 10 and min(norms) > 0, f"layer {i} router gradient norms {norms}"

    gen = np.random.default_rng(5)
    leaves, treedef = jax.tree.flatten(trainable)
    gradient = jax.tree.leaves(grads)
    for trial in range(3):  # the gradient's own direction, then random ones
        direction = gradient if trial == 0 else [
            jnp.asarray(gen.normal(size=np.shape(x)), jnp.float32) for x in leaves]
        norm = np.sqrt(sum(float(jnp.sum(d * d)) for d in direction))
        direction = [d / norm for d in direction]
        eps = 3e-2
        plus = jax.tree.unflatten(treedef, [x + eps * d for x, d in zip(leaves, direction)])
        minus = jax.tree.unflatten(treedef, [x - eps * d for x, d in zip(leaves, direction)])
        fd = (float(loss_of(plus)[0]) - float(loss_of(minus)[0])) / (2 * eps)
        an = sum(float(jnp.sum(g * d)) for g, d in zip(gradient, direction))
        assert abs(an) > 5e-4, f"trial {trial}: directional derivative {an} too small to test"
        np.testing.assert_allclose(an, fd, rtol=1e-2, err_msg=f"trial {trial}")


def test_inference_path_refuses_to_differentiate():
    model = make_model()
    ids = make_batch().input_ids

    def elastic_loss(m):
        return jnp.sum(m(ids, implementation="xla") ** 2)

    with pytest.raises(TypeError, match=r"argmax.*models\.heads\.router"):
        nnx.grad(elastic_loss, argnums=nnx.DiffState(0, rt.TRAINABLE))(model)
    with pytest.raises(TypeError, match=r"models\.heads\.router"):
        nnx.grad(elastic_loss)(model)  # the backbone feeds the routers too
    la = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    with pytest.raises(TypeError, match="hard-concrete"):
        jax.jvp(paw.static_decisions, (la,), (jnp.ones_like(la),))
    with pytest.raises(TypeError, match="no gradient"):
        jax.jvp(argmax_decision, (jnp.ones((1, 2, 2)),), (jnp.ones((1, 2, 2)),))
    np.testing.assert_array_equal(np.asarray(paw.static_decisions(la)), [1, 1, 1])


def test_dense_backbone_still_differentiates():
    model = make_model()
    ids = make_batch().input_ids
    grads = nnx.grad(lambda m: jnp.sum(m(ids, elastic=False, implementation="xla") ** 2))(model)
    state = nnx.state(grads)
    q = state["layers"][0]["mixer"]["q_proj"]
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(q))
    router = state["layers"][0]["mixer"]["router"]
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(router))  # unused


def test_train_steps_reduce_kl_and_fraction_and_freeze_backbone():
    """Target 0: distillation and Lagrangian both want full heads. Same Gumbel noise each step,
    so the first and last metrics compare like for like. Straight-through hard gates: every
    router tensor moves (Adam leaves a tensor with zero gradient where it is)."""
    training = rt.RouterTraining(make_model(), implementation="xla")
    opt = rt.make_optimizer(training, lr=3e-2, lagrangian_lr=1e-1)
    frozen = nnx.Not(rt.TRAINABLE)
    backbone = snapshot(training, frozen)
    routers = snapshot(training, rt.TRAINABLE)
    batch, key = make_batch(), jax.random.key(11)
    history = [rt.train_step(training, opt, batch, key, 0.0) for _ in range(12)]
    first, last = history[0], history[-1]
    assert float(first["kl"]) > 1e-3 and float(first["sparse_fraction"]) > 0.1
    assert float(last["kl"]) < 0.5 * float(first["kl"])
    assert float(last["sparse_fraction"]) < 0.5 * float(first["sparse_fraction"])
    assert float(last["lambda1"]) > 0  # s > t: ascent raises the price of sparsity
    for before, after in zip(backbone, snapshot(training, frozen)):
        np.testing.assert_array_equal(before, after)
    changed = [not np.array_equal(b, a) for b, a in zip(routers, snapshot(training, rt.TRAINABLE))]
    assert all(changed), changed


def test_lagrangian_pushes_fraction_up_to_target():
    """Target 0.8 against a distillation loss that prefers full heads (s starts near 0.5): the
    multiplier goes negative and the expected sparse fraction climbs to the target (Adam on the
    multiplier overshoots it here), at a KL cost."""
    training = rt.RouterTraining(make_model(), implementation="xla")
    opt = rt.make_optimizer(training, lr=3e-3, lagrangian_lr=1e-1)
    batch = make_batch()
    history = [rt.train_step(training, opt, batch, jax.random.key(i), 0.8) for i in range(24)]
    s = np.asarray([float(m["sparse_fraction"]) for m in history])
    kl = np.asarray([float(m["kl"]) for m in history])
    assert s[0] < 0.55 and s.max() > 0.78, s.round(3)
    assert float(history[10]["lambda1"]) < 0
    assert kl[s.argmax()] > kl[0], (kl[0], kl[s.argmax()])


def test_save_load_round_trip_gives_same_decisions(tmp_path):
    trained = make_model()
    for layer in trained.layers:  # shift the routers' last bias: other decisions than fresh's
        r = layer.mixer.router.cls_router_head_agnostic.layers[4]
        r.bias[...] = r.bias[...] + jnp.asarray([1.5, -1.5], jnp.float32)
    ids = make_batch().input_ids
    path = tmp_path / "router.safetensors"
    rt.save_router(trained, path)

    from safetensors.numpy import load_file

    tensors = load_file(str(path))
    hf_names = {s for rule in paw.rules(trained.cfg) if "/router/" in rule.target
                for s in rule.sources}
    assert set(tensors) == hf_names  # the converter's names: loads like a released checkpoint
    w = tensors["model.layers.1.self_attn.mask_allocator.cls_router_head_agnostic.4.weight"]
    assert w.shape == (2, 16)

    fresh = make_model(seed=0)
    before = np.asarray(fresh.router_decisions(ids, lengths=jnp.asarray(PROMPTS)))
    rt.load_router(fresh, path)
    expected = np.asarray(trained.router_decisions(ids, lengths=jnp.asarray(PROMPTS)))
    np.testing.assert_array_equal(np.asarray(fresh.router_decisions(
        ids, lengths=jnp.asarray(PROMPTS))), expected)
    assert not np.array_equal(before, expected)  # the load changed something
    for a, b in zip(jax.tree.leaves(nnx.state(fresh, rt.TRAINABLE)),
                    jax.tree.leaves(nnx.state(trained, rt.TRAINABLE))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_errors_name_the_tensors(tmp_path):
    from safetensors.numpy import save_file

    model = make_model()
    tensors = rt.router_tensors(model)
    name = "model.layers.0.self_attn.mask_allocator.cls_feat_extractor.2.bias"
    missing = {k: v for k, v in tensors.items() if k != name}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(KeyError, match=r"cls_feat_extractor\.2\.bias"):
        rt.load_router(model, tmp_path / "missing.safetensors")
    extra = dict(tensors, **{"model.layers.2.self_attn.mask_allocator.cls_feat_extractor.0.bias":
                             np.zeros(64, np.float32)})
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.2"):
        rt.load_router(model, tmp_path / "extra.safetensors")
    bad = dict(tensors, **{name: np.zeros(3, np.float32)})
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"cls_feat_extractor\.2\.bias has shape \(3,\)"):
        rt.load_router(model, tmp_path / "bad.safetensors")


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="init_temperature"):
        rt.RouterTraining(model, init_temperature=0.0)
    with pytest.raises(ValueError, match="window"):
        rt.RouterTraining(model, window=0)
    with pytest.raises(ValueError, match="sinks"):
        rt.RouterTraining(model, sinks=-1)
    with pytest.raises(TypeError, match="PawQwen3ForCausalLM"):
        rt.RouterTraining(object())
    no_router = paw.PawQwen3ForCausalLM(
        paw.config_from_hf(HFConfig(dict(CONFIG, use_softmax=False, enable_ada_sparsity=False),
                                    source="tiny")), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="use_softmax=False"):
        rt.RouterTraining(no_router)
    with pytest.raises(ValueError, match="use_softmax=False"):
        rt.save_router(no_router, "unused.safetensors")
    training = rt.RouterTraining(model, implementation="xla")
    with pytest.raises(ValueError, match="target=1.5"):
        rt.router_loss(training, make_batch(), None, target=1.5)
    with pytest.raises(ValueError, match="lagrangian_lr"):
        rt.make_optimizer(training, lr=1e-3, lagrangian_lr=0.0)
    b = make_batch()
    with pytest.raises(ValueError, match="answer_ids.shape"):
        rt.router_loss(training, b._replace(answer_ids=b.answer_ids[:, :2]), None, target=0.5)
    with pytest.raises(ValueError, match="final=1.2"):
        rt.target_schedule(0, final=1.2, ramp_steps=10)
    assert rt.target_schedule(5, final=0.6, ramp_steps=10) == pytest.approx(0.3)
    assert rt.target_schedule(50, final=0.6, ramp_steps=10) == pytest.approx(0.6)
