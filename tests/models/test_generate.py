"""Text level and the full forward: bucketed compilation, custom attends, `generate`,
`load_pretrained` (GGUF / HF / orbax with its tokenizer), `load(dtype=)` and the convert CLI.

Models are tiny and random (a Llama and a Qwen3-Next hybrid built from configs, an HF Llama
saved by transformers) with a byte-level tokenizer built offline; greedy text from `generate` is
checked against greedy decoding by repeated full forwards.
"""

import dataclasses
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from experiments import convert
from models import transformer
from models.config import HFConfig
from models.convert import registry
from models.convert.loader import flat_params
from models.layers.attention import DenseAttend
from tests.models import tiny
from tests.utils import assert_close

VOCAB = 260  # 257 byte-level tokens (+ EOS at 0) fit


def byte_tokenizer():
    """A transformers tokenizer: one token per UTF-8 byte, `<eos>` = 0 (exact round trip)."""
    import transformers
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tm

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(tm.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _llama(**attention):
    from models.layers.attention import AttentionConfig
    from models.layers.rope import RopeConfig

    cfg = models.DecoderConfig(
        vocab_size=VOCAB, dim=32, num_layers=2, intermediate_size=64,
        attention=AttentionConfig(dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                                  rope=RopeConfig(rotary_dim=8), **attention))
    return models.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))


def _qwen3_next():
    hf = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
              layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, shared_expert_intermediate_size=16, mlp_only_layers=[1],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5})
    family = registry.get_family("qwen3_next")
    return family.model_cls(family.config_from_hf(HFConfig(hf)), rngs=nnx.Rngs(0))


def _ids(b, t, seed=0):
    return np.random.default_rng(seed).integers(1, VOCAB, (b, t)).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# model(ids): buckets and custom attends


@pytest.mark.parametrize("build,lengths", [(_llama, (1, 17, 33, 40)), (_qwen3_next, (17, 40))],
                         ids=["llama", "qwen3_next"])
def test_bucketed_forward_equals_unbucketed(build, lengths):
    model = build()
    ids = _ids(2, 40)
    for t in lengths:
        assert_close(model(ids[:, :t]), model(ids[:, :t], buckets=None),
                     err_msg=f"T{t}")


def test_forward_compiles_once_per_bucket():
    model = _llama()
    ids = _ids(5, 64)  # a batch size no other test uses: the jit cache starts empty for it
    model(ids[:, :20])  # bucket 32
    before = transformer.TRACES["full_forward"]
    for t in (17, 25, 31, 32):
        assert model(ids[:, :t]).shape == (5, t, VOCAB)
    assert transformer.TRACES["full_forward"] == before  # all in bucket 32
    model(ids[:, :33])  # bucket 64
    model(ids[:, :64])
    assert transformer.TRACES["full_forward"] == before + 1
    for t in (5, 9):  # both in the smallest bucket (MIN_BUCKET = 16)
        model(ids[:, :t])
    assert transformer.TRACES["full_forward"] == before + 2
    unbucketed = transformer.TRACES["full_forward"]
    model(ids[:, :21], buckets=None)
    model(ids[:, :22], buckets=None)
    assert transformer.TRACES["full_forward"] == unbucketed + 2  # per length without buckets


def test_bucket_list_and_positions_and_segments():
    model = _llama()
    ids = _ids(1, 24)
    pos = np.arange(100, 124, dtype=np.int32)[None]
    seg = np.repeat(np.array([[0, 1]], np.int32), 12, axis=1)
    assert transformer.bucket_length(24, (8, 48)) == 48
    assert_close(model(ids, positions=pos, segment_ids=seg, buckets=(8, 48)),
                 model(ids, positions=pos, segment_ids=seg, buckets=None))
    with pytest.raises(ValueError, match=r"T=24 exceeds the largest bucket 16"):
        model(ids, buckets=(8, 16))
    with pytest.raises(ValueError, match=r"buckets='pow3'"):
        model(ids, buckets="pow3")
    with pytest.raises(ValueError, match=r"must be positive lengths"):
        model(ids, buckets=(0, 32))


@dataclasses.dataclass(frozen=True)
class WindowOn:
    """Sliding window + sinks on the listed layers, dense elsewhere."""

    layers: tuple[int, ...]
    window: int
    sinks: int = 0

    def __call__(self, spec, qkv, state=None):
        if spec.layer in self.layers:
            spec = dataclasses.replace(spec, window=self.window, sinks=self.sinks)
        return DenseAttend(implementation="xla")(spec, qkv, state)


