"""The Triton block-sparse prefill kernel: the shared base through the op (`block_sparse_base`,
interpreted on a CPU with 16 x 16 steps, so a 32-token block is walked in two query programs and
two key steps), then what is the kernel's own: the flat walk over steps and groups, the launch
order, the seed's block of 128 on the default tiles in bf16, the block lists, the public dispatch
and its gradient, config checks, compiled runs on a GPU. Queries past `q_lengths` and keys /
values past `kv_lengths` are NaN-poisoned.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.block_sparse import block_sparse_attention, effective_block_mask
from attn.block_sparse import triton as kernel
from tests.attn.block_sparse_base import LENGTHS, BlockSparseTests, clean, problem
from tests.utils import AttentionTestBase, assert_close, rng

SMALL = kernel.Config(block_m=16, block_n=16)


class TestTriton(BlockSparseTests):
    """16 x 16 steps; four rows of the batched cases (whole tiles, one token, a query chunk
    after a prefix off and on the block grid)."""

    implementation = "triton"
    config = SMALL
    lengths = tuple(LENGTHS[i] for i in (0, 1, 4, 5))


def _check(q, k, v, modes, block_mask, *, config=SMALL, dtype=None, outputs=None, **opts):
    """`outputs` (out, lse): the kernel's, already run with `config`."""
    if outputs is None:
        outputs = kernel.block_sparse_attention(q, k, v, modes, block_mask, config=config, **opts)
    out, lse = outputs
    exp_out, exp_lse = block_sparse_attention(clean(q), clean(k), clean(v), modes, block_mask,
                                              implementation="xla", **opts)
    tol = {} if dtype is not None else dict(atol=2e-5, rtol=2e-5)
    assert_close(out, exp_out, dtype=dtype, err_msg="out", **tol)
    assert_close(lse, exp_lse, dtype=dtype, allow_neg_inf=True, err_msg="lse")
    sees = np.isfinite(np.asarray(exp_lse))
    AttentionTestBase.check_masked_rows(out, lse, sees)
    return sees


# The walk is one flat loop of `block_size // block_n` steps per listed block (the block index
# loaded at each step): 1, 2 and 4 steps per block, `block_m` below, at and above (capped to) the
# block size, group sizes 1, 2 and 4, odd lengths with a partial last query tile and key block.
WALKS = {
    "bs16-1step": (16, kernel.Config(block_m=16, block_n=16)),
    "bs32-2steps-bm-capped": (32, kernel.Config(block_m=64, block_n=16)),
    "bs64-4steps-2tiles": (64, kernel.Config(block_m=32, block_n=16, num_stages=2)),
}


@pytest.mark.parametrize("walk", list(WALKS))
@pytest.mark.parametrize("g", [1, 2, 4])
def test_flat_walk_steps_and_groups(walk, g):
    bs, config = WALKS[walk]
    q, k, v, modes, bm, lens = problem(rng(), b=2, t=77, s=131, n=2 * g, kh=2, bs=bs,
                                        q_lengths=[77, 50], kv_lengths=[131, 97])
    sees = _check(q, k, v, modes, bm, config=config, block_size=bs, sink_blocks=1,
                  local_blocks=2, **lens)
    assert sees.any() and not sees.all()


# The launch order: the same walks with programs heads fastest (the default is KV head by KV
# head) give the same output and lse bit for bit.
@pytest.mark.parametrize("walk", ["bs16-1step", "bs64-4steps-2tiles"])
def test_heads_fastest_order_is_bitwise_the_default(walk):
    bs, config = WALKS[walk]
    assert config.kv_head_major  # the default
    heads_fastest = dataclasses.replace(config, kv_head_major=False)
    q, k, v, modes, bm, lens = problem(rng(), b=2, t=77, s=131, n=6, kh=2, bs=bs,
                                        q_lengths=[77, 50], kv_lengths=[131, 97])
    opts = dict(block_size=bs, sink_blocks=1, local_blocks=2, **lens)
    got = kernel.block_sparse_attention(q, k, v, modes, bm, config=heads_fastest, **opts)
    sees = _check(q, k, v, modes, bm, config=heads_fastest, outputs=got, **opts)
    assert sees.any() and not sees.all()
    base = kernel.block_sparse_attention(q, k, v, modes, bm, config=config, **opts)
    for x, y in zip(got, base):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_seed_block_128_bf16_default_config():
    gen = rng()
    q, k, v, modes, bm, lens = problem(gen, b=1, t=200, s=300, n=2, kh=1, bs=128, h=32, hv=32,
                                        kv_lengths=[290], dtype=jnp.bfloat16)
    _check(q, k, v, modes.at[0].set(jnp.asarray([1, -1])), bm, config=None, dtype=jnp.bfloat16,
           block_size=128, sink_blocks=1, local_blocks=1, **lens)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["xla", "triton"])
