"""Training and calibration batches for head selection.

A `Batch` holds prompts with their answers appended (teacher forcing), right padded: causal
attention never lets a padded position reach a real one, so padding needs no mask beyond
`answer_valid`. `batch_from_samples` builds one from task samples (`experiments.tasks.Sample`:
prompt ids, answer string, needle token spans).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from jaxtyping import Array, Bool, Int


class Batch(NamedTuple):
    """Prompts + answers for distillation and scoring.

    Attributes:
      input_ids: `[B, T]` int32 prompt then answer tokens, right padded with 0.
      answer_pos: `[B, A]` int32 positions whose NEXT token is an answer token.
      answer_ids: `[B, A]` int32 those next tokens.
      answer_valid: `[B, A]` bool, False on padding of rows with shorter answers.
      needle_mask: `[B, T]` bool, the needle tokens (the span the answer is copied from).
    """

    input_ids: Int[Array, "B T"]
    answer_pos: Int[Array, "B A"]
    answer_ids: Int[Array, "B A"]
    answer_valid: Bool[Array, "B A"]
    needle_mask: Bool[Array, "B T"]


def batch_from_samples(samples: Sequence, tokenizer, *, pad_to: int | None = None) -> Batch:
    """A `Batch` of task samples: each prompt followed by `" " + answer`, tokenized.

    Args:
      samples: objects with `prompt` (token ids), `answer` (str) and `needle_spans`
        (`[(start, end), ...]` token ranges of the prompt).
      tokenizer: the model's tokenizer (`encode(text, add_special_tokens=False)`).
      pad_to: total length T (default: the longest prompt + answer).

    Raises:
      ValueError: no samples, or `pad_to` shorter than a row.
    """
    if not samples:
        raise ValueError("samples is empty")
    rows, answers = [], []
    for s in samples:
        ans = list(tokenizer.encode(" " + s.answer, add_special_tokens=False))
        rows.append(list(s.prompt) + ans)
        answers.append(ans)
    t = max(len(r) for r in rows) if pad_to is None else pad_to
    if any(len(r) > t for r in rows):
        raise ValueError(f"pad_to={pad_to} is shorter than the longest row "
                         f"({max(len(r) for r in rows)} tokens)")
    a = max(len(x) for x in answers)
    b = len(samples)
    ids = np.zeros((b, t), np.int32)
    pos = np.zeros((b, a), np.int32)
    nxt = np.zeros((b, a), np.int32)
    valid = np.zeros((b, a), bool)
    needle = np.zeros((b, t), bool)
    for i, (s, row, ans) in enumerate(zip(samples, rows, answers)):
        ids[i, :len(row)] = row
        start = len(s.prompt) - 1  # the last prompt token predicts the first answer token
        pos[i, :len(ans)] = np.arange(start, start + len(ans))
        pos[i, len(ans):] = start  # padding points at a real position; masked by `valid`
        nxt[i, :len(ans)] = ans
        valid[i, :len(ans)] = True
        for lo, hi in s.needle_spans:
            needle[i, lo:hi] = True
    return Batch(ids, pos, nxt, valid, needle)
