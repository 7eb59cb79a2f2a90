"""The benchmark machinery (`experiments.bench`) on the CPU: the timer, the row-group runner, the
argument specs and config strings, the CLI, and the committed tables rendered from their JSON.

The `slow` tests run whole suites with `--quick` (tiny shapes through Triton's interpreter, a few
minutes on two cores); the rest takes seconds.
"""

import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench
from experiments.bench import cli, core, registry

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _row(i):
    return core.row(kernel="k", case=f"c{i}", ms=1.0, achieved=1.0, unit="x", ceiling=2.0,
                    anchor=None, anchor_ms=None, goal="none", meets_goal=None)


def test_run_groups_keeps_rows_of_a_failing_group_and_runs_the_next(tmp_path):
    def broken(ctx):
        yield _row(0)
        raise RuntimeError("out of memory")

    rows = core.run_groups("t", {"broken": broken, "fine": lambda ctx: [_row(1)]},
                           core.Context(quick=True), out_dir=tmp_path, command="cmd")
    assert [r["case"] for r in rows] == ["c0", "c1"]
    written = json.loads((tmp_path / "t.json").read_text())
    assert [r["case"] for r in written["rows"]] == ["c0", "c1"]
    assert {"device", "jax", "commit"} <= set(written)
    md = (tmp_path / "t.md").read_text()
    assert "| k | c1 |" in md and "Reproduce: `cmd`" in md


def test_run_groups_writes_each_row_before_the_next_starts(tmp_path):
    seen = []

    def group(ctx):
        yield _row(0)
        seen.append(json.loads((tmp_path / "t.json").read_text())["rows"])
        yield _row(1)

    core.run_groups("t", {"g": group}, core.Context(quick=True), out_dir=tmp_path, command="c")
    assert [r["case"] for r in seen[0]] == ["c0"]


def test_time_ms_budget_cuts_the_calls_of_a_long_function():
    calls = []

    def slow(x):
        calls.append(1)
        time.sleep(0.03)
        return x

    ms = core.time_ms(slow, jnp.ones(2), iters=10, trials=5, warmup=1, budget_s=0.1)
    # warm-up 1 + probe 1 + 3 trials of 1 call, instead of 1 + 50
    assert len(calls) == 5, len(calls)
    assert 25 <= ms <= 200, ms


def test_time_ms_budget_keeps_the_counts_of_a_short_function():
    calls = []

    def fast(x):
        calls.append(1)
        return x

    core.time_ms(fast, jnp.ones(2), iters=10, trials=5, warmup=2, budget_s=1.0)
    assert len(calls) == 2 + 1 + 50


def test_time_ms_carries_state_and_reports_per_step():
    """`carry` feeds each call's state into the next (a donated pool); `steps` divides."""
    seen = []

    def step(state, x):
        seen.append(int(state))
        time.sleep(0.01)
        return state + 1

    ms = core.time_ms(step, 0, jnp.ones(2), iters=2, trials=2, warmup=1, steps=4,
                      carry=lambda out, args: (out, *args[1:]))
    assert seen == [0, 1, 2, 3, 4]
    assert 1 <= ms <= 20, ms  # ~10 ms a call, 4 steps a call


def test_time_ms_times_torch_callables_with_the_same_clock():
    torch = pytest.importorskip("torch")
    a = torch.ones(16)
    calls = []
    ms = core.time_ms(lambda: calls.append(1) or a * 2, iters=3, trials=2, warmup=1)
    assert len(calls) == 1 + 6 and ms >= 0


def test_context_memoises_figures_and_times_once_when_quick():
    ctx = core.Context(quick=True)
    counter = []
    assert ctx.once("a", lambda: counter.append(1) or 7) == 7
    assert ctx.once("a", lambda: counter.append(1) or 8) == 7
    assert counter == [1] and ctx.ceilings() == {}
    calls = []
    ctx.time(lambda x: calls.append(1) or x, jnp.ones(2), iters=10, trials=5)
    assert len(calls) == 2  # one warm-up, one timed call


