"""Training PawQwen3's elastic routers (Elastic Attention style): relaxed decisions, frozen model.

Inference routes with an argmax (`attn.elastic.AttentionRouter`, `ElasticAttend`), which has no
gradient (differentiating it raises). Training replaces the argmax by a straight-through
Gumbel-softmax over the router's two logits, per request and KV head:

    pooled = ctx_q_pool(k_pre, prompt_lengths)               # [B, K, H] pre-RoPE keys
    logits = router.logits(pooled)                           # [B, K, 2], index 1 = retrieval
    soft   = softmax((logits + gumbel) / tau)[..., 1]        # [B, K] in (0, 1)
    gate   = hard + (soft - stop_gradient(soft))             # forward: exactly hard
    o      = stream + gate * (full - stream)                 # models.heads.mix.MixedAttend

`tau = exp(log_temperature)` is learned. With `hard=True` the forward is the hard decision (full
or sink + window attention, the geometry of the config's `sink_size` / `local_window_size` in
tokens) and the gradient is the soft one; `hard=False` is the plain Gumbel-softmax (smooth in
the router weights, which the finite-difference test uses).

Loss (`router_loss`): distillation to the dense model (same weights, `DenseAttend`,
`stop_gradient`) on the answer tokens, `KL(teacher || student)` of the next-token distributions at
`Batch.answer_pos`, averaged over valid answer tokens; plus the Lagrangian sparsity term of
PruLong / Elastic Attention

    lambda1 * (s - t) + lambda2 * (s - t) ** 2,   s = mean over layers, rows, KV heads of
                                                       P(sparse) = softmax(logits)[..., 0]

(`s` is the expected sparse fraction: under Gumbel noise `P(argmax = sparse)` is exactly that
softmax, whatever the temperature). The routers and the temperature descend the loss; the
multipliers `lambda1`, `lambda2` (`LagrangeParam`, initialised to 0) ascend it (their optax group
negates the gradient), so a fraction off target raises its own price. The target `t` is an
argument of each step, so it can ramp (`target_schedule`; Elastic Attention ramps 0 -> 0.6).

Routers pool the prompt only (`answer_pos[:, 0] + 1` tokens, the prompt of `Batch`), as the
engine routes at prefill. Retrieval heads are trained as full heads and sparse heads as streaming
heads whatever the config's `retrieval_mode` / `toggle_type` (XAttention modes are not relaxed).

Trainable: `TRAINABLE` selects the router `nnx.Param`s (path through `router`), the temperature
(`RouterParam`) and the multipliers (`LagrangeParam`); the backbone is never updated.
`save_router` / `load_router` move router weights under their HF names
(`model.layers.{i}.self_attn.mask_allocator.cls_feat_extractor.0.weight`, ... as `[out, in]`), so
the trained file loads into PawQwen3 like a released checkpoint.

Not done here: hard-concrete gates, task embeddings, sequence parallelism, per-layer sparsity
schedules, KV lengths other than the prompt's (packed rows).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float, Int

from attn.elastic import ctx_q_pool
from attn.elastic.router import HF_LINEARS, load_hf_state
from models.families.pawqwen3 import POOL_BOUNDARY, PawQwen3ForCausalLM
from models.heads.data import Batch
from models.heads.mix import MixedAttend
from models.layers.attention import AttendSpec, DenseAttend

HF_PREFIX = "model.layers.{i}.self_attn.mask_allocator."
# log-temperature is clipped to this range (tau in [~0.007, ~148]); outside it the gradient is 0.
LOG_TEMPERATURE_RANGE = (-5.0, 5.0)


class RouterParam(nnx.Variable):
    """A trainable variable of router training other than the router weights (the temperature)."""


class LagrangeParam(nnx.Variable):
    """A Lagrange multiplier of the sparsity constraint; trained by gradient ascent."""


TRAINABLE = nnx.Any(nnx.All(nnx.Param, nnx.PathContains("router")), RouterParam, LagrangeParam)
"""Filter of everything router training updates (`nnx.Optimizer(wrt=...)`, `nnx.DiffState`)."""


def relaxed_gate(
    logits: Float[Array, "*B 2"],
    key: jax.Array | None,
    temperature: Float[Array, ""] | float,
    *,
    hard: bool = True,
) -> Float[Array, "*B"]:
    """Straight-through Gumbel-softmax gate of two-class router logits (1 = full / retrieval).

    Args:
      logits: `[..., 2]` logits, index 1 = retrieval (the router's convention).
      key: PRNG key of the Gumbel noise (one draw per logit pair); None: no noise.
      temperature: softmax temperature `tau > 0`.
      hard: True: the forward value is `1[soft > 1/2]` (the argmax of the noisy logits), the
        gradient is the soft one; False: the soft gate itself.

    Returns:
      `[...]` float32 gate in [0, 1].
    """
    logits = logits.astype(jnp.float32)
    if key is not None:
        logits = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
    soft = jax.nn.softmax(logits / temperature, axis=-1)[..., 1]
    if not hard:
        return soft
    decided = jax.lax.stop_gradient((soft > 0.5).astype(jnp.float32))
    return decided + (soft - jax.lax.stop_gradient(soft))  # exactly `decided` forward


def target_schedule(step: int, *, final: float, ramp_steps: int, start: float = 0.0) -> float:
    """Linear ramp of the sparse-fraction target: `start` at step 0, `final` from `ramp_steps` on.

    Raises:
      ValueError: a fraction outside [0, 1], `ramp_steps < 0` or `step < 0`.
    """
    for name, value in (("start", start), ("final", final)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must lie in [0, 1]")
    if ramp_steps < 0 or step < 0:
        raise ValueError(f"{ramp_steps=} and {step=} must be >= 0")
    if ramp_steps == 0:
        return float(final)
    return float(start + (final - start) * min(step / ramp_steps, 1.0))


class RouterTraining(nnx.Module):
    """A PawQwen3 model, the learned temperature and the Lagrange multipliers of router training.

    Holds `model` by reference: training updates its routers in place (the backbone is never
    updated). Does not own data, the optimizer or the target schedule.

    Attributes:
      model: the `PawQwen3ForCausalLM` (with softmax routers).
      log_temperature: `RouterParam`, scalar float32 `log(tau)`.
      lambda1, lambda2: `LagrangeParam`, scalar float32 multipliers (start at 0).
      window, sinks: streaming geometry of sparse heads, in tokens.
      implementation: attention backend of teacher and student (`attn.dense.attention`).
    """

    def __init__(self, model: PawQwen3ForCausalLM, *, window: int | None = None,
                 sinks: int | None = None, init_temperature: float = 1.0,
                 implementation: str = "auto"):
        """Wrap `model` for router training.

        Args:
          model: a `PawQwen3ForCausalLM` whose config has `use_softmax=True` (routers exist).
          window: sparse heads' window in tokens; default `cfg.local_window_size`.
          sinks: sparse heads' sink tokens; default `cfg.sink_size`.
          init_temperature: initial Gumbel-softmax temperature (> 0).
          implementation: attention backend.

        Raises:
          TypeError: `model` is not a PawQwen3 model.
          ValueError: the model has no routers, `window <= 0`, `sinks < 0`, a temperature that is
            not positive and finite.
        """
        if not isinstance(model, PawQwen3ForCausalLM):
            raise TypeError(f"model is a {type(model).__name__}; router training needs a "
                            "PawQwen3ForCausalLM")
        if model.layers[0].mixer.router is None:
            raise ValueError("model.cfg.use_softmax=False: the model has no softmax routers to "
                             "train")
        cfg = model.cfg
        window = cfg.local_window_size if window is None else window
        sinks = cfg.sink_size if sinks is None else sinks
        if not isinstance(window, int) or window <= 0:
            raise ValueError(f"{window=} must be a positive int")
        if not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"{sinks=} must be an int >= 0")
        lo, hi = (math.exp(b) for b in LOG_TEMPERATURE_RANGE)
        if not lo <= init_temperature <= hi:
            raise ValueError(f"{init_temperature=} must lie in [{lo:.3g}, {hi:.3g}]")
        self.model = model
        self.window = window
        self.sinks = sinks
        self.implementation = implementation
        self.log_temperature = RouterParam(jnp.asarray(math.log(init_temperature), jnp.float32))
        self.lambda1 = LagrangeParam(jnp.zeros((), jnp.float32))
        self.lambda2 = LagrangeParam(jnp.zeros((), jnp.float32))

    @property
    def temperature(self) -> Float[Array, ""]:
        """`tau = exp(clip(log_temperature, *LOG_TEMPERATURE_RANGE))`."""
        return jnp.exp(jnp.clip(self.log_temperature[...], *LOG_TEMPERATURE_RANGE))


def _check_batch(batch: Batch) -> None:
    ids = batch.input_ids
    if jnp.ndim(ids) != 2 or not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
        raise ValueError(f"batch.input_ids must be integer [B, T]; got "
                         f"{jnp.asarray(ids).dtype}{list(jnp.shape(ids))}")
    b, _ = jnp.shape(ids)
    a_shape = jnp.shape(batch.answer_pos)
    if len(a_shape) != 2 or a_shape[0] != b:
        raise ValueError(f"batch.answer_pos.shape={a_shape} must be [B={b}, A]")
    for name in ("answer_ids", "answer_valid"):
        if jnp.shape(getattr(batch, name)) != a_shape:
            raise ValueError(f"batch.{name}.shape={jnp.shape(getattr(batch, name))} must equal "
                             f"answer_pos.shape={a_shape}")


def _answer_log_probs(model, hidden, answer_pos):
    take = jax.vmap(lambda h, i: h[i])  # [B, T, D] x [B, A] -> [B, A, D]
    return jax.nn.log_softmax(model.logits(take(hidden, answer_pos)).astype(jnp.float32), -1)


def router_loss(
    training: RouterTraining,
    batch: Batch,
    key: jax.Array | None,
    *,
    target: float | Float[Array, ""],
    hard: bool = True,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Distillation KL on the answer tokens plus the Lagrangian sparsity term.

    Args:
      training: the `RouterTraining` module.
      batch: a `models.heads.data.Batch` (right-padded prompts + answers).
      key: PRNG key of the Gumbel noise (folded with the layer index); None: no noise.
      target: sparse fraction target `t` in [0, 1] (may be traced).
      hard: straight-through hard gates (training) or soft gates.

    Returns:
      `(loss, metrics)`; metrics (float32 scalars): `loss`, `kl` (distillation), `ce` (student
      cross-entropy on the answer tokens), `sparse_fraction` (expected, `s`),
      `sampled_sparse_fraction` (mean of `1 - gate`), `lagrangian`, `temperature`, `lambda1`,
      `lambda2`, `target`.

    Raises:
      ValueError: batch shapes disagree; a concrete `target` outside [0, 1].
    """
    _check_batch(batch)
    try:
        t_value = float(target)
    except (TypeError, jax.errors.ConcretizationTypeError):
        t_value = None  # traced: documented meaning only
    if t_value is not None and not 0.0 <= t_value <= 1.0:
        raise ValueError(f"target={t_value} must lie in [0, 1]")
    model = training.model
    ids = jnp.asarray(batch.input_ids, jnp.int32)
    answer_pos = jnp.asarray(batch.answer_pos, jnp.int32)
    valid = jnp.asarray(batch.answer_valid, bool)
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    prompt_lengths = answer_pos[:, 0] + 1
    tau = training.temperature
    p_sparse = []  # per layer [B, K], filled while the student forward is traced

    def gate_fn(spec: AttendSpec, qkv) -> Float[Array, "B K"]:
        pooled = ctx_q_pool(qkv.k_pre, prompt_lengths, boundary=POOL_BOUNDARY)
        logits = model.layers[spec.layer].mixer.router.logits(pooled)  # [B, K, 2]
        p_sparse.append(jax.nn.softmax(logits, axis=-1)[..., 0])
        layer_key = None if key is None else jax.random.fold_in(key, spec.layer)
        return relaxed_gate(logits, layer_key, tau, hard=hard)

    teacher_hidden, _ = model.forward(ids, positions,
                                      attend=DenseAttend(implementation=training.implementation))
    teacher = jax.lax.stop_gradient(_answer_log_probs(model, teacher_hidden, answer_pos))
    attend = MixedAttend(gates=gate_fn, window=training.window, sinks=training.sinks,
                         implementation=training.implementation)
    hidden, gates = model.forward(ids, positions, attend=attend)
    student = _answer_log_probs(model, hidden, answer_pos)  # [B, A, V]

    count = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    kl_tok = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)  # [B, A]
    kl = jnp.sum(jnp.where(valid, kl_tok, 0.0)) / count
    ce_tok = -jnp.take_along_axis(student, batch.answer_ids[..., None].astype(jnp.int32),
                                  axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(valid, ce_tok, 0.0)) / count
    s = jnp.mean(jnp.stack(p_sparse))
    gap = s - jnp.asarray(target, jnp.float32)
    lam1, lam2 = training.lambda1[...], training.lambda2[...]
    lagrangian = lam1 * gap + lam2 * gap ** 2
    loss = kl + lagrangian
    metrics = dict(loss=loss, kl=kl, ce=ce, sparse_fraction=s,
                   sampled_sparse_fraction=1.0 - jnp.mean(jnp.stack(gates)),
                   lagrangian=lagrangian, temperature=tau, lambda1=lam1, lambda2=lam2,
                   target=jnp.asarray(target, jnp.float32))
    return loss, metrics


