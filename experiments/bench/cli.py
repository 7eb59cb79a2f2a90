"""`python -m experiments.bench`: run a suite's row groups and write its JSON + markdown table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from experiments.bench import core, registry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench",
        description="Our kernels against their anchors and the hardware ceilings, in one "
                    "process; writes <out>/<suite>.json and <suite>.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="suites written by their own tools (each step a process of its own; arguments "
               "after `--` go to the tool, e.g. `heads -- --model PATH`):\n"
               + "\n".join(f"  {name}: {c.doc}\n" + "\n".join(
                   f"    {_shell(step)}" for step in c.argv("benchmarks", "out/bench"))
                   for name, c in registry.COMMANDS.items()))
    p.add_argument("suite", nargs="?", choices=sorted({*registry.SUITES, *registry.COMMANDS}),
                   help="the suite to run")
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
    p.add_argument("--work", default="out/bench",
                   help="folder of the intermediates of the suites written by their own tools")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands a suite written by its own tool runs; run nothing")
    return p


def _shell(step) -> str:
    return shlex.join(["python", "-m", *step])


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
    for suite, c in registry.COMMANDS.items():
        lines.append(f"{suite}: writes {c.writes} by its own tool: {c.doc}")
        lines += [f"  {_shell(step)}" for step in c.argv("benchmarks", "out/bench")]
        lines += [f"  cp {a} {b}" for a, b in c.files("benchmarks", "out/bench")]
    return "\n".join(lines)


def run_command(suite: str, out: str, work: str, extra=(), *, dry_run: bool = False) -> int:
    """Run (or with `dry_run` print) the steps of `registry.COMMANDS[suite]`; the exit code of
    the first failing step, else 0."""
    c = registry.COMMANDS[suite]
    for step in c.argv(out, work, tuple(extra)):
        print(_shell(step), flush=True)
        if not dry_run:
            code = subprocess.run([sys.executable, "-m", *step]).returncode
            if code:
                return code
    for a, b in c.files(out, work):
        print(f"cp {shlex.quote(a)} {shlex.quote(b)}", flush=True)
        if not dry_run:
            shutil.copyfile(a, b)
    return 0


def main(argv=None) -> list[dict]:
    """Parse `argv`, run the suite, return its rows (`--render`, `--list`: none)."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:len(argv) - len(extra) - 1] if "--" in argv else argv)
    if args.list:
        print(describe())
        return []
    if args.suite is None:
        parser.error("name a suite (or --list)")
    if args.suite in registry.COMMANDS:
        given = [flag for flag, on in (("--rows", args.rows), ("--set", args.settings),
                                       ("--quick", args.quick), ("--render", args.render)) if on]
        if given:
            parser.error(f"{' '.join(given)}: the {args.suite} suite is written by its own tool "
                         f"(--dry-run prints its commands; its arguments go after --)")
        code = run_command(args.suite, args.out, args.work, extra, dry_run=args.dry_run)
        if code:
            raise SystemExit(code)
        return []
    if extra or args.dry_run:
        parser.error(f"{' '.join(extra) or '--dry-run'}: only for the suites written by "
                     f"their own tools ({', '.join(registry.COMMANDS)})")
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