def test_time_rounds_interleaves_the_calls_round_by_round():
    """Each round times every call once, in the given order; `round_ratios` pairs the rounds."""
    order = []

    def named(name):
        def fn(x):
            order.append(name)
            return x
        return fn

    class Counting(core.Context):  # a call's "time": how many calls have run by its end
        def time(self, fn, *args, **knobs):
            fn(*args)
            return float(len(order))

    calls = {"a": (named("a"), jnp.ones(2)), "b": (named("b"), jnp.ones(2))}
    times, clocks = Counting().time_rounds(calls, rounds=3)
    assert order == ["a", "b"] * 3
    assert times == {"a": [1.0, 3.0, 5.0], "b": [2.0, 4.0, 6.0]}
    assert clocks == {"a": [None] * 3, "b": [None] * 3}  # no GPU: nothing sampled
    assert core.clocks_of_round(clocks, 1, "a", "b") is None
    assert core.round_ratios(times["a"], times["b"]) == [0.5, 0.75, round(5 / 6, 4)]
    assert core.median_round(times["a"], times["b"]) == 1
    assert core.median_round([3.0, 1.0, 2.0, 4.0], [1.0] * 4) == 2  # even: the lower middle
    assert len(Counting(quick=True).time_rounds({"a": (named("a"), jnp.ones(2))})[0]["a"]) == 1


def test_gpu_samples_give_median_clocks_and_the_power_capped_fraction():
    """`nvidia-smi` lines `MHz, W, reasons`: medians, and how many samples had the power cap bit
    (0x4) among their reasons; torn lines are skipped; a round's summaries by name."""
    lines = ["1500, 690.5, 0x0000000000000004\n", "1600, 700.0, 0x0000000000000000\n",
             "1550, 695.0, 0x0000000000000005\n", "1980, 80", ""]
    assert core.summarize_gpu_samples(lines) == {"sm_mhz": 1550.0, "power_w": 695.0,
                                                 "power_capped": 0.67}
    assert core.summarize_gpu_samples(["[N/A], 70, 0x0"]) is None
    with core.GpuClocks() as sampled:  # no GPU here: a no-op
        pass
    assert sampled.summary() is None
    clocks = {"ours": [None, {"sm_mhz": 1.0}], "anchor": [None, {"sm_mhz": 2.0}], "x": [1, 2]}
    assert core.clocks_of_round(clocks, 1, "ours", "anchor", "missing") == {
        "ours": {"sm_mhz": 1.0}, "anchor": {"sm_mhz": 2.0}}


