"""The tanh SiLU of the conv1d prefill row kernel (`Config.fast_silu`, the default).

`fast_silu` (bf16 / f16 outputs) is checked against the reference within half-precision
tolerance; in the interpreter its tanh is exact (`_fast_silu`), so there the test checks the
algebra and the plumbing, and the compile check (any machine) and the GPU test of
`tests/conv1d/test_prefill_rows.py` check `tanh.approx.f32`. Float32 outputs ignore the flag
(bitwise the exact SiLU), and so does the tile kernel.
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
from tests.conv1d.test_prefill_rows import _bits, _run, _same
from tests.conv1d.test_prefill_rows import _problem as _rows_problem
from tests.utils import assert_close, rng

ref_conv = jax.jit(ref.causal_conv1d, static_argnames=("activation",))
EXACT = prefill.Config(block_t=8, block_c=16, rows_split=False, fast_silu=False)
# Empty sequences, shorter than W, starting mid-block; 55 tokens. B2 rows of 45: the second row
# starts mid-block.
LENS = [2, 0, 1, 3, 0, 10, 9, 13, 17]


def _problem(gen, **kw):
    return _rows_problem(gen, lens=LENS, t=45, **kw)


def test_fast_silu_is_the_default():
    cfg = prefill.Config()
    assert cfg.rows and cfg.rows_split and cfg.fast_silu and cfg.channels_fastest
    assert (cfg.block_t, cfg.block_c, cfg.num_warps) == (8, 512, 4)


HALF_CONFIGS = {"rows": dataclasses.replace(EXACT, fast_silu=True),
                "split-cf": prefill.Config(block_t=4, block_c=16),
                "split": prefill.Config(block_t=4, block_c=16, channels_fastest=False)}
# Slow (~51 s of CPU CI): the split kernel on the 2-D grid (the split-cf programs in another order,
# bitwise the same: `test_channels_fastest_is_the_same_kernel_bitwise`) and f16 through split-cf
# (f16 differs from bf16 only in the output cast, which f16-rows checks).
HALF_CASES = [pytest.param(cfg, dtype, id=f"{d}-{name}",
                           marks=[pytest.mark.slow] if name == "split" or (
                               d == "f16" and name == "split-cf") else [])
              for d, dtype in (("bf16", jnp.bfloat16), ("f16", jnp.float16))
              for name, cfg in HALF_CONFIGS.items()]


@pytest.mark.parametrize("cfg,dtype", HALF_CASES)
def test_fast_silu_within_half_precision_of_the_reference(cfg, dtype):
    """B2 and varlen, W4, state, bias; the final state is still the exact one."""
    gen = rng()
    assert cfg.fast_silu
    for varlen in (False, True):
        x, weight, b, h0, cu = _problem(gen, w=4, varlen=varlen, state=True, bias=True,
                                        dtype=dtype)
        y, final = _run(cfg, x, weight, b, h0, cu, "silu")
        exp_y, exp_final = ref_conv(x, weight, b, initial_state=h0, activation="silu",
                                    cu_seqlens=cu)
        assert y.dtype == exp_y.dtype
        assert_close(y, exp_y, dtype=dtype)
        np.testing.assert_array_equal(_bits(final), _bits(exp_final))


def test_fast_silu_is_ignored_for_float32_and_by_the_tile_kernel():
    gen = rng()
    args = _problem(gen, w=4, varlen=True, state=True, bias=True, dtype=jnp.float32)
    fast = prefill.Config(block_t=4, block_c=16, fast_silu=True)
    exact = dataclasses.replace(fast, fast_silu=False)
    _same(_run(fast, *args, "silu"), _run(exact, *args, "silu"))
    args = _problem(gen, w=4, varlen=True, state=True, bias=True)
    tile = prefill.Config(block_t=8, block_c=16, rows=False, fast_silu=True)
    _same(_run(tile, *args, "silu"), _run(dataclasses.replace(tile, fast_silu=False), *args,
                                          "silu"))


# Compiled for sm_90 (T32K C8192 W4 bf16 SiLU): the default and the sweep's other row configs:
# block_t, block_c, warps, fast_silu, rows_split, channels_fastest.
COMPILED = [(8, 512, 4, True, True, True), (16, 1024, 4, True, True, True),
            (8, 512, 4, False, True, True)]

_AOT = textwrap.dedent("""
    import os, subprocess, sys, tempfile
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from attn.conv1d import triton_prefill as kp

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    kernel = kp._conv_prefill_rows_kernel
    names = kernel.arg_names
    types = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*fp32", seq_ptr="*i32", cu_ptr="*i32",
                 y_ptr="*bf16")
    for bt, bc, warps, fast, split, cf in eval(sys.argv[1]):
        consts = dict(N_TOK=32768, T_ROW=32768, C=8192, W=4, HAS_BIAS=False, VARLEN=False,
                      SILU=True, BLOCK_T=bt, BLOCK_C=bc, STREAM_STORE=True, SPLIT=split,
                      FAST_SILU=fast, HW_TANH=True, C_FASTEST=cf, NC=8192 // bc)
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts}
        c = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=2))
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(c.asm["ptx"])
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                           capture_output=True, text=True, check=True)
        print("rows", bt, bc, warps, int(fast), c.asm["ptx"].count("tanh.approx.f32"),
              r.stderr.replace("\\n", " "))
""")


@pytest.mark.slow
def test_rows_kernel_compiles_for_sm90_without_spills():
    """The default config (8 x 512 over 4 warps, split, fast SiLU, channels fastest) and two
    others compiled for Hopper on any machine (T32K C8192 W4 bf16 SiLU): no spills (ptxas -v),
    and the fast SiLU emits `tanh.approx.f32` (absent from the exact one)."""
    assert (prefill.Config().block_t, prefill.Config().block_c) == COMPILED[0][:2]
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _AOT, repr(COMPILED)], env=env,
                         capture_output=True, text=True, check=True, cwd=root).stdout
    lines = [line for line in out.splitlines() if line.startswith("rows ")]
    assert len(lines) == len(COMPILED), out
    for line in lines:
        fast, tanh = (int(v) for v in line.split()[4:6])
        assert (tanh > 0) == bool(fast), line
        assert "0 bytes spill stores" in line, line
