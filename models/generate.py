"""Text in, text out: a model with its tokenizer from one path, generation through the engine.

    model, tokenizer = models.load_pretrained(path)    # .gguf file, HF directory or orbax ckpt
    models.generate(model, tokenizer, ["The capital of France is"], max_tokens=16)

`load_pretrained` reads the weights with `from_pretrained` (GGUF, HF) or `load` (an orbax
checkpoint written by `python -m experiments.convert`, which stores the source's tokenizer in the
checkpoint) and the tokenizer with transformers from the same place, offline.

`generate` tokenizes every prompt, queues one `Request` per prompt in an `Engine` (paged KV,
continuous batching, chunked prefill, per-request policy), runs the engine until every request
is done and decodes the outputs. The engine's steps are jitted on static shapes, so `generate`
rounds them: batch slots to a power of two (at most `MAX_SLOTS`) and `max_len` to a power of
two (at least `MIN_LEN`), so that calls with similar prompts reuse the compiled steps. Pass
`engine=` to keep one engine (and its pools) across calls.

Not done here: streaming output, per-prompt sampling parameters or policies (build `Request`s
and call `Engine.add` / `Engine.run` directly), stop strings (only stop tokens).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax.numpy as jnp

from models.checkpoint import is_checkpoint, load, tokenizer_dir
from models.convert import CheckpointError, from_pretrained
from models.engine import Engine, Policy, Request, SamplingParams

MAX_SLOTS = 8  # default batch slots at most: more prompts queue (continuous batching)
MIN_LEN = 256  # default max_len at least: short prompts of any length share compiled steps


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored with a checkpoint (offline).

    Args:
      path: a `.gguf` file (its embedded tokenizer), an HF directory (`tokenizer.json` /
        `tokenizer_config.json`), or an orbax checkpoint written by `experiments.convert`.

    Returns:
      A transformers tokenizer.

    Raises:
      FileNotFoundError: `path` does not exist.
      CheckpointError: no tokenizer there (an orbax checkpoint saved without one, an HF
        directory without tokenizer files).
    """
    import transformers

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such checkpoint directory or GGUF file")
    if os.path.isfile(path):
        return transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path),
            local_files_only=True)
    if is_checkpoint(path):
        found = tokenizer_dir(path)
        if found is None:
            raise CheckpointError(
                f"{path}: this checkpoint was saved without a tokenizer; convert the source "
                f"again (`python -m experiments.convert SRC DST` stores it) or load the "
                f"tokenizer yourself and use models.load({path!r})")
        path = found
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no tokenizer found ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None


