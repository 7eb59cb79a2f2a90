"""Gated DeltaNet prefill rows of `experiments.bench_prefill`: chunked GDN and causal conv1d.

A row library: `experiments.bench_prefill` runs these groups with the others (`--rows`), and

    python -m experiments.bench_gdn_prefill --out benchmarks   # only these rows (needs a GPU)
    python -m experiments.bench_gdn_prefill --smoke            # tiny shapes, CPU interpreter

writes `<out>/gdn_prefill.json` and `.md` (`--smoke`: `gdn_prefill_smoke.*`). Each group is
`(args, ctx) -> rows` (a generator), `ctx` an `experiments._bench.Context`. Rows:

- `causal_conv1d`: Qwen3.5's short conv prefill, C = 8192, W4, bf16, SiLU, no bias, an initial
  state; B1 T32K, and the same tokens packed as 4 sequences (`cu_seqlens`). Ours:
  `attn.conv1d.triton_prefill` (what `implementation="triton"` runs). Bytes: x read + y written
  (+ the small states and weight); ceiling: the copy bandwidth measured in this process. Goal
  (PERF.md) `fraction_of_ceiling >= 0.9`. Anchor: the jitted XLA reference.
- `gdn_chunk_prefill`: Nk16, Nv32, H = Hv = 128, bf16 q/k/v, float32 g / beta / states,
  l2-norm in the kernel, chunk 64; B1 T8K, B1 T32K and B8 T4K. Ours: `attn.gdn.triton_chunk`.
  Anchor: fla's `chunk_gated_delta_rule` (torch, same GPU, timed with CUDA events by
  `_bench.time_torch_ms`; its Triton autotuning happens in the untimed warm-up) with Nk key heads
  (fla's GVA, same head mapping as ours), or q / k repeated to Nv heads if this fla refuses
  that; else the jitted XLA reference, whose time is always reported as `xla_ms`. TFLOP/s
  counted on the chunked algorithm's matmuls (`gdn_flops`); ceiling the bf16 matmul measured in
  this process; `floor_ms` = max(FLOPs / matmul rate, minimum bytes / copy bandwidth) and
  `fraction_of_floor` = floor_ms / ms. Goal (PERF.md) `speedup_vs_anchor >= 1.5` against fla
  (None when fla is missing).

Registers and spills of the GDN kernels for sm_90a (no GPU needed): `python -m
experiments.profile_gdn_chunk --ptxas [--config ...]`.

Every row carries the relative error of our outputs (and final states) against the XLA reference
(and fla's against ours), so a fast wrong kernel shows.
"""

from __future__ import annotations

import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.conv1d import reference as conv_ref
from attn.conv1d import triton_prefill as conv_triton
from attn.gdn import reference as gdn_ref
from attn.gdn import triton_chunk as gdn_triton
from experiments import _bench

log = logging.getLogger("bench_gdn_prefill")

GROUPS = ("gdn_chunk_prefill", "causal_conv1d")
CONV_CASES = [dict(batch=1, tokens=32768, seqs=1), dict(batch=1, tokens=32768, seqs=4)]
GDN_CASES = [dict(batch=1, tokens=8192), dict(batch=1, tokens=32768), dict(batch=8, tokens=4096)]
GDN_HEADS = dict(nk=16, nv=32, h=128)
CONV_CHANNELS, CONV_WIDTH = 8192, 4
SMOKE = dict(conv_cases=[dict(batch=1, tokens=40, seqs=3)], conv_channels=32,
             gdn_cases=[dict(batch=1, tokens=40)], nk=1, nv=2, gdn_head_dim=16)


def configure(args) -> None:
    """Set this library's shapes on `args` (the PERF.md ones, or tiny ones if `args.smoke`)."""
    args.conv_cases, args.conv_channels, args.gdn_cases = CONV_CASES, CONV_CHANNELS, GDN_CASES
    args.nk, args.nv, args.gdn_head_dim = GDN_HEADS["nk"], GDN_HEADS["nv"], GDN_HEADS["h"]
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)


def _cu(tokens: int, seqs: int) -> np.ndarray:
    """`seqs` packed sequences of uneven lengths (the first one short) summing to `tokens`."""
    if seqs == 1:
        return np.asarray([0, tokens], np.int32)
    inner = np.linspace(0, tokens, seqs + 1).astype(np.int64)[1:-1]
    inner[0] = min(3, tokens)
    return np.concatenate([[0], inner, [tokens]]).astype(np.int32)


