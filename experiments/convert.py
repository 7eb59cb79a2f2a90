"""Convert an HF checkpoint directory or a GGUF file into a longctx orbax checkpoint.

    python -m experiments.convert SRC DST [--dtype bfloat16] [--quiet]

SRC is a directory with `config.json` + safetensors (single or sharded) or a `.gguf` file; DST is
the orbax checkpoint directory (written atomically; an existing checkpoint there is replaced).
Load it back with `models.load(DST)`. Exit status 2 with a one-paragraph error on a bad
checkpoint (missing / unexpected / mis-shaped tensors, unknown architecture, corrupt file).
"""

from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="HF checkpoint directory or .gguf file")
    p.add_argument("dst", help="output orbax checkpoint directory")
    p.add_argument("--dtype", default="float32",
                   help="parameter dtype: float32 (default), bfloat16 or float16")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    import models

    start = time.perf_counter()
    try:
        model, report = models.from_pretrained(args.src, dtype=args.dtype,
                                               progress=not args.quiet, return_report=True)
        path = models.save(model, args.dst)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        from flax import nnx

        n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        print(f"{args.src} -> {path}: family {report.family}, {n / 1e6:.1f}M parameters "
              f"({args.dtype}), {len(report.consumed)} tensors, {len(report.ignored)} ignored, "
              f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
