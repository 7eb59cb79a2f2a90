"""Public Gated DeltaNet ops: validation once, then the backend.

Semantics, layouts and the HF conventions they follow are documented in `attn/gdn/reference.py`.
`gdn_decode_pool` has a Triton kernel (`attn/gdn/triton.py`) and `gdn_chunked` /
`gdn_prefill_pool` a chunked one for prefill (`attn/gdn/triton_chunk.py`, chunk_size 64 only), the
defaults on a GPU; the other ops are XLA only and take no `implementation=`.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from attn import _checks
from attn._op import Backend, op
from attn.conv1d.api import check_cu_seqlens, check_slot_ids
from attn.gdn import reference

_TRITON_CHUNK = 64  # attn.gdn.triton_chunk.CHUNK, without importing triton here
# The widest padded H / Hv row of the chunked kernels' intermediates (bf16, or float32 when q, k
# and v all are) whose tiles fit in a Hopper block (`python -m experiments.tools.hopper_fit`).
_TRITON_MAX_ROW_BYTES = 512


def _check_inputs(q, k, v, g, beta, scale, single_token: bool = False) -> tuple[int, ...]:
    """Shapes, dtypes and GVA divisibility; returns `(B, T, Nk, Nv, H, Hv)`."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _checks.check_floating(name, x)
    _checks.check_rank("q", q, 4, "B T Nk H")
    _checks.check_rank("v", v, 4, "B T Nv Hv")
    if k.shape != q.shape:
        raise ValueError(f"k.shape={k.shape} must equal q.shape={q.shape}")
    bsz, t, nk, h = q.shape
    nv, hv = v.shape[2:]
    if v.shape[:2] != (bsz, t):
        raise ValueError(f"v.shape={v.shape} must start with (B, T)={(bsz, t)}")
    _checks.check_divisible("Nv", nv, "Nk", nk)
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (bsz, t, nv):
            raise ValueError(f"{name}.shape={x.shape} must be (B, T, Nv)={(bsz, t, nv)}")
    if t < 1:
        raise ValueError(f"q must hold at least one token; got shape {q.shape}")
    if single_token and t != 1:
        raise ValueError(f"a decode step takes one token: q.shape={q.shape} must have T=1")
    _checks.check_scale(scale)
    return bsz, t, nk, nv, h, hv


def _check_gates(g, beta) -> None:
    """g is a log-decay (<= 0) and beta a write strength in [0, 1]; outside, the state grows
    without bound. Checked when concrete (after every static check, so a static error is
    reported first); traced gates in the checked mode (`attn.debug_checks`)."""
    _checks.check_range("g", g, None, 0.0)
    _checks.check_range("beta", beta, 0.0, 1.0)


def _check_state(name: str, state, rows: int, nv: int, h: int, hv: int) -> None:
    _checks.check_floating(name, state)
    if state.shape != (rows, nv, h, hv):
        raise ValueError(f"{name}.shape={state.shape} must be {(rows, nv, h, hv)} "
                         f"([rows, Nv, H, Hv], K-first)")


def _check_pool(pool, nv: int, h: int, hv: int) -> None:
    _checks.check_floating("ssm_pool", pool)
    if pool.ndim != 4 or pool.shape[1:] != (nv, h, hv):
        raise ValueError(f"ssm_pool.shape={pool.shape} must be (slots, Nv, H, Hv) with "
                         f"(Nv, H, Hv)={(nv, h, hv)}")


def _check_chunk(chunk_size: int) -> None:
    if not isinstance(chunk_size, int):
        raise TypeError(f"{chunk_size=} must be a Python int")
    _checks.check_positive("chunk_size", chunk_size)


def _chunk_reasons(args, config=None) -> list[str]:
    del config
    reasons = []
    if args["chunk_size"] != _TRITON_CHUNK:
        reasons.append(f"chunk_size={args['chunk_size']}: the Triton chunked kernels take "
                       f"{_TRITON_CHUNK} only")
    q, v = args["q"], args["v"]
    itemsize = 4 if all(args[n].dtype == jnp.float32 for n in ("q", "k", "v")) else 2
    width = max(q.shape[-1], v.shape[-1])
    if max(16, 1 << (width - 1).bit_length()) * itemsize > _TRITON_MAX_ROW_BYTES:
        reasons.append(f"H={q.shape[-1]}, Hv={v.shape[-1]} with {itemsize * 8}-bit "
                       f"intermediates: the Triton chunked kernels' [64, H] tiles fit in a "
                       f"Hopper block's shared memory up to {_TRITON_MAX_ROW_BYTES} bytes a row "
                       f"(H <= 256 in 16-bit types, 128 in float32)")
    return reasons


