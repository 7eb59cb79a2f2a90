"""`python -m experiments.serve_sim` at a tiny size: every configuration serves every request,
the page series is consistent with the engine's accounting, head-wise holds fewer pages than
uniform, fp8 gets the same bytes in more pages; bad arguments end in one line before loading."""

import json

import numpy as np
import pytest

from experiments import serve_sim

TINY = ["--model", "tiny-random", "--requests", "4", "--rate", "50", "--prompt-len", "48",
        "--spread", "0.25", "--max-tokens", "3", "--batch", "2", "--chunk", "16",
        "--page-size", "8", "--window", "8", "--sinks", "0", "--kv-fraction", "0.75"]


def test_serve_sim_tiny(tmp_path, capsys):
    report = serve_sim.main(TINY + ["--out", str(tmp_path)])
    assert (tmp_path / "serve_sim.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == report["summary"]
    out = capsys.readouterr().out
    assert "headwise / uniform throughput" in out and "fp8 / uniform throughput" in out
    summary, series = report["summary"], report["series"]
    assert list(summary) == ["uniform", "headwise", "fp8"]
    for name, s in summary.items():
        assert s["tokens"] == 4 * 3, name  # every request generated max_tokens
        assert s["tokens_per_s"] > 0 and s["span_s"] > 0
        assert 0 <= s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_p99_ms"], name
        assert 0 <= s["tbt_p50_ms"] <= s["tbt_p99_ms"], name
        pages = np.asarray(series[name]["pages"])
        assert pages[-1] == 0 and pages.max() <= s["capacity_pages"], name  # all freed at the end
        assert np.all(np.diff(series[name]["time"]) >= 0), name
    # Prompts of 36-60 tokens vs an 8-token window: streaming heads hold a fraction of the pages.
    assert summary["headwise"]["mean_pages"] < 0.9 * summary["uniform"]["mean_pages"]
    # Same KV bytes: fp8 pages are smaller, so there are more of them (float32 model: ~4x).
    budget = summary["uniform"]["capacity_pages"] * summary["uniform"]["page_bytes"]
    fp8 = summary["fp8"]["capacity_pages"] * summary["fp8"]["page_bytes"]
    assert 0.9 * budget <= fp8 <= budget
    assert summary["fp8"]["capacity_pages"] >= 3 * summary["uniform"]["capacity_pages"]


def test_workload_is_poisson_and_seeded():
    args = serve_sim.parse_args(["--model", "tiny-random", "--requests", "400", "--rate", "5"])
    work = serve_sim.make_workload(args, 512)
    gaps = np.diff([a.time for a in work])
    assert work[0].time == 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.2) < 0.03  # mean gap 1 / rate
    lengths = [len(a.prompt) for a in work]
    assert min(lengths) >= 64 and max(lengths) <= 192  # 128 * (1 +- 0.5)
    assert [a.prompt for a in serve_sim.make_workload(args, 512)] == [a.prompt for a in work]


@pytest.mark.parametrize("argv,needle", [
    (["--rate", "0"], "argument --rate: '0' must be > 0"),
    (["--requests", "two"], "argument --requests: 'two' is not a int"),
    (["--configs", "uniform,bogus"], "choose a comma-separated subset of uniform,headwise,fp8"),
    (["--dtype", "float8"], "invalid choice: 'float8'"),
    (["--spread", "1.5"], "--spread 1.5 must be in [0, 1)"),
    (["--kv-fraction", "0"], "--kv-fraction 0.0 must be in (0, 1]"),
    (["--sinks", "-1"], "--sinks -1 must be >= 0"),
    (["--model", "/nonexistent/model.gguf"], "no such file or directory"),
    (["--kv-fraction", "0.1", "--batch", "2"], "fewer than one request"),
], ids=["rate", "requests", "configs", "dtype", "spread", "kv-fraction", "sinks", "model",
        "too-few-pages"])
def test_bad_arguments_one_line_before_loading(argv, needle, monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(serve_sim, "_load_model", fail)
    with pytest.raises(SystemExit) as e:
        serve_sim.main(["--model", "tiny-random"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_help_shows_defaults_and_choices(capsys):
    with pytest.raises(SystemExit) as e:
        serve_sim.parse_args(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width
    assert "(default: smollm2)" in out and "(default: 4.0)" in out
    assert "(default: uniform,headwise,fp8)" in out and "{float32,bfloat16}" in out
