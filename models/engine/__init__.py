"""Generation engine: paged KV, fixed batch slots, chunked prefill, continuous batching, sampling.

    engine = Engine(model, batch_slots=4, max_len=1024, policy=Policy.headwise(L, K, ...))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16))

The package in parts:

* `requests` — `Request`, `SamplingParams`, `Policy` (host data);
* `adapters` — one adapter per mixer kind, in a registry keyed by layer kind: attention (paged
  KV), MLA (paged latent), Gated DeltaNet (per-row slots); a family registers its own (PawQwen3's
  elastic attention: `models/families/pawqwen3_engine.py`); the package imports no family;
* `step` — the device state (`EngineKV`), the attend object handed to the model, the jitted
  mixed (`T = chunk`) and decode (`T = 1`) steps;
* `cache` — `PagedKV`, what an attention layer's attend reads (`Engine(attend=...)`), and
  `paged_attention`, the engine's own;
* `sharding` — tensor parallelism (`Engine(mesh=...)`): weights, layers and state split by head;
* `sampling` — greedy / temperature / top-k / top-p inside the step;
* `scheduler` — slots, admission, preemption and the host mirror of the page accounting, which
  shares its recycle rule with `kv` (`kv.recycle_bounds_host`);
* `engine` — `Engine`, which ties them together (its docstring has the design).
"""

from models.engine.adapters import MixerAdapter, TPSpecs, register_adapter
from models.engine.cache import PagedKV, paged_attention
from models.engine.engine import Engine
from models.engine.requests import Policy, Request, SamplingParams
from models.engine.sampling import sample
from models.engine.sharding import TensorParallel
from models.engine.step import TRACES, EngineKV, PagedAttend

__all__ = [
    "TRACES",
    "Engine",
    "EngineKV",
    "MixerAdapter",
    "PagedAttend",
    "PagedKV",
    "Policy",
    "Request",
    "SamplingParams",
    "TPSpecs",
    "TensorParallel",
    "paged_attention",
    "register_adapter",
    "sample",
]
