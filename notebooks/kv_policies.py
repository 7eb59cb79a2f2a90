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
# # KV policies on one layer: what a streaming head costs and what it sees
#
# A small tour of the building blocks on random data (CPU is fine): dense attention with a
# sliding window + sinks, the same decode step through head-major pages with per-head block
# tables, the pages a streaming head can give back, and fp8 pages. Open with jupytext
# (`jupytext --to ipynb notebooks/kv_policies.py`) or run it as a script.

# %%
import jax
import jax.numpy as jnp
import numpy as np

from attn.dense import attention
from attn.paged_decode import paged_decode
from kv import fp8

B, S, N, K, H, P = 2, 512, 8, 4, 64, 16
key = jax.random.key(0)
q = jax.random.normal(key, (B, 1, N, H))
k = jax.random.normal(jax.random.fold_in(key, 1), (B, S, K, H))
v = jax.random.normal(jax.random.fold_in(key, 2), (B, S, K, H))

# %% [markdown]
# Half the KV heads stream: they see 16 sink tokens and a 64-token window; the others see all.

# %%
window = jnp.asarray([64, 64, 0, 0], jnp.int32)  # <= 0: full
sinks = jnp.asarray([16, 16, 0, 0], jnp.int32)
dense_out, dense_lse = attention(q, k, v, q_offset=S - 1, window=window, sinks=sinks)
print("dense out", dense_out.shape, "lse", dense_lse.shape)

# %% [markdown]
# The same step over pages: every KV head has its own pool and its own table row, so the same
# page id in two heads is different memory. A streaming head's table keeps only its sink and
# window pages; the rest are -1 (given back to the allocator).

# %%
max_pages = S // P
num_pages = B * max_pages + 1  # page 0 is the reserved null page
rng = np.random.default_rng(0)
# Each head hands out its own pages: one permutation per head, split between the sequences.
per_head = [rng.permutation(num_pages - 1).reshape(B, max_pages) + 1 for _ in range(K)]
tables = np.stack(per_head, axis=1).astype(np.int32)  # [B, K, max_pages]
k_pages = jnp.zeros((K, num_pages, P, H))
v_pages = jnp.zeros((K, num_pages, P, H))
for b in range(B):
    for h in range(K):
        k_pages = k_pages.at[h, tables[b, h]].set(k[b, :, h].reshape(max_pages, P, H))
        v_pages = v_pages.at[h, tables[b, h]].set(v[b, :, h].reshape(max_pages, P, H))
visible_pages = np.zeros(max_pages, bool)
visible_pages[: 16 // P + 1] = True
visible_pages[(S - 64) // P:] = True
recycled = tables.copy()
recycled[:, :2, ~visible_pages] = -1  # streaming heads keep sink + window pages only
lengths = jnp.full((B,), S, jnp.int32)
paged_out, _ = paged_decode(q[:, 0], k_pages, v_pages, jnp.asarray(recycled), lengths,
                            window=window, sinks=sinks)
print("max |paged - dense| =", float(jnp.abs(paged_out - dense_out[:, 0]).max()))
kept = (recycled >= 0).sum() / recycled.size
print(f"pages kept: {kept:.2f} of all-full")

# %% [markdown]
# FP8 pages: e4m3 values with one fp32 scale per 16 tokens of a page and head.

# %%
k8, ks = fp8.quantize(k_pages, 16)
v8, vs = fp8.quantize(v_pages, 16)
fp8_out, _ = paged_decode(q[:, 0], k8, v8, jnp.asarray(recycled), lengths, window=window,
                          sinks=sinks, k_scales=ks, v_scales=vs)
rel = float(jnp.linalg.norm(fp8_out - paged_out) / jnp.linalg.norm(paged_out))
print(f"fp8 relative error {rel:.4f}; bytes per token-head {H} (fp8) vs {2 * H} (bf16)")
