"""Public Elastic-Attention pieces: pooling, head-mode mapping and the prefill composition.

Flow per layer at prefill (seed 000, vectorised over requests instead of a Python loop):

    pooled = ctx_q_pool(k_pre, lengths)                       # [B, K, H], pre-RoPE keys
    _, z = router(pooled)                                     # [B, K], 1 = full
    modes = derive_head_mask_type(z, retrieval_mode, toggle_type, N // K)   # [B, N]
    out, lse = elastic_prefill_attention(q, k, v, modes, ...)  # XAttention mask + block-sparse
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from attn import _checks
from attn._checks import concrete as _concrete
from attn.block_sparse import block_sparse_attention
from attn.elastic import reference
from attn.xattention import reference as xattention_reference
from attn.xattention import xattn_estimate

_pool = jax.jit(reference.ctx_q_pool, static_argnames=("boundary",))


def ctx_q_pool(
    k_pre: Float[Array, "B S K H"],
    lengths: Int[Array, " B"] | None = None,
    *,
    boundary: int = 100,
) -> Float[Array, "B K H"]:
    """Boundary pooling for the router: mean of the first and last `min(100, L)` keys.

    Matches the HF eval path `mean(concat([k[:n], k[-n:]]).float()).to(k.dtype)` with
    `n = min(100, L)`: when `L < 200` the slices overlap and shared keys count twice. With
    `lengths`, each request pools its own first and last valid keys; keys past `L` are never read
    (so for chunked prefill, pass the keys of the whole prompt so far and its length). A request
    with `L = 0` pools to zeros.

    Args:
      k_pre: `[B, S, K, H]` keys after k_norm and before RoPE.
      lengths: `[B]` int32 valid keys per request; default S.
      boundary: keys taken at each end (100 in the seed).

    Returns:
      `[B, K, H]` in `k_pre`'s dtype (float32 math).

    Raises:
      ValueError: wrong rank, bad `lengths` shape or values, `boundary <= 0`.
      TypeError: non-floating keys, non-integer lengths.
    """
    _checks.check_rank("k_pre", k_pre, 4, "B S K H")
    _checks.check_floating("k_pre", k_pre)
    _checks.check_positive("boundary", boundary)
    if lengths is not None:
        _checks.check_integer("lengths", lengths)
        if lengths.shape != (k_pre.shape[0],):
            raise ValueError(f"lengths.shape={lengths.shape} must be [B]=({k_pre.shape[0]},)")
        values = _concrete(lengths)
        if values is not None and ((values < 0) | (values > k_pre.shape[1])).any():
            raise ValueError(f"lengths={values.tolist()} must lie in [0, {k_pre.shape[1]}]")
    return _pool(k_pre, lengths, boundary=boundary)


def derive_head_mask_type(
    z: Int[Array, "B K"], retrieval_mode: str, toggle_type: str, group_size: int
) -> Int[Array, "B N"]:
    """Router decisions per KV head -> Block-Sparse-Attention mode codes per query head.

    `where(z == 1, code[retrieval_mode], code[toggle_type])` with codes full 0, xattn 1,
    streaming -1, repeated `group_size` times along the head axis (query head n <- KV head
    `n // group_size`). Supported `(retrieval_mode, toggle_type)` pairs: (full, xattn),
    (full, streaming), (xattn, streaming), (xattn, xattn) (all 1) and (full, full) (all 0).

    Args:
      z: `[B, K]` integer router decisions in {0, 1}; 1 = retrieval (the code's convention).
      retrieval_mode: mode of z == 1 heads.
      toggle_type: mode of z == 0 heads.
      group_size: G = N // K, a positive int.

    Returns:
      `[B, N]` int32.

    Raises:
      ValueError: unknown mode names, z not `[B, K]` or not in {0, 1}, bad group size.
      TypeError: non-integer z.
      NotImplementedError: a known but unsupported pair (e.g. toggle_type "local" or "topk").
    """
    for name, mode in (("retrieval_mode", retrieval_mode), ("toggle_type", toggle_type)):
        if mode not in reference.KNOWN_MODES:
            raise ValueError(f"{name}={mode!r} must be one of {reference.KNOWN_MODES}")
    if (retrieval_mode, toggle_type) not in reference.SUPPORTED_PAIRS:
        raise NotImplementedError(
            f"(retrieval_mode, toggle_type)={(retrieval_mode, toggle_type)} is not supported; "
            f"supported pairs: {reference.SUPPORTED_PAIRS}")
    if not isinstance(group_size, (int, np.integer)) or group_size <= 0:
        raise ValueError(f"{group_size=} must be a positive int")
    z = jnp.asarray(z)
    _checks.check_integer("z", z)
    _checks.check_rank("z", z, 2, "B K")
    values = _concrete(z)
    if values is not None and not np.isin(values, (0, 1)).all():
        raise ValueError(f"z values {sorted(set(values.ravel().tolist()))} must be in (0, 1)")
    return reference.derive_head_mask_type(z, retrieval_mode, toggle_type, int(group_size))


def elastic_prefill_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    head_mask_type: Int[Array, "B N"],
    *,
    block_size: int = 128,
    stride: int = 16,
    threshold: float = xattention_reference.DEFAULT_THRESHOLD,
    norm: float = 1.0,
    chunk_size: int | None = None,
    estimate_fp8: bool = False,
    sink_blocks: int | Int[Array, " N"] = 1,
    local_blocks: int | Int[Array, " N"] = 16,
    q_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
    scale: float | None = None,
    implementation: str = "auto",
) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Elastic prefill: XAttention mask for mode-1 heads, then one block-sparse call for all heads.

    `xattn_estimate(q, k, ...)` gives the block mask (computed for every head; only mode-1 heads
    read it), then `block_sparse_attention(q, k, v, head_mask_type, mask, ...)`. Geometry, lengths
    and the masked-row contract are those of `attn.block_sparse.block_sparse_attention`.

    Args:
      q, k, v: `[B, T, N, H]`, `[B, S, K, H]`, `[B, S, K, Hv]` after RoPE.
      head_mask_type: `[B, N]` int32 modes (e.g. from `derive_head_mask_type`).
      block_size, stride, threshold, norm, chunk_size: XAttention parameters (`xattn_estimate`).
      estimate_fp8: the estimate on q and k rounded to e4m3 (`xattn_estimate(..., fp8=True)`:
        the fp8 tensor cores on a GPU; H100, N32 K8 H128, block 128, stride 16, density 0.1:
        19.8% / 18.7% of estimate + sparse at S64K / S128K against 25.5% / 26.1% in bf16, 99.7%
        of mask entries the same on random inputs).
      sink_blocks, local_blocks: streaming geometry (`ceil(sink_size / bs)`,
        `ceil(local_window_size / bs)`; 1 and 16 for the seed's 128 / 2048 tokens).
      q_lengths, kv_lengths: `[B]` int32 valid lengths.
      scale: softmax scale of the attention (default `H ** -0.5`).
      implementation: `"xla"` or `"auto"`.

    Returns:
      `(out [B, T, N, Hv] in q.dtype, lse [B, T, N] float32)`.

    Raises:
      ValueError, TypeError, NotImplementedError: as `xattn_estimate` and
        `block_sparse_attention`.
    """
    _, block_mask = xattn_estimate(
        q, k, block_size=block_size, stride=stride, threshold=threshold, norm=norm,
        chunk_size=chunk_size, q_lengths=q_lengths, kv_lengths=kv_lengths, fp8=estimate_fp8,
        implementation=implementation)
    return block_sparse_attention(
        q, k, v, head_mask_type, block_mask, block_size=block_size, sink_blocks=sink_blocks,
        local_blocks=local_blocks, q_lengths=q_lengths, kv_lengths=kv_lengths, scale=scale,
        implementation=implementation)
