"""MLA latent decode with fp8 latent pages: our bf16 kernel, the default fp8 path and the
`Config.fp8_dot` variants (e4m3 tensor-core dots), timed in one process (GPU).

    python -m experiments.sweep_mla_fp8 [--quick]

B64, S32K, pages of 64, L512 + R64, N16 and N128. One line per variant: ms, speed-up over bf16,
relative error against the bf16 kernel's output. Writes nothing. `--quick`: tiny shapes through
the interpreter (for CI).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.mla import triton as mla_triton
from experiments import _bench
from experiments import bench_mla_rows as rows


def _variants(base: mla_triton.Config, n: int) -> list[tuple[str, mla_triton.Config]]:
    out = [("fp8 default", base)]
    for reload in (False, True):
        for block_n in ((32, 64) if n < 64 else (64,)):
            d = dataclasses.replace(base, fp8_dot=True, reload_value=reload, block_n=block_n)
            tag = f"reload{int(reload)} n{block_n}"
            out += [(f"dot pv8 {tag}", d),
                    (f"dot pv16 {tag}", dataclasses.replace(d, fp8_pv=False)),
                    (f"dot q2 pv8 {tag}", dataclasses.replace(d, fp8_q_terms=2))]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="ignored (the gpu-check convention)")
    args = parser.parse_args(argv)
    b, s, p, lat, rope = (2, 128, 16, 64, 32) if args.quick else (64, 32768, 64, 512, 64)
    once = dict(iters=1, trials=1, warmup=1) if args.quick else {}
    pages, pages8, scales, table, lengths = rows._latent(
        np.random.default_rng(0), batch=b, seq=s, page=p, kv_lora_rank=lat, rope_dim=rope)
    for n in ((16,) if args.quick else (16, 128)):
        q_lat, q_pe = rows._queries(n, batch=b, kv_lora_rank=lat, rope_dim=rope, seed=n)
        bf16 = rows._ours(None, lat)
        ref, _ = bf16(q_lat, q_pe, pages, table, lengths, None)
        ms16 = _bench.time_ms(bf16, q_lat, q_pe, pages, table, lengths, None, **once)
        print(f"N{n} bf16 {ms16:.4f} ms", flush=True)
        base = mla_triton.default_config(b, n, s, fp8=True)
        for name, cfg in _variants(base, n):
            fn = rows._ours(cfg, lat)
            try:
                out, _ = fn(q_lat, q_pe, pages8, table, lengths, scales)
                ms = _bench.time_ms(fn, q_lat, q_pe, pages8, table, lengths, scales, **once)
            except Exception as e:  # a variant that does not compile: report and go on
                print(f"N{n} {name:24} failed: {str(e).splitlines()[0][:150]}", flush=True)
                continue
            print(f"N{n} {name:24} {ms:.4f} ms  {ms16 / ms:.3f}x bf16  "
                  f"err {_bench.rel_err(out, ref):.5f}", flush=True)


if __name__ == "__main__":
    main()
