"""Generation engine: paged KV, fixed batch slots, chunked prefill, continuous batching, sampling.

Design. The device side is two jitted step functions with static shapes, both over `B` batch
slots and the same state (`EngineKV`: one state per model layer, one block table and one page
allocator spanning every paged layer's KV heads):

* the mixed step (`T = chunk` tokens per slot): every active slot feeds its uncached tokens, up
  to `chunk` of them — a prompt chunk (chunked prefill over its cached prefix) or a single decode
  token; rows are padded to `T`;
* the decode step (`T = 1`), used when every active slot decodes.

Every layer kind keeps its own per-layer state, and the model's layers reach it through the one
attend object the step hands to `CausalLM.forward` (`PagedAttend`):

* softmax attention (Llama, Qwen3, Qwen3-Next / Qwen3.5 gated attention): a `kv.PagePool`
  `[K, num_pages, P, H]`; the layer writes k, v (`kv.write_kv`, quantising for FP8 pools), then the
  mixed step runs `attn.dense.paged_prefill_attention` straight on the pages (`q_offset` = cached
  length, `[B, K]` windows / sinks; Triton on GPU, gather + dense attention as the reference), the
  decode step runs `attn.paged_decode.paged_decode` on the pages;
* MLA (DeepSeek-V2 / V3, `attend.mla_attend`): a `kv.LatentPool` `[num_pages, P, L + R]` (one
  latent "head"); `[c_kv ‖ k_pe]` is written by slot mapping (`kv.write_latent`), the mixed step
  runs `attn.mla.mla_absorbed_attention` over the gathered latent (`kv.gather_latent`), the decode
  step `absorb_query` → `mla_paged_decode` → `expand_output`;
* Gated DeltaNet (Qwen3-Next / Qwen3.5 linear-attention layers, `attend.gdn_mix`): a
  `kv.SlotPool` (conv `[B + 1, C, W - 1]`, ssm `[B + 1, Nv, H, Hv]` float32). Batch row `r` owns
  slot `r + 1` for good; idle rows use the null slot 0, so their writes go nowhere and the state of
  the row they would stand for stays bit-for-bit unchanged. A row whose request starts (cached
  length 0: a new request, or one recomputed after preemption) reads zeros whatever its slot holds
  (`has_initial_state`), and freeing a row zeroes its slot. The mixed step runs the causal conv
  from the slot's conv state and keeps, as the new conv state, the last `W - 1` inputs before the
  row's `num_new`-th token; padding tokens enter the chunked delta rule
  (`attn.gdn.gdn_prefill_pool`) as zero q / k / v / g / beta, which leaves the state unchanged. The
  decode step runs `causal_conv1d_update_pool` and `gdn_decode_pool`.

Pages of the paged layers (attention and MLA; `K` heads per layer, 1 for MLA) are allocated once
before the layers (`kv.alloc_batch`) and released once after them (`kv.recycle`: streaming heads
give back the pages outside sink + window), so 30 layers do not compile 30 allocators. Policies
are data: each request carries per-layer, per-KV-head `window` and `sinks` arrays (`Policy`,
`[L, K]` in model layer indices; entries of GDN layers are ignored, MLA layers cannot hold a
window), passed to the step as `[B, L, K]` int32, so requests with different policies share a
batch and a compiled step (paged prefill and paged decode both take `[B, K]` windows; nothing is
vmapped over rows, which jax-triton's kernels could not be).
Sampling (greedy, temperature, top-k, top-p) runs inside the step on the last real token of each
row; the key of the token at position `p` is `fold_in(key(seed), p)`, so a preempted request that
is recomputed samples the very same tokens.

Elastic attention (PawQwen3, `Engine(..., elastic=True)`; FastDeploy-style): a request's whole
prompt is prefilled in one mixed-step chunk (offset 0; `add` refuses prompts longer than `chunk`).
In that step each attention layer routes the row from the chunk's pre-RoPE keys (`ctx_q_pool`
over its `num_new` valid tokens, then the layer's router: decisions `z [B, K]`), turns them into
per-head modes (`derive_head_mask_type`) and runs the elastic block-sparse attention (XAttention
estimate where a mode is 1) over the chunk itself — exactly `ElasticAttend` with `lengths =
num_new`; k / v still go into the pages. Rows not at offset 0 in that step take the dense paged
path (both are computed, selected per row). The decisions `[B, L, K]` come back to the host with
the step's tokens (one `device_get`) and are stored as `Request.decisions`; from the next step on,
heads whose mode is streaming (-1) become sink + window heads (`sink_size`, `local_window_size` of
the config, in tokens) of the request's effective policy, so the host mirror and `kv.recycle`
give their pages back; full and XAttention heads decode full (dense paged decode; no sparse
decode, as in FastDeploy). Note the geometry differs: prefill streaming heads see whole blocks
(`sink_blocks`, `local_blocks` of `block_size`), decode sees exactly `sink_size` + the last
`local_window_size` tokens. A preempted elastic request is recomputed in two parts: its original
prompt is re-prefilled as one routed chunk (the same tokens at offset 0, so the same decisions
and the same block-sparse rows as its first run), then its generated tokens are fed as ordinary
dense chunks under the re-derived per-head windows — the same attention its decode steps had
(chunked prefill instead of one-token decode: equal up to float rounding), so its continuation
is the one it would have had without preemption. `Request.decisions` is cleared at preemption
and set again by the recomputation.

The host scheduler holds every count: which request sits in which slot, how many of its tokens
are cached, and a NumPy mirror of every paged layer's page accounting (extent, recycle cursor,
free pages per head), so it knows before a step whether the pools can hold it — no device value
is read inside or before a step. When they cannot, the most recently admitted request is
preempted: its pages are freed and its GDN slots zeroed (`kv.free_batch`, `kv.reset_slots`, one
jitted call) and it goes back to the front of the queue with prompt + generated tokens as its new
prompt, recomputed when pages free up. GDN state needs no scheduling: every row has its slot.

Not done here: an FP8 MLA latent cache and windows / sinks on MLA layers (the MLA ops have
neither; both are refused with a ValueError), paged layers with different KV head counts in one
model, models without any paged layer, prefix sharing (GDN state would need snapshots at page
borders), speculative decoding, multi-device sharding of the step. Elastic mode: prompts longer
than one chunk (routing would need the pooled keys of the whole prompt before its first chunk
attends: a two-pass prefill), sparse decode for XAttention heads (they decode full), elastic MLA
layers, request-supplied policies with `elastic=True` (refused), and skipping the unused branch of
the per-row elastic / dense selection (both run in every elastic mixed step).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

import kv
from attn.conv1d import causal_conv1d, causal_conv1d_update_pool
from attn.dense import paged_prefill_attention
from attn.elastic.reference import MODE_CODES
from attn.gdn import gdn_decode_pool, gdn_prefill_pool
from attn.mla import absorb_query, expand_output, mla_absorbed_attention, mla_paged_decode
from attn.paged_decode import paged_decode
from models.families.pawqwen3 import ElasticAttend, ElasticAttendSpec
from models.layers.attention import QKV, AttendSpec, Attention
from models.layers.gdn import GatedDeltaNet, GDNInputs, GDNSpec, split_qkv
from models.layers.mla import MLAProjection, MLASpec, MLAttention

FP8 = jnp.float8_e4m3fn


# ----------------------------------------------------------------------------------------------
# Requests and policies (host side)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Per-request attention policy: per layer and KV head, a window and a sink count.

    Attributes:
      window: `[L, K]` int32, most recent positions visible (own included); `<= 0` = full (then a
        layer's own configured window, if any, applies).
      sinks: `[L, K]` int32 leading positions that stay visible beside the window.
      name: label for reports.

    A head with `window > 0` is a streaming head: the engine releases its pages outside
    sink + window, so it holds at most `ceil(sinks / P) + window / P + 2` pages.
    """

    window: np.ndarray
    sinks: np.ndarray
    name: str = "custom"

    def __post_init__(self):
        w = np.asarray(self.window)
        s = np.asarray(self.sinks)
        if w.ndim != 2 or s.shape != w.shape:
            raise ValueError(f"window and sinks must both be [L, K]; got shapes {w.shape} and "
                             f"{s.shape}")
        if np.any(s < 0):
            raise ValueError(f"sinks must be >= 0; got min {s.min()}")
        object.__setattr__(self, "window", w.astype(np.int32))
        object.__setattr__(self, "sinks", s.astype(np.int32))

    @classmethod
    def dense(cls, num_layers: int, num_kv_heads: int) -> Policy:
        """Every head full (a layer's configured window still applies)."""
        z = np.zeros((num_layers, num_kv_heads), np.int32)
        return cls(z, z, "dense")

    @classmethod
    def streaming(cls, num_layers: int, num_kv_heads: int, *, window: int, sinks: int) -> Policy:
        """Every head sliding window + sinks."""
        shape = (num_layers, num_kv_heads)
        return cls(np.full(shape, window), np.full(shape, sinks), f"window{window}+sinks{sinks}")

    @classmethod
    def headwise(cls, num_layers: int, num_kv_heads: int, *, window: int, sinks: int,
                 streaming: np.ndarray | None = None) -> Policy:
        """Head-wise KV: the heads marked in `streaming` (`[L, K]` bool) stream, the rest are full.

        Default `streaming`: every other (layer, head) pair in row-major order, i.e. half of all
        KV heads of the model (`(l * K + k) % 2 == 1`).
        """
        if streaming is None:
            idx = np.arange(num_layers * num_kv_heads).reshape(num_layers, num_kv_heads)
            streaming = idx % 2 == 1
        streaming = np.asarray(streaming, bool)
        return cls(np.where(streaming, window, 0), np.where(streaming, sinks, 0),
                   f"headwise{window}+sinks{sinks}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request samples and stops.

    Attributes:
      temperature: 0 = greedy (argmax); else softmax temperature.
      top_k: keep the `top_k` most likely tokens (0 = all).
      top_p: nucleus: keep the smallest prefix of sorted tokens whose mass reaches `top_p`.
      seed: sampling seed; the token at position `p` uses `fold_in(key(seed), p)`.
      max_tokens: generated tokens at most (stop token included).
      stop_tokens: generation ends after any of these (it is kept in the output).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclasses.dataclass
class Request:
    """A generation request and its progress (host state).

    Attributes:
      prompt: prompt token ids.
      params: sampling and stopping.
      policy: attention policy (None = the engine default).
      id: request id (assigned by `Engine.add` when None).
      output: generated token ids so far.
      done: finished (stop token or max tokens).
      preemptions: how often it was preempted and recomputed.
      prefill_tokens: tokens it fed through the mixed (prefill) step, recomputation included.
      cached: tokens of `tokens` in the cache.
      row: the batch slot it occupies, or last occupied (its row of `Engine.last_logits`); None
        before its first admission.
      decisions: elastic engines only: `[L, K]` int32 router decisions of its prompt (1
        retrieval, 0 sparse; -1 on layers without a router), set by the step that prefilled the
        prompt; None before (and again after a preemption, until the recomputation routes it).
    """

    prompt: list[int]
    params: SamplingParams = SamplingParams()
    policy: Policy | None = None
    id: Any = None
    output: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    preemptions: int = 0
    prefill_tokens: int = 0
    cached: int = 0  # tokens of `tokens` in the KV cache
    row: int | None = None  # batch slot it occupies (or last occupied); None before admission
    decisions: np.ndarray | None = None  # [L, K] router decisions (elastic engines)

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt) + self.output


