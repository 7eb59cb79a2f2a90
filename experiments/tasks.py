"""Synthetic long-context tasks, generated offline from a seed: passkey retrieval and multi-key
needle-in-a-haystack, at a target token length and needle depth.

A sample is a prompt (token ids, exactly `length` tokens) and the answer string; it is solved when
the answer appears in the decoded generation. The haystack is repeated filler sentences; needles
are inserted at a sentence boundary at `depth` (0 = start, 1 = just before the question).
"""

from __future__ import annotations

import dataclasses

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
KEYS = ("apple", "river", "candle", "mountain", "violin", "harbor", "tiger", "lantern",
        "meadow", "copper", "falcon", "pepper")
TASKS = ("passkey", "multikey")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One task instance.

    Attributes:
      task: task name.
      length: prompt length in tokens.
      depth: needle depth in [0, 1].
      prompt: token ids.
      answer: the string the generation must contain.
      needle_spans: `(start, end)` token ranges in `prompt` of the needles that hold the answer
        (the span a retrieval head copies from; multi-key distractors are not included).
    """

    task: str
    length: int
    depth: float
    prompt: list[int]
    answer: str
    needle_spans: tuple[tuple[int, int], ...] = ()


def _parts(task: str, rng: np.random.Generator) -> tuple[str, list[str], str, str]:
    """`(intro, needles, question, answer)` of one instance."""
    if task == "passkey":
        key = str(rng.integers(10000, 100000))
        intro = ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about the pass key.\n")
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        return intro, [needle], "\nWhat is the pass key? The pass key is", key
    if task == "multikey":
        names = rng.choice(len(KEYS), 4, replace=False)
        values = [str(v) for v in rng.integers(1000000, 10000000, 4)]
        intro = ("Some special magic numbers are hidden inside the following text. Make sure "
                 "to memorize them. I will quiz you about one of them.\n")
        needles = [f"One of the special magic numbers for {KEYS[n]} is: {v}. "
                   for n, v in zip(names, values)]
        ask = int(rng.integers(4))
        word = KEYS[names[ask]]
        question = (f"\nWhat is the special magic number for {word} mentioned in the text? "
                    f"The special magic number for {word} is")
        return intro, needles, question, values[ask]
    raise ValueError(f"task={task!r} must be one of {TASKS}")


def make_sample(tokenizer, task: str, length: int, depth: float, seed: int) -> Sample:
    """Build one sample of exactly `length` tokens (`tokenizer.encode` without special tokens).

    Multi-key needles are spread around `depth` (the queried one is not always the first).

    Raises:
      ValueError: unknown task, depth outside [0, 1], or a length too short for the needles.
    """
    if not 0 <= depth <= 1:
        raise ValueError(f"{depth=} must be in [0, 1]")
    rng = np.random.default_rng(seed)
    intro, needles, question, answer = _parts(task, rng)

    def enc(text):
        return list(tokenizer.encode(text, add_special_tokens=False))

    head, tail = enc(intro), enc(question)
    needle_ids = [enc(n) for n in needles]
    unit = enc(FILLER)
    budget = length - len(head) - len(tail) - sum(len(n) for n in needle_ids)
    if budget < len(unit):
        raise ValueError(f"{length=} is too short for task {task!r}")
    units = budget // len(unit)
    spare = budget - units * len(unit)
    hay = [unit] * units
    # Needle i goes after filler unit round(units * d_i); d_i spread ±0.05 around depth.
    spread = np.linspace(-0.05, 0.05, len(needles)) if len(needles) > 1 else np.zeros(1)
    order = rng.permutation(len(needles))
    slots = {}
    for i, d in zip(order, np.clip(depth + spread, 0, 1)):
        slots.setdefault(int(np.rint(units * d)), []).append(i)
    prompt = head + unit[:spare]
    spans = []
    for u in range(units + 1):
        for i in slots.get(u, []):
            if answer in needles[i]:
                spans.append((len(prompt), len(prompt) + len(needle_ids[i])))
            prompt += needle_ids[i]
        if u < units:
            prompt += hay[u]
    prompt += tail
    if len(prompt) != length:
        raise RuntimeError(f"built {len(prompt)} tokens, wanted {length}")
    return Sample(task, length, float(depth), prompt, answer, tuple(spans))


def make_samples(tokenizer, *, tasks, lengths, depths, samples: int, seed: int = 0):
    """Every (task, length, depth, sample index) instance, seeds derived from the indices."""
    out = []
    for ti, task in enumerate(tasks):
        for li, length in enumerate(lengths):
            for di, depth in enumerate(depths):
                for s in range(samples):
                    out.append(make_sample(tokenizer, task, length, depth,
                                           seed=int(np.random.SeedSequence(
                                               [seed, ti, li, di, s]).generate_state(1)[0])))
    return out


def training_samples(tokenizer, *, count: int, lengths, tasks=TASKS,
                     seed: int = 0) -> list[Sample]:
    """`count` samples for head training or calibration: task, length (one of `lengths`) and
    depth (uniform in [0.05, 0.95]) drawn per sample.

    Seeds are disjoint from `make_samples`' (evaluation) for any `seed`: the seed sequences here
    have one more entry, so the two sets do not share a prompt.

    Raises:
      ValueError: `count < 1`, or no lengths.
    """
    if count < 1:
        raise ValueError(f"{count=} must be >= 1")
    if not lengths:
        raise ValueError(f"{lengths=} must name at least one length")
    out = []
    for i in range(count):
        ss = np.random.SeedSequence([seed, i, 0, 0, 0, 1])
        rng = np.random.default_rng(ss)
        length = int(lengths[int(rng.integers(len(lengths)))])
        task = tasks[int(rng.integers(len(tasks)))]
        depth = float(rng.uniform(0.05, 0.95))
        out.append(make_sample(tokenizer, task, length, depth,
                               seed=int(ss.generate_state(1)[0])))
    return out


def solved(text: str, answer: str) -> bool:
    """Whether the generation contains the answer."""
    return answer in text
