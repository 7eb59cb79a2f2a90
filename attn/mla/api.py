"""Public MLA ops: validation once, then the backend.

`mla_paged_decode` has the XLA reference and a Triton kernel (`attn/mla/triton.py`); the other
ops are XLA only. The scale defaults to `H ** -0.5` of the op's query head dim, as in every op:
`Dn + R` for the attention ops, `L + R` for decode; DeepSeek's models pass their own
(`(Dn + R) ** -0.5 · mscale²`).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from attn import _checks
from attn._op import Backend, op
from attn.mla import reference

# One compiled program per shape instead of one per primitive: eager dispatch of the references
# compiles dozens of small ops. Under an outer `jit` these simply inline.
_naive = jax.jit(reference.mla_naive_attention, static_argnames=("causal",))
_absorbed = jax.jit(reference.mla_absorbed_attention, static_argnames=("causal",))
_partials = jax.jit(reference.mla_paged_decode_partials,
                    static_argnames=("kv_lora_rank", "num_splits"))
_decode = jax.jit(reference.mla_paged_decode, static_argnames=("kv_lora_rank", "num_splits"))


def _decode_triton(*, num_splits, config, **args):
    del num_splits  # the kernel's split count is its config's
    from attn.mla import triton as mla_triton  # imports triton: only when asked for

    return _decode_triton_jit(mla_triton)(**args, config=config)


@functools.cache
def _decode_triton_jit(module):
    return jax.jit(module.mla_paged_decode, static_argnames=("kv_lora_rank", "config"))


def _decode_config(args):
    from attn.mla import triton as mla_triton

    q_lat, tables, pages = args["q_lat"], args["block_tables"], args["latent_pages"]
    return mla_triton.default_config(q_lat.shape[0], q_lat.shape[1],
                                     tables.shape[1] * pages.shape[1],
                                     fp8=args["latent_scales"] is not None,
                                     itemsize=jnp.dtype(pages.dtype).itemsize)


_DECODE_BACKENDS = (
    Backend(name="triton", run=_decode_triton, config_type="attn.mla.triton:Config",
            default_config=_decode_config),
    Backend(name="xla", run=_decode, platforms=("cpu", "gpu")),
)
_absorb = jax.jit(lambda q, w: reference.absorb_query(q, w).astype(q.dtype))
_expand = jax.jit(lambda o, w: reference.expand_output(o, w).astype(o.dtype))
_LATENT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_FP8 = jnp.dtype(jnp.float8_e4m3fn)


def _check_scale(scale, head_dim: int):
    """The shared rule (`_checks.check_scale`; a traced scalar array is accepted unchecked);
    None becomes `head_dim ** -0.5`."""
    _checks.check_scale(scale, allow_traced=True)
    return head_dim**-0.5 if scale is None else scale


def _check_lengths(name: str, x, batch: int) -> None:
    _checks.check_integer(name, x)
    _checks.check_rank(name, x, 1, "B")
    _checks.check_same(f"{name}.shape[0]", x.shape[0], "batch size B", batch)


def _check_attention_inputs(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, q_offset, kv_lengths):
    for name, x, letters in (
        ("q_nope", q_nope, "B T N Dn"), ("q_pe", q_pe, "B T N R"), ("c_kv", c_kv, "B S L"),
        ("k_pe", k_pe, "B S R"), ("w_uk", w_uk, "N Dn L"), ("w_uv", w_uv, "N Hv L"),
    ):
        _checks.check_rank(name, x, len(letters.split()), letters)
        _checks.check_floating(name, x)
    b, t, n, dn = q_nope.shape
    l = c_kv.shape[-1]
    if q_pe.shape[:3] != (b, t, n):
        raise ValueError(f"q_pe.shape={q_pe.shape} must start with q_nope's [B, T, N]={(b, t, n)}")
    if k_pe.shape[:2] != c_kv.shape[:2]:
        raise ValueError(f"k_pe.shape={k_pe.shape} must start with c_kv's [B, S]={c_kv.shape[:2]}")
    _checks.check_same("c_kv.shape[0]", c_kv.shape[0], "q_nope.shape[0]", b)
    _checks.check_same("k_pe.shape[-1]", k_pe.shape[-1], "q_pe.shape[-1]", q_pe.shape[-1])
    if w_uk.shape != (n, dn, l):
        raise ValueError(f"w_uk.shape={w_uk.shape} must be [N, Dn, L]={(n, dn, l)}")
    if (w_uv.shape[0], w_uv.shape[2]) != (n, l):
        raise ValueError(f"w_uv.shape={w_uv.shape} must be [N, Hv, L] with N={n}, L={l}")
    if isinstance(q_offset, jax.Array | np.ndarray):
        _checks.check_integer("q_offset", q_offset)
        if q_offset.shape not in ((), (b,)):
            raise ValueError(f"q_offset.shape={q_offset.shape} must be () or [B]=({b},)")
    elif isinstance(q_offset, bool) or not isinstance(q_offset, numbers.Integral):
        raise TypeError(f"{q_offset=} must be an int or an integer array")
    _checks.check_range("q_offset", q_offset, 0)
    if kv_lengths is not None:
        _check_lengths("kv_lengths", kv_lengths, b)
        _checks.check_range("kv_lengths", kv_lengths, 0, c_kv.shape[1])


def split_kv_b(
    kv_b_weight: Float[Array, "NDnHv L"], num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[Float[Array, "N Dn L"], Float[Array, "N Hv L"]]:
    """Split HF's `kv_b_proj.weight` `[N * (Dn + Hv), L]` into `w_uk [N, Dn, L]`, `w_uv [N, Hv, L]`.

    Rows are head-major; within head n, the first `Dn` rows map the latent to the no-rope key
    (`k_nope[n] = w_uk[n] @ c_kv`) and the next `Hv` rows to the value (`v[n] = w_uv[n] @ c_kv`),
    exactly as HF's `kv_b_proj(c_kv).view(T, N, Dn + Hv).split([Dn, Hv])`.

    Args:
      kv_b_weight: `[N * (Dn + Hv), L]`, the torch `Linear` weight as stored.
      num_heads: `N`.
      qk_nope_head_dim: `Dn`.
      v_head_dim: `Hv`.

    Returns:
      `(w_uk [N, Dn, L], w_uv [N, Hv, L])`, views of the weight in its dtype.

    Raises:
      ValueError: the weight is not rank 2 or its rows are not `N * (Dn + Hv)`.
      TypeError: a non-int size or a non-floating weight.
    """
    for name, value in (("num_heads", num_heads), ("qk_nope_head_dim", qk_nope_head_dim),
                        ("v_head_dim", v_head_dim)):
        _checks.check_positive_int(name, value)
    _checks.check_rank("kv_b_weight", kv_b_weight, 2, "N*(Dn+Hv) L")
    _checks.check_floating("kv_b_weight", kv_b_weight)
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if kv_b_weight.shape[0] != rows:
        raise ValueError(f"kv_b_weight.shape={kv_b_weight.shape} must have N*(Dn+Hv)={rows} rows "
                         f"({num_heads=}, {qk_nope_head_dim=}, {v_head_dim=})")
    return reference.split_kv_b(kv_b_weight, num_heads, qk_nope_head_dim, v_head_dim)


def absorb_query(
    q_nope: Float[Array, "*B N Dn"], w_uk: Float[Array, "N Dn L"]
) -> Float[Array, "*B N L"]:
    """Latent query for absorbed attention: `q_lat[..., n, :] = w_uk[n]ᵀ q_nope[..., n, :]`.

    Args:
      q_nope: `[*B, N, Dn]` no-rope query (e.g. `[B, N, Dn]` for decode).
      w_uk: `[N, Dn, L]` key up-projection.

    Returns:
      `[*B, N, L]` in q_nope's dtype (computed in float32).

    Raises:
      ValueError: `q_nope.shape[-2:]` is not `w_uk.shape[:2]`.
      TypeError: non-floating inputs.
    """
    _checks.check_floating("q_nope", q_nope)
    _checks.check_floating("w_uk", w_uk)
    _checks.check_rank("w_uk", w_uk, 3, "N Dn L")
    if q_nope.ndim < 2 or q_nope.shape[-2:] != w_uk.shape[:2]:
        raise ValueError(f"q_nope.shape={q_nope.shape} must end with w_uk's [N, Dn]="
                         f"{w_uk.shape[:2]}")
    return _absorb(q_nope, w_uk)


def expand_output(
    o_lat: Float[Array, "*B N L"], w_uv: Float[Array, "N Hv L"]
) -> Float[Array, "*B N Hv"]:
    """Per-head output of absorbed attention: `o[..., n, :] = w_uv[n] o_lat[..., n, :]`.

    Args:
      o_lat: `[*B, N, L]` latent attention output.
      w_uv: `[N, Hv, L]` value up-projection.

    Returns:
      `[*B, N, Hv]` in o_lat's dtype (computed in float32).

    Raises:
      ValueError: `o_lat.shape[-2:]` is not `[N, L]` of `w_uv`.
      TypeError: non-floating inputs.
    """
    _checks.check_floating("o_lat", o_lat)
    _checks.check_floating("w_uv", w_uv)
    _checks.check_rank("w_uv", w_uv, 3, "N Hv L")
    if o_lat.ndim < 2 or o_lat.shape[-2:] != (w_uv.shape[0], w_uv.shape[2]):
        raise ValueError(f"o_lat.shape={o_lat.shape} must end with w_uv's [N, L]="
                         f"{(w_uv.shape[0], w_uv.shape[2])}")
    return _expand(o_lat, w_uv)


def _attention(fn, q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, causal, q_offset, kv_lengths):
    _check_attention_inputs(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, q_offset, kv_lengths)
    scale = _check_scale(scale, q_nope.shape[-1] + q_pe.shape[-1])
    return fn(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale=scale, causal=causal,
              q_offset=q_offset, kv_lengths=kv_lengths)


def mla_naive_attention(
    q_nope: Float[Array, "B T N Dn"],
    q_pe: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S L"],
    k_pe: Float[Array, "B S R"],
    w_uk: Float[Array, "N Dn L"],
    w_uv: Float[Array, "N Hv L"],
    *,
    scale: float | None = None,
    causal: bool = True,
    q_offset: int | Int[Array, " B"] = 0,
    kv_lengths: Int[Array, " B"] | None = None,
) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Materialised MLA (prefill form): `k = [w_uk c ‖ k_pe]`, `v = w_uv c`, multi-head attention.

    Args:
      q_nope: `[B, T, N, Dn]` query, no-rope part.
      q_pe: `[B, T, N, R]` query, rope part, already rotated.
      c_kv: `[B, S, L]` compressed KV, already normed (`kv_a_layernorm`).
      k_pe: `[B, S, R]` rope key, already rotated; one head shared by all query heads.
      w_uk: `[N, Dn, L]` key up-projection; `w_uv`: `[N, Hv, L]` value up-projection
        (`split_kv_b` of HF's `kv_b_proj.weight`).
      scale: softmax scale; default `(Dn + R) ** -0.5` (DeepSeek: `(Dn + R) ** -0.5 · mscale²`).
      causal: key s visible iff `s <= q_offset + t`.
      q_offset: int or `[B]` int32 absolute position of query 0 (cached prefix for chunked
        prefill).
      kv_lengths: `[B]` int32; keys `s >= kv_lengths[b]` are masked. None: all `S` keys.

    Returns:
      `(out [B, T, N, Hv] in q_nope's dtype, lse [B, T, N] float32)`; rows with no visible key
      give 0 and `-inf`.

    Raises:
      ValueError: ranks or sizes disagree, a non-positive scale.
      TypeError: non-floating tensors, non-integer offsets or lengths.
    """
    return _attention(_naive, q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale,
                      causal, q_offset, kv_lengths)


