"""The walking conv1d prefill kernel (`Config(loop=True)`) and the tanh SiLU (`fast_silu`).

The loop kernel must give the row kernel's `y` bit for bit (same float32 order of operations) and
the same final state, in the interpreter and compiled. The cases make a wrong halo visible: segments
of 12 tokens in groups of 4 (a segment is not a power of two, three groups), groups of 2 (shorter
than the W4 halo, so the carried halo mixes the old halo and the group), sequence starts in the
middle of segments and of groups, a last segment and a last group that are partial.

`fast_silu` (bf16 / f16 outputs) is checked against the reference within bf16 tolerance; in the
interpreter its tanh is exact (`_fast_silu`), so there the test checks the algebra and the
plumbing, and the GPU test checks `tanh.approx.f32`. Float32 outputs ignore the flag (bitwise the
exact SiLU).
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

from attn.conv1d import reference as ref
from attn.conv1d import triton_prefill as prefill
from tests.utils import assert_close, rng

ref_conv = jax.jit(ref.causal_conv1d, static_argnames=("activation",))
ROWS = prefill.Config(block_t=8, block_c=16, rows_split=False)
# Empty sequences, shorter than W, starting mid-group and mid-segment; 55 tokens (13 groups of 4
# and 3 tokens; 4 segments of 12 and 7 tokens).
LENS = [2, 0, 1, 3, 0, 10, 9, 13, 17]
LOOPS = {
    "g4-s12": prefill.Config(block_t=4, block_c=16, loop=True, seg_t=12, rows_split=False),
    "g4-s12-split": prefill.Config(block_t=4, block_c=16, loop=True, seg_t=12),
    "g2-s6-split": prefill.Config(block_t=2, block_c=32, loop=True, seg_t=6),
    "g8-s8": prefill.Config(block_t=8, block_c=64, loop=True, seg_t=8, rows_split=False),
    "g4-s64-split": prefill.Config(block_t=4, block_c=16, loop=True, seg_t=64),
}


def _bits(x):
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


def _problem(gen, *, w, varlen, state, bias, dtype=jnp.bfloat16, c=40):
    if varlen:
        cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
        b, t, ns = 1, int(cu[-1]), len(LENS)
        cu = jnp.asarray(cu)
    else:  # B2: the second row starts at token 45, mid-segment and mid-group
        b, t, ns, cu = 2, 45, 2, None
    x = jnp.asarray(gen.standard_normal((b, t, c), np.float32), dtype)
    weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, dtype)
    bias_ = jnp.asarray(gen.standard_normal((c,), np.float32), dtype) if bias else None
    h0 = jnp.asarray(gen.standard_normal((ns, c, w - 1), np.float32), dtype) if state else None
    return x, weight, bias_, h0, cu


def _run(config, x, weight, bias, h0, cu, act):
    return prefill.causal_conv1d(x, weight, bias, initial_state=h0, activation=act,
                                 cu_seqlens=cu, config=config)


def _same(a, b):
    for u, v in zip(a, b, strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(_bits(u), _bits(v))


@pytest.mark.parametrize("w", [2, 4])
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T45", "varlen"])
@pytest.mark.parametrize("state,bias,act", [(True, True, "silu"), (False, False, None)],
                         ids=["state-bias-silu", "plain"])
def test_loop_kernel_is_the_row_kernel_bitwise(w, varlen, state, bias, act):
    gen = rng()
    args = _problem(gen, w=w, varlen=varlen, state=state, bias=bias)
    rows = _run(ROWS, *args, act)
    x, weight, b, h0, cu = args
    assert_close(rows[0], ref_conv(x, weight, b, initial_state=h0, activation=act,
                                   cu_seqlens=cu)[0], dtype=x.dtype)
    for name in ("g4-s12", "g4-s12-split", "g2-s6-split"):
        _same(_run(LOOPS[name], *args, act), rows)


@pytest.mark.parametrize("name", ["g8-s8", "g4-s64-split"])
def test_loop_kernel_one_group_and_one_segment_w3_f32(name):
    """One group per segment (the prefetch always masked off) and one segment for all tokens;
    float32, W3, varlen, state, bias, SiLU."""
    gen = rng()
    args = _problem(gen, w=3, varlen=True, state=True, bias=True, dtype=jnp.float32)
    _same(_run(LOOPS[name], *args, "silu"), _run(ROWS, *args, "silu"))


@pytest.mark.parametrize("cfg", [ROWS, LOOPS["g4-s12-split"]], ids=["rows", "loop"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_fast_silu_within_half_precision_of_the_reference(cfg, dtype):
    """B2 and varlen, W4, state, bias; the final state is still the exact one."""
    gen = rng()
    fast = dataclasses.replace(cfg, fast_silu=True)
    for varlen in (False, True):
        x, weight, b, h0, cu = _problem(gen, w=4, varlen=varlen, state=True, bias=True,
                                        dtype=dtype)
        y, final = _run(fast, x, weight, b, h0, cu, "silu")
        exp_y, exp_final = ref_conv(x, weight, b, initial_state=h0, activation="silu",
                                    cu_seqlens=cu)
        assert y.dtype == exp_y.dtype
        assert_close(y, exp_y, dtype=dtype)
        np.testing.assert_array_equal(_bits(final), _bits(exp_final))


def test_fast_silu_is_ignored_for_float32():
    gen = rng()
    args = _problem(gen, w=4, varlen=True, state=True, bias=True, dtype=jnp.float32)
    fast = prefill.Config(block_t=4, block_c=16, loop=True, seg_t=12, fast_silu=True)
    _same(_run(fast, *args, "silu"), _run(ROWS, *args, "silu"))


def test_loop_config_validation():
    with pytest.raises(ValueError, match="seg_t"):
        prefill.Config(block_t=8, seg_t=12)
    with pytest.raises(ValueError, match="seg_t"):
        prefill.Config(block_t=16, seg_t=8)
    with pytest.raises(ValueError, match="rows"):
        prefill.Config(rows=False, loop=True)
    with pytest.raises(ValueError, match="rows"):
        prefill.Config(rows=False, fast_silu=True)


# The loop configs of the H100 sweep (`experiments.sweep_prefill_kernels conv1d`): block_t,
# block_c, warps, seg_t, fast_silu, rows_split.
SWEEP_LOOPS = [(8, 1024, 4, 1024, False, True), (8, 1024, 4, 1024, True, True),
               (8, 512, 4, 512, False, True), (8, 512, 4, 512, True, True),
               (8, 512, 4, 512, True, False), (4, 512, 4, 512, True, True),
               (16, 512, 4, 512, True, True), (8, 512, 4, 256, True, True),
               (8, 512, 4, 1024, True, True), (8, 1024, 8, 1024, True, True)]

_AOT = textwrap.dedent("""
    import os, subprocess, sys, tempfile
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from attn.conv1d import triton_prefill as kp

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    kernel = kp._conv_prefill_loop_kernel
    names = kernel.arg_names
    types = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*fp32", seq_ptr="*i32", cu_ptr="*i32",
                 y_ptr="*bf16")
    for bt, bc, warps, seg, fast, split in eval(sys.argv[1]):
        consts = dict(N_TOK=32768, T_ROW=32768, C=8192, W=4, HAS_BIAS=False, VARLEN=False,
                      SILU=True, BLOCK_T=bt, BLOCK_C=bc, STREAM_STORE=True, SPLIT=split,
                      FAST_SILU=fast, HW_TANH=True, SEG_T=seg, C_FASTEST=False, NC=8)
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts}
        c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=2))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(c.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True, check=True)
        print("loop", bt, bc, warps, seg, int(fast), c.asm["ptx"].count("tanh.approx.f32"),
              r.stderr.replace("\\n", " "))
