"""Public paged decode attention: validation once, then the chosen backend."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from attn import _checks
from attn._op import Backend, op
from attn.merge import merge_partials
from attn.paged_decode import reference

FP8 = jnp.dtype(jnp.float8_e4m3fn)
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)

# jit once here so eager callers (notebooks, tests) do not dispatch op by op; inside a caller's jit
# these are inlined. `paged_decode` shares the partials' compilation with `paged_decode_partials`.
_partials_xla = jax.jit(reference.paged_decode_partials, static_argnames=("num_splits", "scale"))


@functools.partial(jax.jit, static_argnames=("dtype",))
def _finish(o, lse, dtype):
    """One split: take it; several: `attn.merge.merge_partials`. Output in `dtype`."""
    if o.shape[2] == 1:
        out, lse = o[:, :, 0], lse[:, :, 0]
    else:
        out, lse = merge_partials(o, lse, implementation="xla")
    return out.astype(dtype), lse


def check_pool(name: str, pages, scales, scales_name: str) -> int:
    """Validate one page pool (and its fp8 scales); return its sub-block size (0 if not fp8)."""
    _checks.check_rank(name, pages, 4, "K, num_pages, P, " + ("Hv" if name == "v_pages" else "H"))
    if jnp.dtype(pages.dtype) == FP8:
        if scales is None:
            raise ValueError(f"{name}.dtype={pages.dtype} needs {scales_name} "
                             f"[K, num_pages, P // sub_block] float32")
    elif scales is not None:
        raise ValueError(f"{scales_name} given but {name}.dtype={pages.dtype} is not {FP8}")
    else:
        _checks.check_dtype(name, pages, _FLOATS + (FP8,))
        return 0
    _checks.check_dtype(scales_name, scales, (jnp.float32,))
    num_kv, num_pages, page, _ = pages.shape
    _checks.check_rank(scales_name, scales, 3, "K, num_pages, P // sub_block")
    if scales.shape[:2] != (num_kv, num_pages):
        raise ValueError(f"{scales_name}.shape={scales.shape} must start with "
                         f"[K, num_pages]={(num_kv, num_pages)}")
    n_sub = scales.shape[2]
    if n_sub <= 0 or page % n_sub:
        raise ValueError(f"{scales_name}.shape[2]={n_sub} (P // sub_block) must divide the page "
                         f"size P={page}")
    return page // n_sub


def _check_per_head(name: str, value, num_kv: int, *, non_negative: bool, batch: int):
    """None, a Python int, a `[K]` or a `[B, K]` int32 array; returned as a `[K]` or `[B, K]`
    int32 array."""
    if value is None:
        return reference.per_head(None, num_kv)
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be None, an int or a [K] int32 array")
    if isinstance(value, int):
        if non_negative and value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
        if not -(2**31) <= value < 2**31:
            raise ValueError(f"{name}={value} does not fit int32")
        return reference.per_head(value, num_kv)
    if not hasattr(value, "dtype"):
        raise TypeError(f"{name}={value!r} must be None, an int or a [K] int32 array")
    _checks.check_dtype(name, value, (jnp.int32,))
    if value.shape not in ((num_kv,), (batch, num_kv)):
        raise ValueError(f"{name}.shape={value.shape} must be [K]=({num_kv},) or "
                         f"[B, K]={(batch, num_kv)}")
    if non_negative:
        _checks.check_range(name, value, 0)
    return jnp.asarray(value)


def _validate(q, k_pages, v_pages, block_tables, kv_lengths, *, scale, window, sinks, k_scales,
              v_scales, num_splits) -> dict:
    """Shared validation; returns the arguments normalised (scale a float or None, window and
    sinks `[K]` or `[B, K]` int32)."""
    _checks.check_rank("q", q, 3, "B, N, H")
    _checks.check_dtype("q", q, _FLOATS)
    check_pool("k_pages", k_pages, k_scales, "k_scales")
    check_pool("v_pages", v_pages, v_scales, "v_scales")
    _checks.check_rank("block_tables", block_tables, 3, "B, K, max_pages")
    _checks.check_dtype("block_tables", block_tables, (jnp.int32,))
    _checks.check_rank("kv_lengths", kv_lengths, 1, "B")
    _checks.check_dtype("kv_lengths", kv_lengths, (jnp.int32,))
    batch, num_heads, head_dim = q.shape
    num_kv, num_pages, page, k_dim = k_pages.shape
    if v_pages.shape[:3] != (num_kv, num_pages, page):
        raise ValueError(f"v_pages.shape={v_pages.shape} must start with k_pages' "
                         f"[K, num_pages, P]={(num_kv, num_pages, page)}")
    _checks.check_same("q.shape[-1] (H)", head_dim, "k_pages.shape[-1]", k_dim)
    _checks.check_positive("page size P", page)
    _checks.check_positive("num_pages", num_pages)
    _checks.check_divisible("num_heads N", num_heads, "num_kv_heads K", num_kv)
    if block_tables.shape[:2] != (batch, num_kv):
        raise ValueError(f"block_tables.shape={block_tables.shape} must be "
                         f"[B, K, max_pages] with [B, K]={(batch, num_kv)}")
    _checks.check_same("kv_lengths.shape[0] (B)", kv_lengths.shape[0], "q.shape[0]", batch)
    _checks.check_int32_addressable("k_pages", k_pages.shape)
    _checks.check_int32_addressable("v_pages", v_pages.shape)
    _checks.check_int32_addressable("block_tables token positions (max_pages * P)",
                                    (block_tables.shape[2], page))
    _checks.check_positive_int("num_splits", num_splits)
    scale = _checks.check_scale(scale)
    # Concrete lengths are checked now; traced ones are clamped to [0, max_pages * P] (checked
    # mode: run-time error). Table ids are data: an id outside [0, num_pages) is an absent page.
    _checks.check_range("kv_lengths", kv_lengths, 0, block_tables.shape[2] * page)
    _checks.check_table_ids("block_tables", block_tables, num_pages)
    window = _check_per_head("window", window, num_kv, non_negative=False, batch=batch)
    sinks = _check_per_head("sinks", sinks, num_kv, non_negative=True, batch=batch)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, block_tables=block_tables,
                kv_lengths=kv_lengths, scale=scale, window=window, sinks=sinks, k_scales=k_scales,
                v_scales=v_scales, num_splits=num_splits)


def _paged_decode_xla(*, q, num_splits, **args):
    o, lse = _partials_xla(q, num_splits=num_splits, **args)
    return _finish(o, lse, jnp.dtype(q.dtype))


def _paged_decode_triton(*, q, k_pages, v_pages, block_tables, kv_lengths, scale, num_splits,
                         config, **args):
    del num_splits  # the kernel's split count is its config's
    from attn.paged_decode import triton as kernel

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return kernel.paged_decode(q, k_pages, v_pages, block_tables, kv_lengths, scale=scale,
                               config=config, **args)


def _triton_config(args):
    from attn.paged_decode import triton as kernel

    q, pages, tables = args["q"], args["k_pages"], args["block_tables"]
    return kernel.default_config(q.shape[0], pages.shape[0], tables.shape[-1] * pages.shape[2],
                                 fp8=args["k_scales"] is not None,
                                 row_bytes=kernel.row_bytes(pages, args["v_pages"]))


_BACKENDS = (
    Backend(name="triton", run=_paged_decode_triton, config_type="attn.paged_decode.triton:Config",
            default_config=_triton_config,
            tuning_key=lambda args: f"B{args['q'].shape[0]}-K{args['k_pages'].shape[0]}-"
                                    f"{'fp8' if args['k_scales'] is not None else 'float'}"),
    Backend(name="xla", run=_paged_decode_xla, platforms=("cpu", "gpu")),
)


def paged_decode_partials(
    q: Float[Array, "B N H"],
    k_pages: Array,
    v_pages: Array,
    block_tables: Int[Array, "B K M"],
    kv_lengths: Int[Array, " B"],
    *,
    num_splits: int,
    scale: float | None = None,
    window: int | Int[Array, "*B K"] | None = None,
    sinks: int | Int[Array, "*B K"] = 0,
    k_scales: Float[Array, "K num_pages C"] | None = None,
    v_scales: Float[Array, "K num_pages C"] | None = None,
) -> tuple[Float[Array, "B N J Hv"], Float[Array, "B N J"]]:
    """Split-KV partials of paged decode attention (`J = num_splits`); XLA only (the kernel's
    splits are its own, so its partials are not comparable).

    Row `b`'s key range is cut into `num_splits` contiguous, page-aligned pieces of
    `ceil(ceil(kv_lengths[b] / J) / P) * P` keys (the last pieces may be short or empty); each
    split is attended on its own. `attn.merge.merge_partials` of the result equals `paged_decode`.

    Args: as `paged_decode`.

    Returns:
      `(o [B, N, J, Hv] float32, lse [B, N, J] float32)`; a split without visible keys gives 0 and
      -inf.

    Raises: as `paged_decode`.
    """
    args = _validate(q, k_pages, v_pages, block_tables, kv_lengths, scale=scale, window=window,
                     sinks=sinks, k_scales=k_scales, v_scales=v_scales, num_splits=num_splits)
    return _partials_xla(**args)


@op(name="paged_decode", backends=_BACKENDS)
def paged_decode(
    q: Float[Array, "B N H"],
    k_pages: Array,
    v_pages: Array,
    block_tables: Int[Array, "B K M"],
    kv_lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
    window: int | Int[Array, "*B K"] | None = None,
    sinks: int | Int[Array, "*B K"] = 0,
    k_scales: Float[Array, "K num_pages C"] | None = None,
    v_scales: Float[Array, "K num_pages C"] | None = None,
    num_splits: int = 1,
) -> tuple[Float[Array, "B N Hv"], Float[Array, "B N"]]:
    """Decode attention of one query token per row over head-major pages and per-head tables.

    Query head `n` uses KV head `n // (N // K)`. Token `s` of row `b` for KV head `k` lives at
    `pages[k, block_tables[b, k, s // P], s % P]`; the query sits at position `kv_lengths[b] - 1`.
    Key `s` is visible iff `s < kv_lengths[b]`, its page entry names a page of the pool
    (`0 <= id < num_pages`; -1 = unallocated, and any other id is absent too), and it is inside
    the head's window (`s > kv_lengths[b] - 1 - window[k]`, or `window[k] <= 0`) or among its sinks
    (`s < sinks[k]`). Absent entries are never read (mapped to the null page 0 and masked).
    Tokens past `max_pages * P` do not exist: a traced length past the table is clamped to it
    (the query keeps position `kv_lengths[b] - 1` for the window); a negative one is an empty row.
    Concrete lengths must lie in `[0, max_pages * P]`. Identical on every backend; NaN in a
    visible key or value comes out as NaN.

    Args:
      q: `[B, N, H]` decode queries (float32, bfloat16 or float16).
      k_pages: `[K, num_pages, P, H]` key pages: float, or `float8_e4m3fn` with `k_scales`.
      v_pages: `[K, num_pages, P, Hv]` value pages: float, or `float8_e4m3fn` with `v_scales`.
      block_tables: `[B, K, max_pages]` int32 per-head page ids (uniform tables repeat one row);
        -1 = not allocated; page 0 is the reserved null page.
      kv_lengths: `[B]` int32 tokens in the cache, the decode token included; 0 = padding row.
      scale: score scale; default `H ** -0.5`.
      window: None, an int, `[K]` or `[B, K]` int32: most recent positions visible, the query's own
        included; `<= 0` means full attention (for that head).
      sinks: an int >= 0, `[K]` or `[B, K]` int32: the first `sinks` positions stay visible.
      k_scales, v_scales: `[K, num_pages, P // sub_block]` float32 block-wise fp8 scales
        (`kv.fp8` layout), required exactly when the matching pages are fp8; the pages are
        dequantised inside.
      num_splits: split the key range into this many pieces (split-KV) and merge them with
        `attn.merge.merge_partials`; the result equals the unsplit one up to rounding.
        Applies to the XLA backend; the Triton kernel's split count is its config's.
      implementation: `"xla"`, `"triton"` (forward only: differentiating it raises a TypeError
        that says so) or `"auto"` (the Triton kernel on a GPU).
      config: an `attn.paged_decode.triton.Config` (names the Triton backend); default:
        `attn.paged_decode.triton.default_config` and the tuning cache. Splits change the
        result only by rounding.

    Returns:
      `(out [B, N, Hv] in q.dtype, lse [B, N] float32)`, natural-log log-sum-exp of the scaled
      scores. A row without visible keys (length 0) gives exactly 0 and -inf.

    Raises:
      ValueError: ranks, shapes or sizes inconsistent (H, K, P, num_pages, B, N % K, scale shapes,
        sub_block not dividing P, fp8 pages without scales or scales without fp8 pages,
        num_splits < 1, sinks < 0, scale not finite and positive, concrete lengths outside
        `[0, max_pages * P]`, window / sinks outside int32, shapes overflowing int32 addressing,
        unknown implementation). In the checked mode (`attn.debug_checks`), traced lengths
        outside that range and table ids outside `[-1, num_pages)` fail at run time.
      TypeError: dtypes (tables and kv_lengths must be int32; pages float or e4m3; scales float32;
        window / sinks int or int32 arrays).
      NotImplementedError: an implementation this op does not have.
    """
    return _validate(q, k_pages, v_pages, block_tables, kv_lengths, scale=scale, window=window,
                     sinks=sinks, k_scales=k_scales, v_scales=v_scales, num_splits=num_splits)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _gather_xla(pages, block_tables, scales, dtype):
    return reference.gather_pages(pages, block_tables, scales, dtype=dtype)


def gather_pages(
    pages: Array,
    block_tables: Int[Array, "B K M"],
    scales: Float[Array, "K num_pages C"] | None = None,
    *,
    dtype=None,
) -> Float[Array, "B S K H"]:
    """Read every row's tokens through its per-head table into dense `[B, S = M * P, K, H]`.

    -1 entries read the null page 0 (mask those tokens, and tokens past each row's length). With
    fp8 pages, pass their `scales` to get the dequantised copy.

    Args:
      pages: `[K, num_pages, P, H]` pages (float, or `float8_e4m3fn` with `scales`).
      block_tables: `[B, K, M]` int32.
      scales: `[K, num_pages, P // sub_block]` float32, exactly when `pages` are fp8.
      dtype: output dtype; default float32 for fp8 pages, else `pages.dtype`.

    Returns:
      `[B, M * P, K, H]` token-major keys or values, the layout `attn.dense` takes.

    Raises:
      ValueError / TypeError: as `paged_decode` for the pool, the table and the scales.
    """
    check_pool("pages", pages, scales, "scales")
    _checks.check_rank("block_tables", block_tables, 3, "B, K, max_pages")
    _checks.check_dtype("block_tables", block_tables, (jnp.int32,))
    _checks.check_same("block_tables.shape[1] (K)", block_tables.shape[1], "pages.shape[0]",
                       pages.shape[0])
    _checks.check_int32_addressable(
        "gathered pages", (block_tables.shape[0], block_tables.shape[2]) + pages.shape[::2]
        + pages.shape[3:])
    if dtype is not None:
        dtype = _checks.check_float_dtype("dtype", dtype)
    return _gather_xla(pages, block_tables, scales, dtype)
