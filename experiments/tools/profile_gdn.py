"""Per-kernel profile of the chunked GDN prefill (`attn.gdn.triton_chunk`): which of its two
kernels (intra-chunk, state) the time goes to, and how far each is from its bytes and FLOPs.

    python -m experiments.tools.profile_gdn                   # B1 T32K and B8 T4K, defaults
    python -m experiments.tools.profile_gdn --config state_stages=2 --config intra_pairs=0
    python -m experiments.tools.profile_gdn --quick           # tiny shapes, CPU interpreter

Shapes as the `gdn_chunk_prefill` bench rows: Nk16, Nv32, H = Hv = 128, bf16 q / k / v, float32
g and beta, l2-norm in the kernels, no initial state (`--init` adds one). The first table of a
case is the kernel's `default_config` at that shape; every `--config` (fields of `Config` changed
from it, in the config syntax of `experiments.bench.registry`) is one more table, its `rel_err`
measured against the first's outputs (same inputs).

Each kernel is jitted alone on the previous kernel's real outputs and timed with
`experiments.bench.core.time_ms`; `whole` is the jitted op. Per kernel:

- `GB`: HBM bytes if every tensor is read or written once (its inputs and outputs at their
  dtypes); `GB_rr` adds the re-reads the grid implies (k and q per value head, or per pair with
  `intra_pairs`; the normalised keys / queries, W and P per state slice of `block_hv_state` value
  features): L2 absorbs part of those.
- `GFLOP`: the matmuls as the kernels run them, per chunk and value head: intra `K Kᵀ` and
  `Q Kᵀ` 2C²H each (once per pair with `intra_pairs`), the `(I + A)⁻¹` solve (`SOLVE_DOTS`
  [C, C] dots of 2C³), W and U 2C²(H + Hv); state `W S` and `Kᵀ V_new` 4CH·Hv, `Q S` 2CH·Hv,
  `P V_new` 2C²Hv. Without the solve and the pairs, the sum is `experiments.bench.gdn.gdn_flops`.
- `TB/s` = GB / ms and `TFLOP/s` = GFLOP / ms: compare with the copy bandwidth (~3 TB/s on an
  H100) and the dense bf16 rate (~700 TFLOP/s) to see which bound a kernel is far from.
"""

from __future__ import annotations

import argparse
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
from experiments.bench import core, registry

CASES = ((1, 32768), (8, 4096))
HEADS = dict(nk=16, nv=32, h=128, hv=128)
QUICK_CASES = ((1, 130), (2, 64))
QUICK_HEADS = dict(nk=1, nv=2, h=16, hv=32)
# [C, C]-dot equivalents of the solve: 15 substitution steps of one [C, C] x [C, 16] dot (per
# head) or of a batch of 8 [16, 16] blocks (per pair), then the 4 dots of the merge.
SOLVE_DOTS = {"per_head": 15 / 4 + 4, "pairs": 15 / 16 + 4}


