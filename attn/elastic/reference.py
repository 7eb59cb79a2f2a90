"""Reference pieces of the Elastic-Attention router: boundary pooling and head-mode mapping.

The router (`attn.elastic.router.AttentionRouter`) sees one pooled key vector per request and KV
head: the mean of the first and last 100 keys, taken *after* k_norm and *before* RoPE
(`ctx_q_pool`, "boundary pooling" in the paper). Its decision `z` (1 = retrieval / full, the code's
convention, opposite to the paper's notation) becomes a per-query-head mode for
`attn.block_sparse` through `derive_head_mask_type`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Block-Sparse-Attention mode codes of the policy names the checkpoints use.
MODE_CODES = {"full": 0, "xattn": 1, "streaming": -1}
# (retrieval_mode for z == 1, toggle_type for z == 0) pairs the inference path supports.
SUPPORTED_PAIRS = (
    ("full", "xattn"),
    ("full", "streaming"),
    ("xattn", "streaming"),
    ("xattn", "xattn"),
    ("full", "full"),
)
# Names the training code knows; pairs of them outside SUPPORTED_PAIRS are not implemented.
KNOWN_MODES = ("full", "xattn", "streaming", "local", "triangle", "topk", "none")


def ctx_q_pool(
    k_pre: Float[Array, "B S K H"],
    lengths: Int[Array, " B"] | None = None,
    *,
    boundary: int = 100,
) -> Float[Array, "B K H"]:
    """Mean of the first and the last `min(boundary, L)` keys of each request (float32 math).

    With `L < 2 · boundary` the two slices overlap and the shared keys count twice, as in the HF
    eval path (`mean(concat([k[:n], k[-n:]]))`, `n = min(100, L)`). A request with `L = 0` pools to
    zeros.

    Args:
      k_pre: `[B, S, K, H]` keys after k_norm, before RoPE.
      lengths: `[B]` int32 valid keys per request (`L`); default S for every request.
      boundary: keys taken at each end (100 in the seed).

    Returns:
      `[B, K, H]` in `k_pre`'s dtype.
    """
    B, S = k_pre.shape[:2]
    L = jnp.full((B,), S, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    n = jnp.minimum(boundary, L)[:, None]  # [B, 1]
    s = jnp.arange(S, dtype=jnp.int32)[None, :]
    weight = (s < n).astype(jnp.float32) + ((s >= L[:, None] - n) & (s < L[:, None]))
    # Padding may hold anything, NaN included: select, do not multiply by a zero weight.
    k = jnp.where((weight > 0)[:, :, None, None], k_pre.astype(jnp.float32), 0.0)
    total = jnp.einsum("BS,BSKH->BKH", weight, k)
    pooled = total / jnp.maximum(2 * n, 1)[:, :, None].astype(jnp.float32)
    return pooled.astype(k_pre.dtype)


def derive_head_mask_type(
    z: Int[Array, "B K"], retrieval_mode: str, toggle_type: str, group_size: int
) -> Int[Array, "B N"]:
    """Router decision per KV head -> Block-Sparse-Attention mode per query head.

    `mode_kv = where(z == 1, code[retrieval_mode], code[toggle_type])` with `code = {"full": 0,
    "xattn": 1, "streaming": -1}`, repeated `group_size` times per KV head (query head n uses KV
    head `n // group_size`), so all query heads of a GQA group share a mode.

    Args:
      z: `[B, K]` int router decisions, 1 = retrieval (full), 0 = sparse.
      retrieval_mode: mode of z == 1 heads (`full` or `xattn`).
      toggle_type: mode of z == 0 heads (`xattn`, `streaming`, or `full` with `full`).
      group_size: G = N // K.

    Returns:
      `[B, N]` int32, `N = K · group_size`.
    """
    modes = jnp.where(jnp.asarray(z) == 1, MODE_CODES[retrieval_mode], MODE_CODES[toggle_type])
    return jnp.repeat(modes.astype(jnp.int32), group_size, axis=-1)
