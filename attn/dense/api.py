"""Public dense attention: validation once, then the backend (XLA, or the Triton flash kernel).

Semantics (conventions shared by every variant):

- Query `t` of batch row `b` sits at position `q_offset[b] + t` of the key sequence; key `s` at `s`.
- Causal: key `s` is visible iff `s <= q_pos`.
- Sliding window: `window` = number of most recent positions visible, the query's own included
  (`q_pos - window < s`); keys `s < sinks` stay visible as well (causality still applies to
  them). Per-KV-head `window` / `sinks` are `[K]` int32 arrays; a window value `<= 0` means the
  full causal range for that head. A window needs `causal=True`; sinks without one change nothing.
- Segment ids (packed sequences): a query sees only keys with its own id. Causality and the window
  use the packed token index, which is right when q and kv are the same packed sequence with
  `q_offset == 0`; sinks count from the start of the packed row. For per-sequence positions (and
  per-sequence sinks), use `attention_varlen`.
- `kv_lengths[b]`: keys `s >= kv_lengths[b]` are invisible.
- A query that sees no key gets output exactly 0 and lse -inf; gradients stay finite.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from attn import _checks
from attn._op import Backend, dtype_tag, op
from attn.dense import reference
from attn.paged_decode.api import check_pool

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)

# jit once here so eager callers (notebooks, tests) do not dispatch op by op; inside a caller's jit
# these are inlined. The wrappers below pass every optional mask argument as an array (an absent
# window is all zeros, absent segment ids are all equal, absent lengths are S) and the scale as a
# traced scalar, so one compilation per shape serves every option: `causal` and `softcap` are
# static.
_attention = jax.jit(reference.attention, static_argnames=("causal", "softcap"))
_masked_attention = jax.jit(reference.masked_attention)
_attention_varlen = jax.jit(reference.attention_varlen, static_argnames=("causal",))
_visible_mask = jax.jit(reference.visible_mask, static_argnums=(0, 1, 2, 3),
                        static_argnames=("causal",))


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool | np.bool_)


def _check_int_array(name: str, x, shape: tuple[int, ...], letters: str) -> None:
    _checks.check_integer(name, x)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape [{letters}] = {list(shape)}; got {x.shape}")


def _per_head_arg(name: str, x, num_kv_heads: int, *, non_negative: bool = False):
    """An int or a `[K]` integer array, as given to `window` / `sinks`; returns a `[K]` array.
    Ints must fit int32; with `non_negative`, ints and concrete arrays must be >= 0 (traced
    arrays: the checked mode)."""
    if _is_int(x):
        _checks.check_int32_value(name, int(x))
        if non_negative and x < 0:
            raise ValueError(f"{name}={x} must be >= 0")
        return np.full((num_kv_heads,), int(x), np.int32)
    if _is_array(x):
        _check_int_array(name, x, (num_kv_heads,), "K")
        if non_negative:
            _checks.check_range(name, x, 0)
        return x
    raise TypeError(f"{name}={x!r} (type {type(x).__name__}) must be an int or an integer array "
                    f"of shape [K]")


def _check_scale(scale, head_dim: int) -> np.float32:
    """A python number or None (`H ** -0.5`) as a float32 scalar (traced: no recompilation).
    The rule of every op and backend (`_checks.check_scale`): finite and positive."""
    scale = _checks.check_scale(scale)
    return np.float32(head_dim**-0.5 if scale is None else scale)


def _check_window_sinks(window, sinks, num_kv_heads: int, *, causal: bool):
    """Validate `window` / `sinks`; return both as `[K]` arrays (no window: all 0, i.e. full)."""
    if window is None:
        window = 0
    elif not causal:
        raise ValueError("window needs causal=True (the window counts back from the query)")
    window = _per_head_arg("window", window, num_kv_heads)
    return window, _per_head_arg("sinks", sinks, num_kv_heads, non_negative=True)


def _check_mask_args(
    batch, q_len, kv_len, num_kv_heads, *, causal, q_offset, window, sinks, q_segment_ids,
    kv_segment_ids, kv_lengths,
) -> dict:
    """Validate the mask arguments of `attention` / `visible_mask`; return them normalised."""
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal={causal!r} must be a bool")
    if _is_int(q_offset):
        if q_offset < 0:
            raise ValueError(f"q_offset={q_offset} must be >= 0")
        if causal and q_offset + q_len > kv_len:
            raise ValueError(f"q_offset={q_offset} + T={q_len} queries run past the S={kv_len} "
                             f"keys; causal queries must lie inside the key sequence")
    elif _is_array(q_offset):
        _check_int_array("q_offset", q_offset, (batch,), "B")
        _checks.check_range("q_offset", q_offset, 0)
        if causal and q_len > kv_len:
            raise ValueError(f"T={q_len} causal queries cannot fit in S={kv_len} keys")
    else:
        raise TypeError(f"q_offset={q_offset!r} (type {type(q_offset).__name__}) must be an int "
                        f"or an integer array of shape [B]")
    window, sinks = _check_window_sinks(window, sinks, num_kv_heads, causal=causal)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither; got "
                         f"q_segment_ids={'None' if q_segment_ids is None else 'array'}, "
                         f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}")
    if q_segment_ids is None:
        q_segment_ids = np.zeros((batch, q_len), np.int32)
        kv_segment_ids = np.zeros((batch, kv_len), np.int32)
    _check_int_array("q_segment_ids", q_segment_ids, (batch, q_len), "B T")
    _check_int_array("kv_segment_ids", kv_segment_ids, (batch, kv_len), "B S")
    if kv_lengths is None:
        kv_lengths = np.full((batch,), kv_len, np.int32)
    _check_int_array("kv_lengths", kv_lengths, (batch,), "B")
    # Concrete lengths in [0, S]; traced ones are clamped there (checked mode: run-time error).
    _checks.check_range("kv_lengths", kv_lengths, 0, kv_len)
    if _is_int(q_offset):
        q_offset = np.full((batch,), q_offset, np.int32)
    # Defaults are numpy, given arrays pass through (the reference casts them inside the jit):
    # no eager op, so an eager call costs one compilation per shape.
    return dict(causal=bool(causal), q_offset=q_offset, window=window, sinks=sinks,
                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths)


def _check_qkv(q, k, v, *, seq_axis: int) -> None:
    """Ranks, dtypes and head sizes shared by `attention` and `attention_varlen`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_dtype(name, x, _FLOATS)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q.dtype={q.dtype}, k.dtype={k.dtype} and v.dtype={v.dtype} must agree")
    _checks.check_same("q head dim H", q.shape[-1], "k head dim H", k.shape[-1])
    _checks.check_same("k.shape[:-1]", k.shape[:-1], "v.shape[:-1]", v.shape[:-1])
    _checks.check_divisible("num_heads N", q.shape[-2], "num_kv_heads K", k.shape[-2])
    _checks.check_positive("q tokens", q.shape[seq_axis])
    _checks.check_positive("k tokens", k.shape[seq_axis])