# ----------------------------------------------------------------------------------------------
# Device side


class EngineKV(NamedTuple):
    """The engine's device state.

    Attributes:
      pools: one state per model layer: a `kv.PagePool` `[K, num_pages, P, H]` (attention), a
        `kv.LatentPool` `[num_pages, P, L + R]` (MLA) or a `kv.SlotPool` (GDN: conv
        `[B + 1, C, W - 1]`, ssm `[B + 1, Nv, H, Hv]` float32; row `r` owns slot `r + 1`).
      tables: `BlockTables` over the paged (attention / MLA) layers' heads, `[B, Lp * K,
        max_pages]`: the `p`-th paged layer (in model order), head `k` is entry `p * K + k`. One
        table and one allocator for every layer, so the step allocates once before the layers and
        recycles once after them (30 layers would otherwise compile 30 allocators); page ids of a
        layer index that layer's pool.
      allocator: `PageAllocator` over the same `Lp * K` heads.
    """

    pools: list[Any]
    tables: kv.BlockTables
    allocator: kv.PageAllocator


def _paged_layers(pools) -> tuple[int, ...]:
    """Model indices of the layers that hold pages (attention and MLA), in model order."""
    return tuple(i for i, p in enumerate(pools) if isinstance(p, kv.PagePool | kv.LatentPool))


