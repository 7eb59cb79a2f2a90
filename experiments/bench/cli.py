"""`python -m experiments.bench`: run a suite's row groups and write its JSON + markdown table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
from pathlib import Path

from experiments.bench import core, registry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench",
        description="Our kernels against their anchors and the hardware ceilings, in one "
                    "process; writes <out>/<suite>.json and <suite>.md.")
    p.add_argument("suite", nargs="?", choices=sorted(registry.SUITES), help="the suite to run")
    p.add_argument("--rows", default=None,
                   help="comma list of the suite's row groups to run (default: all, in order)")
    p.add_argument("--set", dest="settings", default="",
                   help="argument changes, `name=value,...` (every selected group with that "
                        "field) or `group.name=value`; tuples joined by ':', e.g. seqs=8192:16384")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, one call per figure (the CPU runs them through Triton's "
                        "interpreter); writes <suite>_quick.*")
    p.add_argument("--out", default="benchmarks", help="folder of the JSON and markdown files")
    p.add_argument("--budget-s", type=float, default=0.5,
                   help="seconds of timed calls per figure of the groups that use a budget")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: rewrite <out>/<suite>.md from <out>/<suite>.json")
    p.add_argument("--list", action="store_true",
                   help="print the suites, their row groups and each group's arguments")
    return p


def command(suite: str, rows: str | None = None, settings: str = "", quick: bool = False) -> str:
    """The command line that reproduces a suite's file."""
    parts = ["python", "-m", "experiments.bench", suite]
    if rows:
        parts += ["--rows", rows]
    if settings:
        parts += ["--set", settings]
    if quick:
        parts.append("--quick")
    return shlex.join(parts)


def describe() -> str:
    """Suites, their groups and each group's argument defaults (`--list`)."""
    groups = registry.load()
    lines = []
    for suite, names in registry.SUITES.items():
        lines.append(f"{suite}: writes {suite}.json / .md")
        for name in names:
            g = groups[name]
            args = ", ".join(f"{f.name}={getattr(g.spec(), f.name)}"
                             for f in dataclasses.fields(g.spec))
            lines.append(f"  {name}: {g.doc}\n    {args}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    """Parse `argv`, run the suite, return its rows (`--render`, `--list`: none)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        print(describe())
        return []
    if args.suite is None:
        parser.error("name a suite (or --list)")
    name = args.suite + ("_quick" if args.quick else "")
    cmd = command(args.suite, args.rows, args.settings, args.quick)
    if args.render:
        path = Path(args.out) / f"{name}.json"
        if not path.exists():
            parser.error(f"--render: {path} does not exist")
        (Path(args.out) / f"{name}.md").write_text(
            core.render(name, json.loads(path.read_text()), cmd))
        return []
    suite_groups = registry.SUITES[args.suite]
    selected = args.rows.split(",") if args.rows else list(suite_groups)
    bad = [g for g in selected if g not in suite_groups]
    if bad:
        parser.error(f"--rows {bad}: the {args.suite} suite has {list(suite_groups)}")
    groups = registry.load()
    try:
        specs = registry.specs(selected, args.settings, quick=args.quick)
    except ValueError as e:
        parser.error(f"--set: {e}")
    logging.basicConfig(level=logging.INFO)
    ctx = core.Context(quick=args.quick, budget_s=args.budget_s)
    runs = {g: (lambda ctx, g=g: groups[g].run(specs[g], ctx)) for g in selected}
    rows = core.run_groups(name, runs, ctx, out_dir=args.out, command=cmd)
    core.print_table(rows)
    print(f"wrote {Path(args.out) / name}.md", flush=True)
    return rows
