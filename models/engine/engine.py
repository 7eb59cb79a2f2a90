"""`Engine`: continuous batching over fixed slots, chunked prefill, paged per-head KV, sampling.

It ties the package's parts together (`models.engine`'s docstring lists them): requests are
queued and placed in slots by the `Scheduler`, each step's host arrays go to the jitted step
(`models.engine.step`), whose layers reach their state through their adapters.

Every active slot feeds its uncached tokens each step, up to `chunk` of them (a prompt chunk over
its cached prefix, or one decode token); the decode step runs when every active slot decodes.
Policies are data: each request carries per-layer, per-KV-head `window` and `sinks` arrays
(`Policy`, `[L, K]` in model layer indices; entries of layers without pages are ignored, and an
adapter may refuse windows: MLA does), passed to the step as `[B, L, K]` int32. The key of the
token at position `p` is `fold_in(key(seed), p)`, so a preempted request that is recomputed
samples the very same tokens. The only device-to-host read of a step is its `B` tokens (and the
routing decisions of a routed step).

Routed (elastic) engines, `Engine(..., elastic=True)`, FastDeploy-style: every paged layer's
adapter is routed. A request's whole prompt is prefilled in one mixed-step chunk (offset 0;
`add` refuses prompts longer than `chunk`), in which each routed layer decides per KV head for
the rows at offset 0; the decisions `[B, L, K]` come back with the tokens and are stored as
`Request.decisions`; from the next step on, the request's policy is the adapters'
`routed_policy` of its decisions (streaming heads become sink + window heads, so the mirror and
`kv.recycle` give their pages back). A preempted routed request is recomputed in two parts: its
original prompt is re-prefilled as one routed chunk (the same tokens at offset 0, so the same
decisions), then its generated tokens are fed as ordinary chunks under the re-derived policy,
so its continuation is the one it would have had without preemption.

A custom attend, `Engine(model, attend=...)`, replaces the attention of every softmax-attention
layer as `model(ids, attend=...)` does in the full forward: it is called as
`attend(spec, qkv, cache)` with `cache` the layer's `PagedKV` (pages with this step's k / v
written, block table, query offsets, key lengths, the policy's windows; see
`models.engine.cache`) and returns `(o, cache)`; `models.engine.paged_attention` is the
default. It is a static argument of the jitted steps (hashable; equal attends share them).

Tensor parallelism, `Engine(model, mesh=mesh)`: the step runs under one mesh, every layer and
its state split by head over `mesh_axis`, routed MoE experts by expert
(`models.engine.sharding`); the host side (scheduler, mirror, sampling parameters) is the same.
With whole weights (`shard_weights=False`) every matmul keeps one device's shapes and the tokens
are one device's; with split weights, up to the rounding of the split reductions.

Not done here: paged layers with different KV head counts in one model, models without any paged
layer, prefix sharing (GDN state would need snapshots at page borders), speculative decoding,
routed prompts longer than one chunk (routing would need the pooled keys of the whole prompt
before its first chunk attends: a two-pass prefill), request-supplied policies on a routed engine
(refused), and a routed engine or a custom attend together with `elastic` on a mesh.
"""

from __future__ import annotations

import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kv
from models.engine import sharding
from models.engine.adapters import ADAPTERS, resolve
from models.engine.requests import Policy, Request, SamplingParams
from models.engine.scheduler import Scheduler
from models.engine.step import EngineKV, StaticGraph, free_rows, jit_step


