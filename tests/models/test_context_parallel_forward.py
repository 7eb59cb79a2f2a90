"""Context parallelism in a model's forward (`models.context_parallel`) against the one-device
forward, on 4 fake CPU devices.

JAX fixes its CPU device count when it starts, so the sharded checks run in one subprocess with
`--xla_force_host_platform_device_count=4` (this module as a script: `_worker`); each pytest case
reads that run's verdict for its own check. A check builds a tiny random float32 model (no
checkpoint) and compares, at S = 61 tokens (not a multiple of 4 or 8: the ops pad the end), the
logits and the gradient of a cross-entropy loss with respect to every parameter with those of
the plain full forward (`DenseAttend`, the single-device GDN mix) on the same parameters:

- Llama (GQA N4 / K2) and Qwen3-Next through `model(ids, attend=ContextParallelAttend(...))`
  with the ids sharded by sequence, and `forward` under grad (global arrays, each layer's op
  reorders itself);
- Qwen3 with a sliding layer (window 16, 2 sinks) through `context_parallel_forward` (the whole
  forward in one `shard_map`, zig-zag layout from embedding to logits), all-gather and ring;
- Qwen3-Next (a GDN layer, Nk 2 / Nv 4, chunk size 8, then a MoE; a gated attention layer,
  N4 / K2) both ways (all-gather, ring), with random initial GDN states in the `shard_map` run,
  which computes the per-token losses on the devices (`targets=`; compared per token);
- the `shard_map` forward on an explicit mesh axis (`jax.make_mesh`'s default).

A wrong causal mask, window, sink count, GQA mapping, halo exchange or state pass changes the
logits by far more than the tolerance; a gradient that did not return to the device owning a
token, or a replicated parameter's gradient not summed over devices, shows in the gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.utils import assert_close, report_verdicts, run_worker

NUM_DEVICES = 4
VOCAB = 128
SEQ = 61  # not a multiple of D = 4 nor of the zig-zag unit 2 D = 8
# f32; measured max differences 2.1e-6 (logits of magnitude ~2) and 8.5e-7 (gradients).
LOGIT_TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_parameters=_ROPE)
# family -> HF-style config. Qwen3's layer 1 slides over 16 positions (2 sinks added below).
CONFIGS = {
    "llama": ("llama", _LLAMA),
    "qwen3": ("qwen3", dict(_LLAMA, head_dim=8, use_sliding_window=True, sliding_window=16,
                            max_window_layers=1)),
    "qwen3_next": ("qwen3_next", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
        rope_parameters=dict(_ROPE, partial_rotary_factor=0.5), intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, mlp_only_layers=[1])),
}
# name -> (config, entry, variant, GDN initial states, mesh axis type). Entry "call":
# `model(ids, attend=...)` for the logits and `forward` under grad; "shard_map":
# `context_parallel_forward`; "shard_map-nll": the same with `targets` (per-token losses).
CASES = {
    "llama-ring-call": ("llama", "call", "ring", False, "auto"),
    "llama-ring-shard_map-explicit": ("llama", "shard_map", "ring", False, "explicit"),
    "qwen3-window-sinks-allgather-shard_map": ("qwen3", "shard_map", "allgather", False, "auto"),
    "qwen3-window-sinks-ring-shard_map": ("qwen3", "shard_map", "ring", False, "auto"),
    "qwen3_next-ring-shard_map-states-nll": ("qwen3_next", "shard_map-nll", "ring", True,
                                             "auto"),
    "qwen3_next-allgather-call": ("qwen3_next", "call", "allgather", False, "auto"),
}
# Covered by a sibling case: `model(ids, attend=...)` (Qwen3-Next's; Qwen3 is Llama with q / k
# norms and a window), the all-gather variant (Qwen3-Next's; the window and sinks through the
# ring), the explicit-axis reorder (the ops' own tests).
SLOW = {"llama-ring-call", "qwen3-window-sinks-allgather-shard_map",
        "llama-ring-shard_map-explicit"}


def build(name: str, seed: int = 0):
    """A random-weight float32 model of `CONFIGS[name]` (weights scaled up from the init's 0.02
    so every layer moves the logits); Qwen3 gets 2 sinks on its sliding layer, Qwen3-Next a GDN
    chunk of 8 (several chunks a device block)."""
    import models.families  # noqa: F401  (registers the families)
    from models.config import HFConfig
    from models.convert.registry import get_family

    family, cfg = CONFIGS[name]
    fam = get_family(family)
    config = fam.config_from_hf(HFConfig(dict(cfg), source=f"test:{name}"))
    if name == "qwen3":
        config = dataclasses.replace(config, attention=dataclasses.replace(
            config.attention, sinks=2))
    if name == "qwen3_next":
        config = dataclasses.replace(config, gdn=dataclasses.replace(config.gdn, chunk_size=8))
    model = fam.model_cls(config, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    gen = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: x * 4 if x.ndim >= 2 else x + jnp.asarray(
        0.1 * gen.standard_normal(x.shape), x.dtype), params)
    return nnx.merge(graphdef, params)


def _data(seed: int = 1):
    gen = np.random.default_rng(seed)
    ids = jnp.asarray(gen.integers(0, VOCAB, (2, SEQ)), jnp.int32)
    targets = jnp.asarray(gen.integers(0, VOCAB, (2, SEQ)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32) + 3, (2, SEQ))
    return ids, targets, positions


def _gdn_states(model, seed: int = 2):
    """Random `GDNState`s for the GDN layers, None for the others."""
    from models.layers.gdn import GatedDeltaNet, GDNState

    gen = np.random.default_rng(seed)
    states = []
    for layer in model.layers:
        mixer = layer.mixer
        if not isinstance(mixer, GatedDeltaNet):
            states.append(None)
            continue
        spec = mixer.spec
        conv = gen.standard_normal((2, spec.conv_dim, spec.conv_width - 1))
        ssm = 0.3 * gen.standard_normal((2, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim))
        states.append(GDNState(jnp.asarray(conv, jnp.float32), jnp.asarray(ssm, jnp.float32)))
    return states


def _token_nll(logits, targets):
    """`[B, S]` float32 `-log softmax(logits)[target]`."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]