def _triton_chunked(q, k, v, g, beta, *, chunk_size, **kw):
    from attn.gdn import triton_chunk

    del chunk_size  # 64 (`_chunk_reasons`)
    return triton_chunk.gdn_chunked(q, k, v, g, beta, **kw)


def _chunked(chunked):
    def run(*, q, k, v, g, beta, **args):
        return chunked(q, k, v, g, beta, **args)
    return run


def _prefill_pool(chunked):
    def run(*, q, k, v, g, beta, ssm_pool, slot_ids, **args):
        return reference.gdn_prefill_pool(q, k, v, g, beta, ssm_pool, slot_ids, chunked=chunked,
                                          **args)
    return run


def _decode_pool_triton(*, q, k, v, g, beta, ssm_pool, slot_ids, **args):
    from attn.gdn import triton as kernel

    return kernel.gdn_decode_pool(q, k, v, g, beta, ssm_pool, slot_ids, **args)


def _decode_pool_xla(*, q, k, v, g, beta, ssm_pool, slot_ids, **args):
    return reference.gdn_decode_pool(q, k, v, g, beta, ssm_pool, slot_ids, **args)


# The chunked Triton pipeline differentiates itself (its Triton backward, `_chunk_bwd.py`); the
# decode kernel is forward only.
_CHUNKED_BACKENDS = (
    Backend(name="triton", run=_chunked(_triton_chunked), supports=_chunk_reasons),
    Backend(name="xla", run=_chunked(reference.gdn_chunked), platforms=("cpu", "gpu")),
)
_PREFILL_POOL_BACKENDS = (
    Backend(name="triton", run=_prefill_pool(_triton_chunked), supports=_chunk_reasons),
    Backend(name="xla", run=_prefill_pool(reference.gdn_chunked), platforms=("cpu", "gpu")),
)
_DECODE_POOL_BACKENDS = (
    Backend(name="triton", run=_decode_pool_triton),
    Backend(name="xla", run=_decode_pool_xla, platforms=("cpu", "gpu")),
)


def gdn_gating(
    a: Float[Array, "*R Nv"], b: Float[Array, "*R Nv"],
    A_log: Float[Array, " Nv"], dt_bias: Float[Array, " Nv"],
) -> tuple[Float[Array, "*R Nv"], Float[Array, "*R Nv"]]:
    """Gated DeltaNet gates, in float32 (HF / SGLang `fused_gdn_gating`); XLA only.

    `g = -exp(A_log) · softplus(a + dt_bias)` (softplus is the identity above 20, as torch's) and
    `beta = sigmoid(b)`.

    Args:
      a: `[*R, Nv]` decay projection (`in_proj_a`).
      b: `[*R, Nv]` write-strength projection (`in_proj_b`).
      A_log: `[Nv]`.
      dt_bias: `[Nv]`.

    Returns:
      `(g, beta)` float32, shaped like `a`; `g <= 0`.

    Raises:
      ValueError: shapes disagree.
      TypeError: non-floating inputs.
    """
    for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _checks.check_floating(name, x)
    if a.ndim < 1 or b.shape != a.shape:
        raise ValueError(f"a.shape={a.shape} and b.shape={b.shape} must be equal [*R, Nv]")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != a.shape[-1:]:
            raise ValueError(f"{name}.shape={x.shape} must be (Nv,)={a.shape[-1:]}")
    return reference.gdn_gating(a, b, A_log, dt_bias)


def l2norm(x: Float[Array, "*R H"], eps: float = reference.L2NORM_EPS) -> Float[Array, "*R H"]:
    """`x · rsqrt(Σ x² + eps)` over the last axis, float32 (eps 1e-6 as HF and fla).

    Raises:
      TypeError: non-floating `x`.
      ValueError: `eps` not positive.
    """
    _checks.check_floating("x", x)
    if not eps > 0:
        raise ValueError(f"{eps=} must be positive")
    return reference.l2norm(x, eps)