def conv_rows(args, ctx):
    """Causal conv1d prefill against the copy bandwidth (and the XLA reference)."""
    c, w = args.conv_channels, CONV_WIDTH
    for case in args.conv_cases:
        b, t, seqs = case["batch"], case["tokens"], case["seqs"]
        gen = np.random.default_rng(0)
        x = jnp.asarray(gen.standard_normal((b, t, c), np.float32), jnp.bfloat16)
        weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, jnp.bfloat16)
        n_state = b if seqs == 1 else seqs
        h0 = jnp.asarray(gen.standard_normal((n_state, c, w - 1), np.float32), jnp.bfloat16)
        cu = None if seqs == 1 else jnp.asarray(_cu(t, seqs))
        ours = jax.jit(lambda x, wt, s, cu: conv_triton.causal_conv1d(
            x, wt, initial_state=s, cu_seqlens=cu, activation="silu"))
        xla = jax.jit(lambda x, wt, s, cu: conv_ref.causal_conv1d(
            x, wt, initial_state=s, cu_seqlens=cu, activation="silu"))
        y, final = ours(x, weight, h0, cu)
        y_ref, final_ref = xla(x, weight, h0, cu)
        extra = dict(rel_err_y_vs_xla=round(_bench.rel_err(y, y_ref), 6),
                     final_state_bitwise_equal_to_xla=bool(
                         (np.asarray(final) == np.asarray(final_ref)).all()))
        del y, final, y_ref, final_ref
        ms = ctx.time(ours, x, weight, h0, cu)
        xla_ms = None
        try:
            xla_ms = ctx.time(xla, x, weight, h0, cu)
        except Exception as e:  # an anchor that fails is logged, not fatal
            log.warning("XLA conv reference failed: %s", str(e).splitlines()[0])
        num_bytes = 2 * b * t * c * 2 + 2 * n_state * c * (w - 1) * 2 + c * w * 2
        tbs = num_bytes / ms / 1e9
        ceiling = ctx.copy_tbs["ceiling"]
        name = f"B{b}-T{_bench.kilo(t)}" if seqs == 1 else f"varlen{seqs}-T{_bench.kilo(t)}"
        yield _bench.row(
            kernel="causal_conv1d", case=f"{name}-C{c}-W{w}-bf16-silu-state", ms=ms,
            achieved=tbs, unit="TB/s", ceiling=ceiling,
            anchor="xla reference (jit)", anchor_ms=xla_ms,
            goal="fraction_of_ceiling >= 0.9 (x read + y written vs copy bandwidth)",
            meets_goal=tbs / ceiling >= 0.9, bytes=num_bytes, **extra)


