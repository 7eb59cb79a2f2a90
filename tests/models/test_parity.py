"""Full-forward logits of converted tiny random HF models vs transformers (f32, 160 tokens)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from attn.dense import attention
from tests.models import tiny
from tests.utils import assert_close

CASES = {
    # GQA group 5, biases everywhere, untied head.
    "llama-gqa5-bias": ("llama", dict(hidden_size=80, num_attention_heads=10,
                                      num_key_value_heads=2, attention_bias=True,
                                      mlp_bias=True)),
    # Tied embeddings and Llama-3.1 rope scaling.
    "llama-tied-llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("qwen3", dict()),
    # YaRN (factor 4 over 64 original positions: the 160 tokens run past it) with a tied head.
    "qwen3-yarn-tied": ("qwen3", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64})),
    # Layer 1 uses a 48-token sliding window.
    "qwen3-sliding": ("qwen3", dict(use_sliding_window=True, sliding_window=48,
                                    max_window_layers=1, attention_bias=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    kind, overrides = CASES[case]
    _, ids, expected = tiny.save_tiny(kind, str(tmp_path), **overrides)
    model, report = models.from_pretrained(tmp_path, progress=False, return_report=True)
    assert type(model).family == kind
    assert set(report.consumed.values()) == {1} and not report.ignored
    got = model(jnp.asarray(ids, jnp.int32))
    assert got.shape == expected.shape and got.dtype == jnp.float32
    assert_close(got, expected, atol=tiny.TOLERANCE, rtol=0)


def test_sliding_config_is_parsed(tmp_path):
    tiny.save_tiny("qwen3", str(tmp_path), ids=tiny.token_ids(1, 4), use_sliding_window=True,
                   sliding_window=48, max_window_layers=1)
    model = models.from_pretrained(tmp_path, progress=False)
    windows = [layer.mixer.spec.window for layer in model.layers]
    assert windows == [None, 48]


def test_packed_segments_equal_separate_sequences(tmp_path):
    """Two sequences packed in one row (segment ids, restarted positions) = run separately."""
    _, ids, expected = tiny.save_tiny("llama", str(tmp_path), ids=tiny.token_ids(2, 80))
    model = models.from_pretrained(tmp_path, progress=False)
    packed = jnp.asarray(ids.reshape(1, 160), jnp.int32)
    positions = jnp.asarray(np.tile(np.arange(80), 2)[None], jnp.int32)
    segments = jnp.asarray(np.repeat([0, 1], 80)[None], jnp.int32)
    got = model(packed, positions=positions, segment_ids=segments)
    assert_close(got.reshape(2, 80, -1), expected, atol=tiny.TOLERANCE, rtol=0)


def test_bfloat16_load_agrees_on_top1(tmp_path):
    _, ids, expected = tiny.save_tiny("qwen3", str(tmp_path))
    model = models.from_pretrained(tmp_path, dtype="bfloat16", progress=False)
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    got = np.asarray(model(jnp.asarray(ids, jnp.int32)).astype(jnp.float32))
    agree = (got.argmax(-1) == expected.argmax(-1)).mean()
    assert agree >= 0.9, agree
    assert np.abs(got - expected).max() < 0.25


def test_forward_input_errors(tmp_path):
    tiny.save_tiny("llama", str(tmp_path), ids=tiny.token_ids(1, 4))
    model = models.from_pretrained(tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"input_ids must have shape \[B, T\]"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="input_ids.dtype=float32"):
        model(jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"positions.shape=\(1, 3\)"):
        model(jnp.zeros((1, 4), jnp.int32), positions=jnp.zeros((1, 3), jnp.int32))


@dataclasses.dataclass(frozen=True)
class _ContiguousCacheAttend:
    """A minimal engine-style attend: writes this chunk's k, v into a `[B, S, K, H]` cache at
    `offset` and attends to the cache so far. It proves `project` / `attend` / `output` is enough
    for chunked prefill and decode; the real engine swaps in paged KV."""

    offset: jax.Array  # [B] int32 tokens already cached

    def __call__(self, spec, qkv, state):
        k_cache, v_cache = state
        t = qkv.q.shape[1]
        write = jax.vmap(lambda c, x, o: jax.lax.dynamic_update_slice_in_dim(c, x, o, 0))
        k_cache = write(k_cache, qkv.k, self.offset)
        v_cache = write(v_cache, qkv.v, self.offset)
        o, _ = attention(qkv.q, k_cache, v_cache, causal=True, scale=spec.scale,
                         q_offset=self.offset, kv_lengths=self.offset + t, window=spec.window,
                         sinks=spec.sinks)
        return o, (k_cache, v_cache)


@nnx.jit
def _cached_step(model, ids, offset, caches):
    positions = offset[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)
    hidden, caches = model.forward(ids, positions, attend=_ContiguousCacheAttend(offset),
                                   states=caches)
    return model.logits(hidden), caches


def test_cached_prefill_and_decode_equal_full_forward(tmp_path):
    _, ids, expected = tiny.save_tiny("qwen3", str(tmp_path), ids=tiny.token_ids(2, 110),
                                      use_sliding_window=True, sliding_window=48,
                                      max_window_layers=1)
    model = models.from_pretrained(tmp_path, progress=False)
    a = model.cfg.attention
    shape = (2, 110, a.num_kv_heads, a.head_dim)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in model.layers]
    ids = jnp.asarray(ids, jnp.int32)
    chunks = [(0, 50), (50, 100)] + [(t, t + 1) for t in range(100, 110)]  # prefill, decode
    got = []
    for start, stop in chunks:
        offset = jnp.full((2,), start, jnp.int32)
        logits, caches = _cached_step(model, ids[:, start:stop], offset, caches)
        got.append(logits)
    assert_close(jnp.concatenate(got, axis=1), expected, atol=tiny.TOLERANCE, rtol=0)
