"""Launch-config sweep of the causal conv1d prefill kernel against the copy bandwidth (GPU).

    python -m experiments.sweep_conv1d [--configs 32-128-4-1,64-128-8-1,...] [--quick]

A config is `block_t-block_c-num_warps[-stream_store]`. Case: B1, T32K, C = 8192
(Qwen3.5's conv dim), W4, bf16, SiLU, an initial state: the `causal_conv1d` row of
`experiments.bench_prefill`.
Prints one line per config (ms, TB/s, fraction of copy, max |y - first config's y|); writes
nothing. `--quick` runs a tiny case through the interpreter (for CI).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from attn.conv1d import triton_prefill as conv
from experiments import _bench

DEFAULT_CONFIGS = "8-512-4-1,8-512-4-0,32-128-4-0,16-128-2-1,8-256-2-1,4-1024-4-1"


def _config(text: str) -> conv.Config:
    t, c, w, *stream = (int(v) for v in text.split("-"))
    return conv.Config(block_t=t, block_c=c, num_warps=w, stream_store=bool(stream and stream[0]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--out", default=None, help="ignored (the gpu-check convention)")
    args = parser.parse_args(argv)
    t, c, w = (40, 32, 4) if args.quick else (32768, 8192, 4)
    gen = np.random.default_rng(0)
    x = jnp.asarray(gen.standard_normal((1, t, c), np.float32), jnp.bfloat16)
    weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, jnp.bfloat16)
    h0 = jnp.asarray(gen.standard_normal((1, c, w - 1), np.float32), jnp.bfloat16)
    ceiling = _bench.copy_bandwidth_tbs(1 << 20 if args.quick else 4 << 30)["ceiling"]
    num_bytes = 2 * t * c * 2 + 2 * c * (w - 1) * 2 + c * w * 2
    print(f"copy ceiling {ceiling:.3f} TB/s; B1 T{t} C{c} W{w} bf16 silu state")
    first = None
    for text in args.configs.split(","):
        cfg = _config(text)
        run = jax.jit(lambda x, wt, s, cfg=cfg: conv.causal_conv1d(
            x, wt, initial_state=s, activation="silu", config=cfg))
        y = run(x, weight, h0)[0].astype(jnp.float32)
        first = y if first is None else first
        ms = _bench.time_ms(run, x, weight, h0, iters=2 if args.quick else 20, trials=3)
        tbs = num_bytes / ms / 1e9
        diff = float(jnp.max(jnp.abs(y - first)))
        print(f"{text:>14}  {ms:8.4f} ms  {tbs:6.3f} TB/s  {tbs / ceiling:6.3f} of copy  "
              f"max|dy| {diff:.3g}")
    jax.block_until_ready(first)


if __name__ == "__main__":
    main()
