"""The backward of the chunked GDN prefill (`attn/gdn/triton_chunk.py`): four launches.

Under differentiation the forward (`triton_chunk._forward_saving`) runs the same intra kernel and
`_chunk_bwd_state.state_save_kernel`, which also stores the state entering every chunk and
`V_new`; the residuals are the inputs, `G`, `W`, `P`, the keys and queries as the dots took them
(normalised with l2-norm), the chunk states and `V_new`. `T = (I + A)⁻¹` is recomputed.

1. `dstate_kernel` (sequential, a program per sequence, value head and value slice): from the
   final state's cotangent backwards, the cotangent of the state leaving every chunk, `dV_new`,
   and the initial state's cotangent.
2. `dqk_kernel` (a program per chunk and key head): dq (through the l2-norm), the keys'
   cotangent from the state and output side, dW, that side's dG.
3. `wy_kernel` (a program per chunk and value head): through `W = T X_w`, `U = T X_u` and `T`:
   dv, dβ, dg, and two `[C, C]` factors of the keys' remaining cotangent.
4. `dk_kernel` (a program per chunk and key head): dk from those factors (through the l2-norm).

The value heads of a key head add their q / k cotangents inside the programs, so nothing is
summed over heads in XLA. Memory: chunk states and their cotangents `2 · Nc · Nv · H · Hv`
elements in the intermediates' dtype (bf16: 1.1 GB at B1 T32K Nv32 H = Hv = 128), the rest
token-major.
"""

import dataclasses

import jax
import jax.numpy as jnp
import triton

from attn._harness import triton_call
from attn.gdn import _chunk_config as cfg
from attn.gdn._chunk_bwd_intra import dk_kernel, dqk_kernel, wy_kernel
from attn.gdn._chunk_bwd_state import dstate_kernel
from attn.gdn._chunk_config import CHUNK
from attn.gdn.reference import L2NORM_EPS


def backward(pl: dict, saved: dict, do, dfinal, dtypes: dict):
    """Cotangents of the chunked GDN's inputs.

    Args:
      pl: `triton_chunk.plan` of the forward's arguments.
      saved: the saving forward's residuals: `gcum, w, kn, p, hs, vn` and the output `o`
        (token-major).
      do: `[B, T, Nv, Hv]` the output's cotangent; dfinal `[Ns, Nv, H, Hv]` the final state's.
      dtypes: `q, k, v, g, beta` -> the dtype of that input (and of its cotangent).

    Returns:
      `(dq [N_TOK, Nk, H], dk, dv [N_TOK, Nv, Hv], dg [N_TOK, Nv], dbeta, dh0 [Ns, Nv, H, Hv]
      float32)`, token-major.
    """
    dstate, dqk, wy, dk_stage = stages(pl, saved, dtypes)
    do = do.reshape(pl["n_tok"], pl["nv"], pl["hv"])
    dh, dvn, dh0 = dstate(do, dfinal.astype(jnp.float32))
    dq, dk1, dw, dg1 = dqk(dh, dvn, do)
    dv, dbeta, dg, tb, dkk = wy(dw, dvn, dg1)
    return dq, dk_stage(dw, tb, dkk, dk1), dv, dg, dbeta, dh0


def stages(pl: dict, saved: dict, dtypes: dict):
    """The backward's four launches as functions (`backward` chains them; a profiler can time
    them one by one), on `backward`'s arguments.

    Returns:
      `(dstate, dqk, wy, dk)`: `dstate(do, dfinal) -> (dh, dvn, dh0)`,
      `dqk(dh, dvn, do) -> (dq, dk1, dw, dg1)`, `wy(dw, dvn, dg1) -> (dv, dbeta, dg, tb, dkk)`,
      `dk(dw, tb, dkk, dk1) -> dk`, with `do` token-major `[N_TOK, Nv, Hv]`.
    """
    config, x, common = pl["config"], pl["x"], pl["common"]
    n_tok, n_seq, n_chunks = pl["n_tok"], pl["n_seq"], pl["n_chunks"]
    nk, nv, h, hv, inter, l2 = (pl[n] for n in ("nk", "nv", "h", "hv", "inter", "l2"))
    sds = jax.ShapeDtypeStruct
    bv = min(config.block_hv_state, pl["block_hv"])
    grid = cfg.bwd_grid(config, nk, n_chunks)
    chunk = dict(EPS=L2NORM_EPS, L2NORM=l2, BLOCK_HV=pl["block_hv"],
                 HEAD_MAJOR=config.intra_head_major)

    def dstate(do, dfinal):
        return triton_call(
            saved["kn"], saved["w"], saved["gcum"], x["cstart"], x["clen"], x["sfirst"],
            x["scount"], saved["kn"] if l2 else x["q2"], saved["p"], do, dfinal,
            kernel=dstate_kernel,
            out_shape=(sds((n_chunks, nv, h, hv), inter), sds((n_tok, nv, hv), inter),
                       sds((n_seq, nv, h, hv), jnp.float32)),
            grid=cfg.state_grid(config, n_seq, nv, triton.cdiv(hv, bv)),
            **cfg.bwd_state_launch(config),
            BLOCK_HV=bv, QN=l2, Q_OFF=pl["qn_off"], **cfg.state_constexprs(config, pl["t_row"]),
            **common,
        )

    def dqk(dh, dvn, do):
        return triton_call(
            x["q2"], x["k2"], saved["gcum"], x["cstart"], x["clen"], saved["hs"], dh,
            saved["vn"], dvn, do, saved["p"], saved["o"],
            kernel=dqk_kernel,
            out_shape=(sds((n_tok, nk, h), dtypes["q"]), sds((n_tok, nk, h), jnp.float32),
                       sds((n_tok, nv, h), inter), sds((n_tok, nv), jnp.float32)),
            grid=grid, num_warps=config.dqk_warps, num_stages=config.dqk_stages,
            BV=min(config.dqk_block_v, pl["block_hv"]), **chunk, **common,
        )

    def wy(dw, dvn, dg1):
        return triton_call(
            saved["kn"], x["v2"], saved["gcum"], x["beta2"], x["cstart"], x["clen"], dw, dvn,
            dg1,
            kernel=wy_kernel,
            out_shape=(sds((n_tok, nv, hv), dtypes["v"]), sds((n_tok, nv), dtypes["beta"]),
                       sds((n_tok, nv), dtypes["g"]), sds((n_tok, nv, CHUNK), inter),
                       sds((n_tok, nv, CHUNK), inter)),
            grid=cfg.intra_grid(dataclasses.replace(config, intra_pairs=False), nv, n_chunks),
            num_warps=config.wy_warps, num_stages=1,
            SUB=cfg.SUB, BLOCK_HV=pl["block_hv"], HEAD_MAJOR=config.intra_head_major,
            **{n: v for n, v in common.items() if n != "SCALE"},
        )

    def dk(dw, tb, dkk, dk1):
        return triton_call(
            x["k2"], saved["kn"], x["cstart"], x["clen"], dw, tb, dkk, dk1,
            kernel=dk_kernel, out_shape=sds((n_tok, nk, h), dtypes["k"]),
            grid=grid, num_warps=config.dk_warps, num_stages=1,
            EPS=L2NORM_EPS, L2NORM=l2, HEAD_MAJOR=config.intra_head_major,
            **{n: v for n, v in common.items() if n not in ("SCALE", "HV")},
        )

    return dstate, dqk, wy, dk