def cost(b: int, t: int, *, nk: int, nv: int, h: int, hv: int, config: tc.Config,
         has_init: bool = False, in_bytes: int = 2) -> dict[str, dict[str, float]]:
    """Bytes (`GB`, `GB_rr`) and matmul `GFLOP` of each kernel (module docstring), B rows of T,
    with l2-norm (the intra kernel writes the normalised keys and queries)."""
    c, f32, inter = tc.CHUNK, 4, in_bytes
    n_tok, chunks = b * t, b * -(-t // c)
    k_once, k_heads = n_tok * nk * h * in_bytes, n_tok * nv * h * in_bytes
    gcum, w, u = n_tok * nv * f32, n_tok * nv * h * inter, n_tok * nv * hv * inter
    p = n_tok * nv * c * inter
    kn = 2 * n_tok * nk * h * inter  # the normalised keys, then the queries
    state_io = b * nv * h * hv * f32  # one float32 state per sequence and head
    v_in = n_tok * nv * hv * in_bytes
    intra = 2 * k_once + v_in + 2 * n_tok * nv * f32  # q k v g beta
    intra += gcum + w + u + kn + p
    k_intra = k_heads // 2 if config.intra_pairs else k_heads  # k and q per (pair of) head
    intra_rr = intra - 2 * k_once + 2 * k_intra
    state = kn + w + u + gcum + p + state_io + v_in  # ... final, o
    state += state_io if has_init else 0
    slices = -(-hv // min(config.block_hv_state, hv))
    kn_heads = 2 * n_tok * nv * h * inter  # keys and queries per value head
    state_rr = state - kn - w - p + slices * (kn_heads + w + p)
    heads = chunks * nv
    per_kk = 2 if config.intra_pairs else 1  # value heads sharing one K Kᵀ and Q Kᵀ
    solve = SOLVE_DOTS["pairs" if config.intra_pairs else "per_head"]
    flops = dict(
        intra=heads * (2 * 2 * c * c * h / per_kk + solve * 2 * c**3 + 2 * c * c * (h + hv)),
        state=heads * (4 * c * h * hv + 2 * c * h * hv + 2 * c * c * hv))
    return {name: dict(GB=by / 1e9, GB_rr=rr / 1e9, GFLOP=flops[name] / 1e9)
            for name, by, rr in (("intra", intra, intra_rr), ("state", state, state_rr))}


def _inputs(b, t, *, nk, nv, h, hv, init, seed=0):
    gen = np.random.default_rng(seed)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    q, k = (bf(gen.standard_normal((b, t, nk, h), np.float32)) for _ in range(2))
    v = bf(gen.standard_normal((b, t, nv, hv), np.float32))
    g = jnp.asarray(np.log(gen.uniform(0.4, 0.99, (b, t, nv))), jnp.float32)
    beta = jnp.asarray(gen.uniform(0.05, 0.95, (b, t, nv)), jnp.float32)
    h0 = jnp.asarray(0.5 * gen.standard_normal((b, nv, h, hv)), jnp.float32) if init else None
    return (q, k, v, g, beta), h0


def profile_case(b, t, config, base, *, heads, init, timing, baseline=None, reference=False):
    """One table's rows: per kernel ms / bytes / FLOPs, then `sum` and `whole` (the op).

    Returns:
      `(rows, (o, final))`; rows carry `rel_err_o` / `rel_err_final` against `baseline`
      (another config's outputs) and, if `reference`, against the XLA reference.
    """
    xs, h0 = _inputs(b, t, init=init, **heads)
    intra, state, x = tc.stages(*xs, h0, use_qk_l2norm=True, config=config)
    tables = (x["cstart"], x["clen"])
    intra, state = jax.jit(intra), jax.jit(state)
    args = {"intra": (x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], *tables)}
    gcum, w, u, kn, p = jax.block_until_ready(intra(*args["intra"]))
    args["state"] = (kn, w, u, gcum, *tables, x["sfirst"], x["scount"], x["h0"], x["q2"], p)
    final, o = jax.block_until_ready(state(*args["state"]))
    o = o.reshape(xs[2].shape)
    whole = jax.jit(lambda q, k, v, g, beta, h0: tc.gdn_chunked(
        q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True, config=config))
    costs = cost(b, t, has_init=init, config=config, **heads)
    rows = [dict(kernel=name, ms=core.time_ms(fn, *args[name], **timing), **costs[name])
            for name, fn in (("intra", intra), ("state", state))]
    total_ms = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = r["ms"] / total_ms
    rows.append(dict(kernel="sum", ms=total_ms, share=1.0,
                     **{key: sum(r[key] for r in rows) for key in ("GB", "GB_rr", "GFLOP")}))
    whole_ms = core.time_ms(whole, *xs, h0, **timing)
    rows.append(dict(kernel="whole", ms=whole_ms, share=whole_ms / total_ms,
                     **{key: rows[-1][key] for key in ("GB", "GB_rr", "GFLOP")}))
    extra = {}
    if baseline is not None:
        extra.update(rel_err_o=core.rel_err(o, baseline[0]),
                     rel_err_final=core.rel_err(final, baseline[1]))
    if reference:
        exp_o, exp_final = jax.jit(lambda q, k, v, g, beta, h0: gdn_ref.gdn_chunked(
            q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True))(*xs, h0)
        extra.update(ref_err_o=core.rel_err(o, exp_o), ref_err_final=core.rel_err(final,
                                                                                  exp_final))
    for r in rows:
        r.update(case=f"B{b}-T{t}", config=registry.describe_fields(config, base), **extra)
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


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m experiments.tools.profile_gdn",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes, CPU interpreter")
    p.add_argument("--config", action="append", default=[],
                   help="Config fields changed from default_config, e.g. state_stages=2 "
                        "(repeatable: one table each)")
    p.add_argument("--cases", default=None, help="BxT list, e.g. 1x32768,8x4096")
    p.add_argument("--init", action="store_true", help="with an initial state")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args(argv)
    for text in args.config:  # a bad field fails here, before anything is timed
        registry.parse_changes(tc.Config, text)
    heads = QUICK_HEADS if args.quick else HEADS
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = tuple(tuple(int(n) for n in c.lower().split("x")) for c in args.cases.split(","))
    timing = (dict(iters=1, trials=1, warmup=1) if args.quick else
              dict(iters=args.iters, trials=args.trials, warmup=2))
    print(f"device: {jax.devices()[0].device_kind}  heads: {heads}", flush=True)
    rows = []
    for b, t in cases:
        base = tc.default_config(b, heads["nv"], heads["hv"], nk=heads["nk"], h=heads["h"])
        baseline = None
        for text in ["", *args.config]:
            config = registry.parse_fields(tc.Config, text, base)
            table, outs = profile_case(b, t, config, base, heads=heads, init=args.init,
                                       timing=timing, baseline=baseline, reference=args.quick)
            baseline = baseline or outs
            print(format_table(table) + "\n", flush=True)
            rows += table
    return rows


if __name__ == "__main__":
    main()
