"""The state kernel's launch as `default_config` picks it: three pipeline stages where the shared
memory holds them, and the value-slice width that makes the fewest waves of steps (one program per
SM). `state_smem` must bound what the compiler allocates, or a default launch fails on the GPU."""

import re

import pytest

from attn.gdn import triton_chunk as tc

MODEL = dict(nv=32, hv=128, nk=16)  # Qwen3-Next's GDN heads


@pytest.mark.parametrize(("b", "width"), [(1, 32), (2, 64), (8, 64), (64, 64)])
def test_width_makes_fewest_waves(b, width):
    """B1: 32 chains x 4 slices = 128 programs, one wave either way, so the shorter 32-wide step;
    from B2 on, 64-wide slices halve the waves (2 -> 1 at B2, 8 -> 4 at B8)."""
    config = tc.default_config(b, MODEL["nv"], MODEL["hv"], nk=MODEL["nk"])
    assert (config.block_hv_state, config.state_stages, config.state_warps) == (width, 3, 4)
    assert config.fuse_output and config.store_qn and config.intra_pairs


def test_shared_memory_decides_the_stages():
    """bf16 at H = 128: three stages fit at both widths; float32 intermediates or H = 256 do not
    fit three, and where no estimate fits, the two-stage 32-wide launch of earlier sessions."""
    for width in (32, 64):
        assert tc.state_smem(128, width, 2, 3) <= tc._SMEM_LIMIT
    f32 = tc.default_config(1, 4, 128, nk=2, itemsize=4)
    wide = tc.default_config(1, 32, 128, nk=16, h=256)
    for config in (f32, wide):
        assert (config.block_hv_state, config.state_stages) == (32, 2)
    assert tc.state_smem(256, 32, 2, 3) > tc._SMEM_LIMIT
    small = tc.default_config(2, 4, 32, nk=2, h=32)  # Hv 32: one slice whatever the width
    assert small.state_stages == 3


def test_state_smem_bounds_ptxas():
    """Triton's compiler (sm_90a, bundled ptxas, no GPU) on the state kernel as the B1 and B8
    defaults launch it at the model's heads, bf16: the shared memory it allocates is within
    `state_smem`'s estimate and the per-program limit."""
    from experiments import profile_gdn_chunk as prof

    configs = {b: tc.default_config(b, MODEL["nv"], MODEL["hv"], nk=MODEL["nk"]) for b in (1, 8)}
    done = prof.ptxas_report([prof.describe(c) for c in configs.values()], capture=True)
    if "No such file" in done.stderr or "FileNotFoundError" in done.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert done.returncode == 0, done.stderr[-3000:]
    shared = [int(n) for n in re.findall(r"_state_kernel .*; shared (\d+) B", done.stdout)]
    assert len(shared) == len(configs), done.stdout
    for (b, config), used in zip(configs.items(), shared, strict=True):
        bound = tc.state_smem(128, config.block_hv_state, 2, config.state_stages)
        assert used <= bound <= tc._SMEM_LIMIT, (b, used, bound)
