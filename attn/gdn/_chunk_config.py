"""Launch configuration of the chunked GDN prefill (`attn/gdn/triton_chunk.py`): the frozen
`Config`, the per-shape heuristic `default_config`, and the grids and constexprs a config gives
the two forward kernels and the backward's (`attn/gdn/_chunk_bwd.py`).

A config chooses launches only (warps, pipeline stages, value-slice width, the order of the
programs, one intra program per value head or per pair of them); every config computes the same
algorithm with the same dot precisions.
"""

import dataclasses

import triton

from attn._op import device_facts

CHUNK = 64  # tokens per chunk C; the intra kernel's solve is written for 64 rows
SUB = 16  # rows of the diagonal blocks the (I + A)⁻¹ solve inverts by substitution; C == 4 SUB
GRID_YZ_MAX = 65535  # CUDA's limit on a grid's y and z axes
# Relative time of one state step by value-slice width, one program per SM (H100, bf16, H = Hv =
# 128: 1.49 us at 32, 2.02 us at 64).
STEP_COST = {32: 1.0, 64: 1.36}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration of the intra-chunk and state kernels.

    `Config()` launches on every shape; `default_config` picks the fastest per shape. Does not
    change the arithmetic: outputs are bitwise the same for every config but `intra_pairs`, whose
    W and U round differently in bf16 (β applied to `K Kᵀ`'s rows, not to K).
    """

    block_hv_state: int = 32  # value features per state program ([H, BLOCK_HV] float32 state)
    state_warps: int = 4
    state_stages: int = 2  # software-pipeline depth of the state kernel's chunk loop
    intra_warps: int = 4
    # One intra program per pair of value heads of a key head (Nv // Nk even): K Kᵀ and Q Kᵀ
    # once, both heads' 16 x 16 diagonal blocks inverted as one batch of 3-D dots.
    intra_pairs: bool = False
    # Intra grid `(Nv, chunks)`: the value heads of a chunk launch together (k / q read once per
    # key head from HBM). Chunks <= 65535.
    intra_head_major: bool = False
    # State grid `(slices, Nv, Ns)`: the value slices of a head launch side by side (their re-reads
    # of W, K, Q, P hit L2). Sequences <= 65535.
    state_slice_major: bool = False
    # Backward (`_chunk_bwd.py`). The saving forward state pass and the reverse one take the state
    # kernel's slice width, stages and grid order, and `bwd_state_warps`; the chunk-parallel
    # kernels take the intra grid's order and these. H100, B1 T32K, Nk16 Nv32 H = Hv = 128, bf16:
    # dqk 1.87 ms at 64-wide value steps (3.43 at 16-wide, 2.01 at 32-wide and 2 stages), wy
    # 1.26 ms at 4 warps (2.02 at 8), dk 0.52 ms at 4 warps (0.78 at 8), the state passes fastest
    # at 4 warps (dstate 1.24 ms, 1.46 at 8).
    bwd_state_warps: int = 4
    dqk_warps: int = 8
    dqk_block_v: int = 64  # value features per step of dqk_kernel's loop over Hv
    dqk_stages: int = 1  # software-pipeline depth of that loop
    wy_warps: int = 4
    dk_warps: int = 4

    def __post_init__(self):
        if self.block_hv_state < 16 or self.block_hv_state & (self.block_hv_state - 1):
            raise ValueError(f"block_hv_state={self.block_hv_state} must be a power of two >= 16")
        if self.dqk_block_v < 16 or self.dqk_block_v & (self.dqk_block_v - 1):
            raise ValueError(f"dqk_block_v={self.dqk_block_v} must be a power of two >= 16")
        for name in ("state_warps", "intra_warps", "bwd_state_warps", "dqk_warps", "wy_warps",
                     "dk_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 1")
        for name in ("state_stages", "dqk_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def state_smem(h: int, hv_slice: int, itemsize: int, stages: int) -> int:
    """Shared memory (bytes, a slight over-estimate) of the state kernel: per stage the W, K, Q
    rows, P and the U slice of one chunk and its float32 gates; the state and V_new staged for the
    dots. ptxas for sm_90a, bf16, H = 128: 184,840 B at 32-wide slices and three stages, 213,512
    at 64-wide (`tests/attn/test_gdn_triton.py` checks the bound)."""
    block_h = max(16, triton.next_power_of_2(h))
    per_stage = itemsize * CHUNK * (3 * block_h + CHUNK + hv_slice) + 4 * CHUNK
    return stages * per_stage + itemsize * hv_slice * (block_h + CHUNK)


def default_config(num_seqs: int, nv: int, hv: int, num_chunks: int = 1, *,
                   nk: int | None = None, h: int = 128, itemsize: int = 2) -> Config:
    """The state loop three stages deep where that fits (`state_smem`), the value-slice width of
    the fewest waves of steps (one program per SM, `STEP_COST`), the pair intra kernel where
    `nk` is given and Nv // Nk is even, the head-major grids where they fit (`num_chunks`: an
    upper bound). H100, Nk16 Nv32 H = Hv = 128, bf16, initial states: B1 T32K 1.53 ms, B8 T4K
    1.23 ms, 1.6x / 1.8x fla's `chunk_gated_delta_rule` (benchmarks/prefill.md).

    Three stages matter because Triton issues a step's async copies for the next chunk at the end
    of the step, after its dots: with two, every step opens by waiting out a whole copy latency.
    `h` and `itemsize` (of the intermediates: 4 on the float32 path) size the shared memory:
    rows over 256 bytes (float32 at H128) also take 32-wide dqk value steps, since 64-wide ones
    need 288 KiB there (`python -m experiments.tools.hopper_fit --ops gdn_chunked`).
    """
    majors = dict(state_slice_major=num_seqs <= GRID_YZ_MAX,
                  intra_head_major=num_chunks <= GRID_YZ_MAX)
    pairs = nk is not None and nv % nk == 0 and (nv // nk) % 2 == 0

    facts = device_facts()  # SM count and shared memory per program (an H100's on a CPU)

    def waves(width):
        return triton.cdiv(num_seqs * nv * triton.cdiv(hv, width), facts.num_sms) * STEP_COST[width]

    fits = [(waves(w), w, s) for s in (3, 2) for w in STEP_COST
            if state_smem(h, min(w, max(16, triton.next_power_of_2(hv))), itemsize, s)
            <= facts.shared_memory]
    # Where no estimate fits: 32-wide slices, two stages for float32 intermediates (the estimate
    # overstates them: 160 KiB compiled at H128) and one for 16-bit ones at H256 (two compile to
    # 236 KiB, as estimated).
    fallback = (0, 32, 2 if itemsize == 4 else 1)
    _, width, stages = min(fits, key=lambda f: (f[0], -f[2], f[1])) if fits else fallback
    wide_rows = max(16, triton.next_power_of_2(h)) * itemsize > 256
    return Config(block_hv_state=width, state_warps=4, state_stages=stages, intra_pairs=pairs,
                  dqk_block_v=32 if wide_rows else 64, **majors)


def intra_grid(config: Config, nv: int, n_chunks: int) -> tuple[int, int]:
    """A program per (chunk, value head), or per (chunk, pair of value heads) with
    `intra_pairs`; heads first with `intra_head_major`."""
    heads = nv // 2 if config.intra_pairs else nv
    return (heads, n_chunks) if config.intra_head_major else (n_chunks, heads)


def intra_constexprs(config: Config) -> dict:
    return dict(SUB=SUB, HEAD_MAJOR=config.intra_head_major)


def state_grid(config: Config, n_seq: int, nv: int, slices: int) -> tuple[int, int, int]:
    """A program per (sequence, value head, value slice); slices first with
    `state_slice_major`."""
    return (slices, nv, n_seq) if config.state_slice_major else (n_seq, nv, slices)


def state_constexprs(config: Config, t_row: int) -> dict:
    """`t_row`: tokens per batch row without cu_seqlens (chunk addresses from the index), 0 with
    them (from the chunk tables)."""
    return dict(T_ROW=t_row, SLICE_MAJOR=config.state_slice_major)


def state_launch(config: Config) -> dict:
    return dict(num_warps=config.state_warps, num_stages=config.state_stages)


def bwd_state_launch(config: Config) -> dict:
    """The saving forward's and the reverse pass's launch."""
    return dict(num_warps=config.bwd_state_warps, num_stages=config.state_stages)


def bwd_grid(config: Config, nk: int, n_chunks: int) -> tuple[int, int]:
    """A program per (chunk, key head) of `dqk_kernel` / `dk_kernel`; key heads first with
    `intra_head_major`."""
    return (nk, n_chunks) if config.intra_head_major else (n_chunks, nk)
