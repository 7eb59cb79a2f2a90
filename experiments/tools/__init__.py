"""Lab tools beside the benchmarks: launch-config sweeps (`sweep`) and per-kernel profiles
(`profile_gdn`, `profile_sparse`, `profile_prefill`). They print tables and write nothing; tests
do not import them. The benchmark tables come from `python -m experiments.bench`.
"""