def _attention_xla(*, q, k, v, q_segment_ids, kv_segment_ids, **args):
    if q_segment_ids is None:
        q_segment_ids = np.zeros(q.shape[:2], np.int32)
        kv_segment_ids = np.zeros(k.shape[:2], np.int32)
    return _attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **args)


def _head_dims(args) -> str:
    return f"H{args['q'].shape[-1]}-Hv{args['v'].shape[-1]}{dtype_tag(args['q'])}"


def _flash_config(module: str):
    def config(args):
        from attn.dense import mosaic, triton

        h, hv = args["q"].shape[-1], args["v"].shape[-1]
        if module == "mosaic":
            return mosaic.default_config(h)
        return triton.default_config(h, hv, jnp.dtype(args["q"].dtype).itemsize)

    return config


# `attention`'s backends, in `auto`'s order of preference on a GPU.
_ATTENTION_BACKENDS = (
    Backend(name="mosaic", run="attn.dense.mosaic:attention", supports="attn.dense.mosaic:supports",
            config_type="attn.dense.mosaic:Config", default_config=_flash_config("mosaic"),
            tuning_key=_head_dims),
    Backend(name="triton", run="attn.dense.triton:attention", supports="attn.dense.triton:supports",
            backward="attn.dense.triton:backward_supports",
            config_type="attn.dense.triton:Config", default_config=_flash_config("triton"),
            tuning_key=_head_dims),
    Backend(name="xla", run=_attention_xla, platforms=("cpu", "gpu")),
)


