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
# # Serving with head-wise and fp8 KV: a simulation
#
# Head-wise KV (half the heads streaming) and fp8 pages both shrink what a request holds. Does
# that turn into serving throughput? `experiments.serve_sim` sends Poisson arrivals of long
# prompts through the engine (continuous batching, chunked prefill) under the same KV bytes for
# every configuration, and clocks each engine step:
#
# * `uniform`: every head full, pages in the model dtype;
# * `headwise`: every other (layer, KV head) streams sink + window and gives pages back;
# * `fp8`: every head full on float8_e4m3fn pages (about 4x the pages of float32 in the same bytes).
#
# `GPU = False` runs a tiny random model in seconds (the mechanics: pages over time,
# preemptions); `GPU = True` runs SmolLM2 at 8K-token prompts, the setting that answers the
# throughput question.

# %%
import matplotlib.pyplot as plt
import numpy as np

from experiments import serve_sim

GPU = False

if GPU:
    ARGS = ["--model", "smollm2", "--requests", "64", "--rate", "4", "--prompt-len", "8192",
            "--batch", "16", "--chunk", "1024", "--window", "1024", "--sinks", "128",
            "--dtype", "bfloat16"]
else:
    ARGS = ["--model", "tiny-random", "--requests", "8", "--rate", "50", "--prompt-len", "96",
            "--batch", "4", "--chunk", "32", "--window", "16", "--sinks", "4",
            "--max-tokens", "6"]

report = serve_sim.main(ARGS + ["--out", "out/serve_sim_notebook"])

# %% [markdown]
# ## Throughput and latency
#
# Throughput is generated tokens per simulated second (first arrival to last finish); TTFT is
# arrival to first token; TBT is the gap between consecutive tokens of a request. On a CPU the
# times are the XLA reference ops' (a streaming head's masked keys cost as much as visible ones
# there), so compare pages and preemptions here, and throughput on the GPU.

# %%
summary = report["summary"]
names = list(summary)
fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
axes[0].bar(names, [summary[n]["tokens_per_s"] for n in names])
axes[0].set(title="throughput", ylabel="generated tokens / s")
for ax, metric in zip(axes[1:], ("ttft", "tbt")):
    for n in names:
        values = [summary[n][f"{metric}_p{q}_ms"] for q in serve_sim.PERCENTILES]
        ax.plot(serve_sim.PERCENTILES, values, marker="o", label=n)
    ax.set(title=metric.upper(), xlabel="percentile", ylabel="ms")
    ax.legend()
fig.tight_layout()
for n in names:
    print(f"{n:>9}: {summary[n]['tokens_per_s']:8.1f} tok/s, {summary[n]['preemptions']} "
          f"preemptions, peak {summary[n]['peak_pages']} of {summary[n]['capacity_pages']} pages")

# %% [markdown]
# ## KV pages in use over time
#
# Every configuration has the same bytes; fp8 has more (smaller) pages. Head-wise requests hold
# fewer pages once their streaming heads recycle. Under the default `--admission bytes` the bytes
# are one budget for all heads, so those pages admit more requests; with `--admission pools`
# every head has the same pool, the full heads decide how many requests fit, and head-wise admits
# no more requests than uniform (`benchmarks/serving.md` has both on an H100).

# %%
fig, ax = plt.subplots(figsize=(8, 3.6))
for n, series in report["series"].items():
    t, pages = np.asarray(series["time"]), np.asarray(series["pages"])
    ax.step(t - t[0], pages / summary[n]["capacity_pages"], where="post", label=n)
ax.set(xlabel="simulated seconds", ylabel="fraction of KV pages in use", ylim=(0, 1.05))
ax.legend()
fig.tight_layout()