def gdn_recurrent(
    q: Float[Array, "B T Nk H"], k: Float[Array, "B T Nk H"], v: Float[Array, "B T Nv Hv"],
    g: Float[Array, "B T Nv"], beta: Float[Array, "B T Nv"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B Nv H Hv"] | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B T Nv Hv"], Float[Array, "B Nv H Hv"]]:
    """Gated delta rule, token by token (HF `torch_recurrent_gated_delta_rule`); XLA only.

    Args:
      q, k: `[B, T, Nk, H]`.
      v: `[B, T, Nv, Hv]`; value head h uses key head `h // (Nv // Nk)`.
      g: `[B, T, Nv]` log-decay (<= 0).
      beta: `[B, T, Nv]` write strength in (0, 1).
      scale: query scale; None means `H ** -0.5`.
      initial_state: `[B, Nv, H, Hv]` (cast to float32), or None for zeros.
      use_qk_l2norm: l2-normalise q and k over H first (the Qwen3-Next / Qwen3.5 models do).

    Returns:
      `(o [B, T, Nv, Hv] in q.dtype, final_state [B, Nv, H, Hv] float32)`.

    Raises:
      ValueError: shapes disagree, `Nv % Nk != 0`, `T == 0`, `scale <= 0`, concrete gates out
        of range (`g > 0`, `beta` outside `[0, 1]`).
      TypeError: non-floating inputs.
    """
    bsz, _, _, nv, h, hv = _check_inputs(q, k, v, g, beta, scale)
    if initial_state is not None:
        _check_state("initial_state", initial_state, bsz, nv, h, hv)
    _check_gates(g, beta)
    return reference.gdn_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   use_qk_l2norm=use_qk_l2norm)


@op(name="gdn_chunked", backends=_CHUNKED_BACKENDS)
def gdn_chunked(
    q: Float[Array, "B T Nk H"], k: Float[Array, "B T Nk H"], v: Float[Array, "B T Nv Hv"],
    g: Float[Array, "B T Nv"], beta: Float[Array, "B T Nv"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "Ns Nv H Hv"] | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Int[Array, " Ns+1"] | None = None,
) -> tuple[Float[Array, "B T Nv Hv"], Float[Array, "Ns Nv H Hv"]]:
    """Chunked (WY) gated delta rule for prefill (HF `torch_chunk_gated_delta_rule`, fla `chunk`).

    Args:
      q, k, v, g, beta, scale, use_qk_l2norm: as `gdn_recurrent`.
      initial_state: `[Ns, Nv, H, Hv]` (`Ns = B`, or the sequence count with `cu_seqlens`), or
        None for zeros.
      chunk_size: tokens per chunk `C` (static).
      cu_seqlens: `[Ns + 1]` integer boundaries of sequences packed into one row (`B == 1`); no
        chunk crosses a boundary and each sequence has its own initial and final state.
      implementation: `"xla"`, `"triton"` (chunk_size 64 only) or `"auto"` (the Triton kernels on
        a GPU when chunk_size is 64, else XLA).

    Returns:
      `(o [B, T, Nv, Hv] in q.dtype, final_state [Ns, Nv, H, Hv] float32)`.

    Raises:
      ValueError: shapes disagree, bad `cu_seqlens`, `chunk_size <= 0`, `scale <= 0`, concrete
        gates out of range (`g > 0`, `beta` outside `[0, 1]`).
      TypeError: non-floating inputs, non-integer `cu_seqlens` or `chunk_size`.
      NotImplementedError: `implementation="triton"` with a chunk_size other than 64.
    """
    bsz, t, _, nv, h, hv = _check_inputs(q, k, v, g, beta, scale)
    _check_chunk(chunk_size)
    rows = bsz if cu_seqlens is None else check_cu_seqlens(cu_seqlens, bsz, t)
    if initial_state is not None:
        _check_state("initial_state", initial_state, rows, nv, h, hv)
    _check_gates(g, beta)
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, cu_seqlens=cu_seqlens)