def _check(name: str) -> None:
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.context_parallel import ContextParallelAttend, context_parallel_forward
    from models.layers.attention import DenseAttend

    config, entry, variant, with_states, axis_type = CASES[name]
    model = build(config)
    graphdef, params = nnx.split(model)
    ids, targets, positions = _data()
    states = _gdn_states(model) if with_states else None
    mesh = Mesh(np.array(jax.devices()), ("sp",), axis_types=(
        AxisType.Explicit if axis_type == "explicit" else AxisType.Auto,))
    dense = DenseAttend(implementation="xla")
    cp = ContextParallelAttend(mesh=mesh, axis_name="sp", variant=variant, implementation="xla")

    nll = entry == "shard_map-nll"  # compare per-token losses [B, S], else logits [B, S, V]

    def reference(params):
        m = nnx.merge(graphdef, params)
        hidden, _ = m.forward(ids, positions, attend=dense, states=states)
        return _token_nll(m.logits(hidden), targets) if nll else m.logits(hidden)

    def ours(params):
        m = nnx.merge(graphdef, params)
        if entry.startswith("shard_map"):
            return context_parallel_forward(m, ids, positions, mesh=mesh, axis_name="sp",
                                            variant=variant, implementation="xla",
                                            states=states, targets=targets if nll else None)
        hidden, _ = m.forward(ids, positions, attend=cp)
        return m.logits(hidden)

    loss_of = (lambda out: jnp.mean(out)) if nll else (
        lambda out: jnp.mean(_token_nll(out, targets)))
    grad = lambda f: jax.jit(jax.value_and_grad(lambda p: (lambda out: (loss_of(out), out))(
        f(p)), has_aux=True))
    (want_loss, want), want_grads = grad(reference)(params)
    (loss, got), grads = grad(ours)(params)
    assert_close(got, want, err_msg=f"{name} {'nll' if nll else 'logits'}", **LOGIT_TOL)
    assert_close(loss, want_loss, err_msg=f"{name} loss", **LOGIT_TOL)
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(want_grads)):
        assert_close(a, e, err_msg=f"{name} d{jax.tree_util.keystr(path)}", **GRAD_TOL)
    if entry == "call":  # the public jitted forward, ids sharded by sequence (60 = 4 x 15)
        sharded = jax.device_put(ids[:, :60], NamedSharding(mesh, P(None, "sp")))
        logits = model(sharded, positions=positions[:, :60], attend=cp, buckets=None)
        assert_close(logits, want[:, :60], err_msg=f"{name} model(ids, attend=cp)",
                     **LOGIT_TOL)


def _worker() -> None:
    report_verdicts({name: functools.partial(_check, name) for name in CASES})