def test_kernels_of_trace_reads_the_gpu_streams_call_by_call():
    """Kernels on the GPU's stream threads only (not its other threads, not the host's), in
    launch order, each the median over the calls; None when the calls do not split evenly."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7,
             "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream"}}]

    def event(pid, tid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    runs = [(0, [("fwd", 100), ("stats", 10), ("bwd", 300)]),
            (1000, [("fwd", 140), ("stats", 30), ("bwd", 200)]),
            (2000, [("fwd", 120), ("stats", 20), ("bwd", 250)])]
    kernels = [event(1, 7, name, start + 400 * i, dur)
               for start, run in runs for i, (name, dur) in enumerate(run)]
    noise = [event(1, 8, "fusion", 5, 999), event(2, 7, "host", 6, 999)]
    trace = {"traceEvents": meta + noise + kernels[::-1]}
    assert core.kernels_of_trace(trace, calls=3) == [("fwd", 0.12), ("stats", 0.02),
                                                     ("bwd", 0.25)]
    assert core.kernels_of_trace(trace, calls=2) is None
    assert core.kernels_of_trace({"traceEvents": meta + noise}, calls=1) is None
    if not core.on_gpu():  # a real trace on the CPU: no GPU kernels
        assert core.kernel_ms(jax.jit(lambda x: x + 1), jnp.ones(2), calls=1) is None


def test_kernel_breakdown_is_a_row_field_and_survives_a_failed_trace(monkeypatch):
    monkeypatch.setattr(core, "kernel_ms", lambda fn, *a, calls: [("k" * 90, 1.23456), ("b", 2)])
    assert core.kernel_breakdown(None, calls=3) == [["k" * 80, 1.2346], ["b", 2]]

    def broken(fn, *a, calls):
        raise RuntimeError("no trace\ndetails")

    monkeypatch.setattr(core, "kernel_ms", broken)
    assert core.kernel_breakdown(None, calls=3) is None


def test_sparse_mask_hits_the_target_density():
    from attn.block_sparse import effective_block_mask
    from experiments.bench.sparse import sparse_mask

    n, s, bs = 4, 128 * 32, 32
    for density in (0.1, 1.0):
        mask = sparse_mask(0, n, s, bs, density)
        eff = np.asarray(effective_block_mask(jnp.ones((1, n), jnp.int32), mask,
                                              num_q_tokens=s, num_kv_tokens=s, block_size=bs))
        sb = s // bs
        got = eff.sum() / (n * sb * (sb + 1) / 2)
        assert abs(got - density) < 0.01, (density, got)


def test_banded_like_keeps_each_rows_count_as_the_nearest_blocks():
    from experiments.bench.sparse import banded_like, sparse_mask

    mask = np.asarray(sparse_mask(3, 2, 128 * 24, 128, 0.3))
    band = np.asarray(banded_like(mask))
    causal = np.tril(np.ones(mask.shape[-2:], bool))
    assert not (band & ~causal).any()
    np.testing.assert_array_equal(band.sum(-1), (mask & causal).sum(-1))
    for h, r in np.ndindex(*band.shape[1:3]):  # the sink, then one run ending at the diagonal
        cols = np.flatnonzero(band[0, h, r])
        assert cols[0] == 0 and cols[-1] == r, (h, r, cols)
        assert (np.diff(cols[1:]) == 1).all(), (h, r, cols)


def test_kilo_names_lengths():
    assert (core.kilo(131072), core.kilo(96), core.kilo(1536)) == ("128K", "96", "1536")


def test_parse_changes_keep_the_other_fields_of_a_base_config():
    """A config string changes only the fields it names (a base that is not `Config()`, e.g. a
    `default_config` for wide heads, keeps the rest); a bad name or value says which."""
    from attn.block_sparse import triton as sparse_triton

    base = sparse_triton.default_config(256)  # 32-key steps, 2 stages
    changed = registry.parse_fields(sparse_triton.Config, "warp_specialize=1", base)
    assert changed == dataclasses.replace(base, warp_specialize=True) and changed.block_n == 32
    assert registry.describe_fields(changed, base) == "warp_specialize=True"
    with pytest.raises(ValueError, match="nope=1"):
        registry.parse_changes(sparse_triton.Config, "nope=1")
    with pytest.raises(ValueError, match="num_stages=x"):
        registry.parse_changes(sparse_triton.Config, "num_stages=x")
    with pytest.raises(ValueError, match="num_stages=0"):  # the Config's own check
        registry.parse_fields(sparse_triton.Config, "num_stages=0")


def test_specs_apply_settings_to_every_group_with_the_field_or_to_one():
    registry.load()
    got = registry.specs(["flash_prefill", "window_prefill"],
                         "heads=16,window_prefill.seq=1024,seqs=8:16")
    assert got["flash_prefill"].heads == got["window_prefill"].heads == 16
    assert got["window_prefill"].seq == 1024 and got["flash_prefill"].seqs == (8, 16)
    quick = registry.specs(["paged_decode"], "xla_reference=0", quick=True)["paged_decode"]
    assert quick.seq == 256 and quick.xla_reference is False
    with pytest.raises(ValueError, match="no selected row group has 'nope'"):
        registry.specs(["flash_prefill"], "nope=1")
    with pytest.raises(ValueError, match="not a selected row group"):
        registry.specs(["flash_prefill"], "window_prefill.seq=1")
    with pytest.raises(ValueError, match="unknown row groups"):
        registry.specs(["nope"])


def test_every_suite_group_is_registered_with_a_quick_spec():
    groups = registry.load()
    for suite, names in registry.SUITES.items():
        for name in names:
            spec = groups[name].spec
            fields = {f.name for f in dataclasses.fields(spec)}
            assert set(spec.QUICK) <= fields, (suite, name, set(spec.QUICK) - fields)
            spec(**spec.QUICK)


def test_every_committed_file_has_a_suite():
    """Each file in benchmarks/ is a suite's `<suite>.json` / `.md` or one that a suite written
    by its own tool lists (`registry.COMMANDS`), so `python -m experiments.bench <suite>`
    reproduces it."""
    suites = set(registry.SUITES) | set(registry.COMMANDS)
    for path in BENCHMARKS.iterdir():
        stem = path.stem.split("_")[0] if path.suffix == ".png" else path.stem
        assert stem in suites, path.name
        if path.suffix == ".png":
            assert path.name in registry.COMMANDS[stem].writes, path.name


def test_command_suites_run_their_steps_in_order(tmp_path, capsys):
    """A suite written by its own tool: each step a process, a failing step ends the run with
    its exit code, then the copies; `--dry-run` prints the commands and runs nothing."""
    (tmp_path / "a.json").write_text('{"x": 1}')
    fake = registry.Command(doc="d", writes="c.json",
                            steps=(("json.tool", "{work}/a.json", "{work}/b.json"),),
                            copies=(("{work}/b.json", "{out}/c.json"),))
    registry.COMMANDS["fake"] = fake
    try:
        assert cli.run_command("fake", str(tmp_path / "o"), str(tmp_path), dry_run=True) == 0
        assert not (tmp_path / "b.json").exists()
        (tmp_path / "o").mkdir()
        assert cli.run_command("fake", str(tmp_path / "o"), str(tmp_path)) == 0
        assert json.loads((tmp_path / "o" / "c.json").read_text()) == {"x": 1}
        registry.COMMANDS["fake"] = dataclasses.replace(fake, steps=(("json.tool", "missing"),
                                                                     *fake.steps))
        assert cli.run_command("fake", str(tmp_path / "p"), str(tmp_path)) != 0
        assert not (tmp_path / "p").exists()
    finally:
        del registry.COMMANDS["fake"]
    out = capsys.readouterr().out
    assert f"python -m json.tool {tmp_path}/a.json {tmp_path}/b.json" in out


def test_heads_and_multigpu_commands_are_accepted_by_their_tools(tmp_path, capsys):
    """The steps of `heads` parse with the tools' own parsers (their files made up), the
    extra arguments reach the steps that load the model, and `multigpu`'s tool takes `--out`."""
    import subprocess
    import sys

    from experiments import heads_report, longctx_eval, train_heads

    work, gguf = tmp_path / "w", tmp_path / "m.gguf"
    for path in ("train_heads/heads.json", "eval/results.json", "eval_elastic/results.json"):
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text("{}")
    gguf.write_text("")
    steps = registry.COMMANDS["heads"].argv(str(tmp_path), str(work), ("--model", str(gguf)))
    parsers = {"experiments.train_heads": train_heads.parse_args,
               "experiments.longctx_eval": longctx_eval.parse_args,
               "experiments.heads_report": heads_report.parse_args}
    assert [s[0] for s in steps] == ["experiments.train_heads", "experiments.longctx_eval",
                                     "experiments.longctx_eval", "experiments.heads_report"]
    for module, *argv in steps:
        args = parsers[module](argv)
        assert getattr(args, "model", str(gguf)) == str(gguf), module
    assert cli.main(["heads", "--dry-run", "--work", str(work), "--out", str(tmp_path), "--",
                     "--model", str(gguf)]) == []
    printed = capsys.readouterr().out.splitlines()
    assert printed[:4] == [cli._shell(step) for step in steps]
    assert printed[4] == f"cp {work}/train_heads/loss.png {tmp_path}/heads_loss.png"
    (step,) = registry.COMMANDS["multigpu"].argv("benchmarks", "w")
    helped = subprocess.run([sys.executable, "-m", step[0], "--help"], capture_output=True,
                            text=True, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert helped.returncode == 0 and "--out" in helped.stdout, helped.stderr[-2000:]
    with pytest.raises(SystemExit):
        cli.main(["heads", "--rows", "x"])
    assert "written by its own tool" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(p for p in BENCHMARKS.glob("*.json")
                                        if p.stem not in registry.COMMANDS),
                         ids=lambda p: p.stem)