def _group(path, _) -> str:
    names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    return "ascent" if names & {"lambda1", "lambda2"} else "descent"


def make_optimizer(training: RouterTraining, lr: float = 5e-4,
                   lagrangian_lr: float = 1e-3) -> nnx.Optimizer:
    """Adam on the routers and temperature (descent) and on the multipliers (ascent).

    The ascent group is `optax.chain(optax.scale(-1), optax.adam(lagrangian_lr))`: Adam of the
    negated gradient. Defaults are Elastic Attention's (mask lr 5e-4, regulariser lr 1e-3).
    The multiplier dynamics oscillate around the target; ramp it (`target_schedule`) and keep
    `lr` small: a router pushed far past the target saturates its softmax, where neither term of
    the loss has a gradient left to bring it back.

    Args:
      training: the `RouterTraining` module (its `TRAINABLE` variables are optimised).
      lr: learning rate of routers and temperature.
      lagrangian_lr: learning rate of the multipliers.

    Raises:
      ValueError: a learning rate that is not positive.
    """
    for name, value in (("lr", lr), ("lagrangian_lr", lagrangian_lr)):
        if not value > 0:
            raise ValueError(f"{name}={value} must be positive")
    tx = optax.multi_transform(
        {"descent": optax.adam(lr),
         "ascent": optax.chain(optax.scale(-1.0), optax.adam(lagrangian_lr))},
        lambda params: jax.tree_util.tree_map_with_path(_group, params))
    return nnx.Optimizer(training, tx, wrt=TRAINABLE)