def gdn_flops(b: int, t: int, nv: int, h: int, hv: int, c: int = gdn_triton.CHUNK) -> float:
    """Matmul FLOPs of the chunked algorithm (the `(I + A)⁻¹` solve left out): per chunk and
    head `K Kᵀ` (2C²H), W and U (2C²(H + Hv)), `W S`, `Kᵀ V_new` and `Q S` (3 · 2CHHv), `Q Kᵀ`
    (2C²H) and the intra-chunk `P V_new` (2C²Hv)."""
    chunks = b * -(-t // c)
    per = 2 * c * c * h + 2 * c * c * (h + hv) + 6 * c * h * hv + 2 * c * c * h + 2 * c * c * hv
    return chunks * nv * per


def _fla_ms(ctx, q, k, v, g, beta, h0, *, scale: float):
    """fla `chunk_gated_delta_rule` ms per call and its `(o, final_state)` as numpy float32.

    q / k go in with their Nk heads (fla's GVA); if that call fails, repeated to Nv heads.

    Returns:
      `(ms, (o, final), note)`, or `(None, None, why)` when there is no GPU, fla or CUDA torch is
      missing, or the call fails.
    """
    if not _bench.on_gpu():
        log.warning("fla anchor skipped: no GPU")
        return None, None, "skipped: no GPU"
    _bench.writable_triton_cache()
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        log.warning("fla anchor skipped: %s", e)
        return None, None, f"skipped: {e}"
    if not torch.cuda.is_available():
        log.warning("fla anchor skipped: torch has no CUDA device")
        return None, None, "skipped: torch has no CUDA device"
    dev = torch.device("cuda")
    t = {name: torch.from_numpy(np.asarray(x, np.float32)).to(dev) for name, x in
         (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("h0", h0))}
    for name in ("q", "k", "v"):
        t[name] = t[name].to(torch.bfloat16).contiguous()

    def call():
        return chunk_gated_delta_rule(
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
            ms, out = ctx.time_torch(call)
        except Exception as e:  # an anchor that fails is logged, not fatal
            log.warning("fla anchor failed (gva=%s): %s", gva, str(e).splitlines()[0])
            note = f"fla failed: {str(e).splitlines()[0][:120]}"
            continue
        result = ms, tuple(x.float().cpu().numpy() for x in out)
        del out
        break
    t.clear()
    torch.cuda.empty_cache()
    return *result, note


def gdn_rows(args, ctx):
    """GDN chunked prefill against fla (and the XLA reference)."""
    nk, nv, h, hv = args.nk, args.nv, args.gdn_head_dim, args.gdn_head_dim
    scale = h**-0.5
    for case in args.gdn_cases:
        b, t = case["batch"], case["tokens"]
        gen = np.random.default_rng(0)
        q = gen.standard_normal((b, t, nk, h), np.float32)
        k = gen.standard_normal((b, t, nk, h), np.float32)
        v = gen.standard_normal((b, t, nv, hv), np.float32)
        g = np.log(gen.uniform(0.4, 0.99, (b, t, nv))).astype(np.float32)
        beta = gen.uniform(0.05, 0.95, (b, t, nv)).astype(np.float32)
        h0 = (0.5 * gen.standard_normal((b, nv, h, hv))).astype(np.float32)
        bf = lambda x: jnp.asarray(x, jnp.bfloat16)
        inputs = (bf(q), bf(k), bf(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(h0))
        ours = jax.jit(lambda q, k, v, g, beta, h0: gdn_triton.gdn_chunked(
            q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True))
        xla = jax.jit(lambda q, k, v, g, beta, h0: gdn_ref.gdn_chunked(
            q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True))
        o, final = (np.asarray(x, np.float32) for x in ours(*inputs))
        extra = {}
        xla_ms = None
        try:
            o_ref, final_ref = xla(*inputs)
            extra["rel_err_o_vs_xla"] = round(_bench.rel_err(o, o_ref), 6)
            extra["rel_err_state_vs_xla"] = round(_bench.rel_err(final, final_ref), 6)
            del o_ref, final_ref
            xla_ms = ctx.time(xla, *inputs)
        except Exception as e:  # an OOM of the reference is a result too
            log.warning("XLA GDN reference failed: %s", str(e).splitlines()[0])
        ms = ctx.time(ours, *inputs)
        fla_ms, fla_out, fla_note = _fla_ms(ctx, q, k, v, g, beta, h0, scale=scale)
        if fla_out is not None:
            extra["fla_rel_err_o_vs_ours"] = round(_bench.rel_err(fla_out[0], o), 6)
            extra["fla_rel_err_state_vs_ours"] = round(_bench.rel_err(fla_out[1], final), 6)
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
        yield _bench.row(
            kernel="gdn_chunk_prefill",
            case=f"B{b}-T{_bench.kilo(t)}-Nk{nk}-Nv{nv}-H{h}-Hv{hv}-bf16-l2norm-state", ms=ms,
            achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=matmul, anchor=anchor,
            anchor_ms=anchor_ms, goal="speedup_vs_anchor >= 1.5 against fla",
            meets_goal=None if fla_ms is None else fla_ms / ms >= 1.5,
            xla_ms=None if xla_ms is None else round(xla_ms, 4),
            speedup_vs_xla=None if xla_ms is None else round(xla_ms / ms, 3),
            fla_ms=None if fla_ms is None else round(fla_ms, 4),
            floor_ms=round(floor_ms, 4), fraction_of_floor=round(floor_ms / ms, 4),
            flops=flops, bytes=num_bytes, **extra)


def main(argv=None):
    """These groups alone, through `experiments.bench_prefill` (its options apply)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    from experiments import bench_prefill

    return bench_prefill.main(["--name", "gdn_prefill", *argv], rows=GROUPS)


if __name__ == "__main__":
    main()
