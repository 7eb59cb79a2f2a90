"""Cross-backend edge grid of every paged / gathered attention op: XLA == Triton == numpy.

Each case is one problem whose rows hold the edges of `paged_edges.ROWS` (lengths 0, P - 1, P,
P + 1 and past the table; -1 holes inside and outside the window; an id equal to `num_pages`),
over a pool whose null page and unowned pages are NaN, plus one NaN in a visible key or value.
The ops run under `jit`, so lengths and tables are traced values and take their documented
semantics (no eager check). Outputs must agree with the float64 numpy reference in their NaN and
-inf patterns and within 1e-4 elsewhere; the reference itself is checked to put NaN where a
visible key is NaN and nowhere a NaN page is only unowned. On a CPU the Triton kernels run in the
interpreter; `pytest -m gpu` runs the whole grid compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.block_sparse import block_sparse_attention
from attn.block_sparse import triton as bs_kernel
from attn.dense import paged_prefill_attention
from attn.dense import triton_paged as prefill_kernel
from attn.mla import mla_paged_decode
from attn.mla import triton as mla_kernel
from attn.paged_decode import paged_decode
from attn.paged_decode import triton as decode_kernel
from tests.attn import paged_edges as E
from tests.utils import rng


def _pools(gen, nan: str, *, value_dim: int = E.HV):
    """Poisoned K / V pools and the tables; `nan`: "key" (row 3, head 0, position 16) or "value"
    (row 5, head 1, position 3) additionally NaN, "none" only the unowned pages."""
    table = E.tables(gen)
    kp = gen.standard_normal((E.K, E.NUM_PAGES, E.P, E.H)).astype(np.float32)
    vp = gen.standard_normal((E.K, E.NUM_PAGES, E.P, value_dim)).astype(np.float32)
    kp, vp = E.poison_unowned(kp, table), E.poison_unowned(vp, table)
    if nan == "key":
        kp = E.nan_at(kp, table, row=3, head=0, pos=16)
    elif nan == "value":
        vp = E.nan_at(vp, table, row=5, head=1, pos=3)
    return kp, vp, table


def _check_reference(out, nan: str, nan_rows: tuple):
    """The numpy reference's own contract: NaN exactly where the planted NaN is visible."""
    bad = np.isnan(out).reshape(out.shape[0], -1).any(axis=1)
    if nan == "none":
        assert not bad.any(), "an unowned NaN page reached the numpy reference"
    else:
        assert bad[list(nan_rows)].all(), "a visible NaN did not come out as NaN"
    assert not bad[0] and (out[0] == 0).all()


# -- paged decode ------------------------------------------------------------------------------

DECODE = [
    pytest.param(dict(block_n=16, num_splits=1), "key", id="page-tiles-J1-nan-key"),
    pytest.param(dict(block_n=32, num_splits=2), "value", id="gather-J2-nan-value"),
    pytest.param(dict(block_n=16, num_splits=3), "none", id="page-tiles-J3-poison",
                 marks=pytest.mark.slow),
    pytest.param(dict(block_n=32, num_splits=1), "key", id="gather-J1-nan-key",
                 marks=pytest.mark.slow),
]


def _decode_grid(config: dict, nan: str) -> None:
    gen = rng()
    kp, vp, table = _pools(gen, nan)
    q = gen.standard_normal((E.B, E.K * E.G, E.H)).astype(np.float32)
    lens = E.lengths()
    w, s = E.windows_sinks()
    exp_out, exp_lse = E.np_paged_decode(q, kp, vp, table, lens, w, s, E.SCALE)
    _check_reference(exp_out, nan, (3,) if nan == "key" else (5,))
    xla = jax.jit(lambda *a: paged_decode(*a, scale=E.SCALE, window=jnp.asarray(w),
                                          sinks=jnp.asarray(s), implementation="xla"))
    cfg = decode_kernel.Config(**config)
    tri = jax.jit(lambda *a: decode_kernel.paged_decode(
        *a, scale=E.SCALE, window=jnp.asarray(w), sinks=jnp.asarray(s), config=cfg))
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table),
            jnp.asarray(lens))
    for name, (out, lse) in (("xla", xla(*args)), ("triton", tri(*args))):
        E.assert_agree(f"{name} out", out, exp_out)
        E.assert_agree(f"{name} lse", lse, exp_lse)
        assert (np.asarray(out)[0] == 0).all() and np.isneginf(np.asarray(lse)[0]).all()


@pytest.mark.parametrize("config,nan", DECODE)
def test_paged_decode_edge_grid(config, nan):
    _decode_grid(config, nan)