def test_committed_tables_are_their_json_rendered_by_the_bench(path):
    """Every committed table of a suite is `--render` of its JSON: one format, and the command
    the table names (and `experiments.bench`'s docstring lists) reproduces it."""
    assert path.stem in registry.SUITES, path.stem
    expected = core.render(path.stem, json.loads(path.read_text()), cli.command(path.stem))
    assert path.with_suffix(".md").read_text() == expected
    assert f"python -m experiments.bench {path.stem}" in bench.__doc__


@pytest.mark.parametrize("suite", sorted(registry.COMMANDS))
def test_command_suites_are_listed(suite):
    """`--list`, `--help` and the package docstring name the suites written by their own tools
    and their exact commands."""
    steps = registry.COMMANDS[suite].argv("benchmarks", "out/bench")
    listing, helptext = cli.describe(), cli._parser().format_help()
    for step in steps:
        assert cli._shell(step) in listing and cli._shell(step) in helptext
    assert f"python -m experiments.bench {suite}" in bench.__doc__


def test_cli_refuses_bad_rows_and_settings(capsys):
    with pytest.raises(SystemExit):
        cli.main(["decode", "--rows", "flash_prefill"])
    assert "the decode suite has" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["mla", "--set", "nope=1"])
    assert "no selected row group has 'nope'" in capsys.readouterr().err


