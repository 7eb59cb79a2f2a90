"""Reference Gated DeltaNet (gated delta rule): gates, recurrent, chunked WY, decode, slot pools.

Layouts (DESIGN.md): q, k `[B, T, Nk, H]`, v `[B, T, Nv, Hv]`, g (log-decay, <= 0) and beta
`[B, T, Nv]`, recurrent state `[B, Nv, H, Hv]` float32, K-first. Value head h reads key head
`h // (Nv // Nk)` (GVA, HF's `repeat_interleave`). Per token and value head:

    S ← exp(g_t) · S
    u = beta_t · (v_t − Sᵀ k_t)
    S ← S + k_t uᵀ
    o_t = Sᵀ q_t

Conventions of HF's `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`
(transformers qwen3_next / qwen3_5), which the models must match:
  * q, k, v, g, beta are cast to float32 first; all math and the state are float32; the output
    comes back in q's dtype.
  * `use_qk_l2norm=True` l2-normalises q and k (not v) over H, `x · rsqrt(Σx² + 1e-6)`, before the
    query scale. The models always pass True; the functions default to False, as HF's and fla's.
  * The query is always multiplied by `scale`, default `H ** -0.5` (HF has no scale argument).
  * g and beta arrive already computed (`gdn_gating`); HF's models compute them in float32.

The chunked form pads every sequence to a multiple of the chunk with zero q/k/v/g/beta rows: a
zero row has k = 0 and exp(0) = 1, so it leaves the state unchanged. Einsums run at HIGHEST
precision so an f32 reference stays f32 on GPUs (no TF32).

Slot pools: `ssm_pool [slots, Nv, H, Hv]` float32, slot 0 is the null slot (see
`attn/conv1d/reference.py:gather_slots`).
"""

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular
from jaxtyping import Array, Float

from attn.conv1d.reference import gather_slots

_HI = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0


def gdn_gating(
    a: Float[Array, "*R Nv"], b: Float[Array, "*R Nv"],
    A_log: Float[Array, " Nv"], dt_bias: Float[Array, " Nv"],
) -> tuple[Float[Array, "*R Nv"], Float[Array, "*R Nv"]]:
    """Decay and write strength from the projections (float32).

    `g = -exp(A_log) · softplus(a + dt_bias)` with torch's softplus (identity above 20) and
    `beta = sigmoid(b)`.

    Returns:
      `(g, beta)`, both float32 and shaped like `a`.
    """
    x = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    softplus = jnp.where(x > SOFTPLUS_THRESHOLD, x,
                         jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))
    g = -jnp.exp(A_log.astype(jnp.float32)) * softplus
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def l2norm(x: Float[Array, "*R H"], eps: float = L2NORM_EPS) -> Float[Array, "*R H"]:
    """`x · rsqrt(Σ x² + eps)` over the last axis, in float32 (HF's / fla's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """float32; l2-norm and scale as HF; key heads repeated to value heads."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q * scale
    ratio = v.shape[-2] // q.shape[-2]
    q, k = jnp.repeat(q, ratio, axis=-2), jnp.repeat(k, ratio, axis=-2)  # [..., Nv, H]
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)


def _initial(initial_state, shape):
    if initial_state is None:
        return jnp.zeros(shape, jnp.float32)
    return initial_state.astype(jnp.float32)


def _delta_step(state, q, k, v, g, beta):
    """One token. state `[B, Nv, H, Hv]`; q, k `[B, Nv, H]`; v `[B, Nv, Hv]`; g, beta `[B, Nv]`."""
    state = state * jnp.exp(g)[..., None, None]
    u = beta[..., None] * (v - jnp.einsum("bnhv,bnh->bnv", state, k, precision=_HI))
    state = state + jnp.einsum("bnh,bnv->bnhv", k, u, precision=_HI)
    return state, jnp.einsum("bnhv,bnh->bnv", state, q, precision=_HI)


def gdn_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=False):
    """Specification of `attn.gdn.gdn_recurrent`: the gated delta rule token by token
    (`lax.scan` over T)."""
    q32, k32, v32, g32, b32 = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    bsz, _, nv, hv = v.shape
    state = _initial(initial_state, (bsz, nv, q.shape[-1], hv))
    xs = [jnp.moveaxis(x, 1, 0) for x in (q32, k32, v32, g32, b32)]  # time-major
    state, o = jax.lax.scan(lambda s, x: _delta_step(s, *x), state, xs)
    return jnp.moveaxis(o, 0, 1).astype(q.dtype), state