@pytest.mark.parametrize("build", [_llama, _qwen3_next], ids=["llama", "qwen3_next"])
def test_custom_attend_is_used(build):
    model = build()
    ids = _ids(2, 30)
    attend = WindowOn(layers=(1,), window=4, sinks=1)
    got = model(ids, attend=attend)
    positions = jnp.broadcast_to(jnp.arange(30, dtype=jnp.int32), (2, 30))
    hidden, _ = model.forward(jnp.asarray(ids), positions, attend=attend)
    assert_close(got, model.logits(hidden))  # bucketed + jitted == eager, unpadded
    dense = model(ids)
    assert float(jnp.abs(got[:, 8:] - dense[:, 8:]).max()) > 1e-3  # the window changed logits
    assert_close(got[:, :5], dense[:, :5])  # window 4 + sink 1 sees everything up to token 4
    assert_close(model(ids, attend=DenseAttend(implementation="xla")), dense)


def test_equal_attends_share_a_compile():
    model = _llama()
    ids = _ids(6, 12)  # a batch size no other test uses
    model(ids, attend=WindowOn(layers=(0,), window=3))
    before = transformer.TRACES["full_forward"]
    model(ids, attend=WindowOn(layers=(0,), window=3))  # equal (dataclass eq), not identical
    assert transformer.TRACES["full_forward"] == before
    model(ids, attend=WindowOn(layers=(0,), window=5))
    assert transformer.TRACES["full_forward"] == before + 1


def test_attend_errors():
    model = _llama()
    ids = _ids(1, 8)

    @dataclasses.dataclass  # not frozen: unhashable
    class Mutable:
        def __call__(self, spec, qkv, state=None):
            return DenseAttend()(spec, qkv, state)

    with pytest.raises(TypeError, match=r"attend=.*Mutable.* must be hashable"):
        model(ids, attend=Mutable())
    with pytest.raises(ValueError, match="segment_ids and implementation configure"):
        model(ids, attend=DenseAttend(), segment_ids=np.zeros_like(ids))
    with pytest.raises(ValueError, match="segment_ids and implementation configure"):
        model(ids, attend=DenseAttend(), implementation="xla")


# ------------------------------------------------------------------------------------------------
# generate


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        logits = model(np.asarray([ids + out], np.int32))
        out.append(int(jnp.argmax(logits[0, -1])))
    return out


def test_generate_matches_greedy_full_forward():
    model, tok = _llama(), byte_tokenizer()
    prompts = ["a", "The quick brown fox jumps over the lazy dog."]  # 1 and 3 chunks of 16
    got = models.generate(model, tok, prompts, max_tokens=6, stop_at_eos=False, chunk=16,
                          implementation="xla")
    assert isinstance(got, list) and len(got) == 2
    for prompt, text in zip(prompts, got):
        want = _greedy(model, tok.encode(prompt), 6)
        assert text == tok.decode(want, skip_special_tokens=True), prompt
    single = models.generate(model, tok, prompts[0], max_tokens=6, stop_at_eos=False,
                             implementation="xla")
    assert single == got[0]


def test_generate_policy_and_eos():
    model, tok = _llama(), byte_tokenizer()
    prompt = "abcdefghijklmnopqrstuvwxyz" * 2
    first = _greedy(model, tok.encode(prompt), 1)[0]
    eos_tok = byte_tokenizer()
    eos_tok.add_special_tokens({"eos_token": eos_tok.convert_ids_to_tokens(first)})
    assert models.generate(model, eos_tok, prompt, max_tokens=5) == ""
    dense = models.generate(model, tok, [prompt], max_tokens=8, stop_at_eos=False)
    window = models.generate(model, tok, [prompt], max_tokens=8, stop_at_eos=False,
                             policy=models.Policy.streaming(2, 2, window=4, sinks=1))
    dense_attend = _greedy(model, tok.encode(prompt), 8)
    assert dense == [tok.decode(dense_attend)]
    windowed = []  # greedy by full forwards under the same window, on every layer
    for _ in range(8):
        logits = model(np.asarray([tok.encode(prompt) + windowed], np.int32),
                       attend=WindowOn(layers=(0, 1), window=4, sinks=1))
        windowed.append(int(jnp.argmax(logits[0, -1])))
    assert window == [tok.decode(windowed)]


