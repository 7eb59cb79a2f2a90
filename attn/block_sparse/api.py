"""Public block-sparse attention with per-head modes: validation once, then the chosen backend.

`block_sparse_attention` has the `xla` reference, a Triton kernel (`attn/block_sparse/triton.py`)
and a Mosaic GPU forward (`attn/block_sparse/mosaic.py`). The Triton kernel is differentiated by
the Triton backward (`attn/block_sparse/_triton_bwd.py`), the Mosaic one by the fused Mosaic
backward (`attn/block_sparse/mosaic_bwd.py`) at H == 128, else the Triton backward. `auto` picks a
kernel on a GPU. Values of traced arguments (modes, lengths, per-head sink / local counts) cannot
be checked under `jit`; they are checked when concrete, and traced lengths are clamped to `[0, T]`
/ `[0, S]` on every backend (`attn.debug_checks` turns them into run-time errors).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from attn import _checks
from attn._op import Backend, dtype_tag, op
from attn.block_sparse import reference

_MODES = (reference.MODE_STREAMING, reference.MODE_FULL, reference.MODE_BLOCK_SPARSE)

# One compiled program per shape, also for eager callers (op-by-op dispatch is slow on a CPU).
_attention = jax.jit(reference.block_sparse_attention, static_argnames=("block_size", "scale"))
_effective_block_mask = jax.jit(
    reference.effective_block_mask, static_argnames=("num_q_tokens", "num_kv_tokens", "block_size"))


def _per_head(x, num_heads: int) -> Int[Array, " N"]:
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (num_heads,))


def _check_head_mask_type(head_mask_type, batch: int, num_heads: int) -> None:
    _checks.check_integer("head_mask_type", head_mask_type)
    if head_mask_type.shape != (batch, num_heads):
        raise ValueError(f"head_mask_type.shape={head_mask_type.shape} must be [B, N]="
                         f"{(batch, num_heads)}")
    values = _checks.concrete(head_mask_type)
    if values is not None and not np.isin(values, _MODES).all():
        bad = sorted(set(values[~np.isin(values, _MODES)].tolist()))
        raise ValueError(f"head_mask_type values {bad} must be in {_MODES} "
                         "(0 full, 1 block-sparse, -1 streaming)")


def _check_blocks_count(name: str, value, num_heads: int) -> None:
    if isinstance(value, (int, np.integer)):
        _checks.check_int32_value(name, int(value))
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
        return
    value = jnp.asarray(value)
    _checks.check_integer(name, value)
    if value.shape != (num_heads,):
        raise ValueError(f"{name}.shape={value.shape} must be an int or [N]=({num_heads},)")
    _checks.check_range(name, value, 0)


def _check_lengths(name: str, lengths, batch: int, limit: int) -> None:
    """Concrete lengths in `[0, limit]`; traced ones are clamped there (checked mode: error)."""
    if lengths is None:
        return
    _checks.check_integer(name, lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"{name}.shape={lengths.shape} must be [B]=({batch},)")
    _checks.check_range(name, lengths, 0, limit)


def check_geometry(q, k, *, block_size: int, q_lengths=None, kv_lengths=None) -> None:
    """Validate q [B, T, N, H], k [B, S, K, H], the block size and the lengths (shared checks)."""
    _checks.check_rank("q", q, 4, "B T N H")
    _checks.check_rank("k", k, 4, "B S K H")
    _checks.check_floating("q", q)
    _checks.check_floating("k", k)
    _checks.check_same("q batch", q.shape[0], "k batch", k.shape[0])
    _checks.check_same("q head dim", q.shape[3], "k head dim", k.shape[3])
    _checks.check_divisible("num_heads", q.shape[2], "num_kv_heads", k.shape[2])
    _checks.check_power_of_two("block_size", block_size)
    for name, x in (("q", q), ("k", k)):
        _checks.check_int32_addressable(name, x.shape)
    _check_lengths("q_lengths", q_lengths, q.shape[0], q.shape[1])
    _check_lengths("kv_lengths", kv_lengths, q.shape[0], k.shape[1])


def _check_block_mask(block_mask, shape) -> None:
    if block_mask is None:
        return
    if jnp.dtype(block_mask.dtype) != jnp.dtype(bool):
        raise TypeError(f"block_mask.dtype={block_mask.dtype} must be bool")
    if block_mask.shape != shape:
        raise ValueError(f"block_mask.shape={block_mask.shape} must be [B, N, ceil(T/block_size), "
                         f"ceil(S/block_size)]={shape}")


def effective_block_mask(
    head_mask_type: Int[Array, "B N"],
    block_mask: Bool[Array, "B N Tb Sb"] | None = None,
    *,
    num_q_tokens: int,
    num_kv_tokens: int,
    block_size: int = 128,
    sink_blocks: int | Int[Array, " N"] = 1,
    local_blocks: int | Int[Array, " N"] = 16,
    q_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
) -> Bool[Array, "B N Tb Sb"]:
    """The key blocks each (request, query head, query tile) visits; shared by kernels and tests.

    Dense rows: blocks `0..d(r)`; block-sparse rows: the `block_mask` row clipped to `<= d(r)`;
    streaming rows: `{d(r) - local_blocks < j <= d(r)} ∪ {j < sink_blocks}`, with the diagonal
    `d(r) = r + ceil((kv_len - q_len) / block_size)`. Blocks past `ceil(kv_len / block_size)` and
    tiles past `ceil(q_len / block_size)` are dropped. Inside a visited block the token-level
    causal and length rules still apply (see `attn.block_sparse.reference`).

    Args:
      head_mask_type: `[B, N]` int32 modes: 0 full, 1 block-sparse, -1 streaming.
      block_mask: `[B, N, Tb, Sb]` bool (`Tb = ceil(T / block_size)`, `Sb = ceil(S /
        block_size)`), read only for mode-1 heads. None: no block-sparse heads.
      num_q_tokens: T, the (padded) query length.
      num_kv_tokens: S, the (padded) key length.
      block_size: a power of two; 128 for parity with Block-Sparse-Attention.
      sink_blocks: sink blocks of streaming heads, an int or `[N]` int32.
      local_blocks: local blocks, diagonal included, an int or `[N]` int32.
      q_lengths: `[B]` int32 valid queries per request (default T).
      kv_lengths: `[B]` int32 valid keys per request (default S).

    Returns:
      `[B, N, Tb, Sb]` bool.

    Raises:
      ValueError: bad shapes, modes, counts, lengths or block size; mode-1 heads without a mask.
      TypeError: non-integer modes / counts / lengths, non-bool block mask.
    """
    head_mask_type = jnp.asarray(head_mask_type)
    if head_mask_type.ndim != 2:
        raise ValueError(f"head_mask_type must have shape [B, N]; got {head_mask_type.shape}")
    B, N = head_mask_type.shape
    _check_head_mask_type(head_mask_type, B, N)
    _checks.check_power_of_two("block_size", block_size)
    _checks.check_positive("num_q_tokens", num_q_tokens)
    _checks.check_positive("num_kv_tokens", num_kv_tokens)
    shape = (B, N, -(-num_q_tokens // block_size), -(-num_kv_tokens // block_size))
    _check_block_mask(block_mask, shape)
    _check_sparse_has_mask(head_mask_type, block_mask)
    _check_blocks_count("sink_blocks", sink_blocks, N)
    _check_blocks_count("local_blocks", local_blocks, N)
    _check_lengths("q_lengths", q_lengths, B, num_q_tokens)
    _check_lengths("kv_lengths", kv_lengths, B, num_kv_tokens)
    return _effective_block_mask(
        head_mask_type.astype(jnp.int32), block_mask, num_q_tokens=num_q_tokens,
        num_kv_tokens=num_kv_tokens, block_size=block_size,
        sink_blocks=_per_head(sink_blocks, N), local_blocks=_per_head(local_blocks, N),
        q_lengths=q_lengths, kv_lengths=kv_lengths)


def _check_sparse_has_mask(head_mask_type, block_mask) -> None:
    values = _checks.concrete(head_mask_type)
    if block_mask is None and values is not None and (values == reference.MODE_BLOCK_SPARSE).any():
        raise ValueError("head_mask_type has block-sparse heads (mode 1) but block_mask=None")


def _attention_xla(*, head_mask_type, sink_blocks, local_blocks, **args):
    n = head_mask_type.shape[1]
    return _attention(head_mask_type=head_mask_type, sink_blocks=_per_head(sink_blocks, n),
                      local_blocks=_per_head(local_blocks, n), **args)


def _tuning_key(args) -> str:
    return f"H{args['q'].shape[-1]}-bs{args['block_size']}{dtype_tag(args['q'])}"


def _triton_config(args):
    from attn.block_sparse import triton

    return triton.default_config(args["q"].shape[-1], args["v"].shape[-1],
                                 jnp.dtype(args["q"].dtype).itemsize)


# `block_sparse_attention`'s backends, in `auto`'s order of preference on a GPU; both kernels'
# gradients go through `triton.differentiable` (the Mosaic one's fused where it runs).
_BACKENDS = (
    Backend(name="mosaic", run="attn.block_sparse.mosaic:block_sparse_attention",
            supports="attn.block_sparse.mosaic:supports",
            config_type="attn.block_sparse.mosaic:Config",
            default_config="attn.block_sparse.mosaic:default_config"),
    Backend(name="triton", run="attn.block_sparse.triton:block_sparse_attention",
            supports="attn.block_sparse.triton:supports",
            config_type="attn.block_sparse.triton:Config", default_config=_triton_config,
            tuning_key=_tuning_key),
    Backend(name="xla", run=_attention_xla, platforms=("cpu", "gpu")),
)


@op(name="block_sparse_attention", backends=_BACKENDS)
def block_sparse_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    head_mask_type: Int[Array, "B N"],
    block_mask: Bool[Array, "B N Tb Sb"] | None = None,
    *,
    block_size: int = 128,
    sink_blocks: int | Int[Array, " N"] = 1,
    local_blocks: int | Int[Array, " N"] = 16,
    q_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
    scale: float | None = None,
) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Causal prefill attention with a mode per request and query head (Block-Sparse-Attention).

    Query `t` of request b sits at key position `kv_len - q_len + t` (chunked prefill: the
    queries are the last `q_len` of `kv_len` keys). Key `s` is visible to query `t` of head n iff
    `effective_block_mask(...)[b, n, t // bs, s // bs]`, `s <= kv_len - q_len + t`, `s < kv_len`
    and `t < q_len`. GQA reads KV head `n // (N // K)`; nothing is expanded. All query heads of a
    GQA group usually share one mode (`attn.elastic.derive_head_mask_type`), but any per-head
    modes are accepted, as in the CUDA kernel.

    Args:
      q: `[B, T, N, H]` queries (after RoPE).
      k: `[B, S, K, H]` keys (after RoPE).
      v: `[B, S, K, Hv]` values.
      head_mask_type: `[B, N]` int32 modes: 0 full, 1 block-sparse, -1 streaming.
      block_mask: `[B, N, ceil(T/bs), ceil(S/bs)]` bool; rows of mode-1 heads are used, others
        ignored (e.g. `attn.xattention.xattn_estimate`'s mask). May be None without mode-1 heads.
      block_size: power of two; 128 means parity with Block-Sparse-Attention, whose tile grid is
        fixed at 128. Smaller sizes give the same semantics on a finer grid (tests).
      sink_blocks: sink blocks of streaming heads, int or `[N]` int32 (`ceil(sink_size / bs)`).
      local_blocks: local blocks (diagonal included) of streaming heads, int or `[N]` int32.
      q_lengths: `[B]` int32 valid queries per request; rows past it give 0 / -inf. Default T.
      kv_lengths: `[B]` int32 valid keys per request; keys past it are never read. Default S.
      scale: softmax scale; default `H ** -0.5`.
      implementation: `"xla"`, `"triton"` (`attn/block_sparse/triton.py`: visits only the selected
        key blocks; its gradient the Triton backward, which does too), `"mosaic"`
        (`attn/block_sparse/mosaic.py`: the same on Hopper through Mosaic GPU; T == S, full
        lengths, block 128; its gradient the fused Mosaic backward at H == 128) or `"auto"` (on
        a GPU the first of mosaic, triton that takes the shapes, XLA where neither does).
      config: a launch config of the backend it names (`attn.block_sparse.triton.Config`, or
        `attn.block_sparse.mosaic.Config`); default: the backend's heuristic and the tuning
        cache.

    Returns:
      `(out [B, T, N, Hv] in q.dtype, lse [B, T, N] float32)`. A row with no visible key gives
      output 0 and lse -inf.

    Raises:
      ValueError: bad ranks, shapes, modes, counts, lengths, block size or implementation name.
      TypeError: wrong dtypes.
      NotImplementedError: a backend this op does not have, or one whose `supports` gives
        reasons (`"triton"`: head dims over 256, block sizes under 16).
    """
    check_geometry(q, k, block_size=block_size, q_lengths=q_lengths, kv_lengths=kv_lengths)
    _checks.check_rank("v", v, 4, "B S K Hv")
    _checks.check_floating("v", v)
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v.shape={v.shape} must match k.shape={k.shape} in [B, S, K]")
    _checks.check_int32_addressable("v", v.shape)
    B, T, N, _ = q.shape
    S = k.shape[1]
    head_mask_type = jnp.asarray(head_mask_type)
    _check_head_mask_type(head_mask_type, B, N)
    _check_block_mask(block_mask, (B, N, -(-T // block_size), -(-S // block_size)))
    _check_sparse_has_mask(head_mask_type, block_mask)
    _check_blocks_count("sink_blocks", sink_blocks, N)
    _check_blocks_count("local_blocks", local_blocks, N)
    scale = _checks.check_scale(scale)
    return dict(q=q, k=k, v=v, head_mask_type=head_mask_type.astype(jnp.int32),
                block_mask=block_mask, block_size=block_size, sink_blocks=sink_blocks,
                local_blocks=local_blocks, q_lengths=q_lengths, kv_lengths=kv_lengths,
                scale=None if scale is None else float(scale))


def replace_ones_with_count(head_mask_type: Int[Array, "*B N"]) -> Int[Array, "*B N"]:
    """BSA input format: each mode 1 becomes its 1-based rank among mode-1 heads (last axis).

    `[1, 0, 1, -1, 1] -> [1, 0, 2, -1, 3]`. The CUDA kernel then reads `base_blockmask[b, rank -
    1]`, so `base_blockmask` must hold exactly the mode-1 heads in increasing head order.

    Raises:
      TypeError: non-integer input.
      ValueError: a scalar input.
    """
    head_mask_type = jnp.asarray(head_mask_type)
    _checks.check_integer("head_mask_type", head_mask_type)
    if head_mask_type.ndim < 1:
        raise ValueError(f"head_mask_type must have a head axis; got shape {head_mask_type.shape}")
    return reference.replace_ones_with_count(head_mask_type)


def convert_blockmask_row_reverse(block_mask: Bool[Array, "*R Sb"]) -> Int[Array, "*R Sb"]:
    """BSA input format: bool rows -> int32 rows of selected key blocks, descending, -1 padded.

    `[True, False, True, True] -> [3, 2, 0, -1]` (the kernel binary-searches it).

    Raises:
      TypeError: a non-bool mask.
      ValueError: a scalar input.
    """
    block_mask = jnp.asarray(block_mask)
    if jnp.dtype(block_mask.dtype) != jnp.dtype(bool):
        raise TypeError(f"block_mask.dtype={block_mask.dtype} must be bool")
    if block_mask.ndim < 1:
        raise ValueError(f"block_mask must have a block axis; got shape {block_mask.shape}")
    return reference.convert_blockmask_row_reverse(block_mask)
