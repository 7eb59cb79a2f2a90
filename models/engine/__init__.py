"""Generation engine package; see `models.engine.engine`."""

from models.engine.engine import TRACES, Engine, EngineKV, PagedAttend, Policy, Request, SamplingParams, sample

__all__ = ["TRACES", "Engine", "EngineKV", "PagedAttend", "Policy", "Request", "SamplingParams", "sample"]
