"""Public XAttention estimate and threshold selection: validation once, then the backend.

`xattn_estimate` is an op (`attn._op`): the `xla` reference (jittable with static shapes) and a
Triton kernel for the scores and block sums (`attn/xattention/triton.py`, with the Mosaic GPU
score kernel inside its fp8 config; the threshold selection in a Triton kernel too), which `auto`
picks on a GPU where it supports the call. `find_blocks` is XLA only.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from attn import _checks
from attn._op import Backend, op
from attn.block_sparse.api import check_geometry
from attn.xattention import reference

# One compiled program per shape and configuration, also for eager callers.
# threshold and norm are traced: sweeping them reuses the compiled program.
_estimate = jax.jit(reference.xattn_estimate,
                    static_argnames=("block_size", "stride", "chunk_size"))
_find_blocks = jax.jit(reference.find_blocks)


def _check_threshold(threshold) -> None:
    if not isinstance(threshold, (int, float, np.floating)) or isinstance(threshold, bool):
        raise TypeError(f"threshold={threshold!r} must be a float")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"{threshold=} must lie in (0, 1]")


def _estimate_xla(*, q, k, block_size, stride, threshold, norm, chunk_size, q_lengths,
                  kv_lengths, fp8):
    if fp8:  # the same rounding as the kernel's, scored in float32
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        q = reference.dequantize_e4m3(
            *reference.quantize_e4m3(q, reference._lengths(q_lengths, t, b), stride), stride)
        k = reference.dequantize_e4m3(
            *reference.quantize_e4m3(k, reference._lengths(kv_lengths, s, b), stride), stride)
    return _estimate(
        q, k, block_size=block_size, stride=stride, threshold=jnp.float32(threshold),
        norm=jnp.float32(norm), chunk_size=chunk_size, q_lengths=q_lengths, kv_lengths=kv_lengths)


def _estimate_triton(*, chunk_size, fp8, config, **args):
    del chunk_size, fp8  # the kernel's memory is bounded by `config.scratch_bytes`; fp8: config's
    from attn.xattention import triton as kernel

    return kernel.xattn_estimate(**args, config=config)


def _triton_config(args):
    from attn.xattention import triton as kernel

    return kernel.FP8_CONFIG if args["fp8"] else kernel.Config()


def _tuning_key(args) -> str:
    return (f"H{args['q'].shape[-1]}-st{args['stride']}-bs{args['block_size']}-"
            f"{'fp8' if args['fp8'] else 'float'}")


_BACKENDS = (
    Backend(name="triton", run=_estimate_triton, supports="attn.xattention.triton:supports",
            config_type="attn.xattention.triton:Config", default_config=_triton_config,
            tuning_key=_tuning_key),
    Backend(name="xla", run=_estimate_xla, platforms=("cpu", "gpu")),
)


@op(name="xattn_estimate", backends=_BACKENDS)
def xattn_estimate(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    *,
    block_size: int = 128,
    stride: int = 16,
    threshold: float = reference.DEFAULT_THRESHOLD,
    norm: float = 1.0,
    chunk_size: int | None = None,
    q_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
    fp8: bool = False,
) -> tuple[Float[Array, "B N Tb Sb"], Bool[Array, "B N Tb Sb"]]:
    """XAttention block importance (antidiagonal strided scoring) and its threshold block mask.

    Per query head: reduced scores `A[m, r] = Σ_{i<st} q[m·st + st-1-i] · k[r·st + i]`, a causal
    softmax of `A / sqrt(H) / st / norm` per reduced row, probabilities summed into
    `block_size` tiles, then `find_blocks` (sink block 0 and the diagonal forced, other blocks by
    descending mass until `threshold` of the row is kept), block-causal clip and length trim. The
    mask is what `attn.block_sparse.block_sparse_attention` reads for mode-1 heads. Geometry as
    there: queries are the last `q_len` of `kv_len` keys, tiles query-local, key blocks absolute.

    Args:
      q: `[B, T, N, H]` queries after RoPE.
      k: `[B, S, K, H]` keys after RoPE; query head n reads KV head `n // (N // K)`.
      block_size: power of two, a multiple of `stride`; 128 for Block-Sparse-Attention parity.
      stride: antidiagonal stride (16 in the seed; 8 also common), `block_size % stride == 0`.
      threshold: τ in (0, 1] (0.9 in the paper and FD; the HF eval code hard-codes 0.8).
      norm: positive temperature divisor (1 in the seed).
      chunk_size: query tokens per step (memory only; results do not depend on it), a positive
        multiple of `block_size`. Default `max(min(max(2048, P), 2**28 // P), 2048)` with P the
        next power of two of S, as the original.
      q_lengths: `[B]` int32 valid queries per request (default T).
      kv_lengths: `[B]` int32 valid keys per request (default S).
      fp8: score q and k rounded to e4m3 (one power-of-two scale per head and `stride` tokens,
        `attn.xattention.reference.quantize_e4m3`): the kernel's GEMM then runs on the fp8 tensor
        cores (`triton.FP8_CONFIG`: on a Hopper GPU with full lengths the Mosaic GPU score
        kernel, `attn/xattention/mosaic.py`, else the Triton one with 128 x 256 score tiles; on
        the H100 ~1.5x / 1.65x the bf16 kernel at S64K / S128K, 99.7% of mask entries equal);
        `"xla"` scores the same rounded values in float32.
      implementation: `"xla"`, `"triton"` (one causal GEMM pass storing partial
        log-sum-exps per key block, then a small kernel combining them into block sums; scratch
        capped by `Config.scratch_bytes`; the selection in a third kernel; not differentiable:
        differentiating it raises a TypeError) or `"auto"` (the kernel on a GPU where it
        supports the call).
      config: an `attn.xattention.triton.Config` (names the Triton backend; its `fp8` must equal
        `fp8`); default: `triton.FP8_CONFIG` with `fp8`, else `triton.Config()`, and the tuning
        cache.

    Returns:
      `(block_sums [B, N, Tb, Sb] float32, block_mask [B, N, Tb, Sb] bool)`, `Tb = ceil(T /
      block_size)`, `Sb = ceil(S / block_size)`.

    Raises:
      ValueError: bad ranks or sizes, block size, stride, threshold, norm, chunk size, lengths,
        implementation name.
      TypeError: wrong dtypes, a non-bool `fp8`.
      NotImplementedError: a backend this op does not have; `"triton"` with head dims over 256
        (the reasons: `xattn_estimate.reasons("triton", q, k, ...)`).
    """
    check_geometry(q, k, block_size=block_size, q_lengths=q_lengths, kv_lengths=kv_lengths)
    _checks.check_positive("stride", stride)
    _checks.check_divisible("block_size", block_size, "stride", stride)
    _check_threshold(threshold)
    if not norm > 0:
        raise ValueError(f"{norm=} must be positive")
    if chunk_size is not None:
        _checks.check_positive("chunk_size", chunk_size)
        _checks.check_divisible("chunk_size", chunk_size, "block_size", block_size)
    return dict(q=q, k=k, block_size=block_size, stride=stride, threshold=threshold, norm=norm,
                chunk_size=chunk_size, q_lengths=q_lengths, kv_lengths=kv_lengths,
                fp8=_checks.check_flag("fp8", fp8))


def find_blocks(
    block_sums: Float[Array, "B N Tb Sb"],
    diagonal: Int[Array, "B Tb"] | None = None,
    *,
    threshold: float = reference.DEFAULT_THRESHOLD,
) -> Bool[Array, "B N Tb Sb"]:
    """Threshold block selection of XAttention (`find_blocks_chunked`, prefill, causal).

    Per row: key block 0 (sink) and the diagonal are always kept; the other blocks follow in
    descending mass while the mass kept *before* adding a block is `< threshold · row total`,
    i.e. the smallest prefix that reaches the threshold, the crossing block included. Blocks past
    the diagonal are then dropped (block causal). No length trimming.

    Args:
      block_sums: `[B, N, Tb, Sb]` non-negative block masses (e.g. from `xattn_estimate`).
      diagonal: `[B, Tb]` int32 diagonal block per query tile; default `r + Sb - Tb` (queries at
        the end of the keys, block-aligned).
      threshold: τ in (0, 1].

    Returns:
      `[B, N, Tb, Sb]` bool.

    Raises:
      ValueError: bad ranks or shapes, threshold out of range.
      TypeError: non-floating sums, non-integer diagonal, non-float threshold.
    """
    _checks.check_rank("block_sums", block_sums, 4, "B N Tb Sb")
    _checks.check_floating("block_sums", block_sums)
    _check_threshold(threshold)
    B, _, Tb, Sb = block_sums.shape
    if diagonal is None:
        diagonal = jnp.broadcast_to(jnp.arange(Tb, dtype=jnp.int32) + (Sb - Tb), (B, Tb))
    _checks.check_integer("diagonal", diagonal)
    if diagonal.shape != (B, Tb):
        raise ValueError(f"diagonal.shape={diagonal.shape} must be [B, Tb]={(B, Tb)}")
    return _find_blocks(block_sums, diagonal.astype(jnp.int32), threshold=jnp.float32(threshold))