def test_cli_render_rewrites_the_table_from_the_json(tmp_path):
    rows = [_row(0)]
    (tmp_path / "mla.json").write_text(json.dumps({"device": "d", "rows": rows}))
    assert cli.main(["mla", "--render", "--out", str(tmp_path)]) == []
    md = (tmp_path / "mla.md").read_text()
    assert "`python -m experiments.bench mla`" in md and "| k | c0 |" in md


def test_cli_quick_run_on_cpu_writes_rows_with_ratios(tmp_path):
    """One group end to end through the interpreter: our kernel, its XLA anchor, the copy
    ceiling, the ratios derived, the quick file name."""
    rows = cli.main(["gdn", "--rows", "causal_conv1d_update", "--quick", "--out",
                     str(tmp_path)])
    (r,) = rows
    assert r["kernel"] == "causal_conv1d_update" and r["state_bitwise_equal_to_xla"]
    assert r["rel_err_y_vs_xla"] < 2e-2 and r["anchor_ms"] > 0 and r["ceiling"] > 0
    assert r["speedup_vs_anchor"] == pytest.approx(r["anchor_ms"] / r["ms"], abs=1e-4)
    written = json.loads((tmp_path / "gdn_quick.json").read_text())
    assert written["rows"] == rows and "copy_bandwidth_tbs" in written
    assert "--quick" in (tmp_path / "gdn_quick.md").read_text()


