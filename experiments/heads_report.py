"""Head-selection table: accuracy at a fixed KV budget, from one train_heads + longctx_eval run.

    python -m experiments.heads_report --heads OUT/train_heads/heads.json \
        --eval OUT/eval/results.json                       # writes benchmarks/heads.{md,json}

Per policy and streaming fraction: passkey and multi-key accuracy at every length with n and the
95% Wilson interval, the ratio to dense at the longest length, KV bytes per request at the longest
length and its fraction of dense, and the gate training run's time and throughput. Beside the
table: `<out>_pareto.png` (accuracy vs KV while decoding) and `<out>_maps.png` (gates and scores
per layer and KV head); the JSON keeps the gates and scores themselves.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments.longctx_eval import _pareto, wilson


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", required=True, help="heads.json of experiments.train_heads")
    p.add_argument("--eval", required=True, nargs="+",
                   help="results.json of experiments.longctx_eval (several: their policies are "
                        "joined; the first file's dense rows are the reference)")
    p.add_argument("--out", default="benchmarks/heads", help="path without extension")
    args = p.parse_args(argv)
    for flag, path in [("--heads", args.heads)] + [("--eval", e) for e in args.eval]:
        if not os.path.isfile(path):
            p.error(f"{flag} {path}: no such file")
    return args


def pooled(rows, policy: str, task: str, length: int) -> dict:
    """Accuracy, n and Wilson interval of one (policy, task, length) cell."""
    (r,) = [r for r in rows if r["policy"] == policy and r["task"] == task
            and r["length"] == length]
    hits = round(r["accuracy"] * r["n"])
    lo, hi = wilson(hits, r["n"])
    return dict(accuracy=r["accuracy"], n=r["n"], ci=(lo, hi), kv_bytes=r["kv_bytes"],
                kv_decode_bytes=r.get("kv_decode_bytes", r["kv_bytes"]))


def report(heads: dict, results: dict) -> tuple[str, dict]:
    rows = results["rows"]
    tasks = results["args"]["tasks"]
    lengths = sorted({r["length"] for r in rows})
    longest = lengths[-1]
    policies = list(results["timing"])
    meta = heads.get("meta", {})
    table = []
    for p in policies:
        entry = dict(policy=p)
        for task in tasks:
            cells = [pooled(rows, p, task, n) for n in lengths]
            dense = pooled(rows, "dense", task, longest)["accuracy"]
            entry[task] = dict(by_length={n: c for n, c in zip(lengths, cells)},
                               ratio_to_dense=(cells[-1]["accuracy"] / dense) if dense else None)
        entry["streaming"] = results["timing"][p].get("streaming")
        cell, dense = pooled(rows, p, tasks[0], longest), pooled(rows, "dense", tasks[0], longest)
        entry["kv_bytes"] = cell["kv_bytes"]
        entry["kv_decode_bytes"] = cell["kv_decode_bytes"]
        entry["kv_fraction"] = entry["kv_decode_bytes"] / dense["kv_decode_bytes"]
        table.append(entry)

    def cell(c):
        return f"{c['accuracy']:.2f} [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}]"

    head = ("| policy | heads streaming | "
            + " | ".join(f"{t} {n // 1024}K" for t in tasks for n in lengths)
            + f" | {' | '.join(f'{t} / dense at {longest // 1024}K' for t in tasks)}"
            + f" | KV at {longest // 1024}K: peak / decoding | decoding KV / dense |")
    lines = [
        "# Head selection: accuracy at a fixed KV budget",
        "",
        f"{os.path.basename(results['model'])}, {results['args']['dtype']}, "
        f"{results['device']}, commit {results.get('commit', 'unknown')}. Streaming heads keep "
        f"sink {results['args']['sinks']} + window {results['args']['window']}. "
        f"n = {results['args']['samples'] * len(results['args']['depths'])} prompts per cell "
        f"(depths {', '.join(str(d) for d in results['args']['depths'])}); accuracy with its 95% "
        "Wilson interval. `headwise` streams every other (layer, KV head); `-scored` streams the "
        "heads with the lowest training-free score (retrieval mass + streaming error, "
        "`models.heads.scoring`); `-trained` the lowest DuoAttention gates "
        "(`models.heads.gates`); `@f` is the fraction of KV heads streaming; `elastic-trained` "
        "lets the trained Elastic-Attention router pick each request's streaming heads "
        "(prefill streaming on 128-token blocks, `models.heads.elastic`).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for e in table:
        accs = [cell(e[t]["by_length"][n]) for t in tasks for n in lengths]
        ratios = [f"{e[t]['ratio_to_dense']:.2f}" if e[t]["ratio_to_dense"] is not None else "-"
                  for t in tasks]
        frac = "-" if e["streaming"] is None else f"{e['streaming']:.2f}"
        lines.append(f"| {e['policy']} | {frac} | " + " | ".join(accs) + " | " + " | ".join(ratios)
                     + f" | {e['kv_bytes'] / 2**20:.1f} / {e['kv_decode_bytes'] / 2**20:.1f} MiB"
                     + f" | {e['kv_fraction']:.3f} |")
    lines += ["", "Gate training (the `-trained` rows): "
              f"{meta.get('steps')} steps of batch {meta.get('batch')} on prompts of "
              f"{min(meta.get('lengths', [0]))}-{max(meta.get('lengths', [0]))} tokens "
              f"(every batch padded to {max(meta.get('lengths', [0])) + 16}), lr {meta.get('lr')}, "
              f"l1 {meta.get('l1')}, {meta.get('dtype')} on {meta.get('device')}: "
              f"{meta.get('train_s', 0):.1f} s in all (compile included), "
              f"{meta.get('steps_per_s') or 0:.2f} steps/s and "
              f"{meta.get('tokens_per_s') or 0:,.0f} tokens/s after the first step; scoring "
              f"{meta.get('score_s', 0):.1f} s."]
    router = meta.get("router")
    if router:
        lines += ["", f"Router training (`elastic-trained`): {meta.get('steps')} steps, target "
                  f"sparse fraction {router['target']}, lr {router['lr']}, Lagrangian lr "
                  f"{router['lagrangian_lr']}: {router['train_s']:.1f} s in all, "
                  f"{router.get('steps_per_s') or 0:.2f} steps/s, "
                  f"{router.get('tokens_per_s') or 0:,.0f} tokens/s; expected sparse fraction "
                  f"at the end {router['final_sparse_fraction']:.3f}."]
    lines.append("")
    data = dict(model=results["model"], device=results["device"], commit=results.get("commit"),
                eval_args=results["args"], training=meta, policies=table,
                timing=results["timing"],
                selection={k: heads[k] for k in ("gates", "scores") if k in heads})
    return "\n".join(lines), data


def merged(results: list[dict]) -> dict:
    """One results dict of several longctx_eval runs with the same prompts: the first run whole,
    then each later run's policies that the earlier ones lack."""
    out = dict(results[0], rows=list(results[0]["rows"]), timing=dict(results[0]["timing"]))
    for r in results[1:]:
        new = [p for p in r["timing"] if p not in out["timing"]]
        out["rows"] += [row for row in r["rows"] if row["policy"] in new]
        out["timing"].update({p: r["timing"][p] for p in new})
    return out