def mla_absorbed_attention(
    q_nope: Float[Array, "B T N Dn"],
    q_pe: Float[Array, "B T N R"],
    c_kv: Float[Array, "B S L"],
    k_pe: Float[Array, "B S R"],
    w_uk: Float[Array, "N Dn L"],
    w_uv: Float[Array, "N Hv L"],
    *,
    scale: float | None = None,
    causal: bool = True,
    q_offset: int | Int[Array, " B"] = 0,
    kv_lengths: Int[Array, " B"] | None = None,
) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N"]]:
    """Absorbed MLA: `q_lat = w_ukᵀ q_nope`, attend over `[c_kv ‖ k_pe]` (value `c_kv`), `w_uv o`.

    Arguments, results and errors as `mla_naive_attention`, to which it is equal; it attends with
    one latent KV head of `L + R` dims instead of `N` heads of `Dn + R`.
    """
    return _attention(_absorbed, q_nope, q_pe, c_kv, k_pe, w_uk, w_uv,
                      scale, causal, q_offset, kv_lengths)


def _check_decode_inputs(q_lat, q_pe, latent_pages, block_tables, kv_lengths, kv_lora_rank, scale,
                         latent_scales, num_splits) -> dict:
    """Validate the decode arguments; return them with the scale's default applied."""
    _checks.check_positive_int("kv_lora_rank", kv_lora_rank)
    _checks.check_positive_int("num_splits", num_splits)
    for name, x, letters in (
        ("q_lat", q_lat, "B N L"), ("q_pe", q_pe, "B N R"),
        ("latent_pages", latent_pages, "num_pages P L+R"),
        ("block_tables", block_tables, "B max_pages"), ("kv_lengths", kv_lengths, "B"),
    ):
        _checks.check_rank(name, x, len(letters.split()), letters)
    _checks.check_floating("q_lat", q_lat)
    _checks.check_floating("q_pe", q_pe)
    _checks.check_integer("block_tables", block_tables)
    b, n, l = q_lat.shape
    _checks.check_same("q_lat.shape[-1]", l, "kv_lora_rank", kv_lora_rank)
    lr = latent_pages.shape[-1]
    if lr <= kv_lora_rank:
        raise ValueError(f"latent_pages.shape={latent_pages.shape} must have a last dim L + R "
                         f"greater than {kv_lora_rank=} (R = rope dim >= 1)")
    r = lr - kv_lora_rank
    if q_pe.shape != (b, n, r):
        raise ValueError(f"q_pe.shape={q_pe.shape} must be [B, N, R]={(b, n, r)} "
                         f"(R = latent_pages.shape[-1] - kv_lora_rank)")
    _checks.check_same("block_tables.shape[0]", block_tables.shape[0], "q_lat.shape[0]", b)
    _check_lengths("kv_lengths", kv_lengths, b)
    num_pages, p, _ = latent_pages.shape
    # Concrete lengths in [0, max_pages * P]; traced ones are clamped there. Table ids are data:
    # an id outside [0, num_pages) is an absent page (checked mode: both fail at run time).
    _checks.check_range("kv_lengths", kv_lengths, 0, block_tables.shape[1] * p)
    _checks.check_table_ids("block_tables", block_tables, num_pages)
    if latent_scales is None:
        if jnp.dtype(latent_pages.dtype) == _FP8:
            raise TypeError(f"latent_pages.dtype={latent_pages.dtype} needs latent_scales")
        _checks.check_dtype("latent_pages", latent_pages, _LATENT_DTYPES)
    else:
        _checks.check_dtype("latent_pages", latent_pages, (_FP8,))
        _checks.check_rank("latent_scales", latent_scales, 2, "num_pages P//sub_block")
        _checks.check_dtype("latent_scales", latent_scales, (jnp.float32,))
        _checks.check_same("latent_scales.shape[0]", latent_scales.shape[0], "num_pages",
                           num_pages)
        _checks.check_divisible("page size P", p, "latent_scales.shape[1]",
                                latent_scales.shape[1])
    return dict(q_lat=q_lat, q_pe=q_pe, latent_pages=latent_pages, block_tables=block_tables,
                kv_lengths=kv_lengths, kv_lora_rank=kv_lora_rank,
                scale=_check_scale(scale, lr), latent_scales=latent_scales,
                num_splits=num_splits)


