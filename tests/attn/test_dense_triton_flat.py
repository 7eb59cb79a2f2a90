"""The flash forward's one-loop form (`Config.flat_loop`) against the four-loop form and the
reference.

On the interpreter the two forms agree bit for bit: they visit the same key tiles in the same
order, and a masked step of the flat loop (scores hidden with -inf, then the unmasked update from
a -FLT_MAX running max) gives the masked update's values exactly in numpy, as does an unmasked
sink tile (every row sees it). On a GPU they may differ in rounding only: the flat loop's masked
steps share the unmasked steps' fused multiply-add. Shapes are tiny (interpreter); the tiles are
small so that every step kind (masked / unmasked sink tiles, window edge, whole tiles, diagonal,
length tail) occurs, most of them in one program's loop.
"""

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import triton as kernel
from tests.attn.test_dense_triton import GPU_CASES, _check, _gpu_check, _poison_tail, _qkv
from tests.utils import assert_close, rng

M64N32 = kernel.Config(block_m=64, block_n=32)
M16N16 = kernel.Config(block_m=16, block_n=16)


def _flat(config):
    return dataclasses.replace(config, flat_loop=True)


def _both(shape, options, config, dtype=jnp.float32):
    """Flat kernel vs the reference (`_check`: tolerance, dead rows exactly 0 / -inf) and bit for
    bit vs the four-loop kernel; returns the reference's rows-with-a-key mask."""
    q, k, v = _qkv(rng(), dtype=dtype, **shape)
    bf16 = dtype if dtype != jnp.float32 else None
    out, lse, sees = _check(q, k, v, config=_flat(config), dtype=bf16, **options)
    kp, vp = _poison_tail(k, v, options.get("kv_lengths"))
    ref_out, ref_lse = kernel.attention(q, kp, vp, config=config, **options)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out), err_msg="out vs 4 loops")
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse), err_msg="lse vs 4 loops")
    return sees


