"""Triton chunked (WY) gated delta rule for prefill: fla's pipeline in two kernels.

Chunks of `C = 64` tokens never cross a sequence boundary (`B` rows of T tokens, or the packed
sequences of `cu_seqlens`); a chunk table built in XLA (`_chunk_tables`) gives every chunk slot its
first token and length (0 for the unused slots of the static varlen bound).

1. The intra-chunk kernel (`_chunk_intra.py`), a program per chunk and value head (or pair of
   value heads): the chunk-local cumulative gates `G`, the WY pair `W`, `U` from
   `(I + A)⁻¹` solved in registers, the output's intra-chunk scores `P = (Q Kᵀ) ⊙ L`, and with
   l2-norm the normalised keys and scaled queries.
2. The state kernel (`_chunk_state.py`), a program per sequence, value head and value slice,
   sequential over the sequence's chunks: `V_new = U − W S`, the output
   `O = (Q ⊙ exp(G)) S + P V_new`, the state update; the last state is the final state.

Launch choices (warps, stages, slice width, grid orders, value-head pairs) are `Config`
(`_chunk_config.py`); `default_config` picks them per shape. H100, Nk16 Nv32 H = Hv = 128, bf16:
1.6x fla's `chunk_gated_delta_rule` at B1 T32K and 1.8x at B8 T4K (benchmarks/prefill.md).

q and k are l2-normalised (optional) and q scaled inside the kernels that read them, so nothing is
precomputed in XLA. Value head h reads key head `h // (Nv // Nk)`. With float32 q, k and v
everything is float32 and the dots run in 3-pass TF32 (`tf32x3`: about float32 accuracy on tensor
cores; the interpreter tests match the float64 recurrence to 1e-5). Otherwise, as fla: the
intermediates (W, U, P, the normalised keys / queries) in v's dtype and every dot with bf16
operands and float32 accumulation; the state carried from chunk to chunk stays float32 in
registers (rounded to bf16 only as a dot operand).

Gradients (`jax.custom_vjp`): under differentiation the state kernel is
`_chunk_bwd_state.state_save_kernel`, the same pass that also stores the state entering every
chunk and `V_new`; the backward (`_chunk_bwd.py`) is a reverse pass over the state's cotangent and
three chunk-parallel kernels, for q, k, v, g, β and the initial state, with the output's and the
final state's cotangents, varlen and l2-norm included.

Supports: any B, T, Nk | Nv, H and Hv up to 256 in 16-bit types and 128 in float32 (padded to
powers of two >= 16 and masked; wider rows' tiles do not fit in a Hopper block's shared memory,
and `gdn_chunked` runs XLA), initial and final states `[Ns, Nv, H, Hv]` float32, varlen with
empty sequences, first-order gradients. Not supported: chunk sizes other than 64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton

from attn._harness import triton_call
from attn.gdn import _chunk_bwd
from attn.gdn import _chunk_config as cfg
from attn.gdn._chunk_bwd_state import state_save_kernel
from attn.gdn._chunk_config import CHUNK, Config, default_config
from attn.gdn._chunk_intra import intra_kernel, intra_pair_kernel
from attn.gdn._chunk_state import state_kernel
from attn.gdn.reference import L2NORM_EPS

__all__ = ["CHUNK", "Config", "default_config", "gdn_chunked", "stages"]


def gdn_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=False,
                cu_seqlens=None, config: Config | None = None):
    """Chunked gated delta rule (C = 64) through the kernels; inputs validated by the api.

    Differentiable: the backward runs the Triton kernels of `_chunk_bwd.py`.

    Args:
      q, k: `[B, T, Nk, H]`; v `[B, T, Nv, Hv]`; g, beta `[B, T, Nv]`.
      scale: query scale, None for `H ** -0.5`.
      initial_state: `[Ns, Nv, H, Hv]` (cast to float32), or None for zeros.
      use_qk_l2norm: l2-normalise q and k over H in the kernels (eps 1e-6).
      cu_seqlens: `[Ns + 1]` packed-sequence boundaries (`B == 1`), or None (`Ns = B`).
      config: launch configuration; None for `default_config`.

    Returns:
      `(o [B, T, Nv, Hv] in q.dtype, final_state [Ns, Nv, H, Hv] float32)`.
    """
    scale = None if scale is None else float(scale)
    return _chunked(q, k, v, g, beta, initial_state, cu_seqlens, scale, bool(use_qk_l2norm),
                    config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _chunked(q, k, v, g, beta, h0, cu, scale, l2, config):
    return _forward(q, k, v, g, beta, h0, cu, scale=scale, use_qk_l2norm=l2, config=config)


def _chunked_fwd(q, k, v, g, beta, h0, cu, scale, l2, config):
    out, saved = _forward_saving(q, k, v, g, beta, h0, cu, scale=scale, use_qk_l2norm=l2,
                                 config=config)
    return out, (q, k, v, g, beta, h0, cu, saved)


def _chunked_bwd(scale, l2, config, res, cotangents):
    q, k, v, g, beta, h0, cu, saved = res
    do, dfinal = cotangents
    pl = plan(q, k, v, g, beta, h0, cu, scale=scale, use_qk_l2norm=l2, config=config)
    dtypes = dict(q=q.dtype, k=k.dtype, v=v.dtype, g=g.dtype, beta=beta.dtype)
    dq, dk, dv, dg, dbeta, dh0 = _chunk_bwd.backward(pl, saved, do, dfinal, dtypes)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
            dbeta.reshape(beta.shape), None if h0 is None else dh0.astype(h0.dtype), None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _forward(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, use_qk_l2norm, config):
    intra, state, x = stages(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
                             use_qk_l2norm=use_qk_l2norm, config=config)
    tables = (x["cstart"], x["clen"])
    gcum, w, u, kn, p = intra(x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], *tables)
    final, o = state(kn, w, u, gcum, *tables, x["sfirst"], x["scount"], x["h0"], x["q2"], p)
    return o.reshape(v.shape), final


def _forward_saving(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, use_qk_l2norm,
                    config):
    """`_forward` with `state_save_kernel`: also returns the backward's residuals."""
    pl = plan(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
              use_qk_l2norm=use_qk_l2norm, config=config)
    x, inter = pl["x"], pl["inter"]
    extra = (jax.ShapeDtypeStruct((pl["n_chunks"], pl["nv"], pl["h"], pl["hv"]), inter),
             jax.ShapeDtypeStruct((pl["n_tok"], pl["nv"], pl["hv"]), inter))
    tables = (x["cstart"], x["clen"])
    gcum, w, u, kn, p = intra_stage(pl)(x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], *tables)
    final, o, hs, vn = state_stage(pl, state_save_kernel, extra, cfg.bwd_state_launch)(
        kn, w, u, gcum, *tables, x["sfirst"], x["scount"], x["h0"], x["q2"], p)
    saved = dict(gcum=gcum, w=w, kn=kn, p=p, hs=hs, vn=vn, o=o)
    return (o.reshape(v.shape), final), saved


