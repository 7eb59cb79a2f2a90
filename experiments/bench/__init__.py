"""One benchmark CLI: our kernels against their anchors and the hardware ceilings, in one process.

    python -m experiments.bench <suite> [--rows g1,g2] [--set name=value,...] [--quick]
                                        [--out benchmarks] [--budget-s 0.5]
    python -m experiments.bench <suite> --render   # rewrite <suite>.md from <suite>.json
    python -m experiments.bench --list             # suites, row groups, their arguments

Which command reproduces which committed file (on the GPU machine: `source .ci/gpu-env &&`
first):

    benchmarks/decode.{json,md}    python -m experiments.bench decode
    benchmarks/prefill.{json,md}   python -m experiments.bench prefill
    benchmarks/gdn.{json,md}       python -m experiments.bench gdn --rows gdn_chunk_fwd_bwd,
                                   causal_conv1d_bwd --set gdn_chunk_fwd_bwd.xla_max_tokens=0
                                   (the backward rows, without the XLA reference's timing)
    benchmarks/sparse_prefill.{json,md}  python -m experiments.bench sparse_prefill
                                   --rows block_sparse_fwd_bwd  (the backward rows)
    benchmarks/multigpu.{json,md}  python -m experiments.bench multigpu     (4 GPUs)
    benchmarks/heads.{json,md,*.png}  python -m experiments.bench heads [-- --model GGUF]
    benchmarks/serving.{json,md,png}  python -m experiments.bench serving [-- --model GGUF]

`multigpu`, `heads` and `serving` are suites written by their own tools (`registry.COMMANDS`):
the bench runs their steps, each in a process of its own (`experiments.bench_multigpu`; for
`heads` `experiments.train_heads`, `experiments.longctx_eval` twice and
`experiments.heads_report`; for `serving` `experiments.serve_sim` twice and its `--render`;
intermediates under `--work`); `--dry-run` and `--list` print the exact commands.

Suites (`registry.SUITES`; each writes `<out>/<suite>.json` and `.md`, `<suite>_quick.*` with
`--quick`) and their row groups, in run order:

- `decode`: `paged_decode`, `mla_decode`, `gdn_decode`, `causal_conv1d_update`, `kv_write`,
  `engine_decode` (the engine's pools take ~60 GB at B64 / S8K).
- `prefill`: `flash_prefill`, `window_prefill`, `block_sparse_prefill`, `xattn_estimate`,
  `gdn_chunk_prefill`, `causal_conv1d`, `paged_prefill`, `flash_prefill_fwd_bwd`,
  `softcap_prefill`.
- `sparse_prefill`, `gdn`, `mla`, `kv_write`, `engine`: subsets of the two above, by op family.

A row group is one op (`registry.register`): its arguments are a frozen dataclass (`--list`
prints them) with the PERF.md shapes as defaults and `QUICK`, tiny shapes that the CPU runs
through Triton's interpreter in seconds. `--set` changes arguments in the one config-string
syntax of `registry` (`name=value,...`; `group.name=value` for one group; tuples joined by
`:`), the syntax the tools in `experiments/tools/` take for launch configs too. Every figure,
ours and the anchors' (JAX, cuDNN, tokamax, Pallas, torch / fla), comes from `core.time_ms`,
and every ceiling is measured in the same process (`core.Context`). Each row follows PERF.md's
schema: `ms`, `achieved` against `ceiling` (`fraction_of_ceiling`), `anchor_ms` and
`speedup_vs_anchor`, the `goal` and the computed `meets_goal`; the JSON header records the
device, jax, the commit and the ceilings. A group that fails is logged and the next one runs;
the files are rewritten after every row, so a time limit keeps what was measured.
"""

from experiments.bench.cli import main
from experiments.bench.core import Context, render, row, time_ms
from experiments.bench.registry import SUITES, parse_changes, parse_fields, register, specs

__all__ = ["SUITES", "Context", "main", "parse_changes", "parse_fields", "register", "render",
           "row", "specs", "time_ms"]
