"""Per-kernel profile of the chunked GDN prefill (`attn.gdn.triton_chunk`): which of the three
kernels the time goes to, and how far each is from its bytes and FLOPs.

    python -m experiments.profile_gdn_chunk                       # B1 T32K and B8 T4K, Config()
    python -m experiments.profile_gdn_chunk --config solve=nested,out_bf16=1 --config decay_on_v=1
    python -m experiments.profile_gdn_chunk --quick               # tiny shapes, CPU interpreter
    python -m experiments.profile_gdn_chunk --ptxas --config ...  # sm_90a registers, no GPU
    python -m experiments.profile_gdn_chunk --variants all        # VARIANTS vs default_config

Shapes as `bench_gdn_prefill`'s gdn rows: Nk16, Nv32, H = Hv = 128, bf16 q / k / v, float32 g and
beta, l2-norm in the kernels, no initial state (`--init` adds one). Every `--config` (a comma list
of `Config` fields, `name=value`; booleans as 0 / 1) is one table; the first table is always
`Config()`, the baseline the others' `rel_err` is measured against (same inputs).

Each kernel is jitted alone on the previous kernel's real outputs and timed with
`experiments._bench.time_ms` (median of `--trials` trials of `--iters` back-to-back calls after
a warm-up, `block_until_ready` once per trial); `whole` is the jitted three-kernel op. Per kernel:

- `GB`: HBM bytes if every tensor is read or written once (inputs + outputs, at their dtypes);
  `GB_rr` adds the re-reads the grid implies (k per value head, per pair of them with
  `intra_pairs`; w / k per state tile of `block_hv_state` value features, q / k per output
  tile): L2 absorbs part of those.
- `GFLOP`: the matmuls as the kernel runs them: intra `K Kᵀ` 2C²H (once per pair with
  `intra_pairs`), the solve's [C, C] dots (2C³ each: "subst" 15 + 4, "nested" 3 + 8, "stacked"
  15 / 4 + 4, `intra_pairs` 15 / 16 + 4), W and U 2C²(H + Hv);
  state `W S` and `Kᵀ V_new` 4CH·Hv; output `Q Kᵀ` 2C²H per value tile, `Q S` 2CH·Hv,
  `P V_new` 2C²Hv; per chunk and value head.
- `TB/s` = GB / ms and `TFLOP/s` = GFLOP / ms: compare with the copy bandwidth (~3 TB/s on an
  H100) and the dense bf16 rate (~700 TFLOP/s; TF32 half that) to see which bound a kernel is
  far from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

if "--quick" in sys.argv:  # before jax is imported: the interpreter on the CPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.gdn import reference as gdn_ref
from attn.gdn import triton_chunk as tc
from experiments import _bench

CASES = ((1, 32768), (8, 4096))
HEADS = dict(nk=16, nv=32, h=128, hv=128)
QUICK_CASES = ((1, 130), (2, 64))
QUICK_HEADS = dict(nk=1, nv=2, h=16, hv=32)
SOLVE_DOTS = {"subst": 15 + 4, "subst_hoist": 15 + 4, "nested": 3 + 4 + 4, "stacked": 15 / 4 + 4,
              "pairs": 15 / 16 + 4}  # `intra_pairs`: 15 steps on the four 16 x 16 blocks only
# `--variants`: changes on top of each case's `tc.default_config(B, Nv, Hv, nk=Nk)` (B1: fused,
# 32-wide state slices, 4 warps, value-head-pair intra programs; B8: also the gates loaded a
# chunk ahead). Byte / latency reasoning: the comment above `triton_chunk.default_config`.
# Shared memory / registers from `--ptxas` (sm_90a).
VARIANTS = {
    "prefetch": dict(state_prefetch=True),
    "slice-major": dict(state_slice_major=True),
    "head-major": dict(intra_head_major=True),
    "qn": dict(store_qn=True),
    "qk": dict(qk_in_state=True),
    "qk-qn": dict(qk_in_state=True, store_qn=True),
    "stages3": dict(state_stages=3),
    "qn-majors": dict(store_qn=True, state_slice_major=True, intra_head_major=True),
    "qk-qn-majors": dict(qk_in_state=True, store_qn=True, state_slice_major=True,
                         intra_head_major=True),
    # Two state programs per SM (<= ~113 KB shared memory each): 16- / 32-wide slices, 4 warps.
    "qk-qn-v16": dict(qk_in_state=True, store_qn=True, state_slice_major=True, block_hv_state=16,
                      state_warps=4),
    "qk-qn-v32": dict(qk_in_state=True, store_qn=True, state_slice_major=True, block_hv_state=32,
                      state_warps=4),
    # Session 6: the state loop unpipelined (its loads then wait in place, but the shared memory
    # of the copies in flight is gone: more programs per SM where chains outnumber SMs), 16-wide
    # slices on their own, 8 state warps, 2 intra warps.
    "stages1": dict(state_stages=1),
    "v16": dict(block_hv_state=16),
    "v16-stages1": dict(block_hv_state=16, state_stages=1),
    "w8": dict(state_warps=8),
    "intra-w8": dict(intra_warps=8),
    # Session 7: the per-head intra kernel where `default_config` takes the value-head pairs
    # (`Config.intra_pairs`), and the pairs on 8 warps.
    "no-pairs": dict(intra_pairs=False),
    "pairs-w8": dict(intra_warps=8),
    "gates": dict(state_gates_ahead=True),
    "no-gates": dict(state_gates_ahead=False),
    "u-ahead": dict(state_u_ahead=True),
    "no-u": dict(state_u_ahead=False),
    "u-gates": dict(state_u_ahead=True, state_gates_ahead=True),
    # Session 8: the state loop three chunks deep (ncu source counters at B1 T32K: Triton issues
    # the next chunk's async copies at the end of the step, so with two stages each step starts
    # by waiting for them, 28% of the kernel's warp samples).
    "stages3-v64": dict(state_stages=3, block_hv_state=64),
    "stages3-no-u": dict(state_stages=3, state_u_ahead=False),
    "stages3-gates": dict(state_stages=3, state_gates_ahead=True),
    "stages3-no-gates": dict(state_stages=3, state_gates_ahead=False),
    # At many chains (B8): B1's state kernel (P from the intra kernel, no q kᵀ in the state
    # step, no loads ahead in registers) three stages deep, one program per SM.
    "p-stages3": dict(qk_in_state=False, state_stages=3, state_gates_ahead=False,
                      state_u_ahead=False, intra_head_major=True),
    "p-stages3-v64": dict(qk_in_state=False, state_stages=3, state_gates_ahead=False,
                          state_u_ahead=False, intra_head_major=True, block_hv_state=64),
    "p-stages3-u": dict(qk_in_state=False, state_stages=3, state_gates_ahead=False,
                        state_u_ahead=True, intra_head_major=True),
}


def parse_config(text: str) -> tc.Config:
    """`"name=value,..."` -> `Config` (int / bool / str by the field's default; bool as 0/1)."""
    return _bench.parse_fields(tc.Config, text)


def describe(config: tc.Config) -> str:
    """The fields that differ from `Config()`, or "default"."""
    return _bench.describe_fields(config)


def cost(b: int, t: int, *, nk: int, nv: int, h: int, hv: int, config: tc.Config,
         has_init: bool = False, in_bytes: int = 2) -> dict[str, dict[str, float]]:
    """Bytes (`GB`, `GB_rr`) and matmul `GFLOP` of each kernel (module docstring), B rows of T."""
    c = tc.CHUNK
    n_tok, chunks = b * t, b * -(-t // c)
    per_h = lambda *heads_dims: sum(n * d for n, d in heads_dims)
    f32, inter = 4, in_bytes
    tiles_state = -(-hv // min(config.block_hv_state, hv))
    tiles_out = -(-hv // min(config.block_hv_out, hv))
    state_bytes = chunks * nv * h * hv
    fuse = config.fuse_output
    p_bytes = n_tok * nv * c * inter  # the fused path's P
    gcum = n_tok * nv * f32
    gb = lambda x: x / 1e9
    k_once, k_heads = n_tok * nk * h * in_bytes, n_tok * nv * h * in_bytes
    intra = n_tok * (per_h((nk, h)) * in_bytes + nv * hv * in_bytes + 2 * nv * f32)  # k v g beta
    intra += gcum + n_tok * nv * (h + hv) * inter  # gcum, w, u
    intra += k_once if config.store_kn else 0  # the normalised keys (with l2-norm)
    qk = fuse and config.qk_in_state  # P made by the state kernel: not written or read
    qn = fuse and config.store_qn and config.store_kn  # normalised queries written
    q_read = (fuse and not qk) or qn
    intra += (k_once if q_read else 0) + (k_once if qn else 0)  # q read, queries written
    intra += p_bytes if fuse and not qk else 0  # P written
    # k (and q) read per value head, or per pair of them with `intra_pairs`
    k_intra = k_heads // 2 if config.intra_pairs else k_heads
    intra_rr = intra - k_once + k_intra + (k_intra - k_once if q_read else 0)
    state = k_once + n_tok * nv * (h + hv) * inter + gcum  # k, w, u, gcum
    state += state_bytes * inter + n_tok * nv * hv * inter + b * nv * h * hv * f32  # hbuf, v_new
    state += b * nv * h * hv * f32 if has_init else 0
    if fuse:  # no per-chunk states or V_new written; q and P read, o written
        state += -state_bytes * inter - n_tok * nv * hv * inter + k_once + (0 if qk else p_bytes)
        state += n_tok * nv * hv * in_bytes
    state_rr = state - k_once + tiles_state * (k_heads + n_tok * nv * h * inter)
    if fuse:
        state_rr += (0 if qk else (tiles_state - 1) * p_bytes) + tiles_state * k_heads - k_once
    out = 2 * k_once + gcum + state_bytes * inter + 2 * n_tok * nv * hv * inter  # q k gcum h vn o
    out_rr = out - 2 * k_once + 2 * tiles_out * k_heads
    if fuse:
        out = out_rr = 0
    heads = chunks * nv
    per_kk = 2 if config.intra_pairs else 1  # value heads sharing one K Kᵀ (and Q Kᵀ)
    solve = SOLVE_DOTS["pairs" if config.intra_pairs else config.solve]
    flops = dict(
        intra=heads * (2 * c * c * h / per_kk + solve * 2 * c**3 + 2 * c * c * (h + hv)),
        state=heads * 4 * c * h * hv,
        output=heads * (tiles_out * 2 * c * c * h + 2 * c * h * hv + 2 * c * c * hv),
    )
    if fuse:  # Q Kᵀ once in the intra kernel (per value tile in the state kernel with
        # qk_in_state), Q S and P V_new in the state kernel
        flops["intra" if not qk else "state"] += heads * 2 * c * c * h * (tiles_state if qk
                                                                          else 1 / per_kk)
        flops["state"] += heads * (2 * c * h * hv + 2 * c * c * hv)
        flops["output"] = 0
    return {name: dict(GB=gb(by), GB_rr=gb(rr), GFLOP=flops[name] / 1e9) for name, by, rr in
            (("intra", intra, intra_rr), ("state", state, state_rr), ("output", out, out_rr))}


def _inputs(b, t, *, nk, nv, h, hv, init, seed=0):
    gen = np.random.default_rng(seed)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    q, k = (bf(gen.standard_normal((b, t, nk, h), np.float32)) for _ in range(2))
    v = bf(gen.standard_normal((b, t, nv, hv), np.float32))
    g = jnp.asarray(np.log(gen.uniform(0.4, 0.99, (b, t, nv))), jnp.float32)
    beta = jnp.asarray(gen.uniform(0.05, 0.95, (b, t, nv)), jnp.float32)
    h0 = jnp.asarray(0.5 * gen.standard_normal((b, nv, h, hv)), jnp.float32) if init else None
    return (q, k, v, g, beta), h0


def _rel_err(a, e) -> float:
    a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def profile_case(b, t, config, *, heads, init, timing, baseline=None, reference=False):
    """One table's rows: per kernel ms / bytes / FLOPs, then `whole` (the chained op).

    Returns:
      `(rows, (o, final))`; rows carry `rel_err_o` / `rel_err_final` against `baseline`
      (another config's outputs) and, if `reference`, against the XLA reference.
    """
    xs, h0 = _inputs(b, t, init=init, **heads)
    intra, state, output, x = tc.stages(*xs, h0, use_qk_l2norm=True, config=config)
    tables = (x["cstart"], x["clen"])
    intra, state = jax.jit(intra), jax.jit(state)
    args = {"intra": (x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], *tables)}
    gcum, w, u, kn, p = jax.block_until_ready(intra(*args["intra"]))
    args["state"] = (kn, w, u, gcum, *tables, x["sfirst"], x["scount"], x["h0"], x["q2"], p)
    hbuf, v_new, final, o = jax.block_until_ready(state(*args["state"]))
    kernels = [("intra", intra), ("state", state)]
    if output is not None:  # else fuse_output: the state kernel wrote o
        output = jax.jit(output)
        args["output"] = (x["q2"], kn, gcum, hbuf, v_new, *tables)
        o = output(*args["output"])
        kernels.append(("output", output))
    o = o.reshape(xs[2].shape)
    whole = jax.jit(lambda q, k, v, g, beta, h0: tc.gdn_chunked(
        q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True, config=config))
    costs = cost(b, t, has_init=init, config=config, **heads)
    rows = []
    for name, fn in kernels:
        ms = _bench.time_ms(fn, *args[name], **timing)
        rows.append(dict(kernel=name, ms=ms, **costs[name]))
    total_ms = sum(r['ms'] for r in rows)
    for r in rows:
        r["share"] = r['ms'] / total_ms
    rows.append(dict(kernel="sum", ms=total_ms, share=1.0,
                     **{key: sum(r[key] for r in rows) for key in ("GB", "GB_rr", "GFLOP")}))
    whole_ms = _bench.time_ms(whole, *xs, h0, **timing)
    rows.append(dict(kernel="whole", ms=whole_ms, share=whole_ms / total_ms,
                     **{key: rows[-1][key] for key in ("GB", "GB_rr", "GFLOP")}))
    extra = {}
    if baseline is not None:
        extra.update(rel_err_o=_rel_err(o, baseline[0]), rel_err_final=_rel_err(final, baseline[1]))
    if reference:
        exp_o, exp_final = jax.jit(lambda q, k, v, g, beta, h0: gdn_ref.gdn_chunked(
            q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True))(*xs, h0)
        extra.update(ref_err_o=_rel_err(o, exp_o), ref_err_final=_rel_err(final, exp_final))
    for r in rows:
        r.update(case=f"B{b}-T{t}", config=describe(config), **extra)
    return rows, (np.asarray(o, np.float32), np.asarray(final))


def format_table(rows) -> str:
    head = rows[0]
    lines = [f"{head['case']}  config: {head['config']}" + "".join(
        f"  {key} {head[key]:.3g}" for key in ("rel_err_o", "rel_err_final", "ref_err_o",
                                                "ref_err_final") if key in head)]
    lines.append(f"{'kernel':<8}{'ms':>9} {'share':>6} {'GB':>9} {'GB_rr':>9} {'TB/s':>9} "
                 f"{'GFLOP':>9} {'TFLOP/s':>9}")
    for r in rows:
        lines.append(f"{r['kernel']:<8}{r['ms']:>9.3f} {r['share']:>6.0%} {r['GB']:>9.4g} "
                     f"{r['GB_rr']:>9.4g} {r['GB'] / r['ms']:>9.3g} {r['GFLOP']:>9.4g} "
                     f"{r['GFLOP'] / r['ms']:>9.4g}")
    return "\n".join(lines)


# Run in a fresh interpreter: Triton must be imported before `attn` (which switches a CPU-only
# process to the interpreter), so the kernels stay compilable. argv: the --config strings.
_PTXAS_SCRIPT = """
import os, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attn.gdn import triton_chunk as tc
from experiments.profile_gdn_chunk import describe, parse_config

ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def report(fn, pointers, consts, warps, stages):
    sig = dict(pointers, **{k: "constexpr" for k in consts})
    # jax-triton declares every array argument 16-byte aligned (`tt.divisibility = 16`); without
    # it loads do not vectorise and the loops' tile loads are not software-pipelined.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    info = [line.split(":", 1)[-1].strip() for line in out.splitlines()
            if "registers" in line or "spill" in line]
    print(f"  {fn.fn.__name__:16s} warps={warps}  " + "; ".join(info)
          + f"; shared {k.metadata.shared} B", flush=True)

bf, f32, i32 = "*bf16", "*fp32", "*i32"
for text in sys.argv[1:]:
    c = parse_config(text)
    print(describe(c), flush=True)
    common = dict(EPS=1e-6, L2NORM=True, F32=False, NK=16, NV=32, H=128, HV=128, BLOCK_H=128)
    common.update(tc.kernel_options(c))
    qn = dict(on=c.store_qn and c.store_kn and c.fuse_output, off=32768 * 16 * 128)
    report(tc.intra_kernel(c),
           dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, g_ptr=f32, beta_ptr=f32, cstart_ptr=i32,
                clen_ptr=i32, gcum_ptr=f32, w_ptr=bf, u_ptr=bf, kn_ptr=bf, p_ptr=bf),
           dict(common, BT=64, BLOCK_HV=128, SCALE=128 ** -0.5, **tc.intra_options(c),
                STORE_QN=qn["on"], QN_OFF=qn["off"] if qn["on"] else 0),
           c.intra_warps, 1)
    report(tc._state_kernel,
           dict(k_ptr=bf, w_ptr=bf, u_ptr=bf, gcum_ptr=f32, cstart_ptr=i32, clen_ptr=i32,
                sfirst_ptr=i32, scount_ptr=i32, h0_ptr=f32, q_ptr=bf, p_ptr=bf, hbuf_ptr=bf,
                vnew_ptr=bf, final_ptr=f32, o_ptr=bf),
           dict(common, HAS_INIT=False, BT=64, BLOCK_HV=c.block_hv_state, SCALE=128 ** -0.5,
                QNORM=True, **tc.state_options(c, 32768), L2NORM=not c.store_kn,
                QRAW=qn["on"], Q_OFF=qn["off"] if qn["on"] else 0),
           tc.state_launch(c)["num_warps"], tc.state_launch(c)["num_stages"])
    if c.fuse_output:
        continue
    report(tc._output_kernel,
           dict(q_ptr=bf, k_ptr=bf, gcum_ptr=f32, hbuf_ptr=bf, vnew_ptr=bf, cstart_ptr=i32,
                clen_ptr=i32, o_ptr=bf),
           dict(common, SCALE=128 ** -0.5, BT=64, BLOCK_HV=c.block_hv_out, **tc.output_options(c),
                KNORM=not c.store_kn),
           c.num_warps, c.num_stages)
"""


def ptxas_report(configs: list[str], capture: bool = False):
    """Compile the three kernels (bf16, the profile's heads) for sm_90a per config in a fresh
    process (no GPU needed) and print ptxas's registers and spills.

    Returns:
      the `subprocess.CompletedProcess` (its stdout / stderr text if `capture`).
    """
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run([sys.executable, "-c", _PTXAS_SCRIPT, *configs], env=env,
                          check=False, capture_output=capture, text=True)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, CPU interpreter")
    p.add_argument("--config", action="append", default=[],
                   help="Config fields, e.g. solve=nested,out_bf16=1 (repeatable: one table each)")
    p.add_argument("--cases", default=None, help="BxT list, e.g. 1x32768,8x4096")
    p.add_argument("--init", action="store_true", help="with an initial state")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", default=None, help="ignored (the .ci/gpu-check convention)")
    p.add_argument("--variants", default=None,
                   help="comma list of VARIANTS names, or all: each case's default_config, then "
                        "each variant on top of it (instead of Config() / --config), and a summary")
    p.add_argument("--ptxas", action="store_true",
                   help="no timing: ptxas registers / spills of Config() and each --config")
    args = p.parse_args(argv)
    if args.ptxas:
        if ptxas_report([""] + args.config).returncode:
            raise SystemExit("ptxas report failed")
        return []
    heads = QUICK_HEADS if args.quick else HEADS
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = tuple(tuple(int(n) for n in c.lower().split("x")) for c in args.cases.split(","))
    timing = (dict(iters=1, trials=1, warmup=1) if args.quick else
              dict(iters=args.iters, trials=args.trials, warmup=2))
    names = None
    if args.variants:
        names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
        unknown = sorted(set(names) - set(VARIANTS))
        if unknown:
            raise ValueError(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    print(f"device: {jax.devices()[0].device_kind}  heads: {heads}", flush=True)
    rows = []
    for b, t in cases:
        if names is None:
            configs = [("", tc.Config())] + [("", parse_config(c)) for c in args.config]
        else:
            base = tc.default_config(b, heads["nv"], heads["hv"], nk=heads["nk"])
            configs = [("default_config", base)] + [
                (n, dataclasses.replace(base, **VARIANTS[n])) for n in names]
        baseline = None
        for name, config in configs:
            try:
                table, outs = profile_case(b, t, config, heads=heads, init=args.init,
                                           timing=timing, baseline=baseline,
                                           reference=args.quick)
            except Exception as e:  # a sweep goes on past one variant that fails to launch
                if names is None or not name or name == "default_config":
                    raise
                print(f"B{b}-T{t} {name}: FAILED {type(e).__name__}: {e}"[:2000] + "\n",
                      flush=True)
                continue
            baseline = baseline or outs
            for r in table:
                r["variant"] = name
            print(format_table(table) + "\n", flush=True)
            rows += table
    if names is not None:
        print(format_summary(rows), flush=True)
    return rows


def format_summary(rows) -> str:
    """One line per (case, variant): per-kernel and whole-op ms, whole against the case's
    default_config, the output's error against it."""
    lines = [f"{'case':<10}{'variant':<22}{'intra':>8}{'state':>8}{'output':>8}{'whole':>8}"
             f"{'vs default':>11}{'rel_err_o':>11}"]
    base = {}
    for r in rows:
        if r["kernel"] != "whole":
            continue
        case_rows = [x for x in rows if x["case"] == r["case"] and x["variant"] == r["variant"]]
        ms = {x["kernel"]: x["ms"] for x in case_rows}
        base.setdefault(r["case"], r["ms"])
        lines.append(f"{r['case']:<10}{r['variant']:<22}{ms['intra']:>8.3f}{ms['state']:>8.3f}"
                     f"{ms.get('output', 0.0):>8.3f}{r['ms']:>8.3f}"
                     f"{base[r['case']] / r['ms']:>10.3f}x{r.get('rel_err_o', 0.0):>11.2g}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
