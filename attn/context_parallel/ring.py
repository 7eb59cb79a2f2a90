"""Ring attention: K/V blocks travel around a mesh axis; each device attends to the one it holds.

Runs inside `shard_map` on the zig-zag layout (`_layout.py`): device `d` holds query / key / value
chunks `a = d` and `b = 2D - 1 - d` of `C` tokens each. At step `r = 0 .. D-1` it holds the K/V
block of device `src = (d - r) mod D` (chunks `src` and `2D - 1 - src`); the `ppermute` that
brings step `r + 1`'s block is issued before step `r`'s attention and depends on nothing it
computes, so the transfer overlaps the compute. Every (query chunk, key chunk) block runs through
`attn.dense.attention` (the flash kernels on a GPU), which returns `(out, lse)`; each query
chunk's partials are merged once, at the end, by log-sum-exp.

Blocks per step:

- causal, no window (the balanced path): step 0 runs the two diagonal blocks (causal) and
  `b x a` (whole); the fourth, `a x (2D-1-d)`, is fully masked and never runs. At a step
  `r >= 1`, either `src < d` (both query chunks see key chunk `src` whole and nothing of
  `2D - 1 - src`) or `src > d` (query chunk `b` sees both key chunks whole, `a` sees nothing).
  Both cases are two whole `C x C` blocks, so the operands are chosen by selects, no branch:
  every device does two block-equivalents of work at every step. Whole blocks take no mask and
  no offset, which is what the fastest kernel (Mosaic GPU) supports.
- causal with a window (and sinks): each of a step's four blocks runs under `lax.cond`, with its
  relative query offset and the sinks moved into its frame, and is skipped (output 0, lse -inf,
  nothing computed) when no query of it sees any key of it for any KV head (causal or outside
  the window and the sinks).
- non-causal: one whole `2C x 2C` block per step; padding keys masked by `kv_lengths`.

Gradients come from JAX autodiff: the `ppermute`'s transpose sends dK / dV back around the ring,
and each block's custom VJP (Triton backward kernels on a GPU) gets the merge's cotangents for
both its `out` and its `lse`. Autodiff keeps every block's residuals (its partial `out`, `lse`
and selected operands): about `D` partial outputs per query chunk beside the activations.

Measured (4x H100, causal N32 / K8 H128 bf16, benchmarks/multigpu.json): S = 512K in 933 ms,
0.98x of 4x the one-GPU Mosaic kernel at its largest S (512K); 1M in 3.74 s (0.98x), forward +
backward at 1M in 39.1 s. The three `ppermute`s alone take 6 ms at 512K (10 ms at 1M), under 1%
of the step, so how much of them the compute hides barely matters (about 1 ms at 512K).

Not done here: the window path walks all `D` steps (it skips compute, not transfers). GDN layers
pass their chunk state along the same ring layout in `gdn.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from attn import dense
from attn.context_parallel import _layout


def ring_attention_shard(
    q: Float[Array, "B T2 N H"],
    k: Float[Array, "B T2 K H"],
    v: Float[Array, "B T2 K Hv"],
    *,
    axis_name: str,
    seq_len: int,
    causal: bool,
    scale: float,
    window: Int[Array, " K"] | None,
    sinks: Int[Array, " K"],
    implementation: str,
    permute: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[Float[Array, "B T2 N Hv"], Float[Array, "B T2 N"]]:
    """One device's share of ring attention (inside `shard_map`; arguments validated by `api`).

    Args:
      q, k, v: this device's zig-zag block, `T2 = 2C` tokens (chunks `d` and `2D - 1 - d`).
      axis_name: the mesh axis the sequence is sharded over.
      seq_len: real (unpadded) sequence length `S`; tokens at positions `>= S` are padding.
      causal, scale: as in `attn.dense.attention`.
      window: `[K]` int32 or None (no window); needs `causal`.
      sinks: `[K]` int32; only with a window.
      implementation: passed to every block's `attn.dense.attention`.
      permute: moves a block one device along the ring (default `lax.ppermute` from `i` to
        `i + 1`); the benchmark passes the identity to time the compute alone.

    Returns:
      `(out [B, T2, N, Hv] in q's dtype, lse [B, T2, N] float32)` for this device's queries.
    """
    num = lax.axis_size(axis_name)
    chunk = q.shape[1] // 2
    if permute is None:
        pairs = [(i, (i + 1) % num) for i in range(num)]
        permute = functools.partial(lax.ppermute, axis_name=axis_name, perm=pairs)
    attend = functools.partial(dense.attention, scale=scale, implementation=implementation)
    d = lax.axis_index(axis_name)
    q_starts = _layout.chunk_starts(num, chunk, axis_name)
    halves = (q[:, :chunk], q[:, chunk:])
    parts: list[list] = [[], []]  # (out, lse) partials of query chunk a, of query chunk b
    kv = (k, v)
    for step in range(num):
        nxt = jax.tree.map(permute, kv) if step + 1 < num else None
        src = (d - step) % num
        k_starts = (src * chunk, (2 * num - 1 - src) * chunk)
        if not causal:
            lengths = None
            if seq_len < 2 * num * chunk:
                lengths = jnp.full((q.shape[0],), _layout.valid_prefix(seq_len, *k_starts, chunk))
            out, lse = attend(q, *kv, causal=False, kv_lengths=lengths)
            parts[0].append((out, lse))
        elif window is None:
            _balanced_step(attend, step, d < src, halves, kv, chunk, parts)
        else:
            for i, (qc, qs) in enumerate(zip(halves, q_starts)):
                for j, ks in enumerate(k_starts):
                    kc = kv[0][:, j * chunk:(j + 1) * chunk]
                    vc = kv[1][:, j * chunk:(j + 1) * chunk]
                    parts[i].append(_windowed_block(attend, qc, kc, vc, qs, ks, window, sinks))
        kv = nxt
    if not causal:
        out, lse = merge(parts[0])
    else:
        (out_a, lse_a), (out_b, lse_b) = merge(parts[0]), merge(parts[1])
        out, lse = jnp.concatenate([out_a, out_b], 1), jnp.concatenate([lse_a, lse_b], 1)
    return out.astype(q.dtype), lse


def _balanced_step(attend, step, late, halves, kv, chunk, parts) -> None:
    """Causal blocks of one step without a window (module docstring); `late` = `src > d`."""
    q_a, q_b = halves
    k_lo, k_hi = kv[0][:, :chunk], kv[0][:, chunk:]
    v_lo, v_hi = kv[1][:, :chunk], kv[1][:, chunk:]
    if step == 0:  # own block: chunks a, b of both
        parts[0].append(attend(q_a, k_lo, v_lo, causal=True))
        parts[1].append(attend(q_b, k_hi, v_hi, causal=True))
        parts[1].append(attend(q_b, k_lo, v_lo, causal=False))
        return
    # late: q_b x lo and q_b x hi; early: q_a x lo and q_b x lo. Block 1 has q_a or q_b.
    out1, lse1 = attend(jnp.where(late, q_b, q_a), k_lo, v_lo, causal=False)
    out2, lse2 = attend(q_b, jnp.where(late, k_hi, k_lo), jnp.where(late, v_hi, v_lo),
                        causal=False)
    parts[0].append((out1, jnp.where(late, -jnp.inf, lse1)))
    parts[1].append((out1, jnp.where(late, lse1, -jnp.inf)))
    parts[1].append((out2, lse2))


def block_visible(q_start, k_start, chunk: int, window, sinks):
    """Whether some query of `[q_start, q_start + C)` sees some key of `[k_start, k_start + C)`
    for some KV head under the causal, window and sink rules of `attn.dense.attention`.

    The query that sees the most of the block is the first one at or past its first key
    (`q_near`); its nearest visible key is `min(q_near, k_start + C - 1)`.
    """
    causal_ok = k_start <= q_start + chunk - 1
    q_near = jnp.maximum(q_start, k_start)
    s_near = jnp.minimum(q_near, k_start + chunk - 1)
    in_window = (window <= 0) | (q_near - window < s_near)  # [K]
    return causal_ok & jnp.any(in_window | (k_start < sinks))


def _windowed_block(attend, qc, kc, vc, q_start, k_start, window, sinks):
    """One causal block with a window, in the block's frame: queries at `q_start - k_start + t`,
    sinks `sinks - k_start` clipped to `[0, C]`; skipped when `block_visible` says so."""
    chunk = qc.shape[1]
    batch, _, heads, _ = qc.shape

    def run():
        offset = jnp.full((batch,), jnp.maximum(q_start - k_start, 0), jnp.int32)
        local_sinks = jnp.clip(sinks - k_start, 0, chunk).astype(jnp.int32)
        return attend(qc, kc, vc, causal=True, q_offset=offset, window=window,
                      sinks=local_sinks)

    def skip():
        return (jnp.zeros((batch, chunk, heads, vc.shape[-1]), qc.dtype),
                jnp.full((batch, chunk, heads), -jnp.inf, jnp.float32))

    return lax.cond(block_visible(q_start, k_start, chunk, window, sinks), run, skip)


def merge(parts: list) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge of partials `[(out [..., Hv], lse [...]), ...]` of the same rows.

    Returns `(out float32, lse float32)`; a row empty in every partial gives 0 and -inf, a
    partial with lse -inf weighs nothing whatever its output, a NaN lse makes the row NaN. The
    shift `m` is held constant under differentiation (the result does not depend on it).
    """
    lses = [lse.astype(jnp.float32) for _, lse in parts]
    m = functools.reduce(jnp.maximum, lses)
    m = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    weights = [jnp.exp(lse - m) for lse in lses]  # exactly 0 for empty partials
    denom = sum(weights)
    empty = denom == 0
    denom = jnp.where(empty, 1.0, denom)
    out = sum(w[..., None] * jnp.where(lse[..., None] == -jnp.inf, 0.0, o.astype(jnp.float32))
              for w, lse, (o, _) in zip(weights, lses, parts))
    return out / denom[..., None], jnp.where(empty, -jnp.inf, m + jnp.log(denom))