def load_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, progress: bool = False):
    """A model and its tokenizer from one path: GGUF file, HF directory or orbax checkpoint.

    Args:
      path: a `.gguf` file, an HF directory (`config.json`, safetensors, tokenizer files), or a
        checkpoint directory written by `python -m experiments.convert` / `models.save`.
      dtype: parameter and compute dtype (`jnp.float32`, `jnp.bfloat16`, or their names); an
        orbax checkpoint stored at another dtype is cast.
      progress: show the conversion progress bar (GGUF / HF).

    Returns:
      `(model, tokenizer)`.

    Raises:
      FileNotFoundError: `path` does not exist.
      CheckpointError: unreadable weights, or no tokenizer stored with them.
      ConfigError, ValueError: an invalid config or an unsupported architecture.
      TypeError: a non-floating `dtype`.
    """
    path = os.fspath(path)
    if is_checkpoint(path):
        model = load(path, dtype=dtype)
    else:
        model = from_pretrained(path, dtype=dtype, progress=progress)
    return model, load_tokenizer(path)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _stop_tokens(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(x) for x in eos) if isinstance(eos, list | tuple) else (int(eos),)


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def generate(model, tokenizer, prompts: str | Sequence[str], *, max_tokens: int = 32,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             policy: Policy | None = None, chat: bool = False, stop_at_eos: bool = True,
             engine: Engine | None = None, batch_slots: int | None = None, chunk: int = 256,
             page_size: int = 16, kv_dtype=None,
             implementation: str = "auto") -> str | list[str]:
    """Generate a continuation of every prompt through the paged-KV engine.

    Args:
      model: a `models` CausalLM (any family the engine runs).
      tokenizer: its transformers tokenizer (`encode`, `decode`, `eos_token_id`).
      prompts: one prompt or a sequence of prompts.
      max_tokens: generated tokens per prompt at most.
      temperature: 0 = greedy; else softmax temperature (with `top_k`, `top_p`, `seed`).
      top_k: keep the `top_k` most likely tokens (0 = all).
      top_p: nucleus mass in (0, 1].
      seed: sampling seed (the token at position `p` uses `fold_in(key(seed), p)`).
      policy: attention policy of every prompt (`Policy.dense / streaming / headwise`, `[L, K]`);
        None = the engine's default (dense).
      chat: wrap each prompt as one user turn with the tokenizer's chat template.
      stop_at_eos: stop at the tokenizer's EOS token (it is not part of the returned text).
      engine: an engine over `model` to run on (its shapes and `kv_dtype` apply; the sizing
        arguments below are then ignored); None builds one per call.
      batch_slots: engine batch slots; default the number of prompts rounded up to a power of
        two, at most `MAX_SLOTS`.
      chunk: prefill tokens per slot and step (chunked prefill).
      page_size: tokens per KV page.
      kv_dtype: page dtype (`jnp.float8_e4m3fn` for FP8 pages); default the model dtype.
      implementation: attention backend of the engine.

    Returns:
      The generated text (special tokens skipped): a string for a string prompt, else a list in
      prompt order.

    Raises:
      TypeError: `prompts` is not a string or a sequence of strings.
      ValueError: an empty prompt (named by index), a bad sampling parameter or engine size, a
        policy of the wrong shape, or `engine` built over another model or too short for a
        prompt plus `max_tokens`.
    """
    single = isinstance(prompts, str)
    texts = [prompts] if single else list(prompts)
    bad = [i for i, p in enumerate(texts) if not isinstance(p, str)]
    if bad:
        raise TypeError(f"prompts must be strings; prompt {bad[0]} is "
                        f"{type(texts[bad[0]]).__name__}")
    if not texts:
        return []
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            max_tokens=max_tokens,
                            stop_tokens=_stop_tokens(tokenizer) if stop_at_eos else ())
    ids = [_encode(tokenizer, p, chat) for p in texts]
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        raise ValueError(f"prompt {empty[0]} ({texts[empty[0]]!r}) encodes to no tokens")
    if engine is None:
        longest = max(len(x) for x in ids) + max_tokens
        max_len = max(_pow2(longest), MIN_LEN, page_size)
        slots = batch_slots if batch_slots is not None else min(_pow2(len(ids)), MAX_SLOTS)
        engine = Engine(model, batch_slots=slots, max_len=max_len, page_size=page_size,
                        chunk=min(chunk, max_len), kv_dtype=kv_dtype,
                        implementation=implementation)
    elif engine.model is not model:
        raise ValueError(f"engine runs a {type(engine.model).__name__} other than the given "
                         f"model; pass engine=None or an engine built over this model")
    too_long = [i for i, x in enumerate(ids) if len(x) + max_tokens > engine.max_len]
    if too_long:
        i = too_long[0]
        raise ValueError(f"prompt {i} ({len(ids[i])} tokens) + max_tokens={max_tokens} exceeds "
                         f"the engine's max_len={engine.max_len}")
    reqs = [engine.add(Request(x, params, policy)) for x in ids]
    engine.run()
    stops = set(params.stop_tokens)
    out = [tokenizer.decode([t for t in r.output if t not in stops], skip_special_tokens=True)
           for r in reqs]
    return out[0] if single else out
