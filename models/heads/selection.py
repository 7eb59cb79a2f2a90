"""The result of head selection, as a file: gates and / or scores, and the masks they give.

`python -m experiments.train_heads` writes a `HeadSelection` as JSON (`heads.json`);
`longctx_eval --heads heads.json` and the notebooks read it back and ask for a streaming mask at
any fraction:

    sel = HeadSelection.load("out/train_heads/heads.json")
    mask = sel.streaming("trained", 0.5)                 # [L, K] bool, lowest gates stream
    policy = Policy.headwise(L, K, window=sel.window, sinks=sel.sinks, streaming=mask)

Sources: `"trained"` ranks heads by their trained gates; `"scored"` by the training-free
`HeadScores.combined()` (or `"scored:retrieval"` / `"scored:streaming_error"` for one score).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from models.heads.scoring import SCORE_METHODS, HeadScores, streaming_mask

SOURCES = ("trained", "scored")


@dataclasses.dataclass
class HeadSelection:
    """Per (layer, KV head) rankings of one model at one streaming geometry.

    Attributes:
      num_layers, num_kv_heads: L, K.
      window, sinks: the streaming heads' geometry the rankings were made for.
      gates: `[L, K]` trained gates in [0, 1] (1 = full), or None.
      scores: `HeadScores` of the training-free scoring, or None.
      meta: free-form run facts (model, steps, timing) kept with the file.
    """

    num_layers: int
    num_kv_heads: int
    window: int
    sinks: int
    gates: np.ndarray | None = None
    scores: HeadScores | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        shape = (self.num_layers, self.num_kv_heads)
        if self.gates is not None:
            self.gates = np.asarray(self.gates, np.float64)
            if self.gates.shape != shape:
                raise ValueError(f"gates.shape={self.gates.shape} must be [L, K] = {shape}")
        if self.scores is not None:
            for name in ("retrieval", "streaming_error"):
                got = np.shape(getattr(self.scores, name))
                if got != shape:
                    raise ValueError(f"scores.{name}.shape={got} must be [L, K] = {shape}")

    def ranking(self, source: str) -> np.ndarray:
        """`[L, K]` importance (higher = keep full) of `source`: trained, scored[:method]."""
        kind, _, method = source.partition(":")
        if kind == "trained" and not method:
            if self.gates is None:
                raise ValueError("this selection has no trained gates; run "
                                 "`python -m experiments.train_heads --train gates`")
            return self.gates
        if kind == "scored":
            if self.scores is None:
                raise ValueError("this selection has no head scores; run "
                                 "`python -m experiments.train_heads` without --no-score")
            return self.scores.get(method or "combined")
        raise ValueError(f"source={source!r} must be one of {SOURCES} (scored may name a "
                         f"method: scored:{'|'.join(SCORE_METHODS)})")

    def streaming(self, source: str, fraction: float) -> np.ndarray:
        """`[L, K]` bool: the `round(fraction * L * K)` lowest-ranked heads of `source` stream."""
        return streaming_mask(self.ranking(source), fraction)

    def to_json(self) -> dict:
        out = dict(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                   window=self.window, sinks=self.sinks, meta=self.meta)
        if self.gates is not None:
            out["gates"] = self.gates.tolist()
        if self.scores is not None:
            out["scores"] = dict(retrieval=np.asarray(self.scores.retrieval).tolist(),
                                 streaming_error=np.asarray(self.scores.streaming_error).tolist(),
                                 prompts=int(self.scores.prompts))
        return out

    def save(self, path: str) -> None:
        """Write JSON to `path`."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> HeadSelection:
        """Read a file written by `save`.

        Raises:
          ValueError: a file that is not a head selection (the missing field named).
        """
        with open(path) as f:
            data = json.load(f)
        missing = [k for k in ("num_layers", "num_kv_heads", "window", "sinks") if k not in data]
        if missing:
            raise ValueError(f"{path} is not a head selection: missing {missing}")
        scores = data.get("scores")
        if scores is not None:
            scores = HeadScores(np.asarray(scores["retrieval"]),
                                np.asarray(scores["streaming_error"]), int(scores["prompts"]))
        gates = data.get("gates")
        return cls(int(data["num_layers"]), int(data["num_kv_heads"]), int(data["window"]),
                   int(data["sinks"]), None if gates is None else np.asarray(gates), scores,
                   data.get("meta", {}))