def mla_paged_decode_partials(
    q_lat: Float[Array, "B N L"],
    q_pe: Float[Array, "B N R"],
    latent_pages: Float[Array, "num_pages P LR"],
    block_tables: Int[Array, "B max_pages"],
    kv_lengths: Int[Array, " B"],
    *,
    kv_lora_rank: int,
    scale: float | None = None,
    latent_scales: Float[Array, "num_pages P_sub"] | None = None,
    num_splits: int = 1,
) -> tuple[Float[Array, "B N J L"], Float[Array, "B N J"]]:
    """Split-KV stage 1 of `mla_paged_decode`: one partial per split, before the merge (XLA).

    Row b's `cdiv(kv_lengths[b], P)` pages are cut into `num_splits` page-aligned runs of
    `c_b = cdiv(cdiv(kv_lengths[b], P), num_splits)` pages (split j: pages
    `[j·c_b, (j+1)·c_b)`), so every row's work is balanced by its own length; trailing splits may
    be empty.

    Args: as `mla_paged_decode`.

    Returns:
      `(o [B, N, num_splits, L] float32, lse [B, N, num_splits] float32)`, each partial normalised
      within its split; empty splits give 0 and `-inf`. `attn.merge.merge_partials` combines them.

    Raises: as `mla_paged_decode`.
    """
    return _partials(**_check_decode_inputs(q_lat, q_pe, latent_pages, block_tables, kv_lengths,
                                            kv_lora_rank, scale, latent_scales, num_splits))