def _xla_or_auto(implementation: str) -> str:
    """Backend of the GDN / MLA ops: `"xla"` if asked for, else their own `"auto"` choice."""
    return "xla" if implementation == "xla" else "auto"


@dataclasses.dataclass(frozen=True)
class PagedAttend:
    """Engine attend: write this step's keys / latents / recurrent inputs into each layer's state,
    then attend (or mix) over it.

    The pages the new tokens need are allocated before the layers run (`table` already holds
    them). Attention layers call the object itself (state: the layer's `PagePool`), MLA layers
    `mla_attend` (a `LatentPool`), GDN layers `gdn_mix` (a `SlotPool`).

    Attributes:
      offsets: `[B]` int32 tokens cached before this step (position of token 0).
      num_new: `[B]` int32 real tokens of this step per row (0 = idle slot).
      table: `[B, Lp * K, max_pages]` int32 block tables of every paged layer (see `EngineKV`).
      window: `[B, L, K]` int32 effective window per row, layer and head (`<= 0` full).
      sinks: `[B, L, K]` int32.
      page_size: `P`.
      paged: static model indices of the paged layers (`p`-th entry: table block `p`).
      decode: True for the `T = 1` step (paged decode on the pages, one-token GDN update).
      implementation: attention backend.
      elastic: elastic mixed step: rows at offset 0 (a whole prompt in this chunk) run
        `ElasticAttend` over the chunk (routing from its `k_pre`, block-sparse attention), the
        others dense paged prefill; attention layers then return `(pool, z [B, K])` as their
        state, `z` = -1 on rows that were not routed.
    """

    offsets: Int[Array, "B"]  # noqa: F821
    num_new: Int[Array, "B"]  # noqa: F821
    table: Int[Array, "B LK M"]
    window: Int[Array, "B L K"]
    sinks: Int[Array, "B L K"]
    page_size: int
    paged: tuple[int, ...] = ()
    decode: bool = False
    implementation: str = "auto"
    elastic: bool = False

    def _table(self, layer: int, num_kv: int) -> Int[Array, "B K M"]:
        p = self.paged.index(layer) if self.paged else layer
        return self.table[:, p * num_kv:(p + 1) * num_kv]

    def __call__(self, spec: AttendSpec, qkv: QKV, pool: kv.PagePool):
        num_kv = pool.num_kv_heads
        lengths = self.offsets + self.num_new
        window, sinks = self.window[:, spec.layer], self.sinks[:, spec.layer]  # [B, K]
        table = self._table(spec.layer, num_kv)  # [B, K, M]
        zeros = jnp.zeros(table.shape[:2], jnp.int32)
        tables = kv.BlockTables(table=table, extent=zeros, cursor=zeros,
                                page_size=self.page_size)
        pool = kv.write_kv(pool, tables, qkv.k, qkv.v, self.offsets, self.num_new)
        if self.decode:
            o, _ = paged_decode(qkv.q[:, 0], pool.k, pool.v, table, lengths, scale=spec.scale,
                                window=window, sinks=sinks, k_scales=pool.k_scale,
                                v_scales=pool.v_scale, implementation=self.implementation)
            o = o[:, None]
        else:
            o, _ = paged_prefill_attention(
                qkv.q, pool.k, pool.v, table, self.offsets, lengths, scale=spec.scale,
                window=window, sinks=sinks, k_scales=pool.k_scale, v_scales=pool.v_scale,
                implementation=self.implementation)
            if self.elastic:
                return self._elastic(spec, qkv, o, pool)
        return o, pool

    def _elastic(self, spec: ElasticAttendSpec, qkv, dense: Float[Array, "B T N Hv"],
                 pool: kv.PagePool):
        """Rows at offset 0: `ElasticAttend` over the chunk (`lengths = num_new`); others: dense."""
        routed = (self.offsets == 0) & (self.num_new > 0)  # [B]
        o, z = ElasticAttend(lengths=self.num_new, implementation=self.implementation)(spec, qkv)
        o = jnp.where(routed[:, None, None, None], o.astype(dense.dtype), dense)
        return o, (pool, jnp.where(routed[:, None], z, -1).astype(jnp.int32))

    def mla_attend(self, spec: MLASpec, proj: MLAProjection, pool: kv.LatentPool):
        """MLA over the paged latent cache (windows are refused by the engine, never seen here).
        """
        impl = _xla_or_auto(self.implementation)
        table = self._table(spec.layer, 1)[:, 0]  # [B, M]
        lengths = self.offsets + self.num_new
        t = proj.c_kv.shape[1]
        slots = kv.latent_slot_mapping(table, self.offsets, self.num_new, num_tokens=t,
                                       page_size=self.page_size)
        pool = kv.write_latent(pool, proj.c_kv, proj.k_pe, slots)
        if self.decode:
            q_lat = absorb_query(proj.q_nope[:, 0], proj.w_uk)
            o_lat, _ = mla_paged_decode(q_lat, proj.q_pe[:, 0], pool.pages, table, lengths,
                                        kv_lora_rank=spec.kv_lora_rank, scale=spec.scale,
                                        implementation=impl)
            return expand_output(o_lat, proj.w_uv)[:, None], pool
        latent = kv.gather_latent(pool, table).astype(proj.c_kv.dtype)  # [B, S, L + R]
        lr = spec.kv_lora_rank
        o, _ = mla_absorbed_attention(proj.q_nope, proj.q_pe, latent[..., :lr], latent[..., lr:],
                                      proj.w_uk, proj.w_uv, scale=spec.scale,
                                      q_offset=self.offsets, kv_lengths=lengths,
                                      implementation=impl)
        return o, pool

    def gdn_mix(self, spec: GDNSpec, inputs: GDNInputs, pool: kv.SlotPool):
        """Conv + gated delta rule from / into the rows' slots (row r: slot r + 1; idle rows: the
        null slot 0). Rows starting a request (offset 0) start from zeros."""
        impl = _xla_or_auto(self.implementation)
        b, t, _ = inputs.x.shape
        rows = jnp.arange(b, dtype=jnp.int32)
        slots = jnp.where(self.num_new > 0, rows + 1, kv.NULL_SLOT)
        has_state = self.offsets > 0
        if self.decode:
            y, conv_pool = causal_conv1d_update_pool(
                inputs.x[:, 0], pool.conv, slots, inputs.conv_weight, activation="silu",
                has_initial_state=has_state, implementation=impl)
            q, k, v = split_qkv(spec, y[:, None])
            o, ssm_pool = gdn_decode_pool(q, k, v, inputs.g, inputs.beta, pool.ssm, slots,
                                          has_initial_state=has_state, scale=spec.scale,
                                          use_qk_l2norm=True, implementation=impl)
            return o, pool.replace(conv=conv_pool, ssm=ssm_pool)
        valid = jnp.arange(t, dtype=jnp.int32)[None, :] < self.num_new[:, None]  # [B, T]
        conv0, _ = kv.read_slots(pool, slots, has_state)
        x = jnp.where(valid[..., None], inputs.x, jnp.zeros((), inputs.x.dtype))
        y, _ = causal_conv1d(x, inputs.conv_weight, initial_state=conv0, activation="silu",
                             implementation=impl)
        # New conv state: the last W - 1 inputs before token num_new of xe = [state ‖ x].
        xe = jnp.concatenate([jnp.swapaxes(conv0, 1, 2).astype(x.dtype), x], axis=1)
        idx = self.num_new[:, None] + jnp.arange(spec.conv_width - 1, dtype=jnp.int32)[None]
        conv = jnp.swapaxes(jnp.take_along_axis(xe, idx[..., None], axis=1), 1, 2)
        q, k, v = split_qkv(spec, y)
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