def plot_maps(heads: dict, path: str) -> None:
    """Head maps (layer x KV head): trained gates and the two training-free scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    maps = [("trained gate (1 = full)", heads.get("gates"))]
    scores = heads.get("scores") or {}
    maps += [("needle mass", scores.get("retrieval")),
             ("streaming error", scores.get("streaming_error"))]
    maps = [(t, np.asarray(m)) for t, m in maps if m is not None]
    if not maps:
        return
    fig, axes = plt.subplots(1, len(maps), figsize=(3.2 * len(maps), 6), sharey=True,
                             squeeze=False)
    for ax, (title, m) in zip(axes[0], maps):
        im = ax.imshow(m, aspect="auto", cmap="viridis")
        ax.set(title=title, xlabel="KV head", xticks=range(m.shape[1]))
        fig.colorbar(im, ax=ax, shrink=0.6)
    axes[0][0].set_ylabel("layer")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    with open(args.heads) as f:
        heads = json.load(f)
    runs = []
    for path in args.eval:
        with open(path) as f:
            runs.append(json.load(f))
    results = merged(runs)
    md, data = report(heads, results)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plot_maps(heads, args.out + "_maps.png")
    _pareto(results["rows"], list(results["timing"]),
            argparse.Namespace(lengths=sorted({r["length"] for r in results["rows"]}),
                               tasks=results["args"]["tasks"]), args.out + "_pareto.png")
    with open(args.out + ".md", "w") as f:
        f.write(md)
    with open(args.out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