def test_block_lists_whole_prefix_is_fully_visible(use_kernel):
    """The unmasked prefix of every list holds only blocks every query of its tile sees whole,
    and the lists hold exactly the selected blocks in ascending order, then the others; the
    Triton lists kernel (60 rows: a partial last program of 8) the same as the XLA form."""
    gen = rng()
    b, n, t, s, bs = 3, 4, 70, 150, 16
    modes = jnp.asarray(gen.choice([0, 1, -1], (b, n)), jnp.int32)
    bm = jnp.asarray(gen.random((b, n, -(-t // bs), -(-s // bs))) < 0.5)
    q_len = np.array([70, 33, 64], np.int32)
    kv_len = np.array([150, 100, 64], np.int32)
    eff = effective_block_mask(modes, bm, num_q_tokens=t, num_kv_tokens=s, block_size=bs,
                               sink_blocks=1, local_blocks=2, q_lengths=jnp.asarray(q_len),
                               kv_lengths=jnp.asarray(kv_len))
    blocks, count, whole = (np.asarray(x) for x in kernel.block_lists(
        eff, jnp.asarray(q_len), jnp.asarray(kv_len), bs, use_kernel=use_kernel))
    eff = np.asarray(eff)
    assert (whole <= count).all() and whole.sum() > 0 and (count - whole).sum() > 0
    # Every row is a permutation of the blocks (the padding past `count` too: the kernel loads
    # the entry after the last step ahead of time), the one a stable argsort gives.
    np.testing.assert_array_equal(np.sort(blocks, axis=-1),
                                  np.broadcast_to(np.arange(eff.shape[-1]), blocks.shape))
    np.testing.assert_array_equal(blocks, np.argsort(~eff, axis=-1, kind="stable"))
    for i in range(b):
        for h in range(n):
            for r in range(eff.shape[2]):
                listed = blocks[i, h, r, : count[i, h, r]]
                np.testing.assert_array_equal(listed, np.flatnonzero(eff[i, h, r]))
                first_query = kv_len[i] - q_len[i] + r * bs
                for j in listed[: whole[i, h, r]]:
                    assert (j + 1) * bs - 1 <= first_query and (j + 1) * bs <= kv_len[i]


def test_public_api_dispatch_gradient_and_auto_fallback(monkeypatch):
    gen = rng()
    q, k, v, modes, bm, _ = problem(gen, b=1, t=32, s=48, n=2, kh=1, bs=16)
    opts = dict(block_size=16, sink_blocks=1, local_blocks=1)
    out, lse = block_sparse_attention(q, k, v, modes, bm, implementation="triton", **opts)
    exp_out, exp_lse = block_sparse_attention(q, k, v, modes, bm, implementation="xla", **opts)
    assert_close(out, exp_out)
    assert_close(lse, exp_lse, allow_neg_inf=True)

    def loss(impl):
        return lambda q, k, v: jnp.sum(block_sparse_attention(
            q, k, v, modes, bm, implementation=impl, **opts)[0] ** 2)
    got = jax.grad(loss("triton"), (0, 1, 2))(q, k, v)
    exp = jax.grad(loss("xla"), (0, 1, 2))(q, k, v)
    for a, e in zip(got, exp):
        assert_close(a, e)

    opts8 = dict(block_size=8)
    modes0 = jnp.asarray([[0, -1]], jnp.int32)
    with pytest.raises(NotImplementedError, match="at least 16"):
        block_sparse_attention(q, k, v, modes0, None, implementation="triton", **opts8)
    wide = jnp.zeros((1, 32, 2, 512))
    assert block_sparse_attention.reasons("triton", wide, wide[:, :, :1], wide[:, :, :1], modes0,
                                          None, **opts) == ["head dims H=512, Hv=512 over 256"]
    monkeypatch.setattr(attn._harness, "on_gpu", lambda: True)
    out, _ = block_sparse_attention(q, k, v, modes0, None, implementation="auto", **opts8)
    monkeypatch.undo()
    assert_close(out, block_sparse_attention(q, k, v, modes0, None, implementation="xla",
                                             **opts8)[0])


def test_config_validation():
    with pytest.raises(ValueError, match="block_m"):
        kernel.Config(block_m=24)
    with pytest.raises(ValueError, match="block_n"):
        kernel.Config(block_n=8)
    with pytest.raises(ValueError, match="num_warps"):
        kernel.Config(num_warps=5)
    with pytest.raises(ValueError, match="num_stages"):
        kernel.Config(num_stages=0)


# GPU: the seed geometry (block 128), bf16, against the float32 reference.

# The launch configs of the sweep (block_m-block_n-warps-stages; 128-128-8-3 needs 224 KiB of
# shared memory at H = 128, just under the H100's 227 KiB).
GPU_CONFIGS = {"default": None, **{c: kernel.Config(**dict(zip(
    ("block_m", "block_n", "num_warps", "num_stages"), map(int, c.split("-")))))
    for c in ("128-64-8-3", "128-64-8-4", "128-128-8-2", "128-32-8-4", "64-64-4-3")},
    "heads-fastest": kernel.Config(kv_head_major=False)}


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("g", [1, 4])
def test_gpu_matches_reference(density, g, config="default"):
    gen = rng()
    kh = 4
    q, k, v, modes, bm, lens = problem(
        gen, b=2, t=1536, s=2048, n=kh * g, kh=kh, bs=128, h=128, hv=128, dtype=jnp.bfloat16,
        q_lengths=[1536, 1000], kv_lengths=[2048, 1900], density=density)
    opts = dict(block_size=128, sink_blocks=1, local_blocks=4, **lens)
    run = jax.jit(lambda *a: kernel.block_sparse_attention(*a, config=GPU_CONFIGS[config],
                                                           **opts))
    out, lse = run(q, k, v, modes, bm)
    f32 = [clean(x).astype(jnp.float32) for x in (q, k, v)]
    exp_out, exp_lse = block_sparse_attention(*f32, modes, bm, implementation="xla", **opts)
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, atol=1e-2, rtol=1e-3, allow_neg_inf=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [c for c in GPU_CONFIGS if c != "default"])
def test_gpu_sweep_configs_match_reference(config):
    test_gpu_matches_reference(0.5, 4, config)


@pytest.mark.gpu
def test_gpu_block_lists_kernel_matches_xla():
    """The lists kernel compiled, at the bench's S64K geometry (32 heads x 512 tiles x 512 blocks,
    random modes and masks, two requests with shorter queries): the XLA form's arrays exactly."""
    gen = rng()
    b, n, s, bs = 2, 32, 65536, 128
    sb = s // bs
    modes = jnp.asarray(gen.choice([0, 1, -1], (b, n)), jnp.int32)
    bm = jnp.asarray(gen.random((b, n, sb, sb)) < 0.1)
    q_len, kv_len = jnp.asarray([s, 40000], jnp.int32), jnp.asarray([s, 60001], jnp.int32)
    eff = effective_block_mask(modes, bm, num_q_tokens=s, num_kv_tokens=s, block_size=bs,
                               sink_blocks=1, local_blocks=8, q_lengths=q_len, kv_lengths=kv_len)
    got = jax.jit(lambda e: kernel.block_lists(e, q_len, kv_len, bs, use_kernel=True))(eff)
    want = jax.jit(lambda e: kernel.block_lists(e, q_len, kv_len, bs, use_kernel=False))(eff)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