""")


@pytest.mark.slow
def test_loop_kernel_compiles_for_sm90_without_spills():
    """The sweep's loop configs compiled for Hopper on any machine (T32K C8192 W4 bf16 SiLU):
    no spills (ptxas -v), and the fast SiLU is one `tanh.approx.f32` per element (present)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _AOT, repr(SWEEP_LOOPS)], env=env,
                         capture_output=True, text=True, check=True, cwd=root).stdout
    lines = [line for line in out.splitlines() if line.startswith("loop ")]
    assert len(lines) == len(SWEEP_LOOPS), out
    for line in lines:
        fast, tanh = (int(v) for v in line.split()[5:7])
        assert (tanh > 0) == bool(fast), line
        assert "0 bytes spill stores" in line, line


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["B1-T32K", "varlen"])
def test_loop_kernel_compiled_is_the_row_kernel_bitwise(varlen):
    """T32K, C = 8192, W4, bf16, SiLU, initial state (varlen: four sequences, one shorter than
    W - 1): the compiled loop kernel's y is bitwise the compiled row kernel's; with `fast_silu`
    (tanh.approx.f32) within bf16 tolerance of the reference."""
    gen = rng()
    t, c = 32768, 8192
    x = jnp.asarray(gen.standard_normal((1, t, c), np.float32), jnp.bfloat16)
    weight = jnp.asarray(gen.standard_normal((c, 4), np.float32) * 0.5, jnp.bfloat16)
    cu = jnp.asarray([0, 2, 1000, 20000, t], jnp.int32) if varlen else None
    h0 = jnp.asarray(gen.standard_normal((4 if varlen else 1, c, 3), np.float32), jnp.bfloat16)

    def run(config):
        return jax.jit(lambda x, w: prefill.causal_conv1d(
            x, w, initial_state=h0, activation="silu", cu_seqlens=cu, config=config))(x, weight)

    rows = run(prefill.Config())
    expected = jax.jit(lambda x, w: ref.causal_conv1d(
        x, w, initial_state=h0, activation="silu", cu_seqlens=cu))(x, weight)
    for bt, bc, warps, seg, fast, split in SWEEP_LOOPS:
        out = run(prefill.Config(block_t=bt, block_c=bc, num_warps=warps, loop=True, seg_t=seg,
                                 fast_silu=fast, rows_split=split))
        if fast:
            assert_close(out[0], expected[0], dtype=jnp.bfloat16)
            np.testing.assert_array_equal(_bits(out[1]), _bits(rows[1]))
        else:
            _same(out, rows)