B2 = dict(b=2, t=37, s=130, kh=2, g=5, h=32, hv=24)  # 3 query tiles of 64 rows per head
CASES = {  # (shape, options, config)
    "causal-offset": (B2, dict(q_offset=93), M64N32),
    "causal-offsets-per-row": (B2, dict(q_offset=np.array([0, 50], np.int32)), M64N32),
    "noncausal-lengths": (B2, dict(causal=False, scale=0.37,
                                   kv_lengths=np.array([130, 47], np.int32)), M64N32),
    "noncausal-G1": (dict(b=1, t=20, s=47, kh=2, g=1, h=16, hv=16), dict(causal=False), M16N16),
    # Sinks over two whole 16-key tiles (unmasked steps once the first row is past them) and a
    # third, partial one; the window below a tile; one head without a window.
    "window9-sinks40-G2": (dict(b=1, t=65, s=100, kh=2, g=2, h=16, hv=16),
                           dict(q_offset=35, window=np.array([9, 0], np.int32), sinks=40),
                           M16N16),
    # Sinks past the key length, the first rows still inside the sink tiles (q_offset 0).
    "window-sinks-past-length-G4": (dict(b=2, t=40, s=72, kh=1, g=4, h=16, hv=16),
                                    dict(window=12, sinks=50,
                                         kv_lengths=np.array([72, 20], np.int32)), M16N16),
    "window-sinks-per-head": (B2, dict(q_offset=93, window=np.array([16, 0], np.int32),
                                       sinks=np.array([3, 5], np.int32)), M64N32),
    "window-no-sinks": (B2, dict(q_offset=np.array([93, 10], np.int32), window=40), M64N32),
    # Row 1 sees no key at all; row 0's late queries lose their window to the key length.
    "lengths-dead-rows": (B2, dict(q_offset=93, window=np.array([8, 8], np.int32),
                                   sinks=np.array([2, 0], np.int32),
                                   kv_lengths=np.array([100, 0], np.int32)), M64N32),
    # Chunked prefill whose first rows see nothing (keys shorter than the offset, no sinks).
    "chunk-past-length": (dict(b=1, t=24, s=80, kh=1, g=2, h=16, hv=16),
                          dict(q_offset=40, window=6, kv_lengths=np.array([43], np.int32)),
                          M16N16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flat_matches_four_loops_and_reference(name):
    sees = _both(*CASES[name])
    if name == "lengths-dead-rows":
        assert not sees[1].any() and sees[0, 0].all()
    if name == "chunk-past-length":  # rows past the keys' end + window see nothing
        assert sees[0, 0].all() and not sees[0, -1].any()


def test_flat_bf16_default_tiles():
    """bf16, the default 128 x 128 tiles (one query tile holds all rows), window + sinks."""
    _both(dict(b=1, t=40, s=300, kh=2, g=4, h=32, hv=32),
          dict(q_offset=260, window=np.array([100, 0], np.int32), sinks=np.array([130, 0],
                                                                               np.int32)),
          kernel.default_config(32), dtype=jnp.bfloat16)


def test_flat_gradients_match_four_loops():
    """The backward only reads the forward's out / lse: the flat forward's gradients are the
    four-loop ones."""
    q, k, v = _qkv(rng(), b=1, t=20, s=40, kh=1, g=2, h=16, hv=16)
    opts = dict(q_offset=20, window=7, sinks=3)

    def grads(config):
        def loss(q, k, v):
            return jnp.sum(kernel.attention(q, k, v, config=config, **opts)[0] ** 2)
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    for a, e in zip(grads(_flat(M16N16)), grads(M16N16)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


_AOT = textwrap.dedent("""
    import os, subprocess, sys, tempfile
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from attn.dense import triton as kt

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    for causal in (True, False):
        for flat in (False, True):
            kernel = kt._flash_fwd_flat_kernel if flat else kt._flash_fwd_kernel
            names = kernel.arg_names
            types = {n: "*i32" for n in names if n.startswith(("offset", "len", "window", "sink"))}
            types |= {n: "*fp32" for n in names if n.startswith("lse")}
            consts = dict(B=1, T=8192, S=8192, K=8, G=4, H=128, HV=128, BLOCK_H=128,
                          BLOCK_HV=128, PRECISION="tf32", CAUSAL=causal, SCALE_LOG2=0.13,
                          NUM_M=256, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True)
            consts |= {} if flat else dict(WS_MASKED=False)
            assert set(names) - set(consts) == set(types) | {"q_ptr", "k_ptr", "v_ptr", "o_ptr"}
            sig = {n: "constexpr" if n in consts else types.get(n, "*bf16") for n in names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                     if n not in consts}
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=8, num_stages=3))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(c.asm["ptx"])
            r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                               capture_output=True, text=True, check=True)
            print("fwd", causal, flat, c.asm["ptx"].count("wgmma.mma_async"),
                  c.asm["ttgir"].count("scf.for"), r.stderr.replace("\\n", " "))
""")


@pytest.mark.slow
def test_flat_forward_compiles_for_sm90_as_one_pipelined_loop():
    """Compile the forward for Hopper on any machine (no GPU): the flat form pipelines (Triton
    3.6's pipeliner rejects a run-time branch around the whole softmax update: this guards the
    form that passes), keeps one key loop (a quarter of the four-loop form's wgmma sites) and
    spills nothing at the default tiles."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _AOT], env=dict(os.environ, TRITON_INTERPRET="0"),
                         capture_output=True, text=True, check=True, cwd=root).stdout
    rows = {(c, f): line for line in out.splitlines() if line.startswith("fwd ")
            for c, f in [tuple(line.split()[1:3])]}
    assert len(rows) == 4, out
    for causal in ("True", "False"):
        four, flat = rows[causal, "False"].split(), rows[causal, "True"].split()
        assert int(flat[3]) > 0 and 4 * int(flat[3]) == int(four[3]), (four, flat)
        assert int(flat[4]) == 1 and int(four[4]) == 4, (four, flat)
        for line in rows.values():
            assert "0 bytes spill stores" in line, line


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_flat_matches_reference_and_four_loops(name):
    """bf16 on the GPU: the reference's tolerance, and within rounding of the four-loop form
    (the masked steps' FMA)."""
    shape, options = GPU_CASES[name]
    config = kernel.default_config(shape.get("h", 128), shape.get("hv"))
    _, args, out, lse = _gpu_check(shape, options, _flat(config))
    ref_out, ref_lse = jax.jit(
        lambda q, k, v: kernel.attention(q, k, v, config=config, **options))(*args)
    diff = jnp.linalg.norm(out.astype(jnp.float32) - ref_out.astype(jnp.float32))
    assert float(diff / jnp.linalg.norm(ref_out.astype(jnp.float32))) < 1e-3
    assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5, allow_neg_inf=True)