def gdn_decode_step(
    q: Float[Array, "B 1 Nk H"], k: Float[Array, "B 1 Nk H"], v: Float[Array, "B 1 Nv Hv"],
    g: Float[Array, "B 1 Nv"], beta: Float[Array, "B 1 Nv"], state: Float[Array, "B Nv H Hv"],
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B 1 Nv Hv"], Float[Array, "B Nv H Hv"]]:
    """One decode token of the gated delta rule; XLA only.

    Args:
      q, k: `[B, 1, Nk, H]`; v `[B, 1, Nv, Hv]`; g, beta `[B, 1, Nv]`.
      state: `[B, Nv, H, Hv]` recurrent state (cast to float32).
      scale, use_qk_l2norm: as `gdn_recurrent`.

    Returns:
      `(o [B, 1, Nv, Hv] in q.dtype, new_state [B, Nv, H, Hv] float32)`.

    Raises:
      ValueError: shapes disagree, `T != 1`, concrete gates out of range (`g > 0`, `beta`
        outside `[0, 1]`).
      TypeError: non-floating inputs.
    """
    bsz, _, _, nv, h, hv = _check_inputs(q, k, v, g, beta, scale, single_token=True)
    _check_state("state", state, bsz, nv, h, hv)
    _check_gates(g, beta)
    return reference.gdn_decode_step(q, k, v, g, beta, state, scale=scale,
                                     use_qk_l2norm=use_qk_l2norm)


@op(name="gdn_decode_pool", backends=_DECODE_POOL_BACKENDS)
def gdn_decode_pool(
    q: Float[Array, "B 1 Nk H"], k: Float[Array, "B 1 Nk H"], v: Float[Array, "B 1 Nv Hv"],
    g: Float[Array, "B 1 Nv"], beta: Float[Array, "B 1 Nv"],
    ssm_pool: Float[Array, "slots Nv H Hv"], slot_ids: Int[Array, " B"],
    *,
    has_initial_state: Bool[Array, " B"] | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B 1 Nv Hv"], Float[Array, "slots Nv H Hv"]]:
    """Decode step on the recurrent-state slot pool: gather, step, scatter back.

    Slot 0 is the null slot: padding rows use it (0 or -1), read zeros, output 0 and write their
    garbage there; no request reads it. A row with `has_initial_state=False` starts from zeros
    whatever its slot holds (stale state or NaN).

    Args:
      q, k, v, g, beta, scale, use_qk_l2norm: as `gdn_decode_step`.
      ssm_pool: `[slots, Nv, H, Hv]` float32 states.
      slot_ids: `[B]` int32 slot per row; 0 = padding. Real slots must be distinct.
      has_initial_state: `[B]` bool, or None (= every real row continues its slot's state).
      implementation: `"xla"`, `"triton"` or `"auto"` (the Triton kernel on a GPU). The kernel
        updates the pool in place when the caller donates it, and leaves slot 0 untouched.

    Returns:
      `(o [B, 1, Nv, Hv], new_pool [slots, Nv, H, Hv])`.

    Raises:
      ValueError: shapes disagree, slot ids out of range or shared, concrete gates out of range
        (`g > 0`, `beta` outside `[0, 1]`).
      TypeError: wrong dtypes.
    """
    bsz, _, _, nv, h, hv = _check_inputs(q, k, v, g, beta, scale, single_token=True)
    _check_pool(ssm_pool, nv, h, hv)
    check_slot_ids(slot_ids, bsz, ssm_pool.shape[0], has_initial_state)
    _check_gates(g, beta)
    return dict(q=q, k=k, v=v, g=g, beta=beta, ssm_pool=ssm_pool, slot_ids=slot_ids,
                has_initial_state=has_initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm)


@op(name="gdn_prefill_pool", backends=_PREFILL_POOL_BACKENDS)
def gdn_prefill_pool(
    q: Float[Array, "B T Nk H"], k: Float[Array, "B T Nk H"], v: Float[Array, "B T Nv Hv"],
    g: Float[Array, "B T Nv"], beta: Float[Array, "B T Nv"],
    ssm_pool: Float[Array, "slots Nv H Hv"], slot_ids: Int[Array, " Ns"],
    *,
    has_initial_state: Bool[Array, " Ns"] | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Int[Array, " Ns+1"] | None = None,
) -> tuple[Float[Array, "B T Nv Hv"], Float[Array, "slots Nv H Hv"]]:
    """Chunked prefill on the slot pool: `h0 = where(has_init, pool[slot], 0)`, final states
    scattered back to the slots.

    Args:
      q, k, v, g, beta, scale, use_qk_l2norm, chunk_size, cu_seqlens: as `gdn_chunked`.
      ssm_pool: `[slots, Nv, H, Hv]`.
      slot_ids: `[Ns]` one slot per row (or per sequence with `cu_seqlens`); 0 = padding.
      has_initial_state: `[Ns]` bool, or None (= every real sequence continues its slot).
      implementation: as `gdn_chunked` (gather, mask and scatter stay in XLA).

    Returns:
      `(o [B, T, Nv, Hv], new_pool)`; tokens of padding rows / sequences give 0.

    Raises:
      ValueError: shapes disagree, bad slot ids or boundaries, concrete gates out of range
        (`g > 0`, `beta` outside `[0, 1]`).
      TypeError: wrong dtypes.
      NotImplementedError: `implementation="triton"` with a chunk_size other than 64.
    """
    bsz, t, _, nv, h, hv = _check_inputs(q, k, v, g, beta, scale)
    _check_chunk(chunk_size)
    rows = bsz if cu_seqlens is None else check_cu_seqlens(cu_seqlens, bsz, t)
    _check_pool(ssm_pool, nv, h, hv)
    check_slot_ids(slot_ids, rows, ssm_pool.shape[0], has_initial_state)
    _check_gates(g, beta)
    return dict(q=q, k=k, v=v, g=g, beta=beta, ssm_pool=ssm_pool, slot_ids=slot_ids,
                has_initial_state=has_initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                chunk_size=chunk_size, cu_seqlens=cu_seqlens)