def _check_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool):
        raise TypeError(f"softcap={softcap!r} must be None or a Python number")
    if not (np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap={softcap} must be finite and positive")
    return float(softcap)


@op(name="attention", backends=_ATTENTION_BACKENDS)
def attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    causal: bool = True,
    scale: float | None = None,
    q_offset: int | Int[Array, " B"] = 0,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
    softcap: float | None = None,
) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Dense (GQA) softmax attention with causal, window + sinks, offsets, packing and lengths.

    Args:
      q: `[B, T, N, H]` queries (float32, bfloat16 or float16; q, k, v share one dtype).
      k: `[B, S, K, H]` keys, `N % K == 0`; query head `n` uses KV head `n // (N // K)`.
      v: `[B, S, K, Hv]` values.
      causal: key `s` visible only if `s <= q_offset + t`.
      scale: softmax scale, default `H ** -0.5`.
      q_offset: int or `[B]` int32: position of query 0 in the key sequence (chunked prefill over
        a cached prefix: the prefix length). With an int and `causal`, `q_offset + T <= S` is
        checked; array values may be traced and are not (keep `0 <= q_offset[b] <= S - T`).
      window: None, an int or `[K]` int32: most recent positions visible (query's own included);
        `<= 0` means full. Needs `causal`.
      sinks: int >= 0 or `[K]` int32 >= 0: keys `s < sinks` stay visible despite the window.
      q_segment_ids: `[B, T]` integer segment ids (packed sequences); needs `kv_segment_ids`.
      kv_segment_ids: `[B, S]` integer segment ids.
      kv_lengths: `[B]` integer in `[0, S]` (checked when concrete; traced values are clamped
        there); keys `s >= kv_lengths[b]` are invisible.
      softcap: None or a positive number: logit soft-capping (Gemma 2), the scaled scores
        become `softcap * tanh(scores / softcap)` before the mask.
      implementation: `"xla"`, `"triton"` (the flash kernel, `attn/dense/triton.py`; with
        `softcap` its gradient is the reference's), `"mosaic"` (the Mosaic GPU forward,
        `attn/dense/mosaic.py`: Hopper, static window / sinks, no offsets, lengths or softcap)
        or `"auto"` (on a GPU the first of mosaic, triton that takes the options, XLA where
        neither does, e.g. segment ids).
      config: a launch config of the backend it names (`attn.dense.triton.Config` or
        `attn.dense.mosaic.Config`); default: the backend's heuristic and the tuning cache.

    Returns:
      `(out [B, T, N, Hv] in q's dtype, lse [B, T, N] float32)`; rows with no visible key give
      exactly 0 and -inf.

    Raises:
      ValueError: wrong ranks, mismatched sizes, `N % K != 0`, queries past the keys, a window
        without `causal`, negative sinks or offsets (ints, or concrete arrays), window / sinks /
        offset ints outside int32, concrete `kv_lengths` outside `[0, S]`, a scale that is not
        finite and positive, one segment-id array without the other.
      TypeError: non-float or mixed q/k/v dtypes, non-integer offsets / windows / sinks / ids /
        lengths, a non-numeric scale or softcap, a config of another backend.
      NotImplementedError: `implementation="triton"` / `"mosaic"` with options that kernel does
        not support (its `supports` reasons: segment ids; for mosaic also offsets, lengths,
        per-head windows, softcap).
    """
    _checks.check_rank("q", q, 4, "B T N H")
    _checks.check_rank("k", k, 4, "B S K H")
    _checks.check_rank("v", v, 4, "B S K Hv")
    _check_qkv(q, k, v, seq_axis=1)
    _checks.check_same("q batch B", q.shape[0], "k batch B", k.shape[0])
    scale = _check_scale(scale, q.shape[-1])
    batch, q_len, _, _ = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    args = _check_mask_args(
        batch, q_len, kv_len, num_kv_heads, causal=causal, q_offset=q_offset, window=window,
        sinks=sinks, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        kv_lengths=kv_lengths)
    args.update(q=q, k=k, v=v, scale=scale, q_segment_ids=q_segment_ids,
                kv_segment_ids=kv_segment_ids, softcap=_check_softcap(softcap))
    return args


def visible_mask(
    batch: int,
    q_len: int,
    kv_len: int,
    num_kv_heads: int,
    *,
    causal: bool = True,
    q_offset: int | Int[Array, " B"] = 0,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
) -> Bool[Array, "B T K S"]:
    """The boolean mask `attention` applies, for "dense with the same token mask" tests.

    Args:
      batch, q_len, kv_len, num_kv_heads: `B`, `T`, `S`, `K`.
      causal, q_offset, window, sinks, q_segment_ids, kv_segment_ids, kv_lengths: as in
        `attention`.

    Returns:
      `[B, T, K, S]` bool; query head `n` uses `mask[:, :, n // G]`
      (`jnp.repeat(mask, G, axis=2)` gives the per-query-head `[B, T, N, S]` mask).

    Raises:
      ValueError, TypeError: as `attention`.
    """
    for name, value in (("batch", batch), ("q_len", q_len), ("kv_len", kv_len),
                        ("num_kv_heads", num_kv_heads)):
        if not _is_int(value):
            raise TypeError(f"{name}={value!r} must be an int")
        _checks.check_positive(name, value)
    args = _check_mask_args(
        batch, q_len, kv_len, num_kv_heads, causal=causal, q_offset=q_offset, window=window,
        sinks=sinks, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        kv_lengths=kv_lengths)
    return _visible_mask(int(batch), int(q_len), int(kv_len), int(num_kv_heads), **args)


def masked_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    mask: Bool[Array, "B T M S"],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Dense attention under an arbitrary token mask (the oracle of block-sparse / paged variants).

    XLA only (the reference, jitted).

    Args:
      q, k, v: as in `attention`.
      mask: `[B, T, M, S]` bool, `M` = `N` (per query head), `K` (per KV head) or 1.
      scale: softmax scale, default `H ** -0.5`.

    Returns:
      `(out [B, T, N, Hv] in q's dtype, lse [B, T, N] float32)`.

    Raises:
      ValueError: wrong ranks or sizes, `mask` shape not `[B, T, N|K|1, S]`.
      TypeError: bad dtypes (mask must be bool).
    """
    _checks.check_rank("q", q, 4, "B T N H")
    _checks.check_rank("k", k, 4, "B S K H")
    _checks.check_rank("v", v, 4, "B S K Hv")
    _check_qkv(q, k, v, seq_axis=1)
    _checks.check_same("q batch B", q.shape[0], "k batch B", k.shape[0])
    _checks.check_rank("mask", mask, 4, "B T M S")
    _checks.check_dtype("mask", mask, (jnp.bool_,))
    (batch, q_len, num_heads, _), (_, kv_len, num_kv_heads, _) = q.shape, k.shape
    ok = {(batch, q_len, m, kv_len) for m in (num_heads, num_kv_heads, 1)}
    if tuple(mask.shape) not in ok:
        raise ValueError(f"mask.shape={mask.shape} must be [B, T, M, S] with M in "
                         f"(N={num_heads}, K={num_kv_heads}, 1), B={batch}, T={q_len}, S={kv_len}")
    scale = _check_scale(scale, q.shape[-1])
    return _masked_attention(q, k, v, mask, scale=scale)


def _check_cu_seqlens(name: str, cu) -> None:
    if not _is_array(cu):
        raise TypeError(f"{name} (type {type(cu).__name__}) must be an integer array of shape "
                        f"[B + 1]")
    _checks.check_rank(name, cu, 1, "B+1")
    _checks.check_integer(name, cu)
    if cu.shape[0] < 2:
        raise ValueError(f"{name}.shape={cu.shape} must be [B + 1] with B >= 1")


def _check_total(total) -> int:
    if not _is_int(total):
        raise TypeError(f"total={total!r} must be an int (a static token count)")
    if total < 0:
        raise ValueError(f"total={total} must be >= 0")
    return int(total)


def segment_ids_from_cu_seqlens(cu_seqlens: Int[Array, " B+1"], total: int) -> Int[Array, " T"]:
    """Segment ids of `total` packed tokens: `b` in `[cu[b], cu[b+1])`, -1 for padding.

    Args:
      cu_seqlens: `[B + 1]` non-decreasing int offsets (FlashAttention varlen style).
      total: the packed length `T`, a static int (may exceed `cu[B]`: the rest is padding).

    Returns:
      `[T]` int32, usable as `q_segment_ids` / `kv_segment_ids` (with a batch axis added).

    Raises:
      ValueError, TypeError: `cu_seqlens` not a `[B + 1]` integer array, `total` not an int >= 0.
    """
    _check_cu_seqlens("cu_seqlens", cu_seqlens)
    return _segment_ids(cu_seqlens, _check_total(total))


def positions_from_cu_seqlens(cu_seqlens: Int[Array, " B+1"], total: int) -> Int[Array, " T"]:
    """Position of each packed token inside its own sequence; 0 for padding tokens.

    Args:
      cu_seqlens: `[B + 1]` non-decreasing int offsets.
      total: the packed length `T`, a static int.

    Returns:
      `[T]` int32 (e.g. RoPE positions of a packed batch).

    Raises:
      ValueError, TypeError: as `segment_ids_from_cu_seqlens`.
    """
    _check_cu_seqlens("cu_seqlens", cu_seqlens)
    return _positions(cu_seqlens, _check_total(total))


_segment_ids = jax.jit(reference.segment_ids_from_cu_seqlens, static_argnums=1)
_positions = jax.jit(reference.positions_from_cu_seqlens, static_argnums=1)


def attention_varlen(
    q: Float[Array, "Tq N H"],
    k: Float[Array, "Tk K H"],
    v: Float[Array, "Tk K Hv"],
    cu_seqlens_q: Int[Array, " B+1"],
    cu_seqlens_k: Int[Array, " B+1"],
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
) -> tuple[Float[Array, "Tq N Hv"], Float[Array, "Tq N"]]:
    """Packed variable-length attention in the FlashAttention varlen layout (XLA only).

    Sequence `b` owns queries `[cu_seqlens_q[b], cu_seqlens_q[b+1])` and keys
    `[cu_seqlens_k[b], cu_seqlens_k[b+1])`. Its queries are aligned to the END of its keys: query
    `j` sits at position `len_k - len_q + j` (chunked prefill when `len_q < len_k`, as
    flash-attn's varlen causal); with `len_q > len_k` the first queries see nothing. Windows and
    sinks count within each sequence. Tokens past `cu[B]` are padding: they see nothing (0, -inf)
    and are seen by nobody. Memory is quadratic in `Tq * Tk` (it is the reference).

    Args:
      q: `[Tq, N, H]` packed queries.
      k: `[Tk, K, H]` packed keys; v: `[Tk, K, Hv]`.
      cu_seqlens_q, cu_seqlens_k: `[B + 1]` int32 non-decreasing offsets.
      causal, scale, window, sinks: as in `attention`.

    Returns:
      `(out [Tq, N, Hv] in q's dtype, lse [Tq, N] float32)`.

    Raises:
      ValueError, TypeError: as `attention`, plus bad `cu_seqlens`.
    """
    _checks.check_rank("q", q, 3, "Tq N H")
    _checks.check_rank("k", k, 3, "Tk K H")
    _checks.check_rank("v", v, 3, "Tk K Hv")
    _check_qkv(q, k, v, seq_axis=0)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    _checks.check_same("cu_seqlens_q.shape", cu_seqlens_q.shape,
                       "cu_seqlens_k.shape", cu_seqlens_k.shape)
    scale = _check_scale(scale, q.shape[-1])
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal={causal!r} must be a bool")
    window, sinks = _check_window_sinks(window, sinks, k.shape[1], causal=causal)
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=bool(causal),
                             scale=scale, window=window, sinks=sinks)