class Engine:
    """Continuous-batching generation over `batch_slots` slots with paged, per-head KV.

    Args:
      model: a `models` CausalLM whose every layer's mixer has a registered adapter: softmax
        attention (Llama, Qwen3, gated attention), MLA (DeepSeek-V2 / V3) or Gated DeltaNet
        (Qwen3-Next / Qwen3.5 hybrids) built in, more from families.
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
      elastic: routed engine (PawQwen3's elastic attention): each prompt is prefilled in one
        mixed-step chunk with per-request routing; its policy then follows its decisions (see
        the module docstring). Needs a routed adapter for every paged layer, no `policy`, and
        prompts of at most `chunk` tokens.
      attend: custom attention of the softmax-attention layers, `attend(spec, qkv, cache) ->
        (o, cache)` over the layer's `PagedKV` (module docstring); hashable. MLA and GDN layers
        keep their adapters' attention.
      mesh: a `jax.sharding.Mesh`: tensor parallelism over its axis `mesh_axis` (module
        docstring; `models.engine.sharding`). The model's weights and the engine's state are
        placed on it.
      mesh_axis: the mesh axis heads split over.
      shard_weights: with a mesh, split the weights by head / column too (Megatron-style; routed
        MoE experts by expert: expert parallelism); False keeps every weight whole on every
        device and splits only the KV state and the attention over it.

    Attributes:
      adapters: per model layer, its adapter (`models.engine.adapters`).
      layer_kinds: per model layer the adapter's kind (`"attention"`, `"mla"`, `"gdn"`, or a
        family's, e.g. `"elastic"`).
      paged_layers: model indices of the layers with pages (attention and MLA).
      num_kv_heads: `K` of every paged layer (1 for MLA); policies are `[num_layers, K]`.
      states: the device state (`EngineKV`); each step donates it.

    Raises:
      ValueError: a mixer without adapter, paged layers with different KV head counts, no paged
        layer, a setting or default policy an adapter refuses (an FP8 MLA latent, a window on
        MLA), sizes that cannot work, or `elastic=True` for a model with a paged layer that does
        not route, or with a policy, a mesh or an attend; an attend with `mla_attend` /
        `gdn_mix`; `mesh_axis` not on the mesh; a head count (with `shard_weights`, also a MoE
        layer's expert count) the mesh axis size does not divide.
      TypeError: an unhashable attend, a mesh that is not a `jax.sharding.Mesh`.
    """

    def __init__(self, model, *, batch_slots: int = 4, max_len: int = 1024, page_size: int = 16,
                 num_pages: int | None = None, chunk: int = 128, kv_dtype=None,
                 policy: Policy | None = None, implementation: str = "auto",
                 elastic: bool = False, attend=None, mesh=None, mesh_axis: str = "tp",
                 shard_weights: bool = True):
        mixers = [layer.mixer for layer in model.layers]
        self.elastic = bool(elastic)
        self.adapters = tuple(resolve(model, i, m, routed=self.elastic)
                              for i, m in enumerate(mixers))
        self.attend = self._check_attend(attend)
        self.tp = None if mesh is None else sharding.TensorParallel(
            mesh, mesh_axis, bool(shard_weights))
        if self.elastic and (self.tp is not None or attend is not None):
            raise ValueError("elastic=True runs on one device with the elastic adapters' own "
                             f"attention; got mesh={mesh!r}, attend={attend!r}")
        if self.tp is not None:
            sharding.check_heads(self.adapters, mixers, self.tp)
            sharding.check_experts(model, self.tp)
        for name, value in (("batch_slots", batch_slots), ("max_len", max_len),
                            ("page_size", page_size), ("chunk", chunk)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        self.model = model
        self.layer_kinds = tuple(a.kind for a in self.adapters)
        self.num_layers = len(mixers)
        self.paged_layers = tuple(i for i, a in enumerate(self.adapters) if a.paged)
        if not self.paged_layers:
            raise ValueError("the engine needs at least one attention or MLA layer (a paged "
                             f"layer); the layers of this model are {self.layer_kinds}")
        heads_per_layer = {i: self.adapters[i].num_kv_heads(mixers[i]) for i in self.paged_layers}
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
        for i, (a, m) in enumerate(zip(self.adapters, mixers)):
            a.check(m, layer=i, kv_dtype=self.kv_dtype, model_name=type(model).__name__)
        self.implementation = implementation
        # Layer-configured windows (e.g. Qwen3 sliding layers) apply where a policy says "full".
        own = np.array([a.configured_policy(m) for a, m in zip(self.adapters, mixers)], np.int32)
        self._layer_window, self._layer_sinks = own[:, :1], own[:, 1:]
        self.policy = policy or Policy.dense(self.num_layers, self.num_kv_heads)
        self._check_policy(self.policy)
        if self.elastic:
            self._check_routed(model, mixers, policy)

        pools = [a.create_state(m, batch_slots=batch_slots, num_pages=num_pages,
                                page_size=page_size, kv_dtype=self.kv_dtype,
                                model_dtype=model.dtype)
                 for a, m in zip(self.adapters, mixers)]
        heads = len(self.paged_layers) * self.num_kv_heads
        self.states = EngineKV(
            pools,
            kv.create_block_tables(batch_size=batch_slots, num_kv_heads=heads,
                                   max_pages=self.max_pages, page_size=page_size),
            kv.create_allocator(num_kv_heads=heads, num_pages=num_pages))
        # Distinct buffers for every leaf (the constructors share zeros / ones), so the step can
        # donate the whole state.
        self.states = jax.tree.map(lambda x: jnp.array(x, copy=True), self.states)
        sizes = np.asarray([a.state_bytes(p) for a, p in zip(self.adapters, pools)], np.int64)
        self._layer_page_bytes, self._layer_slot_bytes = sizes[:, 0], sizes[:, 1]
        # Under a mesh with split weights, MoE layers step as expert-parallel blocks (a copy).
        graphdef, self._params = nnx.split(
            model if self.tp is None else sharding.expert_parallel(model, self.tp))
        self._graphdef = StaticGraph(graphdef)
        if self.tp is not None:
            self.states = self.place_state(self.states)
            self._params = sharding.place(
                self._params, sharding.param_specs(self._params, self.tp), self.tp)
        self._step = functools.partial(jit_step, implementation=implementation,
                                       adapters=self.adapters, attend=self.attend, tp=self.tp)
        self._free = functools.partial(free_rows, adapters=self.adapters, tp=self.tp)
        self._unpaged = ~np.isin(np.arange(self.num_layers), self.paged_layers)[:, None]
        self._ids = itertools.count()
        # Step counts and host wall time (dispatch to tokens on the host, compiles included).
        self.stats = {"mixed_steps": 0, "decode_steps": 0, "preemptions": 0,
                      "mixed_seconds": 0.0, "decode_seconds": 0.0}
        self.scheduler = Scheduler(
            batch_slots=batch_slots, num_layers=self.num_layers, paged_layers=self.paged_layers,
            num_kv_heads=self.num_kv_heads, num_pages=num_pages, page_size=page_size,
            free_rows=self._free_on_device, stats=self.stats)
        self.last_logits = None  # [B, V] float32 next-token logits of the latest step (device)

    @staticmethod
    def _check_attend(attend):
        """None, or a hashable callable without the model's MLA / GDN hooks."""
        if attend is None:
            return None
        if not callable(attend):
            raise TypeError(f"attend={attend!r} must be callable: attend(spec, qkv, cache)")
        try:
            hash(attend)
        except TypeError:
            raise TypeError(f"attend={attend!r} must be hashable (a frozen dataclass or a "
                            f"function): it is a static argument of the jitted step") from None
        hooks = [h for h in ("mla_attend", "gdn_mix") if hasattr(attend, h)]
        if hooks:
            raise ValueError(f"attend={attend!r} has {hooks}: the engine's attend replaces "
                             f"softmax attention over pages only; MLA and GDN layers keep the "
                             f"engine's own")
        return attend

    def place_state(self, states: EngineKV) -> EngineKV:
        """`states` (an `EngineKV` of this engine's layout) placed as the engine keeps it: on
        the mesh, split by head (`models.engine.sharding`), or unchanged without a mesh."""
        if self.tp is None:
            return states
        specs = sharding.state_specs(self.adapters, *states, self.tp)
        return EngineKV(*sharding.place(tuple(states), specs, self.tp))

    def _check_routed(self, model, mixers, policy) -> None:
        """A routed engine needs every paged layer to route, and no engine policy."""
        bad = [i for i, a in enumerate(self.adapters) if a.paged and not a.routed]
        if bad:
            routed = sorted(c.kind for c in ADAPTERS.values() if c.routed)
            raise ValueError(
                f"elastic=True needs elastic attention layers (a routed adapter; registered: "
                f"{routed}); layers {bad} of {type(model).__name__} are "
                f"{sorted({type(mixers[i]).__name__ for i in bad})}")
        if policy is not None:
            raise ValueError(f"elastic=True derives each request's policy from its router "
                             f"decisions; got policy {policy.name!r}")

    # -- requests ------------------------------------------------------------------------------

    @property
    def slots(self) -> list[Request | None]:
        """The request in each slot, or None."""
        return self.scheduler.slots

    @property
    def waiting(self):
        """Queued requests (a deque), the next one first."""
        return self.scheduler.waiting

    @property
    def finished(self) -> list[Request]:
        """Finished requests in finishing order."""
        return self.scheduler.finished

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

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
        """Shape `[L, K]`, and no window an adapter cannot honour (MLA)."""
        if policy.window.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"policy shape {policy.window.shape} must be [L, K] = "
                             f"{(self.num_layers, self.num_kv_heads)}")
        for layer, adapter in enumerate(self.adapters):
            adapter.check_policy(layer, policy.window[layer], policy.name)

    def _effective(self, request: Request) -> tuple[np.ndarray, np.ndarray]:
        """Effective `[L, K]` window and sinks (layer windows where the policy is full; 0 on
        layers without pages).

        Routed engines: the adapters' `routed_policy` of the request's decisions; every head is
        full before the prompt is routed.
        """
        p = request.policy or self.policy
        if self.elastic and request.decisions is not None:
            w, s = zip(*(a.routed_policy(z) for a, z in zip(self.adapters, request.decisions)))
            p = Policy(np.stack(w), np.stack(s), "elastic")
        full = p.window <= 0
        window = np.where(full, self._layer_window, p.window)
        sinks = np.where(full, self._layer_sinks, p.sinks)
        return (np.where(self._unpaged, 0, window).astype(np.int32),
                np.where(self._unpaged, 0, sinks).astype(np.int32))

    # -- steps ---------------------------------------------------------------------------------

    def _free_on_device(self, rows: list[int]) -> None:
        mask = np.zeros(self.batch_slots, bool)
        mask[rows] = True
        self.states = self._free(self.states, jnp.asarray(mask))

    def _work(self, req: Request) -> int:
        """Tokens a request feeds in this step: a routed request starts with exactly its prompt
        (one routed chunk; a recomputed one then feeds its generated tokens as plain chunks)."""
        if self.elastic and req.cached == 0:
            return len(req.prompt)
        return min(self.chunk, len(req.tokens) - req.cached)

    def step(self) -> list[Request]:
        """One engine step: admit, (maybe preempt), run the mixed or decode step, retire.

        Returns:
          The requests that finished in this step.
        """
        sched = self.scheduler
        work = sched.plan(self._work, self._effective)
        if not work:
            return []
        # A routed prompt (even of one token) is routed in the mixed step.
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
        window = np.where(num_new[:, None, None] > 0, sched.window, 0)
        sinks = np.where(num_new[:, None, None] > 0, sched.sinks, 0)
        start = time.perf_counter()
        tokens, self.last_logits, self.states, decisions = self._step(
            self._graphdef, self._params, self.states, ids, offsets, num_new, window, sinks,
            seeds, temp, top_k, top_p, decode=decode, draw=bool((temp > 0).any()))
        for r, n in work.items():
            sched.commit(r, int(offsets[r]) + n)
        # The step's only device -> host read: B token ids (and the router decisions).
        tokens, decisions = jax.device_get((tokens, decisions))
        if decisions is not None:
            for r in work:
                if offsets[r] == 0:  # routed in this step: its policy applies from now on
                    req = self.slots[r]
                    req.decisions = np.asarray(decisions[r], np.int32)
                    sched.set_policy(r, *self._effective(req))
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
        sched.free(freed)
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

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None,
                 policy: Policy | None = None) -> list[list[int]]:
        """Generate for every prompt (queued together; default `SamplingParams()`); outputs in
        prompt order."""
        params = params or SamplingParams()
        reqs = [self.add(Request(list(p), params, policy)) for p in prompts]
        self.run()
        return [r.output for r in reqs]

    # -- accounting ----------------------------------------------------------------------------

    def pages_held(self) -> np.ndarray:
        """Host view `[B, L, K]` of the pages each slot holds (0 on layers without pages)."""
        held = np.zeros((self.batch_slots, self.num_layers, self.num_kv_heads), np.int64)
        held[:, np.asarray(self.paged_layers)] = self.scheduler.mirror.held()
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
        self.scheduler.mirror.check(self.states.tables, self.states.allocator)

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
        paged = np.asarray(self.paged_layers)
        pages = np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        pages[paged] = np.asarray(
            kv.pages_in_use(self.states.allocator), np.int64).reshape(-1, self.num_kv_heads)
        used = pages * self._layer_page_bytes[:, None]
        state = self.state_bytes()
        return {"pages": pages, "bytes": used,
                "capacity_pages": np.where(self._unpaged[:, 0], 0,
                                           self.num_pages - 1).astype(np.int64),
                "state_bytes": state,
                "state_capacity_bytes": self.batch_slots * self._layer_slot_bytes,
                "total_bytes": int(used.sum() + state.sum())}

    def free_pages(self) -> np.ndarray:
        """Device free-page counts `[L, K]` (reads device state; 0 on GDN layers, which have no
        pages)."""
        free = np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        free[np.asarray(self.paged_layers)] = np.asarray(
            kv.free_pages(self.states.allocator), np.int64).reshape(-1, self.num_kv_heads)
        return free


__all__ = ["Engine"]
