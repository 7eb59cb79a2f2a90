"""`python -m experiments.serve_sim` at a tiny size: every configuration serves every request,
the page series is consistent with the engine's accounting, head-wise holds fewer pages than
uniform, fp8 gets the same bytes in more pages; `bytes` admission keeps the reserved peaks
within the bytes and lets head-wise run more requests, `pools` admission (equal per-head pools)
admits head-wise exactly as uniform; the peak replay matches the engine; the benchmark render;
bad arguments end in one line before loading."""

import json

import numpy as np
import pytest

from experiments import serve_sim
from models import Engine, Policy, Request, SamplingParams

TINY = ["--model", "tiny-random", "--requests", "4", "--rate", "50", "--prompt-len", "48",
        "--spread", "0.25", "--max-tokens", "3", "--batch", "2", "--chunk", "16",
        "--page-size", "8", "--window", "8", "--sinks", "0", "--kv-fraction", "0.75"]


def test_serve_sim_tiny(tmp_path, capsys):
    # 1 ms a step: the schedule (which requests overlap, so the pages held) is then the same on
    # a busy CI host as on an idle one.
    report = serve_sim.main(TINY + ["--step-ms", "1", "--out", str(tmp_path)])
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
    # bytes admission: no preemption, and the requests' reserved peaks fit the bytes, so
    # head-wise (smaller peaks) runs more requests at once than uniform in the same bytes.
    for name, s in summary.items():
        assert s["admission"] == "bytes" and s["preemptions"] == 0, name
        assert max(series[name]["running"]) == s["peak_running"] <= 2, name
    assert summary["headwise"]["mean_running"] > summary["uniform"]["mean_running"]


def test_pools_admission_headwise_admits_as_uniform(tmp_path):
    """Equal per-head pools: the full heads of a head-wise request need what uniform's do, so
    the same requests run in every step and the same ones are preempted."""
    argv = TINY + ["--rate", "1e6", "--configs", "uniform,headwise", "--admission", "pools",
                   "--kv-fraction", "0.5", "--out", str(tmp_path)]
    report = serve_sim.main(argv)
    uniform, headwise = (report["series"][n] for n in ("uniform", "headwise"))
    assert uniform["running"] == headwise["running"]
    assert np.sum(headwise["pages"]) < np.sum(uniform["pages"])  # it does hold fewer pages
    s = report["summary"]
    assert s["uniform"]["preemptions"] == s["headwise"]["preemptions"] > 0


@pytest.mark.parametrize("policy", ["dense", "headwise"])
def test_peak_pages_matches_the_engine(policy):
    """The replayed peak is the most pages the engine's own steps hold, allocation included."""
    model = serve_sim._load_model(serve_sim.TINY, "float32")
    pol = (Policy.dense(2, 2) if policy == "dense"
           else Policy.headwise(2, 2, window=8, sinks=2))
    engine = Engine(model, batch_slots=1, max_len=64, page_size=4, chunk=8, policy=pol)
    prompt, max_tokens = list(range(1, 38)), 5
    req = engine.add(Request(prompt, SamplingParams(max_tokens=max_tokens)))
    peak = 0
    while not engine.idle:
        before = engine.pages_held().sum()
        # What the coming step allocates: the new tokens' pages beyond the row's extent.
        n = min(engine.chunk, len(req.tokens) - req.cached)
        grow = engine.scheduler.mirror.demand(0, req.cached + n).sum()
        peak = max(peak, int(before + grow))
        engine.step()
    got = serve_sim.peak_pages(engine, pol, len(prompt), max_tokens)
    assert got == peak
    if policy == "dense":
        assert got == 2 * 2 * -(-(len(prompt) + max_tokens - 1) // 4)
    else:  # half the heads keep sink + window + a chunk's pages
        assert got < 2 * 2 * -(-(len(prompt) + max_tokens - 1) // 4)


def test_render_rows_goal_and_table(tmp_path):
    """`--render`: one row per run and configuration, uniform the anchor of its admission,
    the goal computed on head-wise rows only."""
    def run(model, tok_s):
        summary = {}
        for (config, admission), t in tok_s.items():
            label = f"{config}@{admission}"
            summary[label] = dict(
                config=config, admission=admission, tokens_per_s=t, requests_per_s=t / 10,
                span_s=1.0, mean_running=2.0, peak_running=3, preemptions=0, mean_pages=5.0,
                peak_pages=8, capacity_pages=10, capacity_bytes=100,
                **{f"{m}_p{q}_ms": 1.0 for m in ("ttft", "tbt") for q in (50, 90, 99)})
        args = vars(serve_sim.parse_args(["--model", "tiny-random"]))
        return dict(device="GPU X", jax="0", commit="abc", model=model, args=args,
                    summary=summary,
                    series={n: dict(time=[0, 1], pages=[0, 5], running=[0, 2])
                            for n in summary})

    paths = []
    for i, (model, tok_s) in enumerate([
            ("m1", {("uniform", "bytes"): 100.0, ("headwise", "bytes"): 110.0,
                    ("fp8", "bytes"): 90.0, ("uniform", "pools"): 50.0,
                    ("headwise", "pools"): 51.0}),
            ("m2", {("uniform", "bytes"): 10.0, ("headwise", "bytes"): 10.4})]):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps(run(model, tok_s)))
        paths.append(str(path))
    bench = serve_sim.main(["--render", *paths, "--out", str(tmp_path / "b")])
    rows = {(r["model"], r["config"], r["admission"]): r for r in bench["rows"]}
    assert len(rows) == 7 and bench["device"] == "GPU X"
    assert rows["m1", "headwise", "bytes"]["speedup_vs_anchor"] == pytest.approx(1.1)
    assert rows["m1", "headwise", "bytes"]["meets_goal"] is True
    assert rows["m1", "headwise", "pools"]["meets_goal"] is False  # 1.02x
    assert rows["m2", "headwise", "bytes"]["meets_goal"] is False  # 1.04x
    assert rows["m1", "fp8", "bytes"]["speedup_vs_anchor"] == pytest.approx(0.9)
    assert "goal" not in rows["m1", "fp8", "bytes"]
    assert rows["m1", "uniform", "pools"]["anchor_tokens_per_s"] == 50.0
    md = (tmp_path / "b" / "serving.md").read_text()
    assert md.count("| bytes | headwise |") == 2 and ">= 1.05x: met" in md
    assert (tmp_path / "b" / "serving.png").stat().st_size > 0
    assert json.loads((tmp_path / "b" / "serving.json").read_text()) == bench


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
    (["--admission", "bytes,fair"], "choose a comma-separated subset of bytes,pools"),
    (["--render", "/nonexistent/results.json"], "--render /nonexistent/results.json: no such"),
], ids=["rate", "requests", "configs", "dtype", "spread", "kv-fraction", "sinks", "model",
        "too-few-pages", "admission", "render"])
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
    assert "(default: bytes)" in out and "qwen3-0.6b" in out