def sample(logits: Float[Array, "B V"], keys, temperature, top_k, top_p) -> Int[Array, "B"]:  # noqa: F821
    """Greedy / temperature / top-k / top-p sampling per row (jittable).

    Args:
      logits: `[B, V]` next-token logits.
      keys: `[B]` PRNG keys.
      temperature: `[B]` float32, 0 = greedy.
      top_k: `[B]` int32, 0 = no limit.
      top_p: `[B]` float32 in (0, 1].

    Returns:
      `[B]` int32 tokens.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    scaled = sorted_logits / jnp.maximum(temperature, 1e-6)[:, None]
    rank = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    scaled = jnp.where(keep, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
    keep = keep & ((before < top_p[:, None]) | (rank == 0))
    scaled = jnp.where(keep, scaled, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, scaled)
    drawn = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def _step(graphdef, params, states, ids, offsets, num_new, window, sinks, seeds, temperature,
          top_k, top_p, *, decode, implementation, elastic, counter):
    counter["decode" if decode else "mixed"] += 1  # trace time only: counts compilations
    model = nnx.merge(graphdef, params)
    pools, tables, allocator = states
    batch = window.shape[0]
    paged = _paged_layers(pools)
    lengths = offsets + num_new
    allocator, tables, _ = kv.alloc_batch(allocator, tables, kv.pages_needed(tables, lengths))
    positions = offsets[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    attend = PagedAttend(offsets, num_new, tables.table, window, sinks, tables.page_size,
                         paged=paged, decode=decode, implementation=implementation,
                         elastic=elastic and not decode)
    hidden, pools = model.forward(ids, positions, attend=attend, states=pools)
    decisions = None  # [B, L, K] int32 router decisions (elastic mixed step), -1 = none
    if attend.elastic:
        num_kv = pools[paged[0]][0].num_kv_heads
        none = jnp.full((batch, num_kv), -1, jnp.int32)
        decisions = jnp.stack([p[1] if type(p) is tuple else none for p in pools], axis=1)
        pools = [p[0] if type(p) is tuple else p for p in pools]
    # Streaming heads release the pages no later query sees (after every layer's attention).
    index = np.asarray(paged)
    allocator, tables, _ = kv.recycle(allocator, tables, lengths,
                                      window=window[:, index].reshape(batch, -1),
                                      sinks=sinks[:, index].reshape(batch, -1))
    states = EngineKV(pools, tables, allocator)
    last = jnp.clip(num_new - 1, 0, ids.shape[1] - 1)
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
    logits = model.logits(h)[:, 0]
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
        seeds, offsets + num_new)
    tokens = sample(logits, keys, temperature, top_k, top_p)
    return tokens, logits.astype(jnp.float32), states, decisions


def _free_rows(states: EngineKV, rows) -> EngineKV:
    """Free the pages of the rows in `rows` (`[B]` bool) and zero their GDN slots."""
    allocator, tables, _ = kv.free_batch(states.allocator, states.tables, rows)
    slots = jnp.where(rows, jnp.arange(rows.shape[0], dtype=jnp.int32) + 1, kv.NULL_SLOT)
    pools = [kv.reset_slots(p, slots) if isinstance(p, kv.SlotPool) else p
             for p in states.pools]
    return EngineKV(pools, tables, allocator)


# ----------------------------------------------------------------------------------------------
# Engine


class Engine:
    """Continuous-batching generation over `batch_slots` slots with paged, per-head KV.

    Args:
      model: a `models` CausalLM whose layers are softmax attention (Llama, Qwen3, gated
        attention), MLA (DeepSeek-V2 / V3) or Gated DeltaNet (Qwen3-Next / Qwen3.5 hybrids).
      batch_slots: `B`, requests running at once.
      max_len: longest sequence (prompt + generated) a request may reach.
      page_size: `P` tokens per page.
      num_pages: pages per paged layer and head, null page included; default enough for every
        slot at `max_len` (so preemption never happens).
      chunk: `T` of the mixed step: prompt tokens per slot and step (chunked prefill).
      kv_dtype: page dtype of attention layers and of the MLA latent (default the model dtype;
        `jnp.float8_e4m3fn` for FP8 attention pools, not for MLA). GDN state keeps the model
        dtype (conv) and float32 (ssm).
      policy: default `Policy` of requests without one (default dense).
      implementation: attention backend (`"auto"`, `"xla"`, ...); the GDN and MLA ops use `"xla"`
        if it is `"xla"`, else their own `"auto"` choice.
      elastic: elastic attention (PawQwen3): each prompt is prefilled in one mixed-step chunk
        with per-request routing and block-sparse attention; its streaming heads (router mode -1)
        then decode as `sink_size` + `local_window_size` heads (from `model.cfg`), the others
        full. Needs every attention layer to be elastic (`ElasticAttendSpec`), no MLA layer, no
        `policy`, and prompts of at most `chunk` tokens (see the module docstring).

    Attributes:
      layer_kinds: per model layer `"attention"`, `"mla"` or `"gdn"`.
      paged_layers: model indices of the layers with pages (attention and MLA).
      num_kv_heads: `K` of every paged layer (1 for MLA); policies are `[num_layers, K]`.

    Raises:
      ValueError: an unsupported mixer, paged layers with different KV head counts, no paged
        layer, an FP8 MLA latent, a default policy the layers cannot honour, sizes that cannot
        work, or `elastic=True` for a model without elastic attention layers or with a policy.
    """

    def __init__(self, model, *, batch_slots: int = 4, max_len: int = 1024, page_size: int = 16,
                 num_pages: int | None = None, chunk: int = 128, kv_dtype=None,
                 policy: Policy | None = None, implementation: str = "auto",
                 elastic: bool = False):
        mixers = [layer.mixer for layer in model.layers]
        kinds = []
        for i, m in enumerate(mixers):
            kind = next((k for cls, k in _KINDS if isinstance(m, cls)), None)
            if kind is None:
                raise ValueError(
                    f"layer {i} has a {type(m).__name__} mixer; the engine runs attention, MLA "
                    f"and Gated DeltaNet layers ({', '.join(c.__name__ for c, _ in _KINDS)})")
            kinds.append(kind)
        for name, value in (("batch_slots", batch_slots), ("max_len", max_len),
                            ("page_size", page_size), ("chunk", chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        self.model = model
        self.layer_kinds = tuple(kinds)
        self.num_layers = len(mixers)
        self.paged_layers = tuple(i for i, k in enumerate(kinds) if k != "gdn")
        if not self.paged_layers:
            raise ValueError("the engine needs at least one attention or MLA layer (it pages "
                             "their KV); this model has only Gated DeltaNet layers")
        heads_per_layer = {i: (mixers[i].cfg.num_kv_heads if kinds[i] == "attention" else 1)
                           for i in self.paged_layers}
        if len(set(heads_per_layer.values())) != 1:
            raise ValueError("the engine needs the same num_kv_heads in every attention / MLA "
                             f"layer (MLA: 1); got {heads_per_layer} per layer")
        self.num_kv_heads = heads_per_layer[self.paged_layers[0]]
        self.batch_slots, self.max_len, self.page_size, self.chunk = (
            batch_slots, max_len, page_size, chunk)
        self.max_pages = -(-max_len // page_size)
        if num_pages is None:
            num_pages = batch_slots * self.max_pages + 1
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is null)")
        self.num_pages = num_pages
        self.kv_dtype = jnp.dtype(kv_dtype if kv_dtype is not None else model.dtype)
        if "mla" in kinds and self.kv_dtype.itemsize == 1:
            raise ValueError(f"kv_dtype={self.kv_dtype}: MLA layers have no FP8 latent cache; "
                             f"use a 16- or 32-bit kv_dtype for {type(model).__name__}")
        self.implementation = implementation
        # Layer-configured windows (e.g. Qwen3 sliding layers) apply where a policy says "full".
        cfgs = [m.cfg if k == "attention" else None for m, k in zip(mixers, kinds)]
        self._layer_window = np.array([c.window or 0 if c else 0 for c in cfgs], np.int32)[:, None]
        self._layer_sinks = np.array([c.sinks if c else 0 for c in cfgs], np.int32)[:, None]
        self.policy = policy or Policy.dense(self.num_layers, self.num_kv_heads)
        self._check_policy(self.policy)
        self.elastic = bool(elastic)
        if self.elastic:
            self._init_elastic(model, mixers, kinds, policy)

        pools = []
        for m, kind in zip(mixers, kinds):
            if kind == "attention":
                c = m.cfg
                pools.append(kv.create_page_pool(
                    num_kv_heads=c.num_kv_heads, num_pages=num_pages, page_size=page_size,
                    head_dim=c.head_dim, value_head_dim=c.hv, dtype=self.kv_dtype))
            elif kind == "mla":
                c = m.cfg
                pools.append(kv.create_latent_pool(
                    num_pages=num_pages, page_size=page_size, kv_lora_rank=c.kv_lora_rank,
                    rope_dim=c.qk_rope_head_dim, dtype=self.kv_dtype))
            else:
                c = m.cfg
                pools.append(kv.create_slot_pool(
                    num_slots=batch_slots + 1, conv_dim=c.conv_dim, conv_width=c.conv_width,
                    num_v_heads=c.num_v_heads, head_k_dim=c.head_k_dim, head_v_dim=c.head_v_dim,
                    dtype=model.dtype))
        heads = len(self.paged_layers) * self.num_kv_heads
        self.states = EngineKV(
            pools,
            kv.create_block_tables(batch_size=batch_slots, num_kv_heads=heads,
                                   max_pages=self.max_pages, page_size=page_size),
            kv.create_allocator(num_kv_heads=heads, num_pages=num_pages))
        # Distinct buffers for every leaf (the constructors share zeros / ones), so the step can
        # donate the whole state.
        self.states = jax.tree.map(lambda x: jnp.array(x, copy=True), self.states)
        sizes = np.asarray([_state_bytes(p) for p in pools], np.int64)  # [L, 2]
        self._layer_page_bytes, self._layer_slot_bytes = sizes[:, 0], sizes[:, 1]
        self._graphdef, self._params = nnx.split(model)
        self._step = functools.partial(_jit_step, implementation=implementation,
                                       elastic=self.elastic)
        self._free = _jit_free

        # Host mirror of the page accounting, per slot, paged layer and head.
        shape = (batch_slots, len(self.paged_layers), self.num_kv_heads)
        self._paged_index = np.asarray(self.paged_layers)
        self._extent = np.zeros(shape, np.int64)
        self._cursor = np.zeros(shape, np.int64)
        self._released = np.zeros(shape, np.int64)
        self._free_count = np.full(shape[1:], num_pages - 1, np.int64)
        # Effective policy per slot, every model layer (GDN rows are zero).
        self._win = np.zeros((batch_slots, self.num_layers, self.num_kv_heads), np.int32)
        self._sinks = np.zeros_like(self._win)
        self.slots: list[Request | None] = [None] * batch_slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.finished: list[Request] = []
        self._ids = itertools.count()
        self._admitted = itertools.count()
        self._order = [0] * batch_slots  # admission order of the slot's request
        # Step counts and host wall time (dispatch to tokens on the host, compiles included).
        self.stats = {"mixed_steps": 0, "decode_steps": 0, "preemptions": 0,
                      "mixed_seconds": 0.0, "decode_seconds": 0.0}
        self.last_logits = None  # [B, V] float32 next-token logits of the latest step (device)

    def _init_elastic(self, model, mixers, kinds, policy) -> None:
        """Check that the model is elastic; per layer, the mode codes of z = 1 and z = 0 heads."""
        bad = [i for i, (m, k) in enumerate(zip(mixers, kinds))
               if k != "gdn" and not (k == "attention" and isinstance(m.spec, ElasticAttendSpec))]
        if bad:
            raise ValueError(
                f"elastic=True needs elastic attention layers (PawQwen3, ElasticAttendSpec); "
                f"layers {bad} of {type(model).__name__} are "
                f"{sorted({type(mixers[i]).__name__ for i in bad})}")
        if policy is not None:
            raise ValueError(f"elastic=True derives each request's policy from its router "
                             f"decisions; got policy {policy.name!r}")
        retrieval, toggle = np.zeros(self.num_layers, np.int32), np.zeros(self.num_layers, np.int32)
        for i, m in enumerate(mixers):
            if kinds[i] == "attention":
                retrieval[i] = MODE_CODES[m.spec.retrieval_mode]
                toggle[i] = MODE_CODES[m.spec.toggle_type]
        self._mode_codes = (retrieval[:, None], toggle[:, None])  # [L, 1] each
        self._stream = (int(model.cfg.local_window_size), int(model.cfg.sink_size))

    # -- requests ------------------------------------------------------------------------------

    def add(self, request: Request) -> Request:
        """Queue a request (it joins a slot at a later step)."""
        if not request.prompt:
            raise ValueError("a request needs a non-empty prompt")
        total = len(request.prompt) + request.params.max_tokens
        if total > self.max_len:
            raise ValueError(f"prompt ({len(request.prompt)}) + max_tokens "
                             f"({request.params.max_tokens}) = {total} exceeds "
                             f"max_len={self.max_len}")
        self._check_policy(request.policy or self.policy)
        if self.elastic:
            if len(request.prompt) > self.chunk:
                raise ValueError(
                    f"elastic engine: prompt of {len(request.prompt)} tokens exceeds "
                    f"chunk={self.chunk}; an elastic prompt is routed and prefilled in one chunk")
            if request.policy is not None:
                raise ValueError(f"elastic engine: request policy {request.policy.name!r} is not "
                                 f"allowed (the router decides each request's policy)")
        if request.id is None:
            request.id = next(self._ids)
        self.waiting.append(request)
        return request

    def _check_policy(self, policy: Policy) -> None:
        """Shape `[L, K]`, and no window on a layer kind that cannot honour it (MLA)."""
        if policy.window.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"policy shape {policy.window.shape} must be [L, K] = "
                             f"{(self.num_layers, self.num_kv_heads)}")
        for layer, kind in enumerate(self.layer_kinds):
            if kind == "mla" and np.any(policy.window[layer] > 0):
                raise ValueError(
                    f"policy {policy.name!r} asks for window {policy.window[layer].tolist()} on "
                    f"layer {layer}, an MLA layer: the MLA latent cache supports no sliding "
                    f"window (use window <= 0 on MLA layers)")

    def _effective(self, request: Request) -> tuple[np.ndarray, np.ndarray]:
        """Effective `[L, K]` window and sinks (layer windows where the policy is full; GDN 0).

        Elastic engines: heads whose decision maps to streaming (-1) get `local_window_size` and
        `sink_size`, the rest are full; every head is full before the prompt is routed.
        """
        p = request.policy or self.policy
        if self.elastic and request.decisions is not None:
            retrieval, toggle = self._mode_codes
            stream = np.where(request.decisions == 1, retrieval, toggle) == MODE_CODES["streaming"]
            stream &= request.decisions >= 0
            p = Policy(np.where(stream, self._stream[0], 0), np.where(stream, self._stream[1], 0),
                       "elastic")
        full = p.window <= 0
        gdn = np.array([k == "gdn" for k in self.layer_kinds])[:, None]
        window = np.where(full, self._layer_window, p.window)
        sinks = np.where(full, self._layer_sinks, p.sinks)
        return (np.where(gdn, 0, window).astype(np.int32),
                np.where(gdn, 0, sinks).astype(np.int32))

    @property
    def idle(self) -> bool:
        return not self.waiting and all(s is None for s in self.slots)

    # -- host page mirror ----------------------------------------------------------------------

    def _demand(self, row: int, new_len: int) -> np.ndarray:
        """Pages `[Lp, K]` (paged layers) the row must allocate to reach `new_len` tokens."""
        return np.maximum(-(-new_len // self.page_size) - self._extent[row], 0)

    def _commit(self, row: int, new_len: int) -> None:
        """Mirror `alloc_batch` then `recycle` for one row growing to `new_len`."""
        n = self._demand(row, new_len)
        self._extent[row] += n
        self._free_count -= n
        size = self.page_size
        w, s = self._win[row][self._paged_index], self._sinks[row][self._paged_index]
        lo = np.maximum(-(-s // size), self._cursor[row])
        hi = np.minimum(np.maximum(new_len - w, 0) // size, self._extent[row])
        go = (w > 0) & (hi > lo)
        rel = np.where(go, hi - lo, 0)
        self._released[row] += rel
        self._free_count += rel
        self._cursor[row] = np.where(go, hi, self._cursor[row])

    def _release_row(self, row: int) -> None:
        self._free_count += self._extent[row] - self._released[row]
        self._extent[row] = self._cursor[row] = self._released[row] = 0

    def pages_held(self) -> np.ndarray:
        """Host view `[B, L, K]` of the pages each slot holds (GDN layers: 0, they hold none)."""
        held = np.zeros((self.batch_slots, self.num_layers, self.num_kv_heads), np.int64)
        held[:, self._paged_index] = self._extent - self._released
        return held

    def check_page_tables(self) -> None:
        """Check the device block tables and allocator against the host mirror, entry by entry.

        For every slot, paged layer (attention and MLA alike) and head: the extent and recycle
        cursor equal the mirror's; logical pages `[0, extent)` outside the released run
        `[cursor - released, cursor)` hold an id in `[1, num_pages)` and every other entry is -1;
        per head, no id is held twice, the allocator's `owned` marks exactly the held ids, and its
        free count equals the mirror's. A debugging and test aid: it reads device state, so call
        it between steps, never inside one.

        Raises:
          AssertionError: naming the first slot / layer / head that differs.
        """
        b, lp, k = self._extent.shape
        tables = self.states.tables
        table = np.asarray(tables.table).reshape(b, lp, k, -1)
        extent = np.asarray(tables.extent).reshape(b, lp, k)
        cursor = np.asarray(tables.cursor).reshape(b, lp, k)
        alloc = self.states.allocator
        owned = np.asarray(alloc.owned).reshape(lp, k, -1)
        free = np.asarray(alloc.free_count).reshape(lp, k)
        for name, dev, host in (("extent", extent, self._extent), ("cursor", cursor, self._cursor),
                                ("free_count", free, self._free_count)):
            if not np.array_equal(dev, host):
                where = tuple(int(i) for i in np.argwhere(dev != host)[0])
                raise AssertionError(f"{name} at {where}: device {dev[where]} != host mirror "
                                     f"{host[where]}")
        j = np.arange(table.shape[-1])
        held = ((j < self._extent[..., None])
                & ~((j >= (self._cursor - self._released)[..., None])
                    & (j < self._cursor[..., None])))  # [B, Lp, K, M]
        ok = np.where(held, (table >= 1) & (table < self.num_pages), table == kv.UNALLOCATED)
        if not ok.all():
            where = tuple(int(i) for i in np.argwhere(~ok)[0])
            raise AssertionError(f"table entry (slot, paged layer, head, page) {where} = "
                                 f"{table[where]}; held by the mirror: {bool(held[where])}")
        for layer in range(lp):
            for head in range(k):
                ids = table[:, layer, head][held[:, layer, head]]
                mine = np.zeros(self.num_pages, bool)
                mine[ids] = True
                if len(np.unique(ids)) != len(ids) or not np.array_equal(mine, owned[layer, head]):
                    raise AssertionError(f"paged layer {layer}, head {head}: held ids "
                                         f"{sorted(ids.tolist())} vs owned "
                                         f"{np.flatnonzero(owned[layer, head]).tolist()}")

    # -- scheduling ----------------------------------------------------------------------------

    def _free_slots_on_device(self, rows: list[int]) -> None:
        if rows:
            mask = np.zeros(self.batch_slots, bool)
            mask[rows] = True
            self.states = self._free(self.states, jnp.asarray(mask))
            for r in rows:
                self._release_row(r)

    def _preempt(self, row: int) -> None:
        req = self.slots[row]
        req.preemptions += 1
        req.cached = 0
        req.decisions = None  # re-routed when its prompt is prefilled again
        self.stats["preemptions"] += 1
        self.slots[row] = None
        self._free_slots_on_device([row])
        self.waiting.appendleft(req)

    def _plan(self) -> dict[int, int]:
        """Admit waiting requests, size this step's work per slot, preempt until it fits."""
        for row in range(self.batch_slots):
            if self.slots[row] is None and self.waiting:
                req = self.waiting.popleft()
                self.slots[row] = req
                req.row = row
                self._order[row] = next(self._admitted)
                self._win[row], self._sinks[row] = self._effective(req)
        while True:
            active = [r for r in range(self.batch_slots) if self.slots[r] is not None]
            if not active:
                return {}
            work = {r: self._work(self.slots[r]) for r in active}
            need = sum(self._demand(r, self.slots[r].cached + work[r]) for r in active)
            if np.all(need <= self._free_count):
                return work
            if len(active) == 1:
                raise RuntimeError(
                    f"KV pools too small: one request needs {need.max()} more pages in a head "
                    f"with {self._free_count.min()} free (num_pages={self.num_pages})")
            self._preempt(max(active, key=lambda r: self._order[r]))

    def _work(self, req: Request) -> int:
        """Tokens a request feeds in this step: an elastic request starts with exactly its prompt
        (one routed chunk; a recomputed one then feeds its generated tokens as dense chunks)."""
        if self.elastic and req.cached == 0:
            return len(req.prompt)
        return min(self.chunk, len(req.tokens) - req.cached)

    def step(self) -> list[Request]:
        """One engine step: admit, (maybe preempt), run the mixed or decode step, retire.

        Returns:
          The requests that finished in this step.
        """
        work = self._plan()
        if not work:
            return []
        # An elastic prompt (even of one token) is routed in the mixed step.
        decode = all(n == 1 and (self.slots[r].cached > 0 or not self.elastic)
                     for r, n in work.items())
        t = 1 if decode else self.chunk
        b = self.batch_slots
        ids = np.zeros((b, t), np.int32)
        offsets = np.zeros(b, np.int32)
        num_new = np.zeros(b, np.int32)
        seeds = np.zeros(b, np.uint32)
        temp = np.zeros(b, np.float32)
        top_k = np.zeros(b, np.int32)
        top_p = np.ones(b, np.float32)
        for r, n in work.items():
            req = self.slots[r]
            ids[r, :n] = req.tokens[req.cached:req.cached + n]
            offsets[r], num_new[r] = req.cached, n
            p = req.params
            seeds[r], temp[r], top_k[r], top_p[r] = p.seed, p.temperature, p.top_k, p.top_p
            if not decode:
                req.prefill_tokens += n
        window = np.where(num_new[:, None, None] > 0, self._win, 0)
        sinks = np.where(num_new[:, None, None] > 0, self._sinks, 0)
        start = time.perf_counter()
        tokens, self.last_logits, self.states, decisions = self._step(
            self._graphdef, self._params, self.states, ids, offsets, num_new, window, sinks,
            seeds, temp, top_k, top_p, decode=decode)
        for r, n in work.items():
            self._commit(r, int(offsets[r]) + n)
        # The step's only device -> host read: B token ids (and the router decisions).
        tokens, decisions = jax.device_get((tokens, decisions))
        if decisions is not None:
            for r in work:
                if offsets[r] == 0:  # routed in this step: its streaming heads apply from now on
                    req = self.slots[r]
                    req.decisions = np.asarray(decisions[r], np.int32)
                    self._win[r], self._sinks[r] = self._effective(req)
        kind = "decode" if decode else "mixed"
        self.stats[f"{kind}_steps"] += 1
        self.stats[f"{kind}_seconds"] += time.perf_counter() - start
        done, freed = [], []
        for r, n in work.items():
            req = self.slots[r]
            req.cached += n
            if req.cached < len(req.tokens):
                continue  # mid-prompt chunk: its sample is not a token
            tok = int(tokens[r])
            req.output.append(tok)
            if tok in req.params.stop_tokens or len(req.output) >= req.params.max_tokens:
                req.done = True
                done.append(req)
                self.slots[r] = None
                freed.append(r)
        self._free_slots_on_device(freed)
        self.finished.extend(done)
        return done

    def run(self, progress=None) -> list[Request]:
        """Step until every queued request is done; returns them in finishing order."""
        start = len(self.finished)
        while not self.idle:
            done = self.step()
            if progress is not None and done:
                progress(len(done))
        return self.finished[start:]

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams(),
                 policy: Policy | None = None) -> list[list[int]]:
        """Generate for every prompt (queued together); outputs in prompt order."""
        reqs = [self.add(Request(list(p), params, policy)) for p in prompts]
        self.run()
        return [r.output for r in reqs]

    # -- accounting ----------------------------------------------------------------------------

    def page_bytes(self) -> int:
        """Bytes of one page of one head of the first paged layer (keys, values, FP8 scales; an
        MLA page: `P * (L + R)` latent values)."""
        return int(self._layer_page_bytes[self.paged_layers[0]])

    def kv_bytes(self, row: int | None = None) -> np.ndarray:
        """KV bytes in use `[L, K]` per layer and head, of one slot or all (host mirror, no sync).

        GDN layers hold no pages (0 here); their state is `state_bytes`.
        """
        held = self.pages_held() if row is None else self.pages_held()[row][None]
        return held.sum(axis=0) * self._layer_page_bytes[:, None]

    def state_bytes(self, row: int | None = None) -> np.ndarray:
        """GDN state bytes in use `[L]` per layer (conv + ssm slot of every occupied slot, or of
        slot `row` if it is occupied); 0 for paged layers. Host side, no sync."""
        rows = range(self.batch_slots) if row is None else [row]
        busy = sum(self.slots[r] is not None for r in rows)
        return busy * self._layer_slot_bytes

    def kv_usage(self) -> dict:
        """KV pages and bytes in use per layer and head (reads device state).

        Returns:
          dict with `pages` and `bytes` `[L, K]` int64 (pages in use and their bytes; 0 on GDN
          layers), `capacity_pages` `[L]` (allocatable pages per head; 0 on GDN layers),
          `state_bytes` `[L]` int64 (GDN conv + ssm state of the occupied slots; 0 on paged
          layers), `state_capacity_bytes` `[L]` (every GDN slot but the null one), and
          `total_bytes` (pages and GDN state together).
        """
        pages = np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        pages[self._paged_index] = np.asarray(
            kv.pages_in_use(self.states.allocator), np.int64).reshape(-1, self.num_kv_heads)
        used = pages * self._layer_page_bytes[:, None]
        state = self.state_bytes()
        paged = np.isin(np.arange(self.num_layers), self._paged_index)
        return {"pages": pages, "bytes": used,
                "capacity_pages": np.where(paged, self.num_pages - 1, 0).astype(np.int64),
                "state_bytes": state,
                "state_capacity_bytes": self.batch_slots * self._layer_slot_bytes,
                "total_bytes": int(used.sum() + state.sum())}

    def free_pages(self) -> np.ndarray:
        """Device free-page counts `[L, K]` (reads device state; 0 on GDN layers, which have no
        pages)."""
        free = np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        free[self._paged_index] = np.asarray(
            kv.free_pages(self.states.allocator), np.int64).reshape(-1, self.num_kv_heads)
        return free


def _state_bytes(pool) -> tuple[int, int]:
    """`(bytes of one page of one head, bytes of one GDN slot)` of a layer's state."""
    if isinstance(pool, kv.PagePool):
        return kv.page_bytes(pool), 0
    if isinstance(pool, kv.LatentPool):
        return pool.page_size * pool.pages.shape[-1] * pool.pages.dtype.itemsize, 0
    per_slot = sum(x[0].size * x.dtype.itemsize for x in (pool.conv, pool.ssm))
    return 0, int(per_slot)


_KINDS = ((Attention, "attention"), (MLAttention, "mla"), (GatedDeltaNet, "gdn"))
_jit_free = jax.jit(_free_rows, donate_argnums=0)
TRACES = collections.Counter()  # ("mixed" | "decode") -> times the step was traced (compiled)


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("decode", "implementation", "elastic"), donate_argnums=2)
def _jit_step(graphdef, params, states, *args, decode, implementation, elastic=False):
    return _step(graphdef, params, states, *args, decode=decode, implementation=implementation,
                 elastic=elastic, counter=TRACES)


__all__ = [
    "TRACES",
    "Engine",
    "EngineKV",
    "PagedAttend",
    "Policy",
    "Request",
    "SamplingParams",
    "sample",
]
