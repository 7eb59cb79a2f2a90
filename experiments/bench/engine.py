"""The engine's decode step on a Qwen3-0.6B-shaped random model (`engine_decode`), timed as
`Engine.step` runs it.

- `engine_decode`: one decode step of `models.engine._jit_step` (the jitted function
  `Engine.step` calls, `decode=True`, `implementation="auto"`: the Triton paged decode on a GPU)
  for a Qwen3-0.6B-shaped model with random bf16 weights (`QWEN3_0_6B`: 28 layers, D1024, N16 /
  K8, H128, I3072, V151936, tied embeddings, q/k RMSNorm, RoPE theta 1e6), `B` rows each decoding
  one token over `S` tokens in the cache (the decode token included: it sits at `S - 1`, the
  `lengths` convention of the paged decode rows). Nothing is prefilled: the pools are filled with
  random pages and the block tables / allocator are set as if `S` tokens were cached
  (`kv.alloc_batch` of `ceil(S / P)` pages per row and head), so the step's own allocation finds
  nothing to do; every call rewrites position `S - 1`. The step donates its state and the timer
  carries it from call to call, so the pools (~60 GB at B64 / S8K) exist once. Bytes counted:
  every weight once (all `nnx.split` leaves; the tied embedding is the lm head, read whole for
  the logits) plus every layer's K and V of `S` tokens for `B` rows (fp8: plus their scales).
  Not counted (< 0.1%): the new token's K / V writes, tables, activations. Ceiling: the copy
  bandwidth. Goal (PERF.md): `fraction_of_ceiling >= 0.6` and no recompilation in the timed
  calls (`recompiles`: traces of the decode step during them). Anchor: the same step with
  `implementation="xla"` at the same `S` if it fits in memory, else the largest of `S / 2`,
  `S / 4` that does (its row says which; `anchor_ms` then stays empty since the shapes differ;
  an OOM is recorded in `xla_error`). `rel_err_vs_xla`: the first step's logits against the XLA
  step's (same state). `sample_ms`: the step's sampling alone (an argsort over `[B, V]`).
- `engine_decode_fp8`: the same step with `float8_e4m3fn` pages (the engine's `kv_dtype`; the
  pools are the bf16 random pages quantised with `kv.fp8.quantize`). Bytes: fp8 K / V plus their
  float32 scales. Goal as above; anchor: our bf16 step; `rel_err_vs_bf16` of the logits.
- `engine_decode` `...-xla` row: the XLA anchor on its own (at the `S` it ran), `(anchor row)`.

`--quick` takes `QUICK_MODEL` (2 layers, D256, V4096, still N16 / K8 / H128) at B2 / S256; on a
CPU the step runs with `implementation="triton"`, the Triton kernels through the interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kv
from experiments.bench import core
from experiments.bench.registry import register
from models import engine as engine_mod
from models.config import HFConfig
from models.engine import Engine, EngineKV
from models.families.qwen3 import Qwen3ForCausalLM, config_from_hf

log = logging.getLogger("bench.engine")

QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    tie_word_embeddings=True, max_position_embeddings=40960, attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
QUICK_MODEL = dict(QWEN3_0_6B, num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                   vocab_size=4096)


def build_model(hf_config: dict, *, seed: int = 0) -> Qwen3ForCausalLM:
    """A Qwen3 model with random bf16 weights from an HF-style config dict (no checkpoint)."""
    cfg = config_from_hf(HFConfig(hf_config, source="experiments.bench"))
    return Qwen3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


def _seq_name(s: int) -> str:
    return f"S{s // 1024}K" if s % 1024 == 0 else f"S{s}"


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_pages(key, shape, sub_block):
    """Random bf16 pages `shape`, or their e4m3 quantisation `(q, scales)` if `sub_block`."""
    x = jax.random.normal(key, shape, jnp.bfloat16)
    if sub_block is None:
        return x, None
    return kv.fp8.quantize(x, sub_block)


def engine_state(engine: Engine, seq: int, *, seed: int = 0) -> EngineKV:
    """Engine state `B` rows x `seq` cached tokens: random pages, tables and allocator as after
    `seq` tokens per row (`ceil(seq / P)` pages per row and head, every row its own pages).

    The pools have exactly the pages the rows hold (plus the null page). The engine itself only
    supplies the layout (its own state is built with 2 pages per head and is not used).
    """
    b, p = engine.batch_slots, engine.page_size
    pages_per_row = -(-seq // p)
    num_pages = b * pages_per_row + 1
    key = jax.random.key(seed)
    pools = []
    for i, pool in enumerate(engine.states.pools):
        if not isinstance(pool, kv.PagePool):
            raise ValueError(f"layer {i}: {type(pool).__name__}; only attention layers here")
        shape = (pool.num_kv_heads, num_pages, pool.page_size, pool.head_dim)
        k, ks = _random_pages(jax.random.fold_in(key, 2 * i), shape, pool.sub_block)
        v, vs = _random_pages(jax.random.fold_in(key, 2 * i + 1), shape, pool.sub_block)
        pools.append(kv.PagePool(k=k, v=v, k_scale=ks, v_scale=vs))
    heads = len(engine.paged_layers) * engine.num_kv_heads
    tables = kv.create_block_tables(batch_size=b, num_kv_heads=heads,
                                    max_pages=engine.max_pages, page_size=p)
    allocator = kv.create_allocator(num_kv_heads=heads, num_pages=num_pages)
    lengths = jnp.full((b,), seq, jnp.int32)
    allocator, tables, ok = jax.jit(kv.alloc_batch)(allocator, tables,
                                                    kv.pages_needed(tables, lengths))
    if not bool(ok):
        raise RuntimeError(f"could not allocate {pages_per_row} pages x {b} rows of "
                           f"{num_pages} pages per head")
    # Distinct buffers for every small leaf: the step donates the whole state.
    tables, allocator = jax.tree.map(lambda x: jnp.array(x, copy=True), (tables, allocator))
    return EngineKV(pools, tables, allocator)


def _step_inputs(engine: Engine, seq: int, vocab: int) -> tuple:
    """The decode step's arguments after `states`: every row decodes one token at `seq - 1`."""
    b, layers, heads = engine.batch_slots, engine.num_layers, engine.num_kv_heads
    ids = jax.random.randint(jax.random.key(1), (b, 1), 0, vocab, jnp.int32)
    zeros_blk = jnp.zeros((b, layers, heads), jnp.int32)
    return (ids, jnp.full((b,), seq - 1, jnp.int32), jnp.ones((b,), jnp.int32), zeros_blk,
            zeros_blk, jnp.zeros((b,), jnp.uint32), jnp.zeros((b,), jnp.float32),
            jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32))