@pytest.mark.slow
def test_prefill_quick_runs_every_group_on_cpu(tmp_path):
    """`python -m experiments.bench prefill --quick`: every group, tiny shapes, interpreter; our
    outputs close to their references, anchors that need a GPU recorded as None."""
    rows = cli.main(["prefill", "--quick", "--out", str(tmp_path)])
    by = {}
    for r in rows:
        by.setdefault(r["kernel"], []).append(r)
    assert set(by) == {"flash_prefill", "window_prefill", "block_sparse_prefill",
                       "xattn_estimate", "gdn_chunk_prefill", "causal_conv1d", "paged_prefill",
                       "flash_prefill_fwd_bwd", "softcap_prefill"}, set(by)
    assert all(r["tokamax_ms"] is None and "tokamax_note" in r
               for k in ("flash_prefill", "window_prefill") for r in by[k])
    for r in by["block_sparse_prefill"]:
        assert r["goal_ms"] == pytest.approx(1.15 * r["density"] * r["dense_ms"], rel=1e-3)
        assert r["meets_goal"] == (r["ms"] <= 1.15 * r["density"] * r["dense_ms"])
    assert [r["target_density"] for r in by["block_sparse_prefill"]] == [0.4, 1.0, 0.4]
    assert by["block_sparse_prefill"][1]["rel_err_vs_dense"] < 2e-2
    for r in by["xattn_estimate"]:
        assert r["fraction_of_total"] == pytest.approx(r["ms"] / (r["ms"] + r["sparse_ms"]),
                                                       abs=1e-3)
    assert by["paged_prefill"][0]["rel_err_vs_anchor"] < 2e-2
    assert by["gdn_chunk_prefill"][0]["rel_err_o_vs_xla"] < 2e-2
    assert by["causal_conv1d"][0]["rel_err_y_vs_xla"] < 2e-2
    assert by["softcap_prefill"][0]["rel_err_vs_xla"] < 2e-2
    causal, window = by["flash_prefill_fwd_bwd"]  # our no-sink time only beside the window's
    assert "ours_no_sink_ms" not in causal and window["ours_no_sink_ms"] > 0


@pytest.mark.slow
def test_decode_quick_runs_every_group_on_cpu(tmp_path):
    """`python -m experiments.bench decode --quick`: every group; the kv_write rows take the
    paged group's G4 times as their anchor; outputs close to their references."""
    rows = cli.main(["decode", "--quick", "--out", str(tmp_path)])
    by = {}
    for r in rows:
        by.setdefault(r["kernel"], []).append(r)
    assert set(by) >= {"paged_decode", "paged_decode_fp8", "paged_decode_headwise", "mla_decode",
                       "mla_decode_fp8", "gdn_decode", "causal_conv1d_update", "kv_write",
                       "kv_write_prefill", "engine_decode", "engine_decode_fp8"}, set(by)
    g4 = {r["kernel"]: r["ms"] for r in by["paged_decode"] + by["paged_decode_fp8"]
          if "-G4-" in r["case"] and "xla" not in r["case"]}
    assert [r["anchor_ms"] for r in by["kv_write"]] == [g4["paged_decode"],
                                                        g4["paged_decode_fp8"]]
    assert by["gdn_decode"][0]["rel_err_o_vs_xla"] < 2e-2
    assert all(r["recompiles"] == 0 for r in by["engine_decode"] + by["engine_decode_fp8"])


@pytest.mark.slow
def test_block_sparse_fwd_bwd_quick_row_comes_from_one_round(tmp_path):
    """`python -m experiments.bench sparse_prefill --rows block_sparse_fwd_bwd --quick`: the row's
    figures and its ratio are one round's; every head full gives the dense gradients."""
    (r,) = cli.main(["sparse_prefill", "--rows", "block_sparse_fwd_bwd", "--quick", "--out",
                     str(tmp_path)])
    assert r["kernel"] == "block_sparse_fwd_bwd" and r["impl"] == "triton"  # no GPU: no Mosaic
    ratio = r["ms"] / (r["density"] * r["anchor_ms"])
    assert r["ratio_vs_density_x_dense"] == pytest.approx(ratio, rel=1e-3)
    assert r["round_ratios_vs_density_x_dense"] == [pytest.approx(ratio, rel=1e-3)]
    assert r["meets_goal"] == (r["ms"] <= r["goal_ms"]) and r["banded_ms"] > 0
    assert max(r[f"rel_err_full_vs_dense_d{x}"] for x in "qkv") < 2e-2
    assert r["cudnn_note"] == "skipped: no GPU"