def test_paged_decode_hole_inside_the_visible_range():
    """K=1, P=16, table [1, -1], length 20: the 4 keys on the -1 page are absent, so the row
    equals the 16-key row, on both backends."""
    gen = rng()
    q = jnp.asarray(gen.standard_normal((1, 1, 8)), jnp.float32)
    kp = jnp.asarray(gen.standard_normal((1, 3, 16, 8)), jnp.float32)
    kp = kp.at[0, 0].set(0.0)  # a zero null page: attending to it would change the lse
    table = jnp.asarray([[[1, -1]]], jnp.int32)
    for impl in ("xla", "triton"):
        _, lse = paged_decode(q, kp, kp, table, jnp.asarray([20], jnp.int32),
                              implementation=impl)
        _, lse16 = paged_decode(q, kp, kp, table, jnp.asarray([16], jnp.int32),
                                implementation=impl)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(lse16), rtol=1e-6, err_msg=impl)


# -- paged prefill -----------------------------------------------------------------------------

PREFILL = [
    pytest.param(dict(block_m=32, block_n=16), "key", id="page-tiles-nan-key"),
    pytest.param(dict(block_m=32, block_n=16, page_tiles=False), "value", id="gather-nan-value"),
    pytest.param(dict(block_m=16, block_n=32), "none", id="gather-wide-poison",
                 marks=pytest.mark.slow),
]


def _prefill_grid(config: dict, nan: str) -> None:
    gen = rng()
    kp, vp, table = _pools(gen, nan)
    q = gen.standard_normal((E.B, E.T, E.K * E.G, E.H)).astype(np.float32)
    lens = E.lengths()
    offsets = np.maximum(lens - E.T, 0).astype(np.int32)
    w, s = E.windows_sinks()
    exp_out, exp_lse = E.np_paged_prefill(q, kp, vp, table, offsets, lens, w, s, E.SCALE)
    _check_reference(exp_out, nan, (3,) if nan == "key" else (5,))
    xla = jax.jit(lambda *a: paged_prefill_attention(
        *a, scale=E.SCALE, window=jnp.asarray(w), sinks=jnp.asarray(s), implementation="xla"))
    cfg = prefill_kernel.Config(**config)
    tri = jax.jit(lambda *a: prefill_kernel.paged_prefill_attention(
        *a, scale=E.SCALE, window=jnp.asarray(w), sinks=jnp.asarray(s), config=cfg))
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table),
            jnp.asarray(offsets), jnp.asarray(lens))
    for name, (out, lse) in (("xla", xla(*args)), ("triton", tri(*args))):
        E.assert_agree(f"{name} out", out, exp_out)
        E.assert_agree(f"{name} lse", lse, exp_lse)


@pytest.mark.parametrize("config,nan", PREFILL)
def test_paged_prefill_edge_grid(config, nan):
    _prefill_grid(config, nan)


# -- MLA decode --------------------------------------------------------------------------------

L, R, N_MLA = 16, 8, 4
MLA = [
    pytest.param(dict(block_n=16, num_splits=1), "key", id="page-tiles-J1-nan-rope-key"),
    pytest.param(dict(block_n=32, num_splits=2), "value", id="gather-J2-nan-latent"),
    pytest.param(dict(block_n=16, num_splits=2), "none", id="page-tiles-J2-poison",
                 marks=pytest.mark.slow),
]


def _mla_grid(config: dict, nan: str) -> None:
    gen = rng()
    table = E.tables(gen, num_kv=1)
    latent = gen.standard_normal((1, E.NUM_PAGES, E.P, L + R)).astype(np.float32)
    latent = E.poison_unowned(latent, table)[0]
    table = table[:, 0]
    if nan == "key":  # the rope part only: a NaN score
        latent[table[3, 1], 0, L:] = np.nan
    elif nan == "value":  # c_kv: key and value
        latent[table[5, 0], 3, :L] = np.nan
    q_lat = gen.standard_normal((E.B, N_MLA, L)).astype(np.float32)
    q_pe = gen.standard_normal((E.B, N_MLA, R)).astype(np.float32)
    lens = E.lengths()
    exp_out, exp_lse = E.np_mla_decode(q_lat, q_pe, latent, table, lens, L, E.SCALE)
    _check_reference(exp_out, nan, (3,) if nan == "key" else (5,))
    xla = jax.jit(lambda *a: mla_paged_decode(*a, kv_lora_rank=L, scale=E.SCALE, num_splits=2,
                                              implementation="xla"))
    cfg = mla_kernel.Config(**config)
    tri = jax.jit(lambda *a: mla_kernel.mla_paged_decode(*a, kv_lora_rank=L, scale=E.SCALE,
                                                         config=cfg))
    args = (jnp.asarray(q_lat), jnp.asarray(q_pe), jnp.asarray(latent), jnp.asarray(table),
            jnp.asarray(lens))
    for name, (out, lse) in (("xla", xla(*args)), ("triton", tri(*args))):
        E.assert_agree(f"{name} out", out, exp_out)
        E.assert_agree(f"{name} lse", lse, exp_lse)


