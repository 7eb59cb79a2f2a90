"""Per-mixer adapters: how the engine keeps and drives the state of one kind of layer.

The engine knows no mixer class. Every model layer is served by an adapter from a registry keyed
by layer kind; an adapter says which mixers it serves and, for them:

* host side: whether the layer holds pages in the engine's one block table (`paged`) and with
  how many KV heads, the state it needs (`create_state`) and its bytes (`state_bytes`), the
  window / sinks that a policy's full head falls back to (`configured_policy`), and what it
  refuses (`check`, `check_policy`, with the reason in the message);
* device side: `attend(ctx, spec, inputs, state) -> (o, state)`, called for the layer by the
  step's attend object (`models.engine.step.PagedAttend`, the `ctx`: offsets, lengths, block
  tables, windows of this step), and `reset(state, slots)` for rows being freed.

Built in: softmax attention (`"attention"`), MLA (`"mla"`) and Gated DeltaNet (`"gdn"`), each
described on its class. A model family plugs its own adapter in by calling `register_adapter` at
import (PawQwen3's elastic attention: `models/families/pawqwen3_engine.py`); this package imports
no model family.

Routed adapters (`routed = True`, used only by `Engine(elastic=True)`) decide per request at
prefill: in the mixed step their state comes back as `(state, z [B, K])`, and `routed_policy`
turns one request's decisions into the window and sinks of its later steps.

Tensor parallelism (`Engine(..., mesh=...)`, `models.engine.sharding`): an adapter that can split
its layer by heads over a mesh axis says so with `tp_heads` (the head counts that must divide the
axis size) and `tp_specs` (`TPSpecs`: how its inputs, output and block-table rows split); the step
then runs its `attend` under `shard_map` on this device's heads, with a `ctx` whose table,
window and sinks hold only those heads. Its state splits by `tp_state_spec` (by default the
`kv.sharding` rule of the state's type). An adapter without them (`tp_heads` returning None)
makes the engine refuse a mesh.

`resolve` picks, among the registered adapters whose `matches(mixer)` holds, a routed one first
for a routed engine, else a non-routed one; the latest registered wins, so a family's adapter for
its own mixer class takes precedence over a generic one. Adapters are frozen dataclasses built
per layer (`for_layer`) and hold only static, hashable facts: they are static arguments of the
jitted step, so engines over equal layers share its compilation.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import kv
from attn.conv1d import causal_conv1d, causal_conv1d_update_pool
from attn.gdn import gdn_decode_pool, gdn_prefill_pool
from attn.mla import absorb_query, expand_output, mla_absorbed_attention, mla_paged_decode
from models.engine.cache import PagedKV, paged_attention
from models.layers.attention import QKV, AttendSpec, Attention
from models.layers.gdn import GatedDeltaNet, GDNInputs, GDNSpec, split_qkv
from models.layers.mla import MLAProjection, MLASpec, MLAttention

ADAPTERS: dict[str, type[MixerAdapter]] = {}  # kind -> adapter class, in registration order


def register_adapter(cls: type[MixerAdapter]) -> type[MixerAdapter]:
    """Register an adapter class under its `kind` (usable as a class decorator).

    Raises:
      ValueError: another class already holds that kind.
    """
    held = ADAPTERS.get(cls.kind)
    name = (cls.__module__, cls.__qualname__)  # the same class again (a module reload) is fine
    if held is not None and (held.__module__, held.__qualname__) != name:
        raise ValueError(f"adapter kind {cls.kind!r} is already registered to {held.__name__}")
    ADAPTERS[cls.kind] = cls
    return cls


def resolve(model, layer: int, mixer, *, routed: bool) -> MixerAdapter:
    """The adapter of one layer: a matching routed adapter first if `routed`, else a non-routed
    one; the latest registered wins.

    Raises:
      ValueError: no registered adapter serves the mixer.
    """
    found = [cls for cls in reversed(ADAPTERS.values()) if cls.matches(mixer)]
    for cls in sorted(found, key=lambda c: not (routed and c.routed)):
        if routed or not cls.routed:
            return cls.for_layer(model, mixer)
    kinds = ", ".join(f"{c.__name__} ({c.kind})" for c in ADAPTERS.values())
    raise ValueError(f"layer {layer} has a {type(mixer).__name__} mixer; the engine runs the "
                     f"mixers of its registered adapters: {kinds}")


def _xla_or_auto(implementation: str) -> str:
    """Backend of the GDN / MLA ops: `"xla"` if asked for, else their own `"auto"` choice."""
    return "xla" if implementation == "xla" else "auto"


@dataclasses.dataclass(frozen=True)
class TPSpecs:
    """How one layer's `attend` splits over the tensor-parallel mesh axis.

    Attributes:
      inputs: a `PartitionSpec` pytree matching the layer's inputs (`QKV`, `GDNInputs`, ...).
      out: `PartitionSpec` of the output `o [B, T, N, Hv]` (split by head).
      kv_heads: the layer's block-table rows, windows and sinks split by KV head (attention);
        False: every device holds all of them (MLA's one latent head, GDN without pages).
    """

    inputs: Any
    out: P
    kv_heads: bool


def _heads(axis: str, rank: int, dim: int) -> P:
    """`PartitionSpec` of a rank-`rank` array split over `axis` along `dim`."""
    return P(*(axis if i == dim else None for i in range(rank)))


@dataclasses.dataclass(frozen=True)
class MixerAdapter(abc.ABC):
    """How the engine serves one kind of mixer (see the module docstring).

    Class attributes:
      kind: registry key, reported per layer as `Engine.layer_kinds`.
      mixer_types: the mixer classes it serves (`matches` may narrow further).
      paged: the layer's KV lives in pages of the shared block table.
      routed: the layer routes each request at prefill (elastic engines only).
    """

    kind: ClassVar[str]
    mixer_types: ClassVar[tuple[type, ...]]
    paged: ClassVar[bool]
    routed: ClassVar[bool] = False

    @classmethod
    def matches(cls, mixer) -> bool:
        return isinstance(mixer, cls.mixer_types)

    @classmethod
    def for_layer(cls, model, mixer) -> MixerAdapter:
        """The adapter of one layer, holding its static facts (none by default)."""
        return cls()

    def num_kv_heads(self, mixer) -> int:
        """Heads the layer holds in the block table (0 for a layer without pages)."""
        return 0

    @abc.abstractmethod
    def create_state(self, mixer, *, batch_slots: int, num_pages: int, page_size: int,
                     kv_dtype, model_dtype) -> Any:
        """The layer's device state (a page pool, latent pool or slot pool)."""

    @abc.abstractmethod
    def state_bytes(self, state) -> tuple[int, int]:
        """`(bytes of one page of one head, bytes of one slot)` of the layer's state."""

    def configured_policy(self, mixer) -> tuple[int, int]:
        """`(window, sinks)` of the layer itself, used where a policy says full."""
        return 0, 0

    def check(self, mixer, *, layer: int, kv_dtype, model_name: str) -> None:
        """Raise ValueError for an engine setting the layer cannot hold (none by default)."""
        return

    def check_policy(self, layer: int, window: np.ndarray, name: str) -> None:
        """Raise ValueError for a policy row `window [K]` the layer cannot honour (none by
        default)."""
        return

    def routed_policy(self, decisions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(window [K], sinks [K])` of a request whose decisions on this layer are
        `decisions [K]`; full heads for a layer that does not route."""
        zero = np.zeros_like(decisions, np.int32)
        return zero, zero

    @abc.abstractmethod
    def attend(self, ctx, spec, inputs, state) -> tuple[Any, Any]:
        """`(o [B, T, N, Hv], new state)`: write this step's inputs into the state, attend."""

    def reset(self, state, slots):
        """The state with the freed rows' slots (`[B]` int32, null slot elsewhere) cleared;
        pages are freed by the engine, so paged layers keep their state."""
        return state

    def tp_heads(self, mixer) -> dict[str, int] | None:
        """Head counts the tensor-parallel axis size must divide (`{"num_kv_heads": 8, ...}`),
        or None: the layer has no tensor-parallel layout (the engine then refuses a mesh)."""
        return None

    def tp_specs(self, spec, inputs, axis: str) -> TPSpecs:
        """How `attend`'s inputs and output split over mesh axis `axis` (see `TPSpecs`)."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor-parallel layout")

    def tp_state_spec(self, state, axis: str):
        """`PartitionSpec` pytree of the layer's state: the `kv.sharding` rule of its type."""
        return kv.partition_specs(state, axis)


@register_adapter
@dataclasses.dataclass(frozen=True)
class AttentionAdapter(MixerAdapter):
    """Softmax attention (Llama, Qwen3, gated attention) over a `kv.PagePool` `[K, num_pages, P,
    H]`: the layer writes k, v (`kv.write_kv`, quantising for FP8 pools); the mixed step runs
    `paged_prefill_attention` on the pages (`q_offset` = cached length, `[B, K]` windows /
    sinks), the decode step `paged_decode` (both `models.engine.cache.paged_attention`), or the
    engine's custom attend on the same `PagedKV`. A layer's own window (Qwen3 sliding layers)
    applies where a policy says full."""

    kind: ClassVar[str] = "attention"
    mixer_types: ClassVar[tuple[type, ...]] = (Attention,)
    paged: ClassVar[bool] = True

    def num_kv_heads(self, mixer) -> int:
        return mixer.cfg.num_kv_heads

    def create_state(self, mixer, *, batch_slots, num_pages, page_size, kv_dtype, model_dtype):
        c = mixer.cfg
        return kv.create_page_pool(num_kv_heads=c.num_kv_heads, num_pages=num_pages,
                                   page_size=page_size, head_dim=c.head_dim,
                                   value_head_dim=c.hv, dtype=kv_dtype)

    def state_bytes(self, state) -> tuple[int, int]:
        return kv.page_bytes(state), 0

    def configured_policy(self, mixer) -> tuple[int, int]:
        return mixer.cfg.window or 0, mixer.cfg.sinks

    def tp_heads(self, mixer) -> dict[str, int]:
        return {"num_heads": mixer.cfg.num_heads, "num_kv_heads": mixer.cfg.num_kv_heads}

    def tp_specs(self, spec, qkv: QKV, axis: str) -> TPSpecs:
        heads = _heads(axis, 4, 2)  # [B, T, N | K, H]
        gate = None if qkv.gate is None else _heads(axis, 3, 2)  # [B, T, N * H], heads major
        return TPSpecs(inputs=QKV(heads, heads, heads, gate), out=heads, kv_heads=True)

    def cache(self, ctx, spec: AttendSpec, qkv: QKV, pool: kv.PagePool) -> PagedKV:
        """Write this step's k, v into the layer's pages; the `PagedKV` an attend reads."""
        lengths = ctx.offsets + ctx.num_new
        table = ctx.layer_table(spec.layer, pool.num_kv_heads)  # [B, K, M]
        zeros = jnp.zeros(table.shape[:2], jnp.int32)
        tables = kv.BlockTables(table=table, extent=zeros, cursor=zeros,
                                page_size=ctx.page_size)
        pool = kv.write_kv(pool, tables, qkv.k, qkv.v, ctx.offsets, ctx.num_new)
        return PagedKV(pool=pool, table=table, q_offset=ctx.offsets, kv_lengths=lengths,
                       window=ctx.window[:, spec.layer], sinks=ctx.sinks[:, spec.layer],
                       decode=ctx.decode, implementation=ctx.implementation,
                       kv_shards=1 if ctx.axis is None else jax.lax.axis_size(ctx.axis))

    def attend(self, ctx, spec: AttendSpec, qkv: QKV, pool: kv.PagePool):
        """Write, then the engine's custom attend (`Engine(attend=...)`) if any, else
        `paged_attention` (paged prefill, or paged decode in the decode step)."""
        cache = self.cache(ctx, spec, qkv, pool)
        o, cache = (ctx.custom or paged_attention)(spec, qkv, cache)
        if not isinstance(cache, PagedKV):
            raise TypeError(f"layer {spec.layer}: the engine's attend returned "
                            f"{type(cache).__name__} as its state; it must return the PagedKV "
                            f"it was given (or one with a new pool)")
        return o, cache.pool


@register_adapter
@dataclasses.dataclass(frozen=True)
class MLAAdapter(MixerAdapter):
    """MLA (DeepSeek-V2 / V3) over a `kv.LatentPool` `[num_pages, P, L + R]` (one latent
    "head"): `[c_kv ‖ k_pe]` is written by slot mapping (`kv.write_latent`); the mixed step runs
    `mla_absorbed_attention` over the gathered latent, the decode step `absorb_query` →
    `mla_paged_decode` → `expand_output`. Refuses an FP8 latent and windows (the MLA ops have
    neither)."""

    kind: ClassVar[str] = "mla"
    mixer_types: ClassVar[tuple[type, ...]] = (MLAttention,)
    paged: ClassVar[bool] = True

    def num_kv_heads(self, mixer) -> int:
        return 1

    def create_state(self, mixer, *, batch_slots, num_pages, page_size, kv_dtype, model_dtype):
        c = mixer.cfg
        return kv.create_latent_pool(num_pages=num_pages, page_size=page_size,
                                     kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
                                     dtype=kv_dtype)

    def state_bytes(self, state) -> tuple[int, int]:
        return state.page_size * state.pages.shape[-1] * state.pages.dtype.itemsize, 0

    def tp_heads(self, mixer) -> dict[str, int]:
        return {"num_heads": mixer.cfg.num_heads}

    def tp_specs(self, spec, proj: MLAProjection, axis: str) -> TPSpecs:
        heads, up = _heads(axis, 4, 2), _heads(axis, 3, 0)  # q [B, T, N, *], w [N, *, L]
        # The latent (c_kv, k_pe) is one head shared by every query head: whole on every device.
        return TPSpecs(inputs=MLAProjection(q_nope=heads, q_pe=heads, c_kv=P(), k_pe=P(),
                                            w_uk=up, w_uv=up), out=heads, kv_heads=False)

    def check(self, mixer, *, layer, kv_dtype, model_name) -> None:
        if jnp.dtype(kv_dtype).itemsize == 1:
            raise ValueError(f"kv_dtype={jnp.dtype(kv_dtype)}: MLA layers have no FP8 latent "
                             f"cache; use a 16- or 32-bit kv_dtype for {model_name}")

    def check_policy(self, layer, window, name) -> None:
        if np.any(window > 0):
            raise ValueError(
                f"policy {name!r} asks for window {window.tolist()} on layer {layer}, an MLA "
                f"layer: the MLA latent cache supports no sliding window (use window <= 0 on "
                f"MLA layers)")

    def attend(self, ctx, spec: MLASpec, proj: MLAProjection, pool: kv.LatentPool):
        impl = _xla_or_auto(ctx.implementation)
        table = ctx.layer_table(spec.layer, 1)[:, 0]  # [B, M]
        lengths = ctx.offsets + ctx.num_new
        t = proj.c_kv.shape[1]
        slots = kv.latent_slot_mapping(table, ctx.offsets, ctx.num_new, num_tokens=t,
                                       page_size=ctx.page_size)
        pool = kv.write_latent(pool, proj.c_kv, proj.k_pe, slots)
        if ctx.decode:
            q_lat = absorb_query(proj.q_nope[:, 0], proj.w_uk)
            o_lat, _ = mla_paged_decode(q_lat, proj.q_pe[:, 0], pool.pages, table, lengths,
                                        kv_lora_rank=spec.kv_lora_rank, scale=spec.scale,
                                        implementation=impl)
            return expand_output(o_lat, proj.w_uv)[:, None], pool
        latent = kv.gather_latent(pool, table).astype(proj.c_kv.dtype)  # [B, S, L + R]
        lr = spec.kv_lora_rank
        o, _ = mla_absorbed_attention(proj.q_nope, proj.q_pe, latent[..., :lr], latent[..., lr:],
                                      proj.w_uk, proj.w_uv, scale=spec.scale,
                                      q_offset=ctx.offsets, kv_lengths=lengths)
        return o, pool


@register_adapter
@dataclasses.dataclass(frozen=True)
class GDNAdapter(MixerAdapter):
    """Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers) over a `kv.SlotPool` (conv
    `[B + 1, C, W - 1]`, ssm `[B + 1, Nv, H, Hv]` float32); no pages.

    Batch row `r` owns slot `r + 1` for good; idle rows use the null slot 0, so their writes go
    nowhere and the state of the row they would stand for stays bit-for-bit unchanged. A row
    whose request starts (cached length 0: new, or recomputed after preemption) reads zeros
    whatever its slot holds (`has_initial_state`), and freeing a row zeroes its slot. The mixed
    step runs the causal conv from the slot's conv state and keeps, as the new conv state, the
    last `W - 1` inputs before the row's `num_new`-th token; padding tokens enter the chunked
    delta rule as zero q / k / v / g / beta, which leaves the state unchanged. The decode step
    runs `causal_conv1d_update_pool` and `gdn_decode_pool`.

    Tensor parallel: the conv runs on every channel on every device (its taps and conv state
    whole: `[q │ k │ v]` channels would need a split per segment, and the conv is a small part
    of the layer); each device then keeps its key heads of q, k and its value heads of v
    (`ctx.local_heads`; value head `h` reads key head `h // r`, so `Nk / tp` key heads serve
    `Nv / tp` value heads), and runs the delta rule on its value heads of the ssm pool.
    """

    kind: ClassVar[str] = "gdn"
    mixer_types: ClassVar[tuple[type, ...]] = (GatedDeltaNet,)
    paged: ClassVar[bool] = False

    def create_state(self, mixer, *, batch_slots, num_pages, page_size, kv_dtype, model_dtype):
        c = mixer.cfg
        return kv.create_slot_pool(
            num_slots=batch_slots + 1, conv_dim=c.conv_dim, conv_width=c.conv_width,
            num_v_heads=c.num_v_heads, head_k_dim=c.head_k_dim, head_v_dim=c.head_v_dim,
            dtype=model_dtype)

    def state_bytes(self, state) -> tuple[int, int]:
        return 0, int(sum(x[0].size * x.dtype.itemsize for x in (state.conv, state.ssm)))

    def reset(self, state, slots):
        return kv.reset_slots(state, slots)

    def tp_heads(self, mixer) -> dict[str, int]:
        return {"num_k_heads": mixer.cfg.num_k_heads, "num_v_heads": mixer.cfg.num_v_heads}

    def tp_specs(self, spec, inputs: GDNInputs, axis: str) -> TPSpecs:
        return TPSpecs(inputs=GDNInputs(x=P(), z=_heads(axis, 4, 2), g=_heads(axis, 3, 2),
                                        beta=_heads(axis, 3, 2), conv_weight=P()),
                       out=_heads(axis, 4, 2), kv_heads=False)

    @staticmethod
    def _local(ctx, q, k, v):
        """This device's key heads of q, k and value heads of v (all of them without a mesh)."""
        return ctx.local_heads(q, 2), ctx.local_heads(k, 2), ctx.local_heads(v, 2)

    def attend(self, ctx, spec: GDNSpec, inputs: GDNInputs, pool: kv.SlotPool):
        impl = _xla_or_auto(ctx.implementation)
        b, t, _ = inputs.x.shape
        rows = jnp.arange(b, dtype=jnp.int32)
        slots = jnp.where(ctx.num_new > 0, rows + 1, kv.NULL_SLOT)
        has_state = ctx.offsets > 0
        if ctx.decode:
            y, conv_pool = causal_conv1d_update_pool(
                inputs.x[:, 0], pool.conv, slots, inputs.conv_weight, activation="silu",
                has_initial_state=has_state, implementation=impl)
            q, k, v = self._local(ctx, *split_qkv(spec, y[:, None]))
            o, ssm_pool = gdn_decode_pool(q, k, v, inputs.g, inputs.beta, pool.ssm, slots,
                                          has_initial_state=has_state, scale=spec.scale,
                                          use_qk_l2norm=True, implementation=impl)
            return o, pool.replace(conv=conv_pool, ssm=ssm_pool)
        valid = jnp.arange(t, dtype=jnp.int32)[None, :] < ctx.num_new[:, None]  # [B, T]
        conv0, _ = kv.read_slots(pool, slots, has_state)
        x = jnp.where(valid[..., None], inputs.x, jnp.zeros((), inputs.x.dtype))
        y, _ = causal_conv1d(x, inputs.conv_weight, initial_state=conv0, activation="silu",
                             implementation=impl)
        # New conv state: the last W - 1 inputs before token num_new of xe = [state ‖ x].
        xe = jnp.concatenate([jnp.swapaxes(conv0, 1, 2).astype(x.dtype), x], axis=1)
        idx = ctx.num_new[:, None] + jnp.arange(spec.conv_width - 1, dtype=jnp.int32)[None]
        conv = jnp.swapaxes(jnp.take_along_axis(xe, idx[..., None], axis=1), 1, 2)
        q, k, v = self._local(ctx, *split_qkv(spec, y))
        # Padding tokens: zero q / k / v / g / beta leave the recurrent state unchanged.
        q, k, v = (jnp.where(valid[..., None, None], a, jnp.zeros((), a.dtype)) for a in (q, k, v))
        g = jnp.where(valid[..., None], inputs.g, 0.0)
        beta = jnp.where(valid[..., None], inputs.beta, 0.0)
        o, ssm_pool = gdn_prefill_pool(q, k, v, g, beta, pool.ssm, slots,
                                       has_initial_state=has_state, scale=spec.scale,
                                       use_qk_l2norm=True, chunk_size=spec.chunk_size,
                                       implementation=impl)
        drop = jnp.where(slots > 0, slots, pool.num_slots)  # idle rows write nothing
        conv_pool = pool.conv.at[drop].set(conv.astype(pool.conv.dtype), mode="drop")
        return o, pool.replace(conv=conv_pool, ssm=ssm_pool)


__all__ = [
    "ADAPTERS",
    "AttentionAdapter",
    "GDNAdapter",
    "MLAAdapter",
    "MixerAdapter",
    "TPSpecs",
    "register_adapter",
    "resolve",
]
