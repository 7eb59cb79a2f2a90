"""Generation engine: paged KV, fixed batch slots, chunked prefill, continuous batching, sampling.

    engine = Engine(model, batch_slots=4, max_len=1024, policy=Policy.headwise(L, K, ...))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16))

Parts: `requests` (request types), `adapters` (per-mixer adapters in a registry keyed by layer
kind; families register their own), `step` (device state and the jitted step), `sampling`,
`scheduler` (slots, preemption, host page mirror), `engine` (`Engine`). See `engine`'s module
docstring for the design.
"""

from models.engine.adapters import MixerAdapter, register_adapter
from models.engine.engine import Engine
from models.engine.requests import Policy, Request, SamplingParams
from models.engine.sampling import sample
from models.engine.step import TRACES, EngineKV, PagedAttend

__all__ = [
    "TRACES",
    "Engine",
    "EngineKV",
    "MixerAdapter",
    "PagedAttend",
    "Policy",
    "Request",
    "SamplingParams",
    "register_adapter",
    "sample",
]