@pytest.fixture(scope="module")
def sharded_run(request):
    """One worker for the selected cases (slow ones only under `-m slow`)."""
    names = [item.callspec.params["name"] for item in request.session.items
             if item.originalname == "test_context_parallel_equals_one_device"]
    return run_worker("tests.models.test_context_parallel_forward", NUM_DEVICES, names)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in CASES])
def test_context_parallel_equals_one_device(sharded_run, name):
    assert sharded_run["devices"] == NUM_DEVICES
    assert sharded_run["verdicts"][name] == "ok", sharded_run["verdicts"][name]


def _one_device_mesh():
    from jax.sharding import AxisType, Mesh
    return Mesh(np.array(jax.devices()[:1]), ("sp",), axis_types=(AxisType.Auto,))


def test_one_device_mesh_equals_dense_forward():
    """On a 1-device mesh the `shard_map` forward is the plain forward (the ring is one block)."""
    from models.context_parallel import context_parallel_forward

    model = build("qwen3")
    ids, _, positions = _data()
    want = model(ids, positions=positions, buckets=None, implementation="xla")
    got = jax.jit(lambda ids, positions: context_parallel_forward(
        model, ids, positions, mesh=_one_device_mesh(), axis_name="sp",
        implementation="xla"))(ids, positions)
    assert_close(got, want, **LOGIT_TOL)


def test_attend_errors_name_the_value():
    from models.context_parallel import ContextParallelAttend

    mesh = _one_device_mesh()
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        ContextParallelAttend(mesh="sp", axis_name="sp")
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis of the mesh"):
        ContextParallelAttend(mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match="variant='striped' must be one of"):
        ContextParallelAttend(mesh=mesh, axis_name="sp", variant="striped")
    with pytest.raises(ValueError, match="implementation='cuda' must be one of"):
        ContextParallelAttend(mesh=mesh, axis_name="sp", implementation="cuda")
    with pytest.raises(ValueError, match="seq_len=0 must be None or an int >= 1"):
        ContextParallelAttend(mesh=mesh, axis_name="sp", seq_len=0)


def test_unsupported_options_are_refused_by_name():
    """A KV-cache state, an attend spec with more options than `AttendSpec` (elastic), and MLA
    layers raise NotImplementedError naming what is not supported."""
    from models.context_parallel import ContextParallelAttend
    from models.families.pawqwen3 import ElasticAttendSpec
    from models.layers.attention import QKV, AttendSpec
    from tests.models.test_engine_tp import build as build_tp

    cp = ContextParallelAttend(mesh=_one_device_mesh(), axis_name="sp", implementation="xla")
    x = jnp.ones((1, 8, 2, 4), jnp.float32)
    with pytest.raises(NotImplementedError, match="layer 3: .* without a KV cache; got state"):
        cp(AttendSpec(layer=3, scale=0.5), QKV(x, x, x), state=(x, x))
    elastic = ElasticAttendSpec(
        layer=1, scale=0.5, retrieval_mode="full", toggle_type="streaming", group_size=1,
        block_size=4, stride=2, threshold=0.9, norm=1.0, sink_blocks=1, local_blocks=2)
    with pytest.raises(NotImplementedError, match=r"ElasticAttendSpec adds \['retrieval_mode'"):
        cp(elastic, QKV(x, x, x))
    model = build_tp("deepseek_v3")  # layer 0: MLA
    ids = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(NotImplementedError, match="layer 0: .* does not support MLA layers"):
        model.forward(ids, jnp.zeros((1, 8), jnp.int32), attend=cp)


def test_forward_errors_name_the_value():
    from models.context_parallel import context_parallel_forward

    model = build("llama")
    mesh = _one_device_mesh()
    run = lambda ids, positions=None, **kw: context_parallel_forward(
        model, ids, positions, **{"mesh": mesh, "axis_name": "sp", **kw})
    ids = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match=r"input_ids must have shape \[B, S\]"):
        run(ids[0])
    with pytest.raises(TypeError, match="input_ids.dtype=float32 must be an integer type"):
        run(ids.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"positions.shape=\(1, 7\) must equal"):
        run(ids, ids[:, :7])
    with pytest.raises(ValueError, match=r"targets.shape=\(1, 7\) must equal"):
        run(ids, targets=ids[:, :7])
    with pytest.raises(TypeError, match="targets.dtype=float32 must be an integer type"):
        run(ids, targets=ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis"):
        run(ids, axis_name="tp")
    with pytest.raises(ValueError, match="variant='striped'"):
        run(ids, variant="striped")


if __name__ == "__main__":
    _worker()
