"""`python -m experiments.longctx_eval`: the default run's size (>= 4 samples per cell, a cell's
requests batched together) and the report of a tiny end-to-end run (n, intervals, step counts,
the CPU time and load beside the wall time)."""

from __future__ import annotations

import collections
import json

from experiments import longctx_eval, tasks
from tests.models.tiny import ByteTokenizer, tiny_llama


def test_default_run_keeps_four_samples_per_cell_in_one_batch():
    import models
    from experiments.cli import smollm2_path

    args = longctx_eval.parse_args([])
    assert args.samples >= 4
    # A cell's requests (one task, length and depth) fill the batch slots together, so its
    # prompts are prefilled in the same chunks.
    assert args.batch == args.samples * len(args.depths)
    tokenizer = models.load_tokenizer(smollm2_path())
    samples = tasks.make_samples(tokenizer, tasks=args.tasks, lengths=args.lengths,
                                 depths=args.depths, samples=args.samples, seed=args.seed)
    cells = collections.Counter((s.task, s.length) for s in samples)
    assert len(cells) == len(args.tasks) * len(args.lengths)
    assert min(cells.values()) >= 4
    assert all(len(s.prompt) == s.length for s in samples)


def test_tiny_run_reports_steps_cpu_time_and_load(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(longctx_eval, "load_model",
                        lambda path, dtype: (tiny_llama(), ByteTokenizer(), "tiny"))
    report = longctx_eval.main(
        ["--tasks", "passkey", "--lengths", "384,512", "--samples", "2", "--batch", "2",
         "--chunk", "128",
         "--policies", "dense,headwise", "--window", "32", "--sinks", "4", "--max-tokens", "3",
         "--out", str(tmp_path)])
    rows = report["rows"]
    assert {(r["policy"], r["length"]) for r in rows} == {
        (p, n) for p in ("dense", "headwise") for n in (384, 512)}
    assert all(r["n"] == 2 and 0 <= r["ci_low"] <= r["accuracy"] <= r["ci_high"] <= 1
               for r in rows)
    for name, t in report["timing"].items():
        # 3 + 4 chunks of 128 tokens, each cell's 2 prompts in the same steps; more only where
        # a request stops early and the next cell starts beside the other.
        assert 7 <= t["mixed_steps"] <= 10, (name, t)
        assert t["decode_steps"] >= 1, (name, t)
    assert report["cpu_s"] > 0 and report["load_average"] >= 0 and report["load_s"] >= 0
    assert "process CPU time" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == rows