def test_generate_errors():
    model, tok = _llama(), byte_tokenizer()
    with pytest.raises(ValueError, match=r"prompt 1 \(''\) encodes to no tokens"):
        models.generate(model, tok, ["x", ""])
    with pytest.raises(TypeError, match="prompt 0 is int"):
        models.generate(model, tok, [3])
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        models.generate(model, tok, ["x"], max_tokens=0)
    engine = models.Engine(model, batch_slots=1, max_len=16, implementation="xla")
    with pytest.raises(ValueError, match=r"prompt 0 \(20 tokens\) \+ max_tokens=4 exceeds"):
        models.generate(model, tok, ["x" * 20], max_tokens=4, engine=engine)
    with pytest.raises(ValueError, match="engine runs a LlamaForCausalLM other than"):
        models.generate(_llama(), tok, ["x"], engine=engine)
    assert models.generate(model, tok, []) == []


# ------------------------------------------------------------------------------------------------
# load_pretrained, load(dtype=), convert


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny HF Llama with the byte tokenizer saved beside it."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny.save_tiny("llama", str(path), ids=tiny.token_ids(1, 4), vocab_size=VOCAB)
    byte_tokenizer().save_pretrained(str(path))
    return path


def _params(model):
    return {k: np.asarray(v[...]) for k, v in flat_params(nnx.state(model)).items()}


def test_load_pretrained_hf_and_converted(hf_dir, tmp_path, capsys):
    model, tok = models.load_pretrained(hf_dir)
    assert tok.encode("hi there") == byte_tokenizer().encode("hi there")
    dst = tmp_path / "ckpt"
    assert convert.main([str(hf_dir), str(dst), "--quiet"]) == 0
    loaded, tok2 = models.load_pretrained(dst)
    assert tok2.encode("hi there") == tok.encode("hi there")
    ids = _ids(1, 9)
    assert_close(loaded(ids), model(ids))
    text = models.generate(model, tok, "hi", max_tokens=4, stop_at_eos=False)
    assert models.generate(loaded, tok2, "hi", max_tokens=4, stop_at_eos=False) == text
    half, _ = models.load_pretrained(dst, dtype="bfloat16")
    assert half.dtype == jnp.bfloat16
    for key, value in _params(half).items():
        assert value.dtype == jnp.bfloat16, key
    assert_close(half(ids).astype(jnp.float32), model(ids), atol=0.1, rtol=0.1)
    # load(dtype=) gives the parameters a bfloat16 from_pretrained gives (one rounding each)
    direct = _params(models.from_pretrained(hf_dir, dtype="bfloat16", progress=False))
    cast = _params(models.load(dst, dtype=jnp.bfloat16))
    for key in direct:
        np.testing.assert_array_equal(cast[key].view(np.uint16), direct[key].view(np.uint16),
                                      err_msg=key)


def test_checkpoint_without_tokenizer(hf_dir, tmp_path):
    models.save(models.from_pretrained(hf_dir, progress=False), tmp_path / "ckpt")
    with pytest.raises(models.CheckpointError, match="saved without a tokenizer"):
        models.load_pretrained(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        models.load_pretrained(tmp_path / "missing")
    bare = tmp_path / "weights_only"  # an HF directory without tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_dir / name, bare / name)
    with pytest.raises(models.CheckpointError, match="weights_only: no tokenizer found"):
        models.load_pretrained(bare)
    with pytest.raises(TypeError, match="has no save_pretrained"):
        models.save(models.load(tmp_path / "ckpt"), tmp_path / "ckpt", tokenizer=object())


def _one_line_error(capsys, needle):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_convert_refuses_existing_destination(hf_dir, tmp_path, capsys):
    dst = tmp_path / "ckpt"
    assert convert.main([str(hf_dir), str(dst), "--quiet"]) == 0
    assert convert.main([str(hf_dir), str(dst), "--quiet"]) == 2
    _one_line_error(capsys, "already holds a checkpoint; pass --overwrite")
    assert convert.main([str(hf_dir), str(dst), "--quiet", "--overwrite"]) == 0
    (tmp_path / "file").write_text("x")
    assert convert.main([str(hf_dir), str(tmp_path / "file"), "--quiet"]) == 2
    _one_line_error(capsys, "exists and is not a directory")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert convert.main([str(hf_dir), str(tmp_path / "other"), "--quiet"]) == 2
    _one_line_error(capsys, "non-empty directory, not a longctx checkpoint")
    assert convert.main([str(tmp_path), str(tmp_path / "new"), "--quiet"]) == 2
    _one_line_error(capsys, "a directory without config.json")
    assert not (tmp_path / "new").exists()


def test_convert_cli_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        convert.main(["a", "b", "--dtype", "bogus"])
    assert e.value.code == 2
    _one_line_error(capsys, "invalid choice: 'bogus'")
    with pytest.raises(SystemExit) as e:
        convert.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "(default: float32)" in out and "{float32,bfloat16,float16}" in out