def time_engine_step(ctx: core.Context, model, *, batch: int, seq: int, page: int,
                     implementation: str, kv_dtype=None, **knobs) -> dict:
    """Median ms of the engine's jitted decode step at `B = batch`, `S = seq`, state carried
    from call to call (`knobs`: `core.time_ms`'s counts).

    Returns:
      dict: `ms`, `first_call_s` (compile included), `recompiles` (decode-step traces during the
      calls after the first), `logits` (the first call's `[B, V]` float32, on the host),
      `weight_bytes`, `kv_bytes` (K and V read, fp8 scales included), `sub_block` (fp8) or None.
    """
    engine = Engine(model, batch_slots=batch, max_len=seq, page_size=page, num_pages=2,
                    kv_dtype=kv_dtype, implementation=implementation)
    states = engine_state(engine, seq)
    args = _step_inputs(engine, seq, model.cfg.vocab_size)
    call = functools.partial(engine._step, engine._graphdef, engine._params, decode=True)

    pool = states.pools[0]
    itemsize = jnp.dtype(pool.k.dtype).itemsize
    per_token = pool.num_kv_heads * (pool.head_dim + pool.value_head_dim) * itemsize
    if pool.is_fp8:  # one float32 scale per head, sub-block, K and V
        per_token += pool.num_kv_heads * 2 * 4 / pool.sub_block
    kv_bytes = int(len(states.pools) * batch * seq * per_token)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine._params))

    start = time.perf_counter()
    out = call(states, *args)
    states = out[2]
    logits = np.asarray(out[1])
    first_call_s = time.perf_counter() - start
    traces = engine_mod.TRACES["decode"]
    ms = ctx.time(call, states, *args, budget_s=None,
                  carry=lambda out, args: (out[2], *args[1:]), **knobs)
    return {"ms": ms, "first_call_s": first_call_s,
            "recompiles": engine_mod.TRACES["decode"] - traces, "logits": logits,
            "weight_bytes": int(weight_bytes), "kv_bytes": kv_bytes,
            "sub_block": pool.sub_block}