@nnx.jit(static_argnames=("hard",))
def _train_step(training, optimizer, batch, key, target, *, hard):
    grad_fn = nnx.value_and_grad(
        lambda tr: router_loss(tr, batch, key, target=target, hard=hard),
        argnums=nnx.DiffState(0, TRAINABLE), has_aux=True)
    (_, metrics), grads = grad_fn(training)
    optimizer.update(training, grads)
    return metrics


def train_step(training: RouterTraining, optimizer: nnx.Optimizer, batch: Batch,
               key: jax.Array, target: float | Float[Array, ""], *,
               hard: bool = True) -> dict[str, Array]:
    """One optimizer step on `router_loss` (jitted; updates `training` and `optimizer` in place).

    Args:
      training, optimizer: from `RouterTraining` / `make_optimizer`.
      batch: a `Batch`; one compilation per shape.
      key: PRNG key of this step's Gumbel noise.
      target: the sparse fraction target of this step (traced: a ramp does not recompile).
      hard: straight-through hard gates.

    Returns:
      `router_loss`'s metrics, computed before the update.

    Raises:
      ValueError: as `router_loss`.
    """
    _check_batch(batch)
    if not 0.0 <= float(target) <= 1.0:
        raise ValueError(f"target={float(target)} must lie in [0, 1]")
    return _train_step(training, optimizer, batch, key, jnp.asarray(target, jnp.float32),
                       hard=hard)


