"""Lab tools beside the benchmarks: launch-config sweeps (`sweep`), per-kernel profiles
(`profile_gdn`, `profile_sparse`, `profile_prefill`) and the shared memory of every Triton launch
compiled for Hopper without a GPU (`hopper_fit`). They print tables and write nothing; tests do
not import them (one runs `hopper_fit` as its own process). The benchmark tables come from
`python -m experiments.bench`.
"""