def _sample_ms(ctx: core.Context, batch: int, vocab: int) -> float:
    logits = jax.random.normal(jax.random.key(3), (batch, vocab), jnp.float32)
    keys = jax.random.split(jax.random.key(4), batch)
    zeros = jnp.zeros((batch,), jnp.float32)
    fn = jax.jit(engine_mod.sample)
    return ctx.time(fn, logits, keys, zeros, jnp.zeros((batch,), jnp.int32),
                    jnp.ones((batch,), jnp.float32), budget_s=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """Qwen3-0.6B shape (`QWEN3_0_6B`; `tiny`: `QUICK_MODEL`), B64 rows over S8K, pages of 64."""

    batch: int = 64
    seq: int = 8192
    page: int = 64
    tiny: bool = False
    xla_reference: bool = True
    QUICK: ClassVar[dict] = dict(batch=2, seq=256, page=16, tiny=True)


@register("engine_decode", EngineArgs)
def engine_rows(a: EngineArgs, ctx: core.Context):
    """Engine decode step bf16 (against the XLA step), fp8 pages (against bf16), the XLA row.

    Failures are logged and recorded in the rows, never raised."""
    batch, seq, page = a.batch, a.seq, a.page
    impl = "auto" if core.on_gpu() else "triton"  # on a CPU: the Triton kernels interpreted
    hf = QUICK_MODEL if a.tiny else QWEN3_0_6B
    name = "qwen3-tiny-L2" if a.tiny else "qwen3-0.6b"
    model = build_model(hf)
    ceiling = ctx.copy_tbs["ceiling"]
    case = f"{name}-B{batch}-{_seq_name(seq)}-P{page}"
    goal = "fraction_of_ceiling >= 0.6 and 0 recompiles"
    rows, results = [], {}

    def measure(label, **kw):
        try:
            results[label] = time_engine_step(ctx, model, batch=batch, page=page, **kw)
            r = results[label]
            total = r["weight_bytes"] + r["kv_bytes"]
            log.info("engine %s: %.3f ms, %.2f GB -> %.3f TB/s = %.3f of copy (first call %.1f s, "
                     "%d recompiles)", label, r["ms"], total / 1e9, total / r["ms"] / 1e9,
                     total / r["ms"] / 1e9 / ceiling, r["first_call_s"], r["recompiles"])
        except Exception as e:  # an OOM is a result too
            log.warning("engine %s failed: %s", label, core.first_line(e, 300))
            results[label] = {"error": core.first_line(e, 300)}
        gc.collect()

    measure("bf16", seq=seq, implementation=impl, warmup=1)
    measure("fp8", seq=seq, implementation=impl, kv_dtype=jnp.float8_e4m3fn, warmup=1)
    xla, xla_seq = {"error": "skipped (xla_reference=0)"}, None
    if a.xla_reference:
        for s in (seq, seq // 2, seq // 4):
            if s < page:
                break
            measure(f"xla-{s}", seq=s, implementation="xla", iters=3, trials=3, warmup=0)
            xla = results[f"xla-{s}"]
            if "ms" in xla:
                xla_seq = s
                break

    def floor_fields(r):
        total = r["weight_bytes"] + r["kv_bytes"]
        return total, {"weight_bytes": r["weight_bytes"], "kv_bytes": r["kv_bytes"],
                       "floor_ms": round(total / ceiling / 1e9, 4),
                       "recompiles": r["recompiles"], "first_call_s": round(r["first_call_s"], 2)}

    bf16 = results["bf16"]
    if "ms" in bf16:
        total, extra = floor_fields(bf16)
        same = xla_seq == seq
        err = core.rel_err(bf16["logits"], xla["logits"]) if same else None
        tbs = total / bf16["ms"] / 1e9
        rows.append(core.row(
            kernel="engine_decode", case=case + "-bf16", ms=bf16["ms"], achieved=tbs,
            unit="TB/s", ceiling=ceiling,
            anchor=(f"engine step implementation=xla at {_seq_name(xla_seq)}" if xla_seq
                    else "engine step implementation=xla (did not run)"),
            anchor_ms=xla["ms"] if same else None, goal=goal,
            meets_goal=tbs / ceiling >= 0.6 and bf16["recompiles"] == 0,
            implementation=impl, layers=hf["num_hidden_layers"], **extra,
            xla_seq=xla_seq, xla_ms=None if xla_seq is None else round(xla["ms"], 4),
            xla_error=results.get(f"xla-{seq}", xla).get("error"),  # at the same S
            rel_err_vs_xla=None if err is None else round(err, 5),
            sample_ms=round(_sample_ms(ctx, batch, hf["vocab_size"]), 4)))
    else:
        rows.append({"kernel": "engine_decode", "case": case + "-bf16", "goal": goal,
                     "meets_goal": False, "error": bf16["error"]})

    fp8 = results["fp8"]
    if "ms" in fp8:
        total, extra = floor_fields(fp8)
        tbs = total / fp8["ms"] / 1e9
        bf16_ok = "ms" in bf16
        rows.append(core.row(
            kernel="engine_decode_fp8", case=case + f"-fp8-sub{fp8['sub_block']}", ms=fp8["ms"],
            achieved=tbs, unit="TB/s", ceiling=ceiling, anchor="ours engine step bf16",
            anchor_ms=bf16["ms"] if bf16_ok else None, goal=goal,
            meets_goal=tbs / ceiling >= 0.6 and fp8["recompiles"] == 0,
            implementation=impl, **extra,
            rel_err_vs_bf16=(round(core.rel_err(fp8["logits"], bf16["logits"]), 5)
                             if bf16_ok else None)))
    else:
        rows.append({"kernel": "engine_decode_fp8", "case": case + "-fp8", "goal": goal,
                     "meets_goal": False, "error": fp8["error"]})

    if xla_seq is not None:
        total, extra = floor_fields(xla)
        tbs = total / xla["ms"] / 1e9
        bf16_here = "ms" in bf16 and xla_seq == seq
        rows.append(core.row(
            kernel="engine_decode", case=f"{name}-B{batch}-{_seq_name(xla_seq)}-P{page}-bf16-xla",
            ms=xla["ms"], achieved=tbs, unit="TB/s", ceiling=ceiling,
            anchor="ours engine step bf16" if bf16_here else None,
            anchor_ms=bf16["ms"] if bf16_here else None, goal="(anchor row)", meets_goal=None,
            implementation="xla", **extra,
            failed_at_seq=[s for s in (seq, seq // 2) if s > xla_seq] or None))
    elif a.xla_reference:
        rows.append({"kernel": "engine_decode", "case": case + "-bf16-xla", "goal": "(anchor row)",
                     "meets_goal": None, "error": xla.get("error")})
    yield from rows


