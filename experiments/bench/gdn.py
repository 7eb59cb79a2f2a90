"""Gated DeltaNet and causal conv1d rows, decode and prefill (Qwen3.5's linear-attention layers).

- `gdn_decode`: one decode step at B64, Nk16, Nv32, H = Hv = 128, bf16 q / k / v, float32
  states in a slot pool of B + 1 slots, l2-norm in the kernel. Floor: the state read + write,
  `2·B·Nv·H·Hv·4` bytes (268 MB; q / k / v / o add 1.6 MB), against the copy bandwidth (goal
  >= 0.85). Anchors: fla's `fused_recurrent_gated_delta_rule` (torch, same GPU; no slot pool: it
  reads `initial_state [B, Nv, H, Hv]` and writes a fresh final state, the same state bytes) and
  the XLA reference (gather, step, scatter; pool donated), `xla_ms`.
- `causal_conv1d_update`: one step at B64, C = 8192, W4, bf16 pool and input, SiLU, no bias:
  about 8.4 MB a step, so launch-bound; anchor the XLA reference.
- `gdn_chunk_prefill`: chunked prefill, Nk16, Nv32, H = Hv = 128, bf16 q / k / v, float32 g /
  beta / states, l2-norm in the kernel; B1 T8K, B1 T32K, B8 T4K. Anchor: fla's
  `chunk_gated_delta_rule` with Nk key heads (fla's GVA, our head mapping), or q / k repeated to
  Nv heads if this fla refuses that; else the XLA reference, always reported as `xla_ms`.
  TFLOP/s on the chunked algorithm's matmuls (`gdn_flops`) against the matmul rate; `floor_ms`
  = max(FLOPs / matmul rate, minimum bytes / copy bandwidth). Goal >= 1.5x fla.
- `gdn_chunk_fwd_bwd`: the chunked prefill's forward and backward (`jax.vjp`, cotangents for the
  output and the final state) at B1 T32K, B8 T4K and B1 T64K, the `gdn_chunk_prefill` shapes.
  Anchor: fla's `chunk_gated_delta_rule` forward + backward (torch autograd, GVA as above); the
  XLA reference's forward + VJP up to 32K tokens, `xla_ms`. TFLOP/s on the forward's and the
  backward's matmuls (`gdn_flops` + `gdn_bwd_flops`); `temp_gib` the compiled program's scratch
  memory. Every row carries each output's and gradient's relative error against the reference
  and fla's against ours. Goal >= 1.3x fla.
- `causal_conv1d`: prefill, C = 8192, W4, bf16, SiLU, an initial state; T32K as one sequence and
  packed as 4 (`cu_seqlens`). Bytes: x read + y written (+ states and weight) against the copy
  bandwidth (goal >= 0.9); anchor the XLA reference.
- `causal_conv1d_bwd` (and `causal_conv1d_fwd_bwd`): the same shapes and packings, cotangents
  for y and the final state, no bias. Bytes: x and dy read + dx written (the forward adds x read
  + y written), states and weights; against the copy bandwidth (goal >= 0.85); anchor the XLA
  reference's `jax.vjp` (its backward recomputes the forward).

Decode timing: one jitted call runs `STEPS` unrolled steps, each step's output the next one's
input (o → v, y → x) so no step is dead code, and the donated pool is threaded from call to call:
what is timed is the in-place path; `ms` is per step. Every row carries the relative error of our
outputs (and states) against the XLA reference, and fla's against ours.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.conv1d import _triton_bwd as conv_bwd
from attn.conv1d import reference as conv_ref
from attn.conv1d import triton as conv_triton
from attn.conv1d import triton_prefill as conv_prefill
from attn.gdn import reference as gdn_ref
from attn.gdn import triton as gdn_triton
from attn.gdn import triton_chunk as gdn_chunk
from experiments.bench import core
from experiments.bench.registry import register

log = logging.getLogger("bench.gdn")

STEPS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class GDNDecodeArgs:
    """B64, Nk16, Nv32, H = Hv = 128 (Qwen3.5)."""

    batch: int = 64
    nk: int = 16
    nv: int = 32
    head_dim: int = 128
    anchors: bool = True
    QUICK: ClassVar[dict] = dict(batch=2, nk=1, nv=2, head_dim=16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvUpdateArgs:
    """B64, C = 8192, W4 (Qwen3.5's short conv)."""

    batch: int = 64
    channels: int = 8192
    width: int = 4
    anchors: bool = True
    QUICK: ClassVar[dict] = dict(batch=2, channels=32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GDNChunkArgs:
    """`cases`: `BxT` items; Nk16, Nv32, H = Hv = 128."""

    cases: tuple[str, ...] = ("1x8192", "1x32768", "8x4096")
    nk: int = 16
    nv: int = 32
    head_dim: int = 128
    QUICK: ClassVar[dict] = dict(cases=("1x40",), nk=1, nv=2, head_dim=16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvPrefillArgs:
    """`tokens` in one row, as 1 sequence and packed as each of `seqs`."""

    tokens: int = 32768
    seqs: tuple[int, ...] = (1, 4)
    channels: int = 8192
    width: int = 4
    QUICK: ClassVar[dict] = dict(tokens=40, seqs=(3,), channels=32)


def _fla():
    """fla's gated delta rule ops and torch, or `(None, None, why)`."""
    if not core.on_gpu():
        return None, None, "skipped: no GPU"
    core.writable_triton_cache()
    try:
        import torch
        from fla.ops import gated_delta_rule
    except ImportError as e:
        return None, None, f"skipped: {e}"
    if not torch.cuda.is_available():
        return None, None, "skipped: torch has no CUDA device"
    return torch, gated_delta_rule, ""


def stepper(step, steps: int = STEPS):
    """jit of `steps` unrolled `step(pool, x, *args) -> (x_next, pool)` calls; pool donated.

    Every array is an argument: a closed-over array would be baked into the program.
    """
    def run(pool, x, *args):
        for _ in range(steps):
            x, pool = step(pool, x, *args)
        return x, pool
    return jax.jit(run, donate_argnums=(0,))


def thread_pool(out, args):
    """`time_ms(carry=)` of a stepper: the returned pool is the next call's."""
    return (out[1], *args[1:])


def gdn_step(impl: str, config: gdn_triton.Config | None = None):
    """One pooled GDN decode step `(pool, v, q, k, g, beta, slot_ids) -> (o, pool)`."""
    def step(pool, v, q, k, g, beta, slot_ids):
        if impl == "triton":
            o, pool = gdn_triton.gdn_decode_pool(q, k, v, g, beta, pool, slot_ids,
                                                 use_qk_l2norm=True, config=config)
        else:
            o, pool = gdn_ref.gdn_decode_pool(q, k, v, g, beta, pool, slot_ids,
                                              use_qk_l2norm=True)
        return o.astype(v.dtype), pool
    return step


def gdn_decode_inputs(rng, *, batch, nk, nv, h, hv):
    """numpy float32 q, k, v, realistic gates, a pool of B + 1 slots (slot 0 null) and a
    permutation of the real slots."""
    q = rng.standard_normal((batch, 1, nk, h), np.float32)
    k = rng.standard_normal((batch, 1, nk, h), np.float32)
    v = rng.standard_normal((batch, 1, nv, hv), np.float32)
    g = np.log(rng.uniform(0.4, 0.95, (batch, 1, nv))).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (batch, 1, nv)).astype(np.float32)
    pool = 0.5 * rng.standard_normal((batch + 1, nv, h, hv), np.float32)
    pool[0] = 0.0
    slot_ids = (rng.permutation(batch) + 1).astype(np.int32)
    return q, k, v, g, beta, pool, slot_ids


def _fla_recurrent(ctx, q, k, v, g, beta, h0):
    """fla `fused_recurrent_gated_delta_rule` ms per call and its `(o, final)`, or
    `(None, None)`."""
    torch, ops, why = _fla()
    if torch is None:
        log.warning("fla anchor %s", why)
        return None, None
    dev = torch.device("cuda")
    t = {name: torch.from_numpy(x).to(dev) for name, x in
         (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("h0", h0))}
    for name in ("q", "k", "v"):
        t[name] = t[name].to(torch.bfloat16)

    def call():
        return ops.fused_recurrent_gated_delta_rule(
            t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=t["h0"],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
    try:
        ms = ctx.time(call, iters=20, warmup=3, budget_s=None)
        out = call()
    except Exception as e:  # an anchor that fails is logged, not fatal
        log.warning("fla anchor failed: %s", core.first_line(e))
        return None, None
    o, final = (x.float().cpu().numpy() for x in out)
    t.clear()
    del out
    torch.cuda.empty_cache()
    return ms, (o, final)


@register("gdn_decode", GDNDecodeArgs)
def gdn_decode_rows(a: GDNDecodeArgs, ctx: core.Context):
    """GDN decode step against the state-traffic floor, fla and the XLA reference."""
    rng = np.random.default_rng(0)
    b, nk, nv, h = a.batch, a.nk, a.nv, a.head_dim
    hv = h
    q, k, v, g, beta, pool_np, slot_ids = gdn_decode_inputs(rng, batch=b, nk=nk, nv=nv, h=h,
                                                            hv=hv)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf(q), bf(k), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(slot_ids))
    vj = bf(v)
    cfg = gdn_triton.default_config(hv)

    # One step of each, on fresh copies of the pool (the calls donate it).
    o, new_pool = stepper(gdn_step("triton", cfg), 1)(jnp.asarray(pool_np), vj, *args)
    o_ref, pool_ref = stepper(gdn_step("xla"), 1)(jnp.asarray(pool_np), vj, *args)
    live = np.asarray(slot_ids)
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    state, state_ref = np.asarray(new_pool)[live], np.asarray(pool_ref)[live]
    extra = dict(rel_err_o_vs_xla=round(core.rel_err(o, o_ref), 7),
                 rel_err_state_vs_xla=round(core.rel_err(state, state_ref), 7),
                 config=f"block_hv={cfg.block_hv} warps={cfg.num_warps}",
                 programs=b * nv * -(-hv // cfg.block_hv))
    del new_pool, pool_ref

    pooled = dict(carry=thread_pool, steps=STEPS, budget_s=None)
    ms = ctx.time(stepper(gdn_step("triton", cfg)), jnp.asarray(pool_np), vj, *args, **pooled)
    xla_ms = fla_ms = None
    if a.anchors:
        try:
            xla_ms = ctx.time(stepper(gdn_step("xla")), jnp.asarray(pool_np), vj, *args,
                              iters=3, trials=3, warmup=1, **pooled)
        except Exception as e:  # an OOM of the reference is a result too
            log.warning("XLA reference failed: %s", core.first_line(e))
        fla_ms, fla_out = _fla_recurrent(ctx, q, k, v, g, beta, pool_np[slot_ids])
        if fla_out is not None:
            extra["fla_rel_err_o_vs_ours"] = round(core.rel_err(fla_out[0], o), 7)
            extra["fla_rel_err_state_vs_ours"] = round(core.rel_err(fla_out[1], state), 7)
    extra["xla_ms"] = None if xla_ms is None else round(xla_ms, 4)
    extra["speedup_vs_xla"] = None if xla_ms is None else round(xla_ms / ms, 3)
    extra["fla_ms"] = None if fla_ms is None else round(fla_ms, 4)

    state_bytes = 2 * b * nv * h * hv * 4
    io_bytes = 2 * (2 * b * nk * h + 2 * b * nv * hv) + 2 * 4 * b * nv
    tbs = state_bytes / ms / 1e9
    ceiling = ctx.copy_tbs["ceiling"]
    anchor, anchor_ms = ("fla fused_recurrent_gated_delta_rule (torch, same GPU)", fla_ms)
    if fla_ms is None:
        anchor, anchor_ms = "xla reference (gather, step, scatter; pool donated)", xla_ms
    yield core.row(
        kernel="gdn_decode", case=f"B{b}-Nk{nk}-Nv{nv}-H{h}-Hv{hv}-f32state-l2norm", ms=ms,
        achieved=tbs, unit="TB/s", ceiling=ceiling, anchor=anchor, anchor_ms=anchor_ms,
        goal="fraction_of_ceiling >= 0.85 (state read + write)",
        meets_goal=tbs / ceiling >= 0.85, state_bytes=state_bytes, io_bytes=io_bytes, **extra)


def conv_step(impl: str, config: conv_triton.Config | None = None):
    """One pooled conv1d update step `(pool, x, slot_ids, weight) -> (y, pool)`."""
    def step(pool, x, slot_ids, weight):
        if impl == "triton":
            return conv_triton.causal_conv1d_update_pool(x, pool, slot_ids, weight, None, "silu",
                                                         config=config)
        return conv_ref.causal_conv1d_update_pool(x, pool, slot_ids, weight, None, "silu")
    return step


def conv_update_inputs(rng, *, batch, channels, width):
    """bf16 x `[B, C]`, weight `[C, W]`, a float32 pool of B + 1 slots, the live slot ids."""
    x = jnp.asarray(rng.standard_normal((batch, channels), np.float32), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((channels, width), np.float32) * 0.5, jnp.bfloat16)
    pool_np = rng.standard_normal((batch + 1, channels, width - 1), np.float32)
    slot_ids = jnp.asarray(rng.permutation(batch) + 1, jnp.int32)
    return x, weight, pool_np, slot_ids


@register("causal_conv1d_update", ConvUpdateArgs)
def conv_update_rows(a: ConvUpdateArgs, ctx: core.Context):
    """Causal conv1d decode step against the XLA reference (launch-bound)."""
    rng = np.random.default_rng(0)
    b, c, w = a.batch, a.channels, a.width
    x, weight, pool_np, slot_ids = conv_update_inputs(rng, batch=b, channels=c, width=w)
    pool = lambda: jnp.asarray(pool_np, jnp.bfloat16)
    cfg = conv_triton.Config()

    y, new_pool = stepper(conv_step("triton", cfg), 1)(pool(), x, slot_ids, weight)
    y_ref, pool_ref = stepper(conv_step("xla"), 1)(pool(), x, slot_ids, weight)
    live = np.asarray(slot_ids)
    extra = dict(rel_err_y_vs_xla=round(core.rel_err(y, y_ref), 6),
                 state_bitwise_equal_to_xla=bool(
                     (np.asarray(new_pool)[live] == np.asarray(pool_ref)[live]).all()),
                 config=f"block_c={cfg.block_c} warps={cfg.num_warps}")
    del new_pool, pool_ref

    pooled = dict(carry=thread_pool, steps=STEPS, budget_s=None)
    ms = ctx.time(stepper(conv_step("triton", cfg)), pool(), x, slot_ids, weight, **pooled)
    xla_ms = None
    if a.anchors:
        try:
            xla_ms = ctx.time(stepper(conv_step("xla")), pool(), x, slot_ids, weight, **pooled)
        except Exception as e:
            log.warning("XLA reference failed: %s", core.first_line(e))
    num_bytes = 2 * b * c * (w - 1) * 2 + 2 * b * c * 2 + c * w * 2
    tbs = num_bytes / ms / 1e9
    yield core.row(
        kernel="causal_conv1d_update", case=f"B{b}-C{c}-W{w}-bf16-silu", ms=ms, achieved=tbs,
        unit="TB/s", ceiling=ctx.copy_tbs["ceiling"], anchor="xla reference (pool donated)",
        anchor_ms=xla_ms,
        goal="speedup_vs_anchor >= 1 (launch-bound: ~8 MB a step; fraction reported)",
        meets_goal=None if xla_ms is None else xla_ms / ms >= 1.0, bytes=num_bytes, **extra)


def cu_seqlens(tokens: int, seqs: int) -> np.ndarray:
    """`seqs` packed sequences of uneven lengths (the first one short) summing to `tokens`."""
    if seqs == 1:
        return np.asarray([0, tokens], np.int32)
    inner = np.linspace(0, tokens, seqs + 1).astype(np.int64)[1:-1]
    inner[0] = min(3, tokens)
    return np.concatenate([[0], inner, [tokens]]).astype(np.int32)


@register("causal_conv1d", ConvPrefillArgs)
def conv_prefill_rows(a: ConvPrefillArgs, ctx: core.Context):
    """Causal conv1d prefill against the copy bandwidth (and the XLA reference)."""
    c, w, t = a.channels, a.width, a.tokens
    for seqs in a.seqs:
        gen = np.random.default_rng(0)
        x = jnp.asarray(gen.standard_normal((1, t, c), np.float32), jnp.bfloat16)
        weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, jnp.bfloat16)
        h0 = jnp.asarray(gen.standard_normal((seqs, c, w - 1), np.float32), jnp.bfloat16)
        cu = None if seqs == 1 else jnp.asarray(cu_seqlens(t, seqs))
        ours = jax.jit(lambda x, wt, s, cu: conv_prefill.causal_conv1d(
            x, wt, initial_state=s, cu_seqlens=cu, activation="silu"))
        xla = jax.jit(lambda x, wt, s, cu: conv_ref.causal_conv1d(
            x, wt, initial_state=s, cu_seqlens=cu, activation="silu"))
        y, final = ours(x, weight, h0, cu)
        y_ref, final_ref = xla(x, weight, h0, cu)
        extra = dict(rel_err_y_vs_xla=round(core.rel_err(y, y_ref), 6),
                     final_state_bitwise_equal_to_xla=bool(
                         (np.asarray(final) == np.asarray(final_ref)).all()))
        del y, final, y_ref, final_ref
        ms = ctx.time(ours, x, weight, h0, cu)
        xla_ms = None
        try:
            xla_ms = ctx.time(xla, x, weight, h0, cu)
        except Exception as e:  # an anchor that fails is logged, not fatal
            log.warning("XLA conv reference failed: %s", core.first_line(e))
        num_bytes = 2 * t * c * 2 + 2 * seqs * c * (w - 1) * 2 + c * w * 2
        tbs = num_bytes / ms / 1e9
        ceiling = ctx.copy_tbs["ceiling"]
        name = f"B1-T{core.kilo(t)}" if seqs == 1 else f"varlen{seqs}-T{core.kilo(t)}"
        yield core.row(
            kernel="causal_conv1d", case=f"{name}-C{c}-W{w}-bf16-silu-state", ms=ms,
            achieved=tbs, unit="TB/s", ceiling=ceiling,
            anchor="xla reference (jit)", anchor_ms=xla_ms,
            goal="fraction_of_ceiling >= 0.9 (x read + y written vs copy bandwidth)",
            meets_goal=tbs / ceiling >= 0.9, bytes=num_bytes, **extra)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvBwdArgs:
    """`tokens` in one row, as 1 sequence and packed as each of `seqs`; bf16, SiLU, a state."""

    tokens: int = 32768
    seqs: tuple[int, ...] = (1, 4)
    channels: int = 8192
    width: int = 4
    QUICK: ClassVar[dict] = dict(tokens=40, seqs=(3,), channels=32)


def conv_vjp(conv):
    """jit of `(x, weight, state, cu_seqlens, dy, dfinal) -> (y, final, dx, dweight, dstate)`:
    the forward and the pull-back of `conv` (the reference's signature) with SiLU."""
    def run(x, weight, state, cu, dy, dfinal):
        out, pull = jax.vjp(lambda *a: conv(a[0], a[1], initial_state=a[2], activation="silu",
                                            cu_seqlens=cu), x, weight, state)
        return (*out, *pull((dy, dfinal)))
    return jax.jit(run)


def conv_bwd_step(x, weight, state, cu, dy, dfinal):
    """Our backward alone: `(dx, dweight, None, dstate)`."""
    return conv_bwd.backward(x, weight, None, state, cu, dy, dfinal, activation="silu")


@register("causal_conv1d_bwd", ConvBwdArgs)
def conv_bwd_rows(a: ConvBwdArgs, ctx: core.Context):
    """Causal conv1d backward, and forward + backward, against the copy bandwidth and XLA's."""
    c, w, t = a.channels, a.width, a.tokens
    bwd = jax.jit(conv_bwd_step)
    xla_fwd_bwd = conv_vjp(conv_ref.causal_conv1d)
    xla_bwd = jax.jit(lambda *a: xla_fwd_bwd(*a)[2:])
    fwd_bwd = conv_vjp(conv_prefill.causal_conv1d)
    for seqs in a.seqs:
        shapes = ((1, t, c), (c, w), (seqs, c, w - 1), (1, t, c), (seqs, c, w - 1))
        x, weight, h0, dy, dfinal = (  # drawn on the device (fast at T32K x C8192)
            (jax.random.normal(jax.random.key(i), shape) * (0.5 if i == 1 else 1.0))
            .astype(jnp.bfloat16) for i, shape in enumerate(shapes))
        cu = None if seqs == 1 else jnp.asarray(cu_seqlens(t, seqs))
        args = (x, weight, h0, cu, dy, dfinal)
        dx, dw, _, ds = bwd(*args)
        exp = xla_bwd(*args)
        extra = dict(rel_err_dx_vs_xla=round(core.rel_err(dx, exp[0]), 6),
                     rel_err_dweight_vs_xla=round(core.rel_err(dw, exp[1]), 6),
                     rel_err_dstate_vs_xla=round(core.rel_err(ds, exp[2]), 6),
                     config=str(conv_bwd.Config()))
        del dx, dw, ds, exp
        name = f"B1-T{core.kilo(t)}" if seqs == 1 else f"varlen{seqs}-T{core.kilo(t)}"
        ceiling = ctx.copy_tbs["ceiling"]
        small = 3 * seqs * c * (w - 1) * 2 + 2 * c * w * 2  # states in / out, weight, dweight
        for kernel, ours, xla, big, what in (
                ("causal_conv1d_bwd", bwd, xla_bwd, 3, "x, dy read + dx written"),
                ("causal_conv1d_fwd_bwd", fwd_bwd, xla_fwd_bwd, 5,
                 "x read + y written, then x, dy read + dx written")):
            ms = ctx.time(ours, *args)
            xla_ms = None
            try:
                xla_ms = ctx.time(xla, *args)
            except Exception as e:  # an anchor that fails is logged, not fatal
                log.warning("XLA conv reference failed: %s", core.first_line(e))
            num_bytes = big * t * c * 2 + small
            yield core.row(
                kernel=kernel, case=f"{name}-C{c}-W{w}-bf16-silu-state", ms=ms,
                achieved=num_bytes / ms / 1e9, unit="TB/s", ceiling=ceiling,
                anchor="xla reference (jit, jax.vjp)", anchor_ms=xla_ms,
                goal=f"fraction_of_ceiling >= 0.85 ({what} vs copy bandwidth)",
                meets_goal=num_bytes / ms / 1e9 / ceiling >= 0.85, bytes=num_bytes, **extra)


def gdn_flops(b: int, t: int, nv: int, h: int, hv: int, c: int = gdn_chunk.CHUNK) -> float:
    """Matmul FLOPs of the chunked algorithm (the `(I + A)⁻¹` solve left out): per chunk and
    head `K Kᵀ` (2C²H), W and U (2C²(H + Hv)), `W S`, `Kᵀ V_new` and `Q S` (3 · 2CHHv), `Q Kᵀ`
    (2C²H) and the intra-chunk `P V_new` (2C²Hv)."""
    chunks = b * -(-t // c)
    per = 2 * c * c * h + 2 * c * c * (h + hv) + 6 * c * h * hv + 2 * c * c * h + 2 * c * c * hv
    return chunks * nv * per


def _fla_chunk(ctx, q, k, v, g, beta, h0, *, scale: float):
    """fla `chunk_gated_delta_rule` ms per call and its `(o, final_state)` as numpy float32.

    q / k go in with their Nk heads (fla's GVA); if that call fails, repeated to Nv heads.

    Returns:
      `(ms, (o, final), note)`, or `(None, None, why)`.
    """
    torch, ops, why = _fla()
    if torch is None:
        log.warning("fla anchor %s", why)
        return None, None, why
    dev = torch.device("cuda")
    t = {name: torch.from_numpy(np.asarray(x, np.float32)).to(dev) for name, x in
         (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("h0", h0))}
    for name in ("q", "k", "v"):
        t[name] = t[name].to(torch.bfloat16).contiguous()

    def call():
        return ops.chunk_gated_delta_rule(
            t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], scale=scale,
            initial_state=t["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    result, note = (None, None), ""
    for gva in (True, False):
        if not gva:
            ratio = v.shape[2] // q.shape[2]
            for name in ("q", "k"):
                t[name] = t[name].repeat_interleave(ratio, dim=2).contiguous()
            note = "q / k repeated to Nv heads"
        try:
            ms = ctx.time(call, warmup=3, budget_s=None)
            out = call()
        except Exception as e:  # an anchor that fails is logged, not fatal
            log.warning("fla anchor failed (gva=%s): %s", gva, core.first_line(e))
            note = f"fla failed: {core.first_line(e, 120)}"
            continue
        result = ms, tuple(x.float().cpu().numpy() for x in out)
        del out
        break
    t.clear()
    torch.cuda.empty_cache()
    return *result, note


@register("gdn_chunk_prefill", GDNChunkArgs)
def gdn_chunk_rows(a: GDNChunkArgs, ctx: core.Context):
    """GDN chunked prefill against fla (and the XLA reference)."""
    nk, nv, h = a.nk, a.nv, a.head_dim
    hv = h
    scale = h**-0.5
    for text in a.cases:
        b, t = (int(x) for x in text.lower().split("x"))
        gen = np.random.default_rng(0)
        q = gen.standard_normal((b, t, nk, h), np.float32)
        k = gen.standard_normal((b, t, nk, h), np.float32)
        v = gen.standard_normal((b, t, nv, hv), np.float32)
        g = np.log(gen.uniform(0.4, 0.99, (b, t, nv))).astype(np.float32)
        beta = gen.uniform(0.05, 0.95, (b, t, nv)).astype(np.float32)
        h0 = (0.5 * gen.standard_normal((b, nv, h, hv))).astype(np.float32)
        bf = lambda x: jnp.asarray(x, jnp.bfloat16)
        inputs = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0))
        ours = jax.jit(lambda q, k, v, g, beta, h0: gdn_chunk.gdn_chunked(
            q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True))
        xla = jax.jit(lambda q, k, v, g, beta, h0: gdn_ref.gdn_chunked(
            q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True))
        o, final = (np.asarray(x, np.float32) for x in ours(*inputs))
        extra = {}
        xla_ms = None
        try:
            o_ref, final_ref = xla(*inputs)
            extra["rel_err_o_vs_xla"] = round(core.rel_err(o, o_ref), 6)
            extra["rel_err_state_vs_xla"] = round(core.rel_err(final, final_ref), 6)
            del o_ref, final_ref
            xla_ms = ctx.time(xla, *inputs)
        except Exception as e:  # an OOM of the reference is a result too
            log.warning("XLA GDN reference failed: %s", core.first_line(e))
        ms = ctx.time(ours, *inputs)
        fla_ms, fla_out, fla_note = _fla_chunk(ctx, q, k, v, g, beta, h0, scale=scale)
        if fla_out is not None:
            extra["fla_rel_err_o_vs_ours"] = round(core.rel_err(fla_out[0], o), 6)
            extra["fla_rel_err_state_vs_ours"] = round(core.rel_err(fla_out[1], final), 6)
        if fla_note:
            extra["fla_note"] = fla_note
        flops = gdn_flops(b, t, nv, h, hv)
        num_bytes = (2 * b * t * (2 * nk * h + 2 * nv * hv) + 2 * 4 * b * t * nv
                     + 2 * 4 * b * nv * h * hv)
        matmul = ctx.matmul_tflops
        floor_ms = max(flops / matmul / 1e9, num_bytes / ctx.copy_tbs["ceiling"] / 1e9)
        anchor, anchor_ms = "fla chunk_gated_delta_rule (torch, same GPU)", fla_ms
        if fla_ms is None:
            anchor, anchor_ms = "xla reference (jit)", xla_ms
        yield core.row(
            kernel="gdn_chunk_prefill",
            case=f"B{b}-T{core.kilo(t)}-Nk{nk}-Nv{nv}-H{h}-Hv{hv}-bf16-l2norm-state", ms=ms,
            achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=matmul, anchor=anchor,
            anchor_ms=anchor_ms, goal="speedup_vs_anchor >= 1.5 against fla",
            meets_goal=None if fla_ms is None else fla_ms / ms >= 1.5,
            xla_ms=None if xla_ms is None else round(xla_ms, 4),
            speedup_vs_xla=None if xla_ms is None else round(xla_ms / ms, 3),
            fla_ms=None if fla_ms is None else round(fla_ms, 4),
            floor_ms=round(floor_ms, 4), fraction_of_floor=round(floor_ms / ms, 4),
            flops=flops, bytes=num_bytes, **extra)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GDNFwdBwdArgs:
    """`cases`: `BxT` items; Nk16, Nv32, H = Hv = 128. The XLA reference's gradient (errors and
    time) runs up to `xla_max_tokens` tokens a case."""

    cases: tuple[str, ...] = ("1x32768", "8x4096", "1x65536")
    nk: int = 16
    nv: int = 32
    head_dim: int = 128
    xla_max_tokens: int = 32768
    QUICK: ClassVar[dict] = dict(cases=("1x40",), nk=1, nv=2, head_dim=16)


def gdn_bwd_flops(b: int, t: int, nv: int, h: int, hv: int, c: int = gdn_chunk.CHUNK) -> float:
    """Matmul FLOPs of the chunked algorithm's backward, per chunk and head (no recomputation,
    the `(I + A)⁻¹` solve left out): the reverse state pass `Pᵀ dO` (2C²Hv), `K dS`, `Qᵀ dO`,
    `Wᵀ dV_new` (3 · 2CHHv); the state side `dO Sᵀ`, `V_new dSᵀ`, `dV_new Sᵀ` (3 · 2CHHv),
    `dO V_newᵀ` (2C²Hv), `dP K`, `dPᵀ Q` (2 · 2C²H); the WY side `dV_new Vᵀ`, `Tᵀ dV_new`
    (2 · 2C²Hv), `dW Kᵀ`, `Tᵀ dW` (2 · 2C²H), `dT Tᵀ`, `Tᵀ (dT Tᵀ)` (2 · 2C³), `dA K`, `dAᵀ K`
    (2 · 2C²H)."""
    chunks = b * -(-t // c)
    per = (2 * c * c * hv + 12 * c * h * hv + 2 * c * c * hv + 4 * c * c * h + 4 * c * c * hv
           + 4 * c * c * h + 4 * c ** 3 + 4 * c * c * h)
    return chunks * nv * per


def gdn_fwd_bwd(chunked):
    """jit of `(q, k, v, g, beta, h0, do, dfinal) -> (o, final, dq, dk, dv, dg, dbeta, dh0)`:
    the forward of `chunked` (`gdn_chunked`'s signature, l2-norm) and its pull-back."""
    def run(q, k, v, g, beta, h0, do, dfinal):
        out, pull = jax.vjp(lambda *a: chunked(*a[:5], initial_state=a[5], use_qk_l2norm=True),
                            q, k, v, g, beta, h0)
        return (*out, *pull((do, dfinal)))
    return jax.jit(run)


def _fla_chunk_fwd_bwd(ctx, arrays, *, scale: float):
    """fla `chunk_gated_delta_rule` forward + backward (torch autograd), ms per call, and its
    `(o, final, dq, dk, dv, dg, dbeta, dh0)` as numpy float32.

    q / k go in with their Nk heads (fla's GVA); if that call fails, repeated to Nv heads (their
    gradients summed back to Nk heads).

    Returns:
      `(ms, outputs, note)`, or `(None, None, why)`.
    """
    torch, ops, why = _fla()
    if torch is None:
        log.warning("fla anchor %s", why)
        return None, None, why
    dev = torch.device("cuda")
    q, k, v, g, beta, h0, do, dfinal = (torch.from_numpy(np.asarray(x, np.float32)).to(dev)
                                        for x in arrays)
    q, k, v, do = (x.to(torch.bfloat16).contiguous() for x in (q, k, v, do))
    nk, nv = q.shape[2], v.shape[2]
    result, note = (None, None), ""
    from fla.ops.common import chunk_o

    guard = "TRITON_ABOVE_3_7_1"
    if not getattr(chunk_o, guard, True):
        # fla refuses its gated backward on Hopper with Triton 3.4 - 3.7.0 (fla issue #640,
        # wrong gradients); timed anyway, its gradients are reported against ours.
        setattr(chunk_o, guard, True)
        note = "fla's Hopper guard for Triton < 3.7.1 (fla #640) bypassed; "
    for gva in (True, False):
        if not gva:
            q, k = (x.repeat_interleave(nv // nk, dim=2).contiguous() for x in (q, k))
            note += "q / k repeated to Nv heads"
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]

        def call(leaves=leaves):
            o, final = ops.chunk_gated_delta_rule(
                *leaves[:3], g=leaves[3], beta=leaves[4], scale=scale, initial_state=leaves[5],
                output_final_state=True, use_qk_l2norm_in_kernel=True)
            return (o, final, *torch.autograd.grad((o, final), leaves, (do, dfinal)))
        try:
            ms = ctx.time(call, warmup=3, budget_s=None)
            out = [x.detach().float() for x in call()]
        except Exception as e:  # an anchor that fails is logged, not fatal
            log.warning("fla anchor failed (gva=%s): %s", gva, core.first_line(e))
            note += f"fla failed: {core.first_line(e, 120)}; "
            continue
        if not gva:  # the repeated heads' q / k gradients back to their key head
            for i in (2, 3):
                out[i] = out[i].unflatten(2, (nk, nv // nk)).sum(3)
        result = ms, [x.cpu().numpy() for x in out]
        del out
        break
    torch.cuda.empty_cache()
    return *result, note


def gdn_fwd_bwd_inputs(key, *, b, t, nk, nv, h, hv):
    """bf16 q, k, v, float32 g (decay 0.4..0.99), β (0.05..0.95), an initial state, and the
    cotangents: dO bf16, d(final state) float32 (drawn on the device: numpy takes seconds a
    case at T32K)."""
    ks = jax.random.split(key, 8)
    normal = lambda i, shape, dtype=jnp.bfloat16: jax.random.normal(ks[i], shape).astype(dtype)
    uniform = lambda i, lo, hi: jax.random.uniform(ks[i], (b, t, nv), jnp.float32, lo, hi)
    return (normal(0, (b, t, nk, h)), normal(1, (b, t, nk, h)), normal(2, (b, t, nv, hv)),
            jnp.log(uniform(3, 0.4, 0.99)), uniform(4, 0.05, 0.95),
            0.5 * normal(5, (b, nv, h, hv), jnp.float32), normal(6, (b, t, nv, hv)),
            normal(7, (b, nv, h, hv), jnp.float32))


@register("gdn_chunk_fwd_bwd", GDNFwdBwdArgs)
def gdn_fwd_bwd_rows(a: GDNFwdBwdArgs, ctx: core.Context):
    """GDN chunked prefill forward + backward against fla's (and the XLA reference's VJP)."""
    nk, nv, h = a.nk, a.nv, a.head_dim
    hv = h
    scale = h**-0.5
    ours = gdn_fwd_bwd(gdn_chunk.gdn_chunked)
    xla = gdn_fwd_bwd(gdn_ref.gdn_chunked)
    fwd = jax.jit(lambda *x: gdn_chunk.gdn_chunked(*x[:5], initial_state=x[5],
                                                   use_qk_l2norm=True))
    names = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for text in a.cases:
        b, t = (int(x) for x in text.lower().split("x"))
        inputs = gdn_fwd_bwd_inputs(jax.random.key(0), b=b, t=t, nk=nk, nv=nv, h=h, hv=hv)
        arrays = [np.asarray(x.astype(jnp.float32)) for x in inputs]  # fla's, the same values
        got = [np.asarray(x, np.float32) for x in ours(*inputs)]
        memory = ours.lower(*inputs).compile().memory_analysis()
        extra = dict(fwd_ms=round(ctx.time(fwd, *inputs[:6]), 4),
                     temp_gib=round(memory.temp_size_in_bytes / 2**30, 3))
        xla_ms = None
        if b * t <= a.xla_max_tokens:
            try:
                exp = xla(*inputs)
                for name, x, e in zip(names, got, exp):
                    extra[f"rel_err_{name}_vs_xla"] = round(core.rel_err(x, e), 6)
                del exp
                xla_ms = ctx.time(xla, *inputs)
            except Exception as e:  # an OOM of the reference is a result too
                log.warning("XLA GDN reference failed: %s", core.first_line(e))
        ms = ctx.time(ours, *inputs)
        fla_ms, fla_out, fla_note = _fla_chunk_fwd_bwd(ctx, arrays, scale=scale)
        if fla_out is not None:
            for name, x, e in zip(names, fla_out, got):
                extra[f"fla_rel_err_{name}_vs_ours"] = round(core.rel_err(x, e), 6)
        if fla_note:
            extra["fla_note"] = fla_note
        del got
        flops = gdn_flops(b, t, nv, h, hv) + gdn_bwd_flops(b, t, nv, h, hv)
        matmul = ctx.matmul_tflops
        anchor, anchor_ms = "fla chunk_gated_delta_rule fwd + bwd (torch, same GPU)", fla_ms
        if fla_ms is None:
            anchor, anchor_ms = "xla reference fwd + vjp (jit)", xla_ms
        yield core.row(
            kernel="gdn_chunk_fwd_bwd",
            case=f"B{b}-T{core.kilo(t)}-Nk{nk}-Nv{nv}-H{h}-Hv{hv}-bf16-l2norm-state", ms=ms,
            achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=matmul, anchor=anchor,
            anchor_ms=anchor_ms, goal="speedup_vs_anchor >= 1.3 against fla fwd + bwd",
            meets_goal=None if fla_ms is None else fla_ms / ms >= 1.3,
            xla_ms=None if xla_ms is None else round(xla_ms, 4),
            fla_ms=None if fla_ms is None else round(fla_ms, 4), flops=flops, **extra)
