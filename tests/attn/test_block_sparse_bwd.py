"""The Triton block-sparse backward (`attn/block_sparse/_triton_bwd.py`) against the reference's
gradients: interpreted on CPU, compiled on GPU.

Every gradient case mixes the three modes (0 full, 1 block mask, -1 streaming) over the query
heads of GQA groups, NaN-poisons queries past `q_lengths` and keys / values past `kv_lengths`,
and takes the loss through both outputs (`sum(out * dO) + sum(lse * dlse)` over the rows that see
a key), so the lse cotangent is checked too. CPU cases use blocks of 16 or 32 tokens with 16-row
/ 16-key steps (a 32-token block is two steps of each walk).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.block_sparse import _triton_bwd, block_sparse_attention, effective_block_mask, reference
from attn.block_sparse import mosaic as sparse_mosaic
from attn.block_sparse import triton as kernel
from tests.utils import assert_close, poison, randn, rng

SMALL = kernel.Config(block_m=16, block_n=16, dq_block_m=16, dq_block_n=16, dkv_block_m=16,
                      dkv_block_n=16)


def _problem(gen, *, b, t, s, n, kh, bs, h=16, hv=16, q_lengths=None, kv_lengths=None,
             density=0.5, dtype=jnp.float32):
    q = randn(gen, (b, t, n, h), dtype)
    k = randn(gen, (b, s, kh, h), dtype)
    v = randn(gen, (b, s, kh, hv), dtype)
    modes = jnp.asarray(gen.choice([0, 1, -1], (b, n)), jnp.int32)
    modes = modes.at[0, :3].set(jnp.asarray([1, -1, 0])[: min(3, n)])  # every mode present
    block_mask = jnp.asarray(gen.random((b, n, -(-t // bs), -(-s // bs))) < density)
    lens = {}
    if q_lengths is not None:
        lens["q_lengths"] = jnp.asarray(q_lengths, jnp.int32)
        q = poison(q, jnp.arange(t)[None, :] < lens["q_lengths"][:, None])
    if kv_lengths is not None:
        lens["kv_lengths"] = jnp.asarray(kv_lengths, jnp.int32)
        keep = jnp.arange(s)[None, :] < lens["kv_lengths"][:, None]
        k, v = poison(k, keep), poison(v, keep)
    d_out = randn(gen, (b, t, n, hv), jnp.float32)
    d_lse = randn(gen, (b, t, n), jnp.float32)
    return (q, k, v), modes, block_mask, lens, (d_out, d_lse)


def _clean(x):
    return jnp.where(jnp.isnan(x), 0.0, x).astype(x.dtype)


def _grads(qkv, modes, block_mask, cotangents, *, implementation, config=None, **opts):
    """`(dq, dk, dv)` of `sum(out * dO) + sum(lse * dlse)` (lse where finite) and `(out, lse)`."""
    d_out, d_lse = cotangents
    extra = {} if config is None else dict(config=config)

    def loss(q, k, v):
        out, lse = block_sparse_attention(q, k, v, modes, block_mask,
                                          implementation=implementation, **opts, **extra)
        lse_term = jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse_term), (out, lse)

    grads, outputs = jax.grad(loss, (0, 1, 2), has_aux=True)(*qkv)
    return grads, outputs


def _check(qkv, modes, block_mask, cotangents, *, config=SMALL, dtype=None, **opts):
    got, (_, lse) = _grads(qkv, modes, block_mask, cotangents, implementation="triton",
                             config=config, **opts)
    exp, _ = _grads([_clean(x) for x in qkv], modes, block_mask, cotangents,
                    implementation="xla", **opts)
    tol = {} if dtype is not None else dict(atol=5e-5, rtol=5e-5)
    for name, a, e in zip(("dq", "dk", "dv"), got, exp, strict=True):
        assert_close(a, e, dtype=dtype, err_msg=name, **tol)
    return got, np.isfinite(np.asarray(lse))


# (problem, options): G in {1, 3, 8}, densities 0 / partial / 1, odd lengths, partial last query
# tiles and key blocks, queries longer than keys (rows that see nothing), a 2-step block.
CASES = {
    "G1-T33-S47-d0.5": (dict(b=2, t=33, s=47, n=3, kh=3, bs=16, q_lengths=[33, 20],
                             kv_lengths=[47, 29]), dict(block_size=16, local_blocks=2)),
    "G3-T40-S100-d0.5-lengths": (
        dict(b=2, t=40, s=100, n=3, kh=1, bs=16, q_lengths=[37, 40], kv_lengths=[90, 45]),
        dict(block_size=16, sink_blocks=np.array([1, 2, 0], np.int32), local_blocks=2)),
    "G8-T31-S50-d1": (dict(b=1, t=31, s=50, n=8, kh=1, bs=16, density=1.0, kv_lengths=[49]),
                      dict(block_size=16, sink_blocks=0, local_blocks=1)),
    "G3-T48-S48-d0": (dict(b=1, t=48, s=48, n=6, kh=2, bs=16, density=0.0),
                      dict(block_size=16, local_blocks=1)),
    "G1-q-longer-than-kv": (dict(b=2, t=48, s=48, n=2, kh=2, bs=16, q_lengths=[40, 9],
                                 kv_lengths=[30, 48]),
                            dict(block_size=16, local_blocks=np.array([1, 3], np.int32))),
    "G3-T65-S65-bs32-2steps": (dict(b=1, t=65, s=65, n=3, kh=1, bs=32, hv=24),
                               dict(block_size=32, sink_blocks=1, local_blocks=1, scale=0.2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_grads_match_reference(name):
    problem, opts = CASES[name]
    qkv, modes, bm, lens, cot = _problem(rng(), **problem)
    # On a CPU the fair share is tiny (an H100's 132 SMs, a few steps): most dK / dV programs
    # are cut into chunks and reduced; the 2-step case runs every program whole.
    config = dataclasses.replace(SMALL, dkv_split=not name.endswith("2steps"))
    (dq, dk, dv), sees = _check(qkv, modes, bm, cot, config=config, **opts, **lens)
    # Rows that see nothing (and padding) have zero dQ; keys past the lengths zero dK / dV.
    assert not np.asarray(dq)[~sees].any()
    if "kv_lengths" in lens:
        past = np.arange(qkv[1].shape[1])[None, :] >= np.asarray(lens["kv_lengths"])[:, None]
        assert not np.asarray(dk)[past].any() and not np.asarray(dv)[past].any()
    if name == "G3-T48-S48-d0":  # mode-1 heads with an empty mask see nothing
        sparse = np.asarray(modes)[:, None, :] == 1
        assert not np.broadcast_to(sparse, sees.shape)[sees].any()


def test_fully_masked_everywhere_gives_zero_gradients():
    """Every head block-sparse with an empty mask: no row sees a key; the gradients are exact
    zeros (finite), as the reference's."""
    qkv, _, bm, _, cot = _problem(rng(), b=1, t=20, s=20, n=2, kh=1, bs=16, density=0.0)
    modes = jnp.ones((1, 2), jnp.int32)
    got, (out, lse) = _grads(qkv, modes, bm, cot, implementation="triton", config=SMALL,
                             block_size=16)
    assert np.isneginf(np.asarray(lse)).all() and not np.asarray(out).any()
    for g in got:
        assert np.isfinite(np.asarray(g)).all() and not np.asarray(g).any()


