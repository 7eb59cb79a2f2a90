"""Host-side request types: a request's prompt and progress, how it samples, its attention policy.

`Policy` is data (`[L, K]` window and sinks per model layer and KV head), so requests with
different policies share a batch and a compiled step; the engine passes the effective policies
to the step as `[B, L, K]` int32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Policy:
    """Per-request attention policy: per layer and KV head, a window and a sink count.

    Attributes:
      window: `[L, K]` int32, most recent positions visible (own included); `<= 0` = full (then a
        layer's own configured window, if any, applies).
      sinks: `[L, K]` int32 leading positions that stay visible beside the window.
      name: label for reports.

    A head with `window > 0` is a streaming head: the engine releases its pages outside
    sink + window, so it holds at most `ceil(sinks / P) + window / P + 2` pages.
    """

    window: np.ndarray
    sinks: np.ndarray
    name: str = "custom"

    def __post_init__(self):
        w = np.asarray(self.window)
        s = np.asarray(self.sinks)
        if w.ndim != 2 or s.shape != w.shape:
            raise ValueError(f"window and sinks must both be [L, K]; got shapes {w.shape} and "
                             f"{s.shape}")
        if np.any(s < 0):
            raise ValueError(f"sinks must be >= 0; got min {s.min()}")
        object.__setattr__(self, "window", w.astype(np.int32))
        object.__setattr__(self, "sinks", s.astype(np.int32))

    @classmethod
    def dense(cls, num_layers: int, num_kv_heads: int) -> Policy:
        """Every head full (a layer's configured window still applies)."""
        z = np.zeros((num_layers, num_kv_heads), np.int32)
        return cls(z, z, "dense")

    @classmethod
    def streaming(cls, num_layers: int, num_kv_heads: int, *, window: int, sinks: int) -> Policy:
        """Every head sliding window + sinks."""
        shape = (num_layers, num_kv_heads)
        return cls(np.full(shape, window), np.full(shape, sinks), f"window{window}+sinks{sinks}")

    @classmethod
    def headwise(cls, num_layers: int, num_kv_heads: int, *, window: int, sinks: int,
                 streaming: np.ndarray | None = None) -> Policy:
        """Head-wise KV: the heads marked in `streaming` (`[L, K]` bool) stream, the rest are full.

        Default `streaming`: every other (layer, head) pair in row-major order, i.e. half of all
        KV heads of the model (`(l * K + k) % 2 == 1`).
        """
        if streaming is None:
            idx = np.arange(num_layers * num_kv_heads).reshape(num_layers, num_kv_heads)
            streaming = idx % 2 == 1
        streaming = np.asarray(streaming, bool)
        return cls(np.where(streaming, window, 0), np.where(streaming, sinks, 0),
                   f"headwise{window}+sinks{sinks}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request samples and stops.

    Attributes:
      temperature: 0 = greedy (argmax); else softmax temperature.
      top_k: keep the `top_k` most likely tokens (0 = all).
      top_p: nucleus: keep the smallest prefix of sorted tokens whose mass reaches `top_p`.
      seed: sampling seed; the token at position `p` uses `fold_in(key(seed), p)`.
      max_tokens: generated tokens at most (stop token included).
      stop_tokens: generation ends after any of these (it is kept in the output).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclasses.dataclass
class Request:
    """A generation request and its progress (host state).

    Attributes:
      prompt: prompt token ids.
      params: sampling and stopping.
      policy: attention policy (None = the engine default).
      id: request id (assigned by `Engine.add` when None).
      output: generated token ids so far.
      done: finished (stop token or max tokens).
      preemptions: how often it was preempted and recomputed.
      prefill_tokens: tokens it fed through the mixed (prefill) step, recomputation included.
      cached: tokens of `tokens` in the cache.
      row: the batch slot it occupies, or last occupied (its row of `Engine.last_logits`); None
        before its first admission.
      decisions: elastic engines only: `[L, K]` int32 router decisions of its prompt (1
        retrieval, 0 sparse; -1 on layers without a router), set by the step that prefilled the
        prompt; None before (and again after a preemption, until the recomputation routes it).
    """

    prompt: list[int]
    params: SamplingParams = SamplingParams()
    policy: Policy | None = None
    id: Any = None
    output: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    preemptions: int = 0
    prefill_tokens: int = 0
    cached: int = 0  # tokens of `tokens` in the KV cache
    row: int | None = None  # batch slot it occupies (or last occupied); None before admission
    decisions: np.ndarray | None = None  # [L, K] router decisions (elastic engines)

    @property
    def tokens(self) -> list[int]:
        return list(self.prompt) + self.output