def _routers(model: PawQwen3ForCausalLM):
    if not isinstance(model, PawQwen3ForCausalLM):
        raise TypeError(f"model is a {type(model).__name__}; need a PawQwen3ForCausalLM")
    routers = [layer.mixer.router for layer in model.layers]
    if routers[0] is None:
        raise ValueError("model.cfg.use_softmax=False: the model has no softmax routers")
    return routers


def router_tensors(model: PawQwen3ForCausalLM) -> dict[str, np.ndarray]:
    """Every router's weights as float32 numpy under HF names (Linear weights `[out, in]`).

    Raises:
      TypeError, ValueError: not a PawQwen3 model, or one without routers.
    """
    out = {}
    for i, router in enumerate(_routers(model)):
        prefix = HF_PREFIX.format(i=i)
        for seq, indices in HF_LINEARS.items():
            for j in indices:
                layer = getattr(router, seq).layers[j]
                out[f"{prefix}{seq}.{j}.weight"] = np.asarray(layer.kernel[...], np.float32).T
                out[f"{prefix}{seq}.{j}.bias"] = np.asarray(layer.bias[...], np.float32)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_router(model: PawQwen3ForCausalLM, path: str | os.PathLike) -> None:
    """Write every layer's router to a safetensors file under HF names (float32).

    Raises:
      TypeError, ValueError: not a PawQwen3 model, or one without routers.
    """
    from safetensors.numpy import save_file

    save_file(router_tensors(model), os.fspath(path), metadata={"format": "pt"})


def load_router(model: PawQwen3ForCausalLM, path: str | os.PathLike) -> None:
    """Load a `save_router` file (or any file with the HF router names) into `model` in place.

    Every router tensor of every layer must be present with its HF shape; the file must hold
    nothing else. Inference uses the routers only with `enable_ada_sparsity=True`.

    Raises:
      TypeError, ValueError: not a PawQwen3 model, or one without routers; tensors of the wrong
        shape; tensors the model has no place for (listed).
      KeyError: tensors missing from the file (listed).
      FileNotFoundError: no file at `path`.
    """
    from safetensors.numpy import load_file

    routers = _routers(model)
    tensors = load_file(os.fspath(path))
    expected = set(router_tensors(model))
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ValueError(f"{os.fspath(path)}: tensors the model has no router for: {unexpected}")
    for i, router in enumerate(routers):
        load_hf_state(router, tensors, prefix=HF_PREFIX.format(i=i))


def sparse_fraction(decisions: Int[Array, "L B K"]) -> float:
    """Fraction of sparse (z = 0) decisions in `model.router_decisions(...)`'s output."""
    return float(1.0 - np.mean(np.asarray(decisions)))
