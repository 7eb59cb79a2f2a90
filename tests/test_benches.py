"""The benchmark plumbing (experiments/_bench.py) and the prefill benchmark's smoke run.

The plumbing tests are fast and run in CI; the smoke run of every prefill row group (tiny shapes
through Triton's interpreter, about a minute on two cores) is `slow`.
"""

import dataclasses
import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import _bench


def _row(i):
    return _bench.row(kernel="k", case=f"c{i}", ms=1.0, achieved=1.0, unit="x", ceiling=2.0,
                      anchor=None, anchor_ms=None, goal="none", meets_goal=None)


def test_run_groups_keeps_rows_of_a_failing_group_and_runs_the_next(tmp_path):
    def broken(args, ctx):
        yield _row(0)
        raise RuntimeError("out of memory")

    def fine(args, ctx):
        return [_row(1)]

    ctx = _bench.Context(smoke=True)
    rows = _bench.run_groups("t", {"broken": broken, "fine": fine}, ["broken", "fine"], None,
                             ctx, out_dir=tmp_path)
    assert [r["case"] for r in rows] == ["c0", "c1"]
    written = json.loads((tmp_path / "t.json").read_text())
    assert [r["case"] for r in written["rows"]] == ["c0", "c1"]
    assert "| k | c1 |" in (tmp_path / "t.md").read_text()


def test_run_groups_writes_each_row_before_the_next_starts(tmp_path):
    seen = []

    def group(args, ctx):
        yield _row(0)
        seen.append(json.loads((tmp_path / "t.json").read_text())["rows"])
        yield _row(1)

    _bench.run_groups("t", {"g": group}, ["g"], None, _bench.Context(smoke=True),
                      out_dir=tmp_path)
    assert [r["case"] for r in seen[0]] == ["c0"]


def test_run_groups_rejects_an_unknown_group(tmp_path):
    with pytest.raises(ValueError, match="unknown row groups"):
        _bench.run_groups("t", {"g": lambda a, c: []}, ["nope"], None, _bench.Context(),
                          out_dir=tmp_path)


def test_time_ms_budget_cuts_the_calls_of_a_long_function():
    calls = []

    def slow(x):
        calls.append(1)
        time.sleep(0.03)
        return x

    ms = _bench.time_ms(slow, jnp.ones(2), iters=10, trials=5, warmup=1, budget_s=0.1)
    # warm-up 1 + probe 1 + 3 trials of 1 call, instead of 1 + 50
    assert len(calls) == 5, len(calls)
    assert 25 <= ms <= 200, ms


def test_time_ms_budget_keeps_the_counts_of_a_short_function():
    calls = []

    def fast(x):
        calls.append(1)
        return x

    _bench.time_ms(fast, jnp.ones(2), iters=10, trials=5, warmup=2, budget_s=1.0)
    assert len(calls) == 2 + 1 + 50


def test_context_memoises_figures():
    ctx = _bench.Context(smoke=True)
    counter = []
    assert ctx.once("a", lambda: counter.append(1) or 7) == 7
    assert ctx.once("a", lambda: counter.append(1) or 8) == 7
    assert counter == [1]
    assert ctx.ceilings() == {}


def test_sparse_mask_hits_the_target_density():
    from attn.block_sparse import effective_block_mask
    from experiments.bench_sparse_prefill import _sparse_mask

    n, s, bs = 4, 128 * 32, 32
    for density in (0.1, 1.0):
        mask = _sparse_mask(0, n, s, bs, density)
        eff = np.asarray(effective_block_mask(jnp.ones((1, n), jnp.int32), mask,
                                              num_q_tokens=s, num_kv_tokens=s, block_size=bs))
        sb = s // bs
        got = eff.sum() / (n * sb * (sb + 1) / 2)
        assert abs(got - density) < 0.01, (density, got)


def test_kilo_names_lengths():
    assert (_bench.kilo(131072), _bench.kilo(96), _bench.kilo(1536)) == ("128K", "96", "1536")


@pytest.mark.slow
def test_prefill_smoke_runs_every_group_on_cpu(tmp_path):
    """`python -m experiments.bench_prefill --smoke`: every row group, tiny shapes, interpreter;
    our outputs close to their references, anchors that need a GPU recorded as None."""
    from experiments import bench_prefill

    rows = bench_prefill.main(["--smoke", "--out", str(tmp_path)])
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"flash_prefill", "window_prefill", "block_sparse_prefill",
                       "xattn_estimate", "gdn_chunk_prefill", "causal_conv1d", "paged_prefill",
                       "flash_prefill_fwd_bwd"}, kernels
    written = json.loads((tmp_path / "prefill_smoke.json").read_text())
    assert len(written["rows"]) == len(rows)
    by = {}
    for r in rows:
        by.setdefault(r["kernel"], []).append(r)
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


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["experiments.sweep_prefill_kernels", "conv1d", "--quick"],
    ["experiments.sweep_prefill_kernels", "paged", "--quick"],
    ["experiments.sweep_prefill_kernels", "sparse", "--quick"],
    ["experiments.sweep_prefill_kernels", "xattn", "--quick"],
], ids=["conv1d", "paged", "sparse", "xattn"])
def test_sweep_scripts_run_on_cpu(argv, capsys):
    """The GPU sweep scripts' `--quick` modes (interpreter): every config times and checks."""
    import importlib

    importlib.import_module(argv[0]).main(argv[1:])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if " ms " in line or line.rstrip().endswith("ms")]
    assert lines and "failed" not in out, out


def test_block_sparse_profile_runs_on_cpu(capsys):
    """`experiments.profile_block_sparse --quick` (interpreter): the op, its lists, the kernel
    per config and dense flash are timed; the kernel alone gives the op's output bit for bit."""
    from experiments import profile_block_sparse as prof

    rows = prof.main(["--quick", "--config", "num_stages=2"])
    assert [r["config"] for r in rows] == ["default", "num_stages=2"]
    assert all(r["same"] and r["kernel"] > 0 and r["lists"] > 0 for r in rows), rows
    assert 0 < rows[0]["density"] <= 1 and rows[0]["steps"] > 0
    assert "k+l/goal" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no_such_field=1"):
        prof.main(["--quick", "--config", "no_such_field=1"])


def test_parse_changes_keep_the_other_fields_of_a_base_config():
    """`--config` text changes only the fields it names (a base that is not `Config()`, e.g. a
    `default_config` for wide heads, keeps the rest); a bad name or value says which."""
    from attn.block_sparse import triton as sparse_triton

    base = sparse_triton.default_config(256)  # 32-key steps, 2 stages
    changed = dataclasses.replace(base, **_bench.parse_changes(sparse_triton.Config,
                                                                 "warp_specialize=1"))
    assert changed == dataclasses.replace(base, warp_specialize=True) and changed.block_n == 32
    with pytest.raises(ValueError, match="nope=1"):
        _bench.parse_changes(sparse_triton.Config, "nope=1")
    with pytest.raises(ValueError, match="num_stages=0"):
        _bench.parse_fields(sparse_triton.Config, "num_stages=0")
