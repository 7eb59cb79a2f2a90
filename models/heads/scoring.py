"""Head scoring without training: which (layer, KV head) pairs may stream.

Two scores per `[L, K]` head, from calibration prompts whose answers are teacher-forced after the
prompt (`models.heads.data.Batch`):

* **retrieval**: the attention mass a head (mean of its G query heads) puts on the needle span
  while the model produces the answer tokens — the retrieval-head signal of RazorAttention and
  the retrieval-head papers. A head that reads the needle must stay full.
* **streaming error**: how much the layer's output at the answer positions changes when only that
  head switches to sink + window, relative to the layer's output: `‖Δo_k W_o‖ / ‖o W_o‖`, where
  `Δo_k` is that head's streaming-minus-full attention output (the other heads stay full, so the
  change is exactly this head's rows of `o_proj`).

Both come from one forward (`ProbeAttend`) per batch. `combined` averages the two scores' ranks;
`streaming_mask` keeps the highest-scored heads full and streams the rest at a target fraction,
the `[L, K]` mask `Policy.headwise(streaming=...)` takes.

Not done here: models whose mixers are not `Attention` layers with an `o_proj` (GDN, MLA).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from models.heads.data import Batch
from models.heads.mix import Probe, ProbeAttend
from models.layers.attention import Attention


class HeadScores(NamedTuple):
    """Per (layer, KV head) scores; higher = more important to keep full.

    Attributes:
      retrieval: `[L, K]` mean attention mass on the needle at the answer positions.
      streaming_error: `[L, K]` mean relative change of the layer output when the head streams.
      prompts: number of calibration prompts averaged.
    """

    retrieval: np.ndarray
    streaming_error: np.ndarray
    prompts: int

    def combined(self) -> np.ndarray:
        """`[L, K]` mean of the two scores' rank percentiles in [0, 1]."""
        return (_rank01(self.retrieval) + _rank01(self.streaming_error)) / 2

    def get(self, method: str) -> np.ndarray:
        """The `[L, K]` score named `method`: retrieval, streaming_error or combined."""
        if method == "combined":
            return self.combined()
        if method in ("retrieval", "streaming_error"):
            return getattr(self, method)
        raise ValueError(f"method={method!r} must be one of {SCORE_METHODS}")


SCORE_METHODS = ("combined", "retrieval", "streaming_error")


def _rank01(x: np.ndarray) -> np.ndarray:
    flat = np.asarray(x, np.float64).ravel()
    ranks = np.argsort(np.argsort(flat, kind="stable"), kind="stable")
    return (ranks / max(len(flat) - 1, 1)).reshape(np.shape(x))


def attention_layers(model) -> list[int]:
    """Indices of the model's softmax-attention layers (the ones a head policy applies to)."""
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mixer, Attention)]


@nnx.jit(static_argnames=("window", "sinks", "implementation"))
def _probe(model, batch: Batch, *, window: int, sinks: int, implementation: str):
    b, t = batch.input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    attend = ProbeAttend(batch.answer_pos, batch.needle_mask, window=window, sinks=sinks,
                         implementation=implementation)
    states = [None] * len(model.layers)
    _, probes = model.forward(batch.input_ids, positions, attend=attend, states=states)
    valid = batch.answer_valid.astype(jnp.float32)  # [B, A]
    count = jnp.maximum(valid.sum(axis=1), 1.0)  # [B]
    retrieval, error = [], []
    for layer, probe in zip(model.layers, probes):
        retrieval.append(jnp.einsum("BAK,BA->BK", probe.mass, valid) / count[:, None])
        error.append(_streaming_error(layer.mixer, probe, valid, count))
    return jnp.stack(retrieval, axis=1), jnp.stack(error, axis=1)  # [B, L, K] each


def _streaming_error(mixer: Attention, probe: Probe, valid, count) -> Float[Array, "B K"]:
    """`‖Δo_k W_o‖ / ‖o W_o‖` per row and KV head, averaged over the valid answer positions."""
    b, a, n, hv = probe.full.shape
    num_kv = mixer.cfg.num_kv_heads
    w = mixer.o_proj.kernel[...].astype(jnp.float32).reshape(num_kv, n // num_kv * hv, -1)
    delta = (probe.stream - probe.full).reshape(b, a, num_kv, n // num_kv * hv)
    change = jnp.linalg.norm(jnp.einsum("BAKI,KID->BAKD", delta, w), axis=-1)  # [B, A, K]
    base = jnp.linalg.norm(probe.full.reshape(b, a, n * hv) @ w.reshape(n * hv, -1), axis=-1)
    rel = change / jnp.maximum(base, 1e-6)[..., None]
    return jnp.einsum("BAK,BA->BK", rel, valid) / count[:, None]


def score_heads(model, batches: Iterable[Batch], *, window: int, sinks: int,
                implementation: str = "auto", progress: bool = False) -> HeadScores:
    """Retrieval and streaming-error scores of every attention head, over calibration batches.

    Args:
      model: a `CausalLM` whose attention layers are `Attention` modules.
      batches: `Batch`es (prompt + answer, needle marked); each is one forward.
      window, sinks: the streaming geometry the streaming error is measured for.
      implementation: dense attention backend.
      progress: show a tqdm bar over batches.

    Returns:
      `HeadScores` with `[L, K]` arrays over the attention layers (`attention_layers(model)`).

    Raises:
      ValueError: no batches, `window < 1`, `sinks < 0`, or a model with no attention layer.
    """
    if window < 1 or sinks < 0:
        raise ValueError(f"{window=} must be >= 1 and {sinks=} >= 0")
    layers = attention_layers(model)
    if not layers or len(layers) != len(model.layers):
        raise ValueError("score_heads needs a model whose every layer is softmax attention; "
                         f"attention layers {layers} of {len(model.layers)}")
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty")
    if progress:
        from tqdm import tqdm

        batches = tqdm(batches, desc="score heads (first batch compiles)", unit="batch")
    ret, err, rows = 0.0, 0.0, 0
    for batch in batches:
        r, e = _probe(model, jax.tree.map(jnp.asarray, batch), window=int(window),
                      sinks=int(sinks), implementation=implementation)
        ret = ret + np.asarray(r, np.float64).sum(0)
        err = err + np.asarray(e, np.float64).sum(0)
        rows += r.shape[0]
    return HeadScores(ret / rows, err / rows, rows)


def streaming_mask(scores: np.ndarray, fraction: float) -> np.ndarray:
    """The `[L, K]` bool mask streaming the `round(fraction * L * K)` lowest-scored heads.

    Higher score = keep full. Ties go to the lower (layer, head) index first.

    Raises:
      ValueError: `scores` not 2-D or not finite; `fraction` outside [0, 1].
    """
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [L, K]; got shape {scores.shape}")
    if not np.isfinite(scores).all():
        raise ValueError("scores must be finite; got NaN or inf at "
                         f"{np.argwhere(~np.isfinite(scores)).tolist()[:4]}")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{fraction=} must be in [0, 1]")
    count = round(fraction * scores.size)
    order = np.argsort(scores.ravel(), kind="stable")
    mask = np.zeros(scores.size, bool)
    mask[order[:count]] = True
    return mask.reshape(scores.shape)
