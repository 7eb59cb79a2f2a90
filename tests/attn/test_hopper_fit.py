"""Launches recorded while tracing (`attn._harness.recorded_launches`) and the Hopper fit tool
(`experiments.tools.hopper_fit`): every Triton launch of the ops fits in an sm_90 block's shared
memory at the dtypes and head dims whose tiles differ."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from attn import _harness
from attn.dense import attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_recorded_launches_name_types_and_constants():
    """Tracing a gradient records its launches (nothing runs): the forward's and both backward
    kernels', each runtime argument with its Triton type and every constexpr, defaults included."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)

    def loss(q, k, v):
        return attention(q, k, v, causal=True, implementation="triton")[0].sum()

    with _harness.recorded_launches() as launches:
        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
    names = [launch.name for launch in dict.fromkeys(launches)]
    assert names == ["_flash_fwd_kernel", "_flash_bwd_dq_kernel", "_flash_bwd_dkdv_kernel"]
    fwd = launches[0]
    sig = dict(fwd.signature)
    assert sig["q_ptr"] == "*fp32" and sig["lse_ptr"] == "*fp32"
    assert all(t.startswith("*") for t in sig.values())
    consts = dict(fwd.constexprs)
    assert consts["H"] == 64 and consts["G"] == 2 and consts["PRECISION"] == "ieee"
    assert fwd.num_stages == 2  # float32 at H64: `default_config`
    assert _harness._recording is None  # the context restores the outer state


def test_launch_of_types_scalars_and_defaults():
    # Triton is imported here, not at the top: `attn` (imported above) must pick the interpreter
    # before Triton's first import, or every kernel in this process compiles for a GPU.
    import triton
    import triton.language as tl

    @triton.jit
    def _scaled_copy(x_ptr, n, y_ptr, SCALE: tl.constexpr, BLOCK: tl.constexpr = 16):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * SCALE, mask=offs < n)

    out = jax.ShapeDtypeStruct((16,), jnp.bfloat16)
    launch = _harness.Launch.of(_scaled_copy, (jnp.zeros(16, jnp.bfloat16), 16), out, 4, 2,
                                dict(SCALE=2.0))
    assert launch.signature == (("x_ptr", "*bf16"), ("n", "i32"), ("y_ptr", "*bf16"))
    assert launch.constexprs == (("BLOCK", 16), ("SCALE", 2.0))
    with pytest.raises(ValueError, match="2 arguments and outputs for 3 runtime parameters"):
        _harness.Launch.of(_scaled_copy, (jnp.zeros(16),), out, 4, 2, dict(SCALE=2.0))


@pytest.mark.slow
def test_every_attention_launch_fits_hopper_shared_memory():
    """Every op of `experiments.tools.hopper_fit` (dense, block-sparse, paged prefill and
    decode with float and fp8 pools, the XAttention estimate, GDN chunked and decode, MLA decode,
    conv1d), bf16 and float32, H64, H128 and H256, forward and gradient: compiled for sm_90, no
    launch asks for more than 227 KiB."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run([sys.executable, "-m", "experiments.tools.hopper_fit"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    rows = [line.split() for line in done.stdout.splitlines()[1:] if line.split()[-1:] in
            (["yes"], ["NO"])]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(rows) >= 20 and all(r[-1] == "yes" for r in rows), done.stdout