__all__ = [
    "attention",
    "attention_varlen",
    "masked_attention",
    "paged_prefill_attention",
    "positions_from_cu_seqlens",
    "segment_ids_from_cu_seqlens",
    "visible_mask",
]


_paged_prefill = jax.jit(reference.paged_prefill_attention)


def _paged_prefill_config(args):
    from attn.dense import triton_paged

    return triton_paged.config_for(args["q"], args["v_pages"])


_PAGED_PREFILL_BACKENDS = (
    Backend(name="triton", run="attn.dense.triton_paged:paged_prefill_attention",
            supports="attn.dense.triton_paged:supports", backward=lambda args: ["no backward"],
            config_type="attn.dense.triton_paged:Config", default_config=_paged_prefill_config,
            tuning_key=lambda args: (f"H{args['q'].shape[-1]}-P{args['k_pages'].shape[2]}"
                                     f"{dtype_tag(args['q'])}")),
    Backend(name="xla", run=_paged_prefill, platforms=("cpu", "gpu")),
)


def _per_row_head_arg(name: str, x, batch: int, num_kv_heads: int, *, non_negative: bool):
    """None, an int, `[K]` or `[B, K]` integer array (`window` / `sinks`) as a `[B, K]` array."""
    if x is None:
        x = 0
    if _is_int(x):
        _checks.check_int32_value(name, int(x))
        if non_negative and x < 0:
            raise ValueError(f"{name}={x} must be >= 0")
        return np.full((batch, num_kv_heads), int(x), np.int32)
    if not _is_array(x):
        raise TypeError(f"{name}={x!r} (type {type(x).__name__}) must be None, an int or an "
                        f"integer array of shape [K] or [B, K]")
    _checks.check_integer(name, x)
    if tuple(x.shape) not in ((num_kv_heads,), (batch, num_kv_heads)):
        raise ValueError(f"{name}.shape={x.shape} must be [K]={[num_kv_heads]} or "
                         f"[B, K]={[batch, num_kv_heads]}")
    if non_negative:
        _checks.check_range(name, x, 0)
    if isinstance(x, np.ndarray):
        return np.broadcast_to(x.astype(np.int32), (batch, num_kv_heads))
    return jnp.broadcast_to(x.astype(jnp.int32), (batch, num_kv_heads))