@op(name="mla_paged_decode", backends=_DECODE_BACKENDS)
def mla_paged_decode(
    q_lat: Float[Array, "B N L"],
    q_pe: Float[Array, "B N R"],
    latent_pages: Float[Array, "num_pages P LR"],
    block_tables: Int[Array, "B max_pages"],
    kv_lengths: Int[Array, " B"],
    *,
    kv_lora_rank: int,
    scale: float | None = None,
    latent_scales: Float[Array, "num_pages P_sub"] | None = None,
    num_splits: int = 1,
) -> tuple[Float[Array, "B N L"], Float[Array, "B N"]]:
    """Absorbed MLA decode (one query token per row) over the paged latent cache.

    Token s of row b is `latent_pages[block_tables[b, s // P], s % P] = [c_kv ‖ k_pe]`; the key
    is all `L + R` dims, the value the first `L`. Score `scale · (q_lat·c_kv + q_pe·k_pe)`.

    Args:
      q_lat: `[B, N, L]` absorbed query (`absorb_query(q_nope, w_uk)`).
      q_pe: `[B, N, R]` rotated rope query.
      latent_pages: `[num_pages, P, L + R]` latent pool (page 0 is the reserved null page):
        float32 / bfloat16 / float16, or float8_e4m3fn with `latent_scales`.
      block_tables: `[B, max_pages]` int32 page ids; `-1` = unallocated. Every id outside
        `[0, num_pages)` is an absent page: its tokens are invisible and never read (every
        backend).
      kv_lengths: `[B]` int32 tokens in the cache, the decode token included; 0: a padding row.
        Concrete lengths must lie in `[0, max_pages · P]`; traced ones are clamped there.
      kv_lora_rank: `L` (from the config; `R = latent_pages.shape[-1] - L`).
      scale: softmax scale; default `(L + R) ** -0.5`, the op's query head dim. DeepSeek's
        models pass theirs, `(Dn + R) ** -0.5 · mscale²`.
      latent_scales: fp8 only: `[num_pages, P // sub_block]` float32; value of token s of page g is
        `latent_pages[g, s].astype(f32) * latent_scales[g, s // sub_block]`.
      num_splits: split-KV factor (see `mla_paged_decode_partials`); the result does not depend on
        it beyond rounding.
      implementation: `"xla"`, `"triton"` (forward only: differentiating it raises a TypeError) or
        `"auto"` (the Triton kernel on a GPU; its split count is its config's, `num_splits`
        applies to `"xla"`).
      config: an `attn.mla.triton.Config` (names the Triton backend); default:
        `attn.mla.triton.default_config`.

    Returns:
      `(o_lat [B, N, L] in q_lat's dtype, lse [B, N] float32)`; rows with length 0 give exactly 0
      and `-inf`. The per-head output is `expand_output(o_lat, w_uv)`.

    Raises:
      ValueError: ranks or sizes disagree (q_pe's rope dim, batch sizes, scale rows, P not
        divisible by the number of scale sub-blocks), non-positive `scale` / `num_splits` /
        `kv_lora_rank`, concrete kv_lengths outside `[0, max_pages · P]`, unknown implementation.
        In the checked mode (`attn.debug_checks`) traced lengths outside it and table ids
        outside `[-1, num_pages)` fail at run time.
      TypeError: wrong dtypes (fp8 pages without scales or scales with non-fp8 pages, integer
        queries, float tables or lengths).
      NotImplementedError: an implementation this op does not have.
    """
    return _check_decode_inputs(q_lat, q_pe, latent_pages, block_tables, kv_lengths,
                                kv_lora_rank, scale, latent_scales, num_splits)
