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
# # Kernels against their anchors and the roofline
#
# Every `benchmarks/*.json` written by `python -m experiments.bench` holds one row per kernel and
# shape:
# our time, what it achieved (TB/s for memory-bound kernels, TFLOP/s for compute-bound ones),
# the ceiling measured in the same process (copy bandwidth of the GPU, or its dense matmul
# peak), and the anchor it was timed against in the same process (cuDNN, fla, the deprecated
# Pallas kernel, the XLA reference, or another of our variants).
#
# `GPU = False` plots the stored results (any machine, seconds); `GPU = True` first re-measures
# on this GPU (`python -m experiments.bench decode` and `... prefill`, several minutes,
# rewriting their JSON files), then plots.

# %%
# ruff: noqa: E402 (the setting comes first, the imports after it)
GPU = False

# %%
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "benchmarks").is_dir())
if GPU:
    for suite in ("decode", "prefill"):
        subprocess.run([sys.executable, "-m", "experiments.bench", suite], cwd=ROOT, check=True)

tables = {}
for path in sorted((ROOT / "benchmarks").glob("*.json")):
    data = json.loads(path.read_text())
    rows = data.get("rows", [])
    if rows and all("ms" in r for r in rows):  # kernel timings, not the heads or serving reports
        tables[path.stem] = data
for name, data in tables.items():
    print(f"{name}: {len(data['rows'])} rows, {data['device']}, commit {data['commit']}")

# %% [markdown]
# ## The numbers
#
# `roofline` is our fraction of the ceiling: achieved / ceiling, where the ceiling is copy
# bandwidth for TB/s rows and matmul peak for TFLOP/s rows. `x anchor` is the anchor's time over
# ours (> 1: we are faster). Where the anchor does the same work as ours (an external
# implementation or the XLA reference of the same op on the same shapes, i.e. not one of our
# own variants such as "ours bf16" for an fp8 row), its fraction of the ceiling is ours scaled
# by the time ratio: `anchor roofline = roofline x ms / anchor_ms`. Rows whose GEMMs run in
# fp8 can pass 1: their ceiling is the bf16 matmul peak. Multi-GPU rows (`multigpu.json`)
# record no ceiling; their anchor is D times the one-GPU throughput (`ratio_to_D_x_one_gpu`).

# %%
NAN = float("nan")


def same_work(row) -> bool:
    """Whether the anchor runs the same op on the same data (not another of our variants)."""
    return bool(row.get("anchor_ms")) and not row["anchor"].lower().startswith("our")


def against_anchor(row, data) -> tuple[float, str]:
    """`(speedup over the anchor, the anchor's name)`; NaN and "" for a row without one."""
    if row.get("speedup_vs_anchor"):
        return row["speedup_vs_anchor"], row["anchor"]
    if row.get("ratio_to_D_x_one_gpu"):
        return row["ratio_to_D_x_one_gpu"], f"{row['gpus']} x {data['one_gpu_baseline']}"
    return NAN, ""


def roofline(row) -> tuple[float, float]:
    """`(our fraction of the ceiling, the anchor's where it does the same work)`, NaN if none."""
    frac = row.get("fraction_of_ceiling") or NAN
    return frac, frac * row["ms"] / row["anchor_ms"] if same_work(row) else NAN


for name, data in tables.items():
    print(f"\n{name} ({data['device']})")
    print(f"{'kernel':<22} {'case':<58} {'ms':>9} {'roofline':>8} {'anchor rl':>9} "
          f"{'x anchor':>8}  anchor")
    for r in data["rows"]:
        speedup, anchor = against_anchor(r, data)
        print(f"{r['kernel']:<22} {r['case']:<58} {r['ms']:>9.3f} {roofline(r)[0]:>8.3f} "
              f"{roofline(r)[1]:>9.3f} {speedup:>8.2f}  {anchor}")

# %% [markdown]
# ## Plots
#
# Per file: left, the fraction of the ceiling (bars: ours; dots: the anchor where it does the
# same work; the dashed line is the roofline); right, the speedup over the anchor (the dashed
# line is parity).

# %%
UNIT = {"TB/s": "of copy bandwidth", "TFLOP/s": "of matmul peak"}
for name, data in tables.items():
    rows = data["rows"]
    labels = [f"{r['kernel']}  {r['case']}" for r in rows]
    y = np.arange(len(rows))
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(15, 0.32 * len(rows) + 1.5), sharey=True)
    colors = ["tab:blue" if r.get("unit") == "TB/s" else "tab:orange" for r in rows]
    ours, theirs = np.asarray([roofline(r) for r in rows]).T
    ax0.barh(y, np.nan_to_num(ours), color=colors)
    if np.isfinite(theirs).any():
        ax0.plot(theirs, y, "ko", ms=4, label="anchor")
        ax0.legend(loc="lower right")
    ax0.axvline(1.0, ls="--", color="gray")
    ax0.set(yticks=y, yticklabels=labels, xlabel="fraction of the ceiling (blue: "
            f"{UNIT['TB/s']}, orange: {UNIT['TFLOP/s']})")
    ax0.invert_yaxis()
    speed, anchor = zip(*(against_anchor(r, data) for r in rows))
    ax1.barh(y, speed, color="tab:green")
    ax1.axvline(1.0, ls="--", color="gray")
    ax1.set_xscale("log")
    ax1.set(xlabel="speedup over the anchor (anchor ms / our ms)")
    for i, a in enumerate(anchor):
        ax1.annotate(a, (ax1.get_xlim()[0], i), xytext=(3, 0), textcoords="offset points",
                     va="center", fontsize=7)
    fig.suptitle(f"{name}: {data['device']}, commit {data['commit']}")
    fig.tight_layout()
    plt.show()