def plan(q, k, v, g, beta, initial_state=None, cu_seqlens=None, *, scale=None,
         use_qk_l2norm=False, config: Config | None = None) -> dict:
    """What every launch of the pipeline, forward and backward, shares: shapes, dtypes, the
    config (`default_config` where None), the chunk tables and the flattened inputs `x`
    (`q2, k2, v2, g2, beta2, cstart, clen, sfirst, scount, h0`).

    Raises:
      ValueError: a head-major grid over more than 65535 chunks / sequences, or `intra_pairs`
        with an odd number of value heads per key head.
    """
    bsz, t, nk, h = q.shape
    nv, hv = v.shape[2:]
    n_tok = bsz * t
    n_seq = bsz if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = all(x.dtype == jnp.float32 for x in (q, k, v))
    inter = jnp.float32 if f32 else v.dtype
    if config is None:
        config = default_config(n_seq, nv, hv, num_chunks=triton.cdiv(n_tok, CHUNK) + n_seq,
                                nk=nk, h=h, itemsize=jnp.dtype(inter).itemsize)
    scale = h**-0.5 if scale is None else scale
    cstart, clen, sfirst, scount = _chunk_tables(bsz, t, cu_seqlens)
    n_chunks = cstart.shape[0]
    has_init = initial_state is not None
    x = dict(q2=q.reshape(n_tok, nk, h), k2=k.reshape(n_tok, nk, h), v2=v.reshape(n_tok, nv, hv),
             g2=g.reshape(n_tok, nv), beta2=beta.reshape(n_tok, nv), cstart=cstart, clen=clen,
             sfirst=sfirst, scount=scount,
             h0=initial_state.astype(jnp.float32) if has_init else jnp.zeros((1,), jnp.float32))
    block_h = max(16, triton.next_power_of_2(h))
    block_hv = max(16, triton.next_power_of_2(hv))
    l2 = bool(use_qk_l2norm)  # the intra kernel stores the normalised keys and scaled queries
    if config.intra_head_major and n_chunks > cfg.GRID_YZ_MAX:
        raise ValueError(f"intra_head_major: {n_chunks} chunks > 65535 (the grid's y limit)")
    if config.state_slice_major and n_seq > cfg.GRID_YZ_MAX:
        raise ValueError(f"state_slice_major: {n_seq} sequences > 65535 (the grid's z limit)")
    if config.intra_pairs and (nv % nk or (nv // nk) % 2):
        raise ValueError(f"intra_pairs needs an even number of value heads per key head: "
                         f"Nv={nv}, Nk={nk} (Nv // Nk = {nv // nk})")
    return dict(
        x=x, config=config, n_tok=n_tok, n_seq=n_seq, n_chunks=n_chunks, nk=nk, nv=nv, h=h, hv=hv,
        inter=inter, out_dtype=q.dtype, has_init=has_init, l2=l2,
        qn_off=n_tok * nk * h if l2 else 0, block_h=block_h, block_hv=block_hv,
        t_row=t if cu_seqlens is None else 0,
        common=dict(F32=f32, NK=nk, NV=nv, H=h, HV=hv, BLOCK_H=block_h, BT=CHUNK,
                    SCALE=float(scale)))


def stages(q, k, v, g, beta, initial_state=None, cu_seqlens=None, *, scale=None,
           use_qk_l2norm=False, config: Config | None = None):
    """The pipeline's two kernel launches as separate functions (`_forward` chains them; a
    profiler can time them one by one).

    Returns:
      `(intra, state, x)`:
      `intra(q2, k2, v2, g2, beta2, cstart, clen) -> (gcum, w, u, kn, p)`,
      `state(kn, w, u, gcum, cstart, clen, sfirst, scount, h0, q2, p) -> (final, o [B·T, Nv, Hv])`,
      and `x` the flattened inputs and chunk tables by those names. With l2-norm `kn` is
      `[2·B·T, Nk, H]`: the normalised keys, then the normalised and scaled queries (the state
      kernel reads its queries there, not from `q2`); without, `kn` is `k2` itself.

    Raises:
      ValueError: as `plan`.
    """
    pl = plan(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
              use_qk_l2norm=use_qk_l2norm, config=config)
    return intra_stage(pl), state_stage(pl), pl["x"]


def intra_stage(pl: dict):
    """`intra(q2, k2, v2, g2, beta2, cstart, clen) -> (gcum, w, u, kn, p)` of plan `pl`."""
    config, n_tok, nk, nv, h, hv = (pl[n] for n in ("config", "n_tok", "nk", "nv", "h", "hv"))
    inter, l2 = pl["inter"], pl["l2"]

    def intra(q2, k2, v2, g2, beta2, cstart, clen):
        gcum, w, u, kn, p = triton_call(
            q2, k2, v2, g2, beta2, cstart, clen,
            kernel=intra_pair_kernel if config.intra_pairs else intra_kernel,
            out_shape=(jax.ShapeDtypeStruct((n_tok, nv), jnp.float32),
                       jax.ShapeDtypeStruct((n_tok, nv, h), inter),
                       jax.ShapeDtypeStruct((n_tok, nv, hv), inter),
                       jax.ShapeDtypeStruct((2 * n_tok, nk, h) if l2 else (1,), inter),
                       jax.ShapeDtypeStruct((n_tok, nv, CHUNK), inter)),
            grid=cfg.intra_grid(config, nv, pl["n_chunks"]),
            num_warps=config.intra_warps,
            num_stages=1,
            EPS=L2NORM_EPS, L2NORM=l2, BLOCK_HV=pl["block_hv"], STORE_KN=l2, STORE_QN=l2,
            QN_OFF=pl["qn_off"], **cfg.intra_constexprs(config), **pl["common"],
        )
        return gcum, w, u, kn if l2 else k2, p

    return intra


def state_stage(pl: dict, kernel=state_kernel, extra_out=(), launch=cfg.state_launch):
    """`state(kn, w, u, gcum, cstart, clen, sfirst, scount, h0, q2, p) -> (final, o, *extra)` of
    plan `pl`: `state_kernel`, or a kernel with its arguments and the outputs `extra_out` after
    them (`state_save_kernel`, with `launch=cfg.bwd_state_launch`)."""
    config, nv, hv, l2 = pl["config"], pl["nv"], pl["hv"], pl["l2"]
    bv = min(config.block_hv_state, pl["block_hv"])

    def state(kn, w, u, gcum, cstart, clen, sfirst, scount, h0, q2, p):
        return triton_call(
            kn, w, u, gcum, cstart, clen, sfirst, scount, h0, kn if l2 else q2, p,
            kernel=kernel,
            out_shape=(jax.ShapeDtypeStruct((pl["n_seq"], nv, pl["h"], hv), jnp.float32),
                       jax.ShapeDtypeStruct((pl["n_tok"], nv, hv), pl["out_dtype"]),
                       *extra_out),
            grid=cfg.state_grid(config, pl["n_seq"], nv, triton.cdiv(hv, bv)),
            **launch(config),
            HAS_INIT=pl["has_init"], BLOCK_HV=bv, QN=l2, Q_OFF=pl["qn_off"],
            **cfg.state_constexprs(config, pl["t_row"]), **pl["common"],
        )

    return state


def _chunk_tables(b: int, t: int, cu_seqlens):
    """Chunk slots of C tokens that never cross a sequence.

    Returns:
      `(chunk_start [Nc], chunk_len [Nc], seq_first_chunk [Ns], seq_chunks [Ns])` int32; unused
      slots (varlen's static bound `Nc = (T + Ns (C − 1)) // C`) have length 0.
    """
    c = CHUNK
    if cu_seqlens is None:
        per_row = -(-t // c)
        j = np.arange(b * per_row)
        local = j % per_row
        tables = ((j // per_row) * t + local * c, np.minimum(t - local * c, c),
                  np.arange(b) * per_row, np.full(b, per_row))
        return tuple(jnp.asarray(x, jnp.int32) for x in tables)
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    count = (cu[1:] - cu[:-1] + c - 1) // c
    end = jnp.cumsum(count)
    first = end - count
    j = jnp.arange(max((t + n * (c - 1)) // c, 1), dtype=jnp.int32)
    seq_raw = jnp.searchsorted(end, j, side="right")
    used = seq_raw < n
    seq = jnp.minimum(seq_raw, n - 1)
    start = cu[seq] + (j - first[seq]) * c
    length = jnp.where(used, jnp.clip(cu[seq + 1] - start, 0, c), 0)
    return (jnp.where(used, start, 0).astype(jnp.int32), length.astype(jnp.int32),
            first.astype(jnp.int32), count.astype(jnp.int32))