def gdn_decode_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """Specification of `attn.gdn.gdn_decode_step`: a rank-1 update per head, no scan."""
    q32, k32, v32, g32, b32 = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    state, o = _delta_step(state.astype(jnp.float32), q32[:, 0], k32[:, 0], v32[:, 0],
                           g32[:, 0], b32[:, 0])
    return o[:, None].astype(q.dtype), state


def _intra_chunk(q, k, v, g, beta):
    """Everything that does not depend on the incoming state, for a batch of chunks.

    Args: q, k `[..., C, H]`, v `[..., C, Hv]`, g, beta `[..., C]` (float32, prepared).

    Returns:
      `(q_dec, k_dec, attn, u, w, chunk_decay)`: q ⊙ exp(G), k ⊙ exp(G_C − G), the decayed causal
      scores `(Q Kᵀ) ⊙ L` (diagonal included), the WY pair U = T V_β and W = T (K_β ⊙ exp(G)), and
      exp(G_C).
    """
    c = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # G_i, [..., C]
    causal = jnp.tril(jnp.ones((c, c), bool))
    # L_ij = exp(G_i − G_j) for j <= i. Masking before the exp keeps j > i from overflowing.
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    strict = jnp.einsum("...ih,...jh->...ij", k_beta, k, precision=_HI) * decay
    strict = jnp.where(jnp.tril(causal, -1), strict, 0.0)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * jnp.exp(cum)[..., None]], axis=-1)
    # T = (I + StrictLower(K_β Kᵀ ⊙ L))⁻¹ applied by forward substitution (unit lower triangle).
    eye = jnp.eye(c, dtype=strict.dtype)
    uw = solve_triangular(strict + eye, rhs, lower=True, unit_diagonal=True)
    u, w = uw[..., : v.shape[-1]], uw[..., v.shape[-1]:]
    attn = jnp.einsum("...ih,...jh->...ij", q, k, precision=_HI) * decay
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    return q_dec, k_dec, attn, u, w, jnp.exp(cum[..., -1])


def _inter_chunk(state, pieces):
    """Apply one chunk to the incoming state `[..., H, Hv]`; returns (new state, chunk output)."""
    q_dec, k_dec, attn, u, w, chunk_decay = pieces
    v_new = u - jnp.einsum("...ih,...hv->...iv", w, state, precision=_HI)  # V_new = U − W S
    o = (jnp.einsum("...ih,...hv->...iv", q_dec, state, precision=_HI)
         + jnp.einsum("...ij,...jv->...iv", attn, v_new, precision=_HI))
    state = (chunk_decay[..., None, None] * state
             + jnp.einsum("...ih,...iv->...hv", k_dec, v_new, precision=_HI))
    return state, o


def gdn_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=False,
                chunk_size=64, cu_seqlens=None):
    """Specification of `attn.gdn.gdn_chunked`: the chunked (WY) form, intra-chunk work batched
    and `lax.scan` over chunks; with `cu_seqlens` chunks never cross a sequence boundary and the
    state restarts from `initial_state[i]` at sequence i."""
    if cu_seqlens is not None:
        return _chunked_varlen(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, chunk_size,
                               cu_seqlens)
    c = chunk_size
    bsz, t, nv, hv = v.shape
    pad = -t % c
    xs = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    # [B, T, ...] -> [nC, B, Nv, C, ...]: chunks lead (scan axis), heads before positions.
    xs = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in xs]
    xs = [jnp.moveaxis(x.reshape((bsz, -1, c) + x.shape[2:]), (1, 2), (0, 3)) for x in xs]
    pieces = _intra_chunk(*xs)
    state = _initial(initial_state, (bsz, nv, q.shape[-1], hv))
    state, o = jax.lax.scan(_inter_chunk, state, pieces)  # o [nC, B, Nv, C, Hv]
    o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(bsz, -1, nv, hv)[:, :t]
    return o.astype(q.dtype), state


