"""Convert an HF checkpoint directory or a GGUF file into a longctx orbax checkpoint.

    python -m experiments.convert SRC DST [--dtype bfloat16] [--overwrite] [--quiet]

SRC is a directory with `config.json` + safetensors (single or sharded) or a `.gguf` file; DST is
the orbax checkpoint directory, written atomically together with SRC's tokenizer (if it has
one), so `models.load_pretrained(DST)` returns model and tokenizer (`models.load(DST)`: the
model alone). DST must not exist, be an empty directory, or be a longctx checkpoint with
`--overwrite`. Arguments are checked before anything is loaded; bad arguments and bad
checkpoints (missing / unexpected / mis-shaped tensors, unknown architecture, corrupt file) end
with an error message and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DTYPES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the arguments (the paths are checked by `check_paths`).

    Raises:
      SystemExit: status 2 with one line on stderr for bad arguments; 0 for `--help`.
    """
    p = _Parser(prog="python -m experiments.convert", description=__doc__,
                formatter_class=_Help)
    p.add_argument("src", help="HF checkpoint directory or .gguf file")
    p.add_argument("dst", help="output orbax checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter dtype")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the longctx checkpoint already at DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    return p.parse_args(argv)


def check_paths(src: str, dst: str, *, overwrite: bool) -> str | None:
    """What is wrong with SRC / DST, in one line, or None if they can be converted."""
    from models.checkpoint import is_checkpoint

    if not os.path.exists(src):
        return f"SRC {src}: no such checkpoint directory or GGUF file"
    if os.path.isdir(src) and not os.path.isfile(os.path.join(src, "config.json")):
        return f"SRC {src}: a directory without config.json (not an HF checkpoint)"
    if os.path.isfile(dst) or (os.path.exists(dst) and not os.path.isdir(dst)):
        return f"DST {dst} exists and is not a directory; choose another destination"
    if os.path.isdir(dst) and os.listdir(dst):
        if not is_checkpoint(dst):
            return f"DST {dst} is a non-empty directory, not a longctx checkpoint; refusing " \
                   f"to write there"
        if not overwrite:
            return f"DST {dst} already holds a checkpoint; pass --overwrite to replace it"
    return None


def main(argv=None) -> int:
    """Run the conversion; returns the exit status (0 ok, 2 bad paths or a bad checkpoint)."""
    args = parse_args(argv)
    problem = check_paths(args.src, args.dst, overwrite=args.overwrite)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import jax

    import models

    start = time.perf_counter()
    try:
        model, report = models.from_pretrained(args.src, dtype=args.dtype,
                                               progress=not args.quiet, return_report=True)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        tokenizer = models.load_tokenizer(args.src)
    except (ValueError, OSError) as e:  # weights without a tokenizer are still worth converting
        tokenizer = None
        print(f"warning: {args.src} has no tokenizer ({str(e).splitlines()[0]}); saving the "
              f"model alone (models.load works, models.load_pretrained needs a tokenizer)",
              file=sys.stderr)
    try:
        path = models.save(model, args.dst, tokenizer=tokenizer)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        from flax import nnx

        n = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        print(f"{args.src} -> {path}: family {report.family}, {n / 1e6:.1f}M parameters "
              f"({args.dtype}), {len(report.consumed)} tensors, {len(report.ignored)} ignored, "
              f"tokenizer {'saved' if tokenizer is not None else 'absent'}, "
              f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