@pytest.mark.parametrize("config,nan", MLA)
def test_mla_decode_edge_grid(config, nan):
    _mla_grid(config, nan)


# -- block-sparse prefill ----------------------------------------------------------------------

T_BS, S_BS, BS = 32, 32, 16
# (q_len, kv_len): empty, P - 1, a chunk ending one past a block, P + 1, past T and S (traced:
# clamped), a chunk after a prefix.
BS_ROWS = [(0, 0), (15, 15), (16, 17), (17, 17), (40, 40), (20, 32)]
BLOCK_SPARSE = [
    pytest.param("key", id="nan-key"),
    pytest.param("value", id="nan-value", marks=pytest.mark.slow),
]


def _block_sparse_grid(nan: str) -> None:
    gen = rng()
    b = len(BS_ROWS)
    n, kh = E.K * E.G, E.K
    q_lens = np.array([r[0] for r in BS_ROWS], np.int32)
    kv_lens = np.array([r[1] for r in BS_ROWS], np.int32)
    q = gen.standard_normal((b, T_BS, n, E.H)).astype(np.float32)
    k = gen.standard_normal((b, S_BS, kh, E.H)).astype(np.float32)
    v = gen.standard_normal((b, S_BS, kh, E.HV)).astype(np.float32)
    for r in range(b):  # padding past the (clamped) lengths is NaN
        q[r, min(q_lens[r], T_BS):] = np.nan
        k[r, min(kv_lens[r], S_BS):] = np.nan
        v[r, min(kv_lens[r], S_BS):] = np.nan
    if nan == "key":
        k[3, 16, 0] = np.nan
    else:
        v[3, 2, 1] = np.nan
    modes = np.zeros((b, n), np.int32)
    modes[:, E.G:] = -1  # KV head 1's query heads stream: 1 sink block + 1 local block
    exp_out, exp_lse = E.np_block_sparse(q, k, v, modes, q_lens, kv_lens, BS, 1, 1, E.SCALE)
    _check_reference(exp_out, "key", (3,))
    opts = dict(block_size=BS, sink_blocks=1, local_blocks=1, scale=E.SCALE)
    xla = jax.jit(lambda q, k, v, ql, kl: block_sparse_attention(
        q, k, v, jnp.asarray(modes), q_lengths=ql, kv_lengths=kl, implementation="xla", **opts))
    cfg = bs_kernel.Config(block_m=16, block_n=16, num_stages=1)
    tri = jax.jit(lambda q, k, v, ql, kl: bs_kernel.block_sparse_attention(
        q, k, v, jnp.asarray(modes), q_lengths=ql, kv_lengths=kl, config=cfg, **opts))
    args = tuple(jnp.asarray(x) for x in (q, k, v, q_lens, kv_lens))
    for name, (out, lse) in (("xla", xla(*args)), ("triton", tri(*args))):
        E.assert_agree(f"{name} out", out, exp_out)
        E.assert_agree(f"{name} lse", lse, exp_lse)


@pytest.mark.parametrize("nan", BLOCK_SPARSE)
def test_block_sparse_edge_grid(nan):
    _block_sparse_grid(nan)


# -- compiled ----------------------------------------------------------------------------------


def _values(params):
    """The CPU parametrisations (slow ones included), ids kept, marks dropped: on the GPU the
    whole grid is cheap."""
    return [pytest.param(*p.values, id=p.id) for p in params]


@pytest.mark.gpu
@pytest.mark.parametrize("config,nan", _values(DECODE))
def test_paged_decode_edge_grid_compiled(config, nan):
    _decode_grid(config, nan)


@pytest.mark.gpu
@pytest.mark.parametrize("config,nan", _values(PREFILL))
def test_paged_prefill_edge_grid_compiled(config, nan):
    _prefill_grid(config, nan)


@pytest.mark.gpu
@pytest.mark.parametrize("config,nan", _values(MLA))
def test_mla_decode_edge_grid_compiled(config, nan):
    _mla_grid(config, nan)


@pytest.mark.gpu
@pytest.mark.parametrize("nan", _values(BLOCK_SPARSE))
def test_block_sparse_edge_grid_compiled(nan):
    _block_sparse_grid(nan)