def _varlen_layout(cu_seqlens, tokens, c):
    """Chunk slots for packed sequences: per-sequence chunks, never crossing a boundary.

    Returns:
      `(tok [Nc, C] token index or `tokens` for an empty position, seq [Nc], first [Nc],
      last [Nc])`, where `Nc = (tokens + Ns (C − 1)) // C` bounds the chunk count statically.
    """
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    n_chunks = (lens + c - 1) // c  # [Ns]
    chunk_end = jnp.cumsum(n_chunks)
    chunk_start = chunk_end - n_chunks
    slots = max((tokens + n * (c - 1)) // c, 1)
    j = jnp.arange(slots)
    seq_raw = jnp.searchsorted(chunk_end, j, side="right")  # == Ns for unused chunk slots
    seq = jnp.minimum(seq_raw, n - 1)
    local = j - chunk_start[seq]
    used = seq_raw < n
    tok = cu[seq, None] + local[:, None] * c + jnp.arange(c)  # [Nc, C]
    tok = jnp.where(used[:, None] & (tok < cu[seq + 1, None]), tok, tokens)
    return tok, seq, used & (local == 0), used & (local == n_chunks[seq] - 1)


def _chunked_varlen(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, c, cu_seqlens):
    t, nv, hv = v.shape[1:]
    n = cu_seqlens.shape[0] - 1
    tok, seq, first, last = _varlen_layout(cu_seqlens, t, c)
    xs = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    # Gather packed tokens into chunk slots [Nc, 1, Nv, C, ...]; empty positions read zeros.
    xs = [jnp.moveaxis(jnp.take(x[0], tok, axis=0, mode="fill", fill_value=0), 1, 2)[:, None]
          for x in xs]
    pieces = _intra_chunk(*xs)
    h0 = _initial(initial_state, (n, nv, q.shape[-1], hv))

    def body(carry, inputs):
        state, finals = carry
        piece, s, is_first, is_last = inputs
        state = jnp.where(is_first, h0[s][None], state)  # a new sequence starts from its h0
        state, o = _inter_chunk(state, piece)
        finals = finals.at[s].set(jnp.where(is_last, state[0], finals[s]))
        return (state, finals), o

    init = (jnp.zeros((1, nv, q.shape[-1], hv), jnp.float32), h0)
    (_, finals), o = jax.lax.scan(body, init, (pieces, seq, first, last))
    o = jnp.moveaxis(o[:, 0], 1, 2)  # [Nc, C, Nv, Hv]
    out = jnp.zeros((t, nv, hv), jnp.float32).at[tok].set(o, mode="drop")
    return out[None].astype(q.dtype), finals


def gdn_decode_pool(q, k, v, g, beta, ssm_pool, slot_ids, *, has_initial_state=None, scale=None,
                    use_qk_l2norm=False):
    """Specification of `attn.gdn.gdn_decode_pool`: gather `pool[slot_ids]` (zeros for padding /
    fresh rows), step, scatter back; padding rows (slot 0) output 0 and write the null slot."""
    state, ids = gather_slots(ssm_pool, slot_ids, has_initial_state)
    o, state = gdn_decode_step(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    o = jnp.where((ids > 0)[:, None, None, None], o, jnp.zeros((), o.dtype))
    return o, ssm_pool.at[ids].set(state.astype(ssm_pool.dtype))


def gdn_prefill_pool(q, k, v, g, beta, ssm_pool, slot_ids, *, has_initial_state=None, scale=None,
                     use_qk_l2norm=False, chunk_size=64, cu_seqlens=None, chunked=None):
    """Specification of `attn.gdn.gdn_prefill_pool`: `h0 = where(has_init, pool[slot], 0)`, final
    states written back, padding tokens (slot 0) output 0. `chunked` replaces `gdn_chunked` (same
    keywords; the api passes the Triton pipeline), None for this reference."""
    h0, ids = gather_slots(ssm_pool, slot_ids, has_initial_state)
    chunked = gdn_chunked if chunked is None else chunked
    o, final = chunked(q, k, v, g, beta, scale=scale, initial_state=h0,
                           use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                           cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        live = (ids > 0)[:, None, None, None]
    else:
        tok = jnp.arange(q.shape[1])
        seq = jnp.searchsorted(cu_seqlens.astype(jnp.int32)[1:], tok, side="right")
        live = (ids[jnp.minimum(seq, ids.shape[0] - 1)] > 0)[None, :, None, None]
    o = jnp.where(live, o, jnp.zeros((), o.dtype))
    return o, ssm_pool.at[ids].set(final.astype(ssm_pool.dtype))