@op(name="paged_prefill_attention", backends=_PAGED_PREFILL_BACKENDS)
def paged_prefill_attention(
    q: Float[Array, "B T N H"],
    k_pages: Array,
    v_pages: Array,
    block_tables: Int[Array, "B K M"],
    q_offset: int | Int[Array, " B"],
    kv_lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
    window: int | Int[Array, " K"] | Int[Array, "B K"] | None = None,
    sinks: int | Int[Array, " K"] | Int[Array, "B K"] = 0,
    k_scales: Float[Array, "K num_pages C"] | None = None,
    v_scales: Float[Array, "K num_pages C"] | None = None,
) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Chunked prefill: a query chunk attends its row's paged cache (prefix + the chunk itself).

    Query `t` of row `b` sits at position `q_offset[b] + t`. Key `s` of row `b` for KV head `k`
    lives at `pages[k, block_tables[b, k, s // P], s % P]` and is visible iff `s <= q_pos`,
    `s < kv_lengths[b]`, its table entry is not -1, and it lies inside the window of (row, head)
    (`q_pos - window < s`, or `window <= 0`) or among its sinks (`s < sinks`). The chunk's own K/V
    must already be in the pages (usually `kv_lengths = q_offset + T`). Query head `n` reads KV
    head `n // (N // K)`. Exactly `attn.dense.attention` on the gathered cache with the same
    `q_offset`, `kv_lengths`, window and sinks, with -1 pages masked (the reference does that).

    Args:
      q: `[B, T, N, H]` chunk queries (float32, bfloat16 or float16).
      k_pages: `[K, num_pages, P, H]` key pages: float, or `float8_e4m3fn` with `k_scales`.
      v_pages: `[K, num_pages, P, Hv]` value pages: float, or `float8_e4m3fn` with `v_scales`.
      block_tables: `[B, K, M]` int32 per-head page ids; -1 = not allocated; every id outside
        `[0, num_pages)` is absent (masked and never read, on every backend).
      q_offset: int or `[B]` int32: position of query 0 (the cached prefix length).
      kv_lengths: `[B]` int32 tokens in the cache, the chunk's included; 0 = padding row.
      scale: softmax scale, default `H ** -0.5`.
      window: None, an int, `[K]` or `[B, K]` int32 (per request and head): most recent
        positions visible, the query's own included; `<= 0` means full.
      sinks: an int >= 0, `[K]` or `[B, K]` int32: keys `s < sinks` stay visible.
      k_scales, v_scales: `[K, num_pages, P // sub_block]` float32 fp8 scales (`kv.fp8` layout),
        required exactly when the matching pages are fp8.
      implementation: `"xla"` (gather + dense reference), `"triton"` (reads the pages in the
        kernel, `attn/dense/triton_paged.py`; its gradient is the reference's) or `"auto"`.
      config: an `attn.dense.triton_paged.Config` (names the Triton backend); default: its
        heuristic and the tuning cache.

    Returns:
      `(out [B, T, N, Hv] in q's dtype, lse [B, T, N] float32)`; a row with no visible key gives
      exactly 0 and -inf.

    Raises:
      ValueError: ranks, shapes or sizes inconsistent (B, K, H, N % K, pages, scales), negative
        offsets or sinks, lengths outside `[0, M * P]` (concrete values; traced ones are clamped,
        and in the checked mode fail at run time, as table ids outside `[-1, num_pages)` do), a
        scale that is not finite and positive, ints outside int32, an unknown implementation.
      TypeError: dtypes (q float; pages float or e4m3; tables, offsets, lengths, windows and sinks
        integer; scales float32), a non-numeric scale.
      NotImplementedError: `implementation="triton"` with options the kernel refuses (its
        `supports` reasons: head dims over 256, float pages in another dtype than q).
    """
    _checks.check_rank("q", q, 4, "B T N H")
    _checks.check_dtype("q", q, _FLOATS)
    check_pool("k_pages", k_pages, k_scales, "k_scales")
    check_pool("v_pages", v_pages, v_scales, "v_scales")
    batch, _, num_heads, head_dim = q.shape
    num_kv, num_pages, page, k_dim = k_pages.shape
    if v_pages.shape[:3] != (num_kv, num_pages, page):
        raise ValueError(f"v_pages.shape={v_pages.shape} must start with k_pages' "
                         f"[K, num_pages, P]={(num_kv, num_pages, page)}")
    _checks.check_same("q head dim H", head_dim, "k_pages head dim", k_dim)
    _checks.check_divisible("num_heads N", num_heads, "num_kv_heads K", num_kv)
    _checks.check_rank("block_tables", block_tables, 3, "B K M")
    _checks.check_dtype("block_tables", block_tables, (jnp.int32,))
    if block_tables.shape[:2] != (batch, num_kv):
        raise ValueError(f"block_tables.shape={block_tables.shape} must be [B, K, M] with "
                         f"[B, K]={(batch, num_kv)}")
    max_tokens = block_tables.shape[2] * page
    _checks.check_int32_addressable("k_pages", k_pages.shape)
    _checks.check_int32_addressable("v_pages", v_pages.shape)
    if _is_int(q_offset):
        _checks.check_int32_value("q_offset", int(q_offset))
        if q_offset < 0:
            raise ValueError(f"q_offset={q_offset} must be >= 0")
        q_offset = np.full((batch,), q_offset, np.int32)
    elif _is_array(q_offset):
        _check_int_array("q_offset", q_offset, (batch,), "B")
        _checks.check_range("q_offset", q_offset, 0)
    else:
        raise TypeError(f"q_offset={q_offset!r} (type {type(q_offset).__name__}) must be an int "
                        f"or an integer array of shape [B]")
    if not _is_array(kv_lengths):
        raise TypeError(f"kv_lengths={kv_lengths!r} must be an integer array of shape [B]")
    _check_int_array("kv_lengths", kv_lengths, (batch,), "B")
    # Concrete lengths in [0, M * P]; traced ones are clamped there (checked mode: run-time
    # error). Table ids are data: an id outside [0, num_pages) is an absent page.
    _checks.check_range("kv_lengths", kv_lengths, 0, max_tokens)
    _checks.check_table_ids("block_tables", block_tables, num_pages)
    window = _per_row_head_arg("window", window, batch, num_kv, non_negative=False)
    sinks = _per_row_head_arg("sinks", sinks, batch, num_kv, non_negative=True)
    scale = _check_scale(scale, head_dim)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, block_tables=block_tables,
                q_offset=q_offset, kv_lengths=kv_lengths, scale=scale, window=window, sinks=sinks,
                k_scales=k_scales, v_scales=v_scales)