def test_bf16_block_128_default_config():
    qkv, modes, bm, lens, cot = _problem(rng(), b=1, t=150, s=200, n=2, kh=1, bs=128, h=32,
                                         hv=32, kv_lengths=[190], dtype=jnp.bfloat16)
    _check(qkv, modes.at[0].set(jnp.asarray([1, -1])), bm, cot, config=None, dtype=jnp.bfloat16,
           block_size=128, sink_blocks=1, local_blocks=1, **lens)


@pytest.mark.parametrize("what", ["key", "value"])
def test_nan_a_row_does_not_see_reaches_none_of_its_gradients(what):
    """A NaN in one key (or value) inside the keys: the rows that do not see it keep the
    reference's finite gradients, and so do the keys no row that sees it sees; the rows that see
    it get a NaN dQ."""
    gen = rng()
    b, t, s, n, kh, bs = 1, 48, 48, 4, 2, 16
    qkv, modes, bm, _, cot = _problem(gen, b=b, t=t, s=s, n=n, kh=kh, bs=bs, density=0.6)
    modes = jnp.asarray([[0, 1, -1, 1]], jnp.int32)
    opts = dict(block_size=bs, sink_blocks=0, local_blocks=1)
    bad_key, bad_head = 21, 1  # inside key block 1, KV head 1 (query heads 2, 3)
    q, k, v = qkv
    if what == "key":
        k = k.at[0, bad_key, bad_head, 3].set(jnp.nan)
    else:
        v = v.at[0, bad_key, bad_head, 5].set(jnp.nan)
    got, _ = _grads((q, k, v), modes, bm, cot, implementation="triton", config=SMALL, **opts)
    exp, _ = _grads(qkv, modes, bm, cot, implementation="xla", **opts)  # no NaN
    eff = effective_block_mask(modes, bm, num_q_tokens=t, num_kv_tokens=s, block_size=bs,
                               sink_blocks=0, local_blocks=1)
    mask = np.asarray(reference.token_mask(eff, num_q_tokens=t, num_kv_tokens=s,
                                           block_size=bs))  # [B, N, T, S]
    sees_bad = np.zeros((b, n, t), bool)
    sees_bad[:, 2 * bad_head: 2 * bad_head + 2] = mask[:, 2 * bad_head: 2 * bad_head + 2,
                                                       :, bad_key]
    assert sees_bad.any() and not sees_bad.all()
    dq, dk, dv = (np.asarray(x) for x in got)
    clean_rows = ~sees_bad.transpose(0, 2, 1)  # [B, T, N]
    assert np.isnan(dq[~clean_rows]).any(axis=-1).all()
    assert_close(dq[clean_rows], np.asarray(exp[0])[clean_rows], atol=5e-5, rtol=5e-5,
                 err_msg="dq")
    # Keys seen by a row that sees the NaN (their dK goes through that row's delta), per KV head.
    tainted = np.einsum("bnts,bnt->bsn", mask, sees_bad).reshape(b, s, kh, n // kh).any(-1)
    if what == "key":
        tainted[:, bad_key, bad_head] = True  # its own dK / dV: NaN scores
    assert_close(dk[~tainted], np.asarray(exp[1])[~tainted], atol=5e-5, rtol=5e-5,
                 err_msg="dk")
    # dV does not read V: with a NaN value only NaN scores (a NaN key) can reach it.
    dv_ok = ~tainted if what == "key" else np.ones_like(tainted)
    assert_close(dv[dv_ok], np.asarray(exp[2])[dv_ok], atol=5e-5, rtol=5e-5, err_msg="dv")


@pytest.mark.parametrize("use_kernel,elements", [(False, None), (True, None), (True, 16)],
                         ids=["xla", "triton", "triton-row-a-program"])
def test_transposed_lists_partition(use_kernel, elements, monkeypatch):
    """Every row of the transposed lists: the selected (sibling, tile) pairs, the whole ones
    (every query of the tile valid and past the block, the block inside the keys) first, each
    part ascending, then the unselected entries; a permutation of all entries. Both
    formulations (the Triton one in its interpreter here; with `elements`, one row a
    program)."""
    if elements is not None:
        monkeypatch.setattr(_triton_bwd, "_TRANSPOSED_ELEMENTS", elements)
    gen = rng()
    b, n, kh, t, s, bs = 4, 6, 2, 70, 150, 16
    modes = jnp.asarray(gen.choice([0, 1, -1], (b, n)), jnp.int32)
    bm = jnp.asarray(gen.random((b, n, -(-t // bs), -(-s // bs))) < 0.5)
    # The last request's key offset (15) puts a block's last key on a tile's first query.
    q_len, kv_len = np.array([70, 33, 64, 49], np.int32), np.array([150, 100, 64, 64], np.int32)
    eff = effective_block_mask(modes, bm, num_q_tokens=t, num_kv_tokens=s, block_size=bs,
                               sink_blocks=1, local_blocks=2, q_lengths=jnp.asarray(q_len),
                               kv_lengths=jnp.asarray(kv_len))
    entries, count, whole = (np.asarray(x) for x in _triton_bwd.transposed_lists(
        eff, jnp.asarray(q_len), jnp.asarray(kv_len), bs, kh, use_kernel=use_kernel))
    eff = np.asarray(eff)
    g, tb, sb = n // kh, eff.shape[2], eff.shape[3]
    assert entries.shape == (b, kh, sb, g * tb)
    np.testing.assert_array_equal(np.sort(entries, -1),
                                  np.broadcast_to(np.arange(g * tb), entries.shape))
    assert whole.sum() > 0 and (count - whole).sum() > 0
    for i in range(b):
        for h in range(kh):
            for j in range(sb):
                sel = [e for e in range(g * tb) if eff[i, h * g + e // tb, e % tb, j]]

                def is_whole(e, i=i, j=j):
                    r = e % tb
                    return ((r + 1) * bs <= q_len[i] and (j + 1) * bs <= kv_len[i]
                            and (j + 1) * bs - 1 <= kv_len[i] - q_len[i] + r * bs)
                want = [e for e in sel if is_whole(e)] + [e for e in sel if not is_whole(e)]
                assert count[i, h, j] == len(sel) and whole[i, h, j] == sum(map(is_whole, sel))
                np.testing.assert_array_equal(entries[i, h, j, : len(sel)], want)


def test_dkv_schedule_cuts_heavy_programs_and_covers_every_step_once():
    """Units cover each program's steps exactly once, in order; a program over the fair share is
    cut (its chunks first, with consecutive partial slots listed in `cut`), the rest runs whole
    KV head by KV head; the static bounds hold; `split=False` cuts nothing."""
    b, kh, sb, num_sms = 2, 3, 8, 4
    count = np.zeros((b, kh, sb), np.int32)
    count[:, :, 1:] = 2
    count[1, 2, 0] = 200  # a sink-like block: far above a fair share
    count[0, 1, 3] = 0  # an empty list: one unit that writes zeros
    for split in (True, False):
        units, cut = (np.asarray(x) for x in _triton_bwd.dkv_schedule(
            jnp.asarray(count), sb, 16, 16, 16, num_sms, split=split))
        assert units.shape == (4, b * kh * sb + 2 * num_sms) and cut.shape == (3, 2 * num_sms)
        prog, lo, hi, slot = units[:, units[0] >= 0]
        steps = count.transpose(1, 0, 2).reshape(-1)  # (kh * B + b) * NUM_N + nt
        for p in range(b * kh * sb):
            mine = np.flatnonzero(prog == p)
            assert len(mine) >= 1 and lo[mine[0]] == 0 and hi[mine[-1]] == steps[p]
            np.testing.assert_array_equal(lo[mine[1:]], hi[mine[:-1]])
        heavy = (2 * b + 1) * sb  # (kh 2, b 1, tile 0)
        assert prog[0] == heavy
        if not split:
            assert (slot == -1).all() and (cut[0] == -1).all()
            np.testing.assert_array_equal(prog[1:], [p for p in range(48) if p != heavy])
            continue
        chunks = np.flatnonzero(prog == heavy)
        assert len(chunks) > 1 and (slot[chunks] == np.arange(len(chunks))).all()
        assert (slot[prog != heavy] == -1).all()
        np.testing.assert_array_equal(cut[:, 0], [heavy, 0, len(chunks)])
        assert (cut[0, 1:] == -1).all()
        assert (hi - lo).max() <= -(-steps.sum() // (2 * num_sms))
    # Few programs: the bound on extra units is the program count.
    units, cut = _triton_bwd.dkv_schedule(jnp.asarray(count[:1, :1]), sb, 16, 16, 16, num_sms)
    assert units.shape == (4, 2 * sb) and cut.shape == (3, sb)


def test_config_validation():
    for field in ("dq_block_m", "dq_block_n", "dkv_block_m", "dkv_block_n"):
        with pytest.raises(ValueError, match=field):
            kernel.Config(**{field: 48})
    with pytest.raises(ValueError, match="dkv_num_warps"):
        kernel.Config(dkv_num_warps=3)
    with pytest.raises(ValueError, match="dq_num_stages"):
        kernel.Config(dq_num_stages=0)


@pytest.mark.slow
def test_mosaic_forward_takes_the_triton_backward():
    """Gradients through the (interpreted) Mosaic GPU forward are the Triton backward's."""
    qkv, modes, bm, _, cot = _problem(rng(), b=1, t=256, s=256, n=2, kh=1, bs=128, h=64, hv=64,
                                      dtype=jnp.bfloat16)
    opts = dict(block_size=128, sink_blocks=1, local_blocks=1)
    got, _ = _grads(qkv, modes, bm, cot, implementation="mosaic",
                    config=sparse_mosaic.Config(interpret=True), **opts)
    exp, _ = _grads(qkv, modes, bm, cot, implementation="triton", **opts)
    for a, e in zip(got, exp, strict=True):
        assert_close(a, e, dtype=jnp.bfloat16)


# GPU: the seed geometry (block 128), bf16, against the float32 reference: the relative error of
# each gradient at most 3x that of the bf16 reference (QUALITY.md).


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["triton", "mosaic"])
@pytest.mark.parametrize("density", [0.1, 1.0])
@pytest.mark.parametrize("g", [1, 4])
def test_gpu_grads_match_reference(g, density, implementation):
    gen = rng()
    kh = 4
    t = s = 2048
    lengths = implementation == "triton"  # Mosaic: full lengths only
    qkv, modes, bm, lens, cot = _problem(
        gen, b=2, t=t, s=s, n=kh * g, kh=kh, bs=128, h=128, hv=128, dtype=jnp.bfloat16,
        density=density, **(dict(q_lengths=[2048, 1000], kv_lengths=[2048, 1900])
                             if lengths else {}))
    opts = dict(block_size=128, sink_blocks=1, local_blocks=4, **lens)
    got, _ = jax.jit(lambda *x: _grads(x, modes, bm, cot, implementation=implementation,
                                       **opts))(*qkv)
    clean = [_clean(x) for x in qkv]
    exp, _ = _grads([x.astype(jnp.float32) for x in clean], modes, bm, cot,
                    implementation="xla", **opts)
    same_precision, _ = _grads(clean, modes, bm, cot, implementation="xla", **opts)
    for name, a, e, r in zip(("dq", "dk", "dv"), got, exp, same_precision, strict=True):
        assert np.isfinite(np.asarray(a, np.float32)).all(), name
        assert _rel(a, e) <= 3 * _rel(r, e) + 1e-3, (name, _rel(a, e), _rel(r, e))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [64, 128, 256])
def test_gpu_float32(h):
    """float32 inputs, compiled: at H64 the default backward tiles (the dK / dV stages take as
    much shared memory as bf16 at H128) and a 2-stage forward, at H128 the wide-rows config, at
    H256 its half-height query tiles. Gradients close to the reference's."""
    cfg = kernel.default_config(h, h, 4)
    assert (cfg.dkv_num_stages == kernel.Config().dkv_num_stages) == (h == 64)
    gen = rng()
    qkv, modes, bm, lens, cot = _problem(
        gen, b=1, t=1000, s=1000, n=8, kh=2, bs=128, h=h, hv=h, dtype=jnp.float32,
        density=0.3)
    opts = dict(block_size=128, sink_blocks=1, local_blocks=2, **lens)
    got, _ = jax.jit(lambda *x: _grads(x, modes, bm, cot, implementation="triton", **opts))(*qkv)
    exp, _ = _grads([_clean(x) for x in qkv], modes, bm, cot, implementation="xla", **opts)
    for name, a, e in zip(("dq", "dk", "dv"), got, exp, strict=True):
        assert _rel(a, e) < 1e-4, (name, _rel(a, e))


@pytest.mark.gpu
@pytest.mark.parametrize("g,tb", [(4, 256), (8, 1024)], ids=["width1024", "width8192"])
def test_gpu_transposed_lists_kernel_matches_xla(g, tb):
    """Compiled, the kernel's lists equal the XLA formulation's, up to the widest row it takes;
    one request is shorter than the mask (partial tiles, a key offset)."""
    gen = rng()
    b, bs = 2, 16
    assert g * tb <= _triton_bwd._TRANSPOSED_MAX_WIDTH
    eff = jnp.asarray(gen.random((b, g, tb, tb)) < 0.3)
    q_len = jnp.asarray([tb * bs, tb * bs - 37], jnp.int32)
    kv_len = jnp.asarray([tb * bs, tb * bs - 21], jnp.int32)
    got, want = (_triton_bwd.transposed_lists(eff, q_len, kv_len, bs, 1, use_kernel=kernel)
                 for kernel in (True, False))
    for name, a, w in zip(("entries", "count", "whole"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w), err_msg=name)
