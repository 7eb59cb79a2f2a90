"""Generation engine: paged KV, fixed batch slots, chunked prefill, continuous batching, sampling.

Design. The device side is two jitted step functions with static shapes, both over `B` batch
slots and the same KV state (`EngineKV`: a page pool per layer, one block table and one page
allocator spanning every layer's KV heads):

* the mixed step (`T = chunk` tokens per slot): every active slot feeds its uncached tokens, up
  to `chunk` of them — a prompt chunk (chunked prefill over its cached prefix) or a single decode
  token; rows are padded to `T`. Each attention layer writes k, v (`kv.write_kv`, quantising for
  FP8 pools), gathers the row's pages (`kv.gather_kv`) and runs `attn.dense.attention` with
  `q_offset` = cached length;
* the decode step (`T = 1`), used when every active slot decodes: the same write, then
  `attn.paged_decode.paged_decode` straight on the pages.

Pages are allocated once before the layers (`kv.alloc_batch`) and released once after them
(`kv.recycle`: streaming heads give back the pages outside sink + window), so 30 layers do not
compile 30 allocators. Policies are data: each request carries per-layer, per-KV-head `window`
and `sinks` arrays (`Policy`), passed to the step as `[B, L, K]` int32, so requests with
different policies share a batch and a compiled step (attention is vmapped over rows for
per-row windows).
Sampling (greedy, temperature, top-k, top-p) runs inside the step on the last real token of each
row; the key of the token at position `p` is `fold_in(key(seed), p)`, so a preempted request that
is recomputed samples the very same tokens.

The host scheduler holds every count: which request sits in which slot, how many of its tokens
are cached, and a NumPy mirror of every layer's page accounting (extent, recycle cursor, free
pages per head), so it knows before a step whether the pools can hold it — no device value is
read inside or before a step. When they cannot, the most recently admitted request is preempted:
its pages are freed (`kv.free_batch`) and it goes back to the front of the queue with prompt +
generated tokens as its new prompt, recomputed when pages free up.

Not done here: GDN / MLA families (attention-only models: Llama, Qwen3), XAttention / elastic
modes, prefix sharing, speculative decoding, multi-device sharding of the step.
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
from attn.dense import attention
from attn.paged_decode import paged_decode
from models.layers.attention import QKV, AttendSpec, Attention

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

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt) + self.output


# ----------------------------------------------------------------------------------------------
# Device side


class EngineKV(NamedTuple):
    """The engine's KV state.

    Attributes:
      pools: one `PagePool` per attention layer, `[K, num_pages, P, H]` each.
      tables: `BlockTables` over `L * K` "heads" (`[B, L * K, max_pages]`): layer `l`, head `k`
        is entry `l * K + k`. One table and one allocator for every layer, so the step allocates
        once before the layers and recycles once after them (30 layers would otherwise compile
        30 allocators); page ids of layer `l` index that layer's pool.
      allocator: `PageAllocator` over the same `L * K` heads.
    """

    pools: list[kv.PagePool]
    tables: kv.BlockTables
    allocator: kv.PageAllocator


@dataclasses.dataclass(frozen=True)
class PagedAttend:
    """Engine attend: write this step's k, v into the layer's pages, then attend over them.

    The pages the new tokens need are allocated before the layers run (`table` already holds
    them); the per-layer state is the layer's `PagePool`.

    Attributes:
      offsets: `[B]` int32 tokens cached before this step (position of token 0).
      num_new: `[B]` int32 real tokens of this step per row (0 = idle slot).
      table: `[B, L * K, max_pages]` int32 block tables of every layer (see `EngineKV`).
      window: `[B, L, K]` int32 effective window per row, layer and head (`<= 0` full).
      sinks: `[B, L, K]` int32.
      page_size: `P`.
      decode: True for the `T = 1` step (paged decode on the pages).
      implementation: attention backend.
    """

    offsets: Int[Array, "B"]  # noqa: F821
    num_new: Int[Array, "B"]  # noqa: F821
    table: Int[Array, "B LK M"]
    window: Int[Array, "B L K"]
    sinks: Int[Array, "B L K"]
    page_size: int
    decode: bool = False
    implementation: str = "auto"

    def __call__(self, spec: AttendSpec, qkv: QKV, pool: kv.PagePool):
        num_kv = pool.num_kv_heads
        lengths = self.offsets + self.num_new
        window, sinks = self.window[:, spec.layer], self.sinks[:, spec.layer]  # [B, K]
        table = self.table[:, spec.layer * num_kv:(spec.layer + 1) * num_kv]  # [B, K, M]
        zeros = jnp.zeros(table.shape[:2], jnp.int32)
        tables = kv.BlockTables(table=table, extent=zeros, cursor=zeros,
                                page_size=self.page_size)
        pool = kv.write_kv(pool, tables, qkv.k, qkv.v, self.offsets, self.num_new)
        if self.decode:
            def one(q, table, length, w, s):
                o, _ = paged_decode(q[None], pool.k, pool.v, table[None], length[None],
                                    scale=spec.scale, window=w, sinks=s, k_scales=pool.k_scale,
                                    v_scales=pool.v_scale, implementation=self.implementation)
                return o[0]

            o = jax.vmap(one)(qkv.q[:, 0], table, lengths, window, sinks)[:, None]
        else:
            k, v = kv.gather_kv(pool, tables, dtype=qkv.q.dtype)

            def one(q, k, v, off, length, w, s):
                o, _ = attention(q[None], k[None], v[None], causal=True, scale=spec.scale,
                                 q_offset=off[None], kv_lengths=length[None], window=w, sinks=s,
                                 implementation=self.implementation)
                return o[0]

            o = jax.vmap(one)(qkv.q, k, v, self.offsets, lengths, window, sinks)
        return o, pool


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
    before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs  # mass of better tokens
    keep = keep & ((before < top_p[:, None]) | (rank == 0))
    scaled = jnp.where(keep, scaled, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, scaled)
    drawn = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def _step(graphdef, params, states, ids, offsets, num_new, window, sinks, seeds, temperature,
          top_k, top_p, *, decode, implementation, counter):
    counter["decode" if decode else "mixed"] += 1  # trace time only: counts compilations
    model = nnx.merge(graphdef, params)
    pools, tables, allocator = states
    batch, layers, num_kv = window.shape
    lengths = offsets + num_new
    allocator, tables, _ = kv.alloc_batch(allocator, tables, kv.pages_needed(tables, lengths))
    positions = offsets[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    attend = PagedAttend(offsets, num_new, tables.table, window, sinks, tables.page_size,
                         decode=decode, implementation=implementation)
    hidden, pools = model.forward(ids, positions, attend=attend, states=pools)
    # Streaming heads release the pages no later query sees (after every layer's attention).
    allocator, tables, _ = kv.recycle(allocator, tables, lengths,
                                      window=window.reshape(batch, layers * num_kv),
                                      sinks=sinks.reshape(batch, layers * num_kv))
    states = EngineKV(pools, tables, allocator)
    last = jnp.clip(num_new - 1, 0, ids.shape[1] - 1)
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
    logits = model.logits(h)[:, 0]
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
        seeds, offsets + num_new)
    tokens = sample(logits, keys, temperature, top_k, top_p)
    return tokens, logits.astype(jnp.float32), states


def _free_rows(states: EngineKV, rows) -> EngineKV:
    allocator, tables, _ = kv.free_batch(states.allocator, states.tables, rows)
    return EngineKV(states.pools, tables, allocator)


# ----------------------------------------------------------------------------------------------
# Engine


class Engine:
    """Continuous-batching generation over `batch_slots` slots with paged, per-head KV.

    Args:
      model: a `models` CausalLM whose layers are all softmax attention (Llama, Qwen3).
      batch_slots: `B`, requests running at once.
      max_len: longest sequence (prompt + generated) a request may reach.
      page_size: `P` tokens per page.
      num_pages: pages per layer and head, null page included; default enough for every slot at
        `max_len` (so preemption never happens).
      chunk: `T` of the mixed step: prompt tokens per slot and step (chunked prefill).
      kv_dtype: page dtype (default the model dtype; `jnp.float8_e4m3fn` for FP8 pools).
      policy: default `Policy` of requests without one (default dense).
      implementation: attention backend (`"auto"`, `"xla"`, ...).

    Raises:
      ValueError: non-attention layers, or sizes that cannot work.
    """

    def __init__(self, model, *, batch_slots: int = 4, max_len: int = 1024, page_size: int = 16,
                 num_pages: int | None = None, chunk: int = 128, kv_dtype=None,
                 policy: Policy | None = None, implementation: str = "auto"):
        mixers = [layer.mixer for layer in model.layers]
        if not all(type(m) is Attention for m in mixers):
            bad = sorted({type(m).__name__ for m in mixers if type(m) is not Attention})
            raise ValueError(f"the engine runs attention-only models; got mixers {bad}")
        for name, value in (("batch_slots", batch_slots), ("max_len", max_len),
                            ("page_size", page_size), ("chunk", chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        cfgs = [m.cfg for m in mixers]
        self.model = model
        self.num_layers = len(cfgs)
        self.num_kv_heads = cfgs[0].num_kv_heads
        self.batch_slots, self.max_len, self.page_size, self.chunk = (
            batch_slots, max_len, page_size, chunk)
        self.max_pages = -(-max_len // page_size)
        if num_pages is None:
            num_pages = batch_slots * self.max_pages + 1
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is null)")
        self.num_pages = num_pages
        self.kv_dtype = jnp.dtype(kv_dtype if kv_dtype is not None else model.dtype)
        self.policy = policy or Policy.dense(self.num_layers, self.num_kv_heads)
        self.implementation = implementation
        # Layer-configured windows (e.g. Qwen3 sliding layers) apply where a policy says "full".
        self._layer_window = np.array([c.window or 0 for c in cfgs], np.int32)[:, None]
        self._layer_sinks = np.array([c.sinks for c in cfgs], np.int32)[:, None]

        if any(c.num_kv_heads != self.num_kv_heads for c in cfgs):
            raise ValueError("the engine needs the same num_kv_heads in every layer; got "
                             f"{[c.num_kv_heads for c in cfgs]}")
        heads = self.num_layers * self.num_kv_heads
        self.states = EngineKV(
            [kv.create_page_pool(num_kv_heads=c.num_kv_heads, num_pages=num_pages,
                                 page_size=page_size, head_dim=c.head_dim, value_head_dim=c.hv,
                                 dtype=self.kv_dtype) for c in cfgs],
            kv.create_block_tables(batch_size=batch_slots, num_kv_heads=heads,
                                   max_pages=self.max_pages, page_size=page_size),
            kv.create_allocator(num_kv_heads=heads, num_pages=num_pages))
        # Distinct buffers for every leaf (the constructors share zeros / ones), so the step can
        # donate the whole state.
        self.states = jax.tree.map(lambda x: jnp.array(x, copy=True), self.states)
        self._graphdef, self._params = nnx.split(model)
        self._step = functools.partial(_jit_step, implementation=implementation)
        self._free = _jit_free

        # Host mirror of the page accounting, per slot, layer and head.
        shape = (batch_slots, self.num_layers, self.num_kv_heads)
        self._extent = np.zeros(shape, np.int64)
        self._cursor = np.zeros(shape, np.int64)
        self._released = np.zeros(shape, np.int64)
        self._free_count = np.full(shape[1:], num_pages - 1, np.int64)
        self._win = np.zeros(shape, np.int32)
        self._sinks = np.zeros(shape, np.int32)
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
        policy = request.policy or self.policy
        if policy.window.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"policy shape {policy.window.shape} must be [L, K] = "
                             f"{(self.num_layers, self.num_kv_heads)}")
        if request.id is None:
            request.id = next(self._ids)
        self.waiting.append(request)
        return request

    def _effective(self, request: Request) -> tuple[np.ndarray, np.ndarray]:
        p = request.policy or self.policy
        full = p.window <= 0
        return (np.where(full, self._layer_window, p.window).astype(np.int32),
                np.where(full, self._layer_sinks, p.sinks).astype(np.int32))

    @property
    def idle(self) -> bool:
        return not self.waiting and all(s is None for s in self.slots)

    # -- host page mirror ----------------------------------------------------------------------

    def _demand(self, row: int, new_len: int) -> np.ndarray:
        """Pages `[L, K]` the row must allocate to reach `new_len` tokens."""
        return np.maximum(-(-new_len // self.page_size) - self._extent[row], 0)

    def _commit(self, row: int, new_len: int) -> None:
        """Mirror `alloc_batch` then `recycle` for one row growing to `new_len`."""
        n = self._demand(row, new_len)
        self._extent[row] += n
        self._free_count -= n
        size = self.page_size
        w, s = self._win[row], self._sinks[row]
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
        """Host view `[B, L, K]` of the pages each slot holds."""
        return self._extent - self._released

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
                self._order[row] = next(self._admitted)
                self._win[row], self._sinks[row] = self._effective(req)
        while True:
            active = [r for r in range(self.batch_slots) if self.slots[r] is not None]
            if not active:
                return {}
            work = {r: min(self.chunk, len(self.slots[r].tokens) - self.slots[r].cached)
                    for r in active}
            need = sum(self._demand(r, self.slots[r].cached + work[r]) for r in active)
            if np.all(need <= self._free_count):
                return work
            if len(active) == 1:
                raise RuntimeError(
                    f"KV pools too small: one request needs {need.max()} more pages in a head "
                    f"with {self._free_count.min()} free (num_pages={self.num_pages})")
            self._preempt(max(active, key=lambda r: self._order[r]))

    def step(self) -> list[Request]:
        """One engine step: admit, (maybe preempt), run the mixed or decode step, retire.

        Returns:
          The requests that finished in this step.
        """
        work = self._plan()
        if not work:
            return []
        decode = all(n == 1 for n in work.values())
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
        tokens, self.last_logits, self.states = self._step(
            self._graphdef, self._params, self.states, ids, offsets, num_new, window, sinks,
            seeds, temp, top_k, top_p, decode=decode)
        for r, n in work.items():
            self._commit(r, int(offsets[r]) + n)
        tokens = np.asarray(tokens)  # the step's only device -> host read: B token ids
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
        """Bytes of one page of one head (keys, values, FP8 scales)."""
        return kv.page_bytes(self.states.pools[0])

    def kv_bytes(self, row: int | None = None) -> np.ndarray:
        """KV bytes in use `[L, K]` per layer and head, of one slot or all (host mirror, no sync).
        """
        held = self.pages_held() if row is None else self.pages_held()[row][None]
        return held.sum(axis=0) * self.page_bytes()

    def kv_usage(self) -> dict:
        """KV pages and bytes in use per layer and head (reads device state).

        Returns:
          dict as `kv.kv_usage`: `pages` and `bytes` `[L, K]` int64, `capacity_pages` `[L]`,
          `total_bytes`.
        """
        shape = (self.num_layers, self.num_kv_heads)
        pages = np.asarray(kv.pages_in_use(self.states.allocator), np.int64).reshape(shape)
        per_page = np.asarray([kv.page_bytes(p) for p in self.states.pools], np.int64)[:, None]
        return {"pages": pages, "bytes": pages * per_page,
                "capacity_pages": np.full(self.num_layers, self.num_pages - 1, np.int64),
                "total_bytes": int((pages * per_page).sum())}

    def free_pages(self) -> np.ndarray:
        """Device free-page counts `[L, K]` (reads device state)."""
        return np.asarray(kv.free_pages(self.states.allocator)).reshape(
            self.num_layers, self.num_kv_heads)


_jit_free = jax.jit(_free_rows, donate_argnums=0)
TRACES = collections.Counter()  # ("mixed" | "decode") -> times the step was traced (compiled)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("decode", "implementation"),
                   donate_argnums=2)
def _jit_step(graphdef, params, states, *args, decode, implementation):
    return _step(graphdef, params, states, *args, decode=decode, implementation=implementation,
                 counter=TRACES)


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
