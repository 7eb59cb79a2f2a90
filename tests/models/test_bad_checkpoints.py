"""Bad checkpoints give errors naming the tensor / field; sharded and counted loads work."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import models
from models.convert.loader import flat_params
from tests.models import tiny

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    tiny.save_tiny("llama", path, ids=tiny.token_ids(1, 4))
    return path


@pytest.fixture
def ckpt(hf_dir, tmp_path):
    """A private copy of the tiny checkpoint to damage."""
    path = tmp_path / "ckpt"
    shutil.copytree(hf_dir, path)
    return path


def _edit_weights(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)


def _edit_config(path, fn):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(file, "w") as f:
        json.dump(cfg, f)


def _params(model):
    from flax import nnx

    return {k: np.asarray(v[...]) for k, v in flat_params(nnx.state(model)).items()}


def test_every_tensor_consumed_exactly_once(hf_dir):
    model, report = models.from_pretrained(hf_dir, progress=False, return_report=True)
    names = set(load_file(os.path.join(hf_dir, "model.safetensors")))
    assert set(report.consumed) == names
    assert all(c == 1 for c in report.consumed.values())
    params = _params(model)
    expected = load_file(os.path.join(hf_dir, "model.safetensors"))[Q_PROJ].T
    np.testing.assert_array_equal(params["layers/1/mixer/q_proj/kernel"], expected)


def test_missing_tensor(ckpt):
    _edit_weights(ckpt, lambda t: t.pop(Q_PROJ))
    with pytest.raises(models.CheckpointError, match=rf"missing tensors \(1\):\s+{Q_PROJ}"):
        models.from_pretrained(ckpt, progress=False)


def test_unexpected_tensor(ckpt):
    _edit_weights(ckpt, lambda t: t.update({"model.layers.7.mlp.extra.weight": np.ones(3)}))
    with pytest.raises(models.CheckpointError,
                       match=r"unexpected tensors \(1\):\s+'model.layers.7.mlp.extra.weight'"):
        models.from_pretrained(ckpt, progress=False)


def test_misshaped_tensor(ckpt):
    _edit_weights(ckpt, lambda t: t.update({Q_PROJ: np.ones((60, 64), np.float32)}))
    with pytest.raises(models.CheckpointError,
                       match=rf"mis-shaped tensors \(1\):\s+'{Q_PROJ}' \(model.safetensors\) "
                             r"\[60, 64\]: gives \[64, 60\]; parameter "
                             r"layers/1/mixer/q_proj/kernel needs \[64, 64\]"):
        models.from_pretrained(ckpt, progress=False)


def test_all_problems_reported_together(ckpt):
    def damage(t):
        t.pop("model.norm.weight")
        t["lm_head.bias"] = np.ones(3, np.float32)
        t["model.layers.0.mlp.up_proj.weight"] = np.ones((128, 65), np.float32)

    _edit_weights(ckpt, damage)
    with pytest.raises(models.CheckpointError) as info:
        models.from_pretrained(ckpt, progress=False)
    msg = str(info.value)
    for s in ("missing tensors (1)", "model.norm.weight", "unexpected tensors (1)",
              "lm_head.bias", "mis-shaped tensors (1)", "model.layers.0.mlp.up_proj.weight"):
        assert s in msg


def test_unknown_architecture(ckpt):
    _edit_config(ckpt, lambda c: c.update(architectures=["FooForCausalLM"]))
    expected = (r"unsupported architecture 'FooForCausalLM'; "
                r"supported: \[.*'LlamaForCausalLM', .*'Qwen3ForCausalLM'")
    with pytest.raises(ValueError, match=expected):
        models.from_pretrained(ckpt, progress=False)


def test_missing_architectures_field(ckpt):
    _edit_config(ckpt, lambda c: c.pop("architectures"))
    with pytest.raises(models.ConfigError, match="field 'architectures'"):
        models.from_pretrained(ckpt, progress=False)


def test_missing_config_field(ckpt):
    _edit_config(ckpt, lambda c: c.pop("hidden_size"))
    with pytest.raises(models.ConfigError, match="required field 'hidden_size' is missing"):
        models.from_pretrained(ckpt, progress=False)


def test_ill_typed_config_field(ckpt):
    _edit_config(ckpt, lambda c: c.update(num_hidden_layers="two"))
    with pytest.raises(models.ConfigError, match="num_hidden_layers='two' must be int"):
        models.from_pretrained(ckpt, progress=False)


def test_inconsistent_config(ckpt):
    _edit_config(ckpt, lambda c: c.update(num_key_value_heads=3))
    with pytest.raises(models.ConfigError,
                       match=r"config.json: AttentionConfig.num_heads=4 must be divisible by "
                             r"AttentionConfig.num_kv_heads=3"):
        models.from_pretrained(ckpt, progress=False)


def test_missing_config_file(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(models.CheckpointError, match="config.json: not found"):
        models.from_pretrained(ckpt, progress=False)


def test_no_weights_file(ckpt):
    os.remove(os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(models.CheckpointError, match="no model.safetensors"):
        models.from_pretrained(ckpt, progress=False)


def test_truncated_safetensors(ckpt):
    file = os.path.join(ckpt, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(models.CheckpointError,
                       match=r"model.safetensors: corrupt safetensors entry for tensor .*"
                             r"truncated file"):
        models.from_pretrained(ckpt, progress=False)


def test_garbage_safetensors_header(ckpt):
    with open(os.path.join(ckpt, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"\x00not json")
    with pytest.raises(models.CheckpointError, match="model.safetensors: corrupt safetensors file"):
        models.from_pretrained(ckpt, progress=False)


def _shard(path, index_extra=None):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    os.remove(file)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, os.path.join(path, shard))
        weight_map.update(dict.fromkeys(part, shard))
    weight_map.update(index_extra or {})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def test_sharded_checkpoint_loads_identically(ckpt, hf_dir):
    _shard(ckpt)
    sharded = _params(models.from_pretrained(ckpt, progress=False))
    single = _params(models.from_pretrained(hf_dir, progress=False))
    assert sharded.keys() == single.keys()
    for k in single:
        np.testing.assert_array_equal(sharded[k], single[k])


def test_sharded_index_names_absent_tensor(ckpt):
    _shard(ckpt, {"model.layers.0.ghost.weight": "model-00001-of-00002.safetensors"})
    with pytest.raises(models.CheckpointError,
                       match="'model.layers.0.ghost.weight' is listed in "
                             "model-00001-of-00002.safetensors but that shard does not"):
        models.from_pretrained(ckpt, progress=False)


def test_bad_arguments(ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        models.from_pretrained(tmp_path / "nope", progress=False)
    with pytest.raises(TypeError, match="must be a floating dtype"):
        models.from_pretrained(ckpt, dtype="int32", progress=False)
