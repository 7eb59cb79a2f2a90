"""Orbax save / load: bitwise round trip, atomic replacement, strict restore, the convert CLI."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from experiments import convert
from models import checkpoint
from models.convert.loader import flat_params
from tests.models import tiny


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    tiny.save_tiny("qwen3", path, ids=tiny.token_ids(1, 4), tie_word_embeddings=True)
    return path


def _params(model):
    return {k: np.asarray(v[...]) for k, v in flat_params(nnx.state(model)).items()}


def _assert_bitwise(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype, k
        np.testing.assert_array_equal(pa[k].view(np.uint8), pb[k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bitwise(hf_dir, tmp_path, dtype):
    model = models.from_pretrained(hf_dir, dtype=dtype, progress=False)
    models.save(model, tmp_path / "ckpt")
    back = models.load(tmp_path / "ckpt")
    assert type(back) is type(model) and back.cfg == model.cfg
    assert back.dtype == jnp.dtype(dtype)
    _assert_bitwise(back, model)


def _perturbed(model):
    state = nnx.state(model)
    state = nnx.from_flat_state([(p, v.replace(value=v[...] + 1)) for p, v
                                 in nnx.to_flat_state(state)])
    return nnx.merge(nnx.graphdef(model), state)


def test_save_replaces_previous_version(hf_dir, tmp_path):
    first = models.from_pretrained(hf_dir, progress=False)
    second = _perturbed(first)
    ckpt = tmp_path / "ckpt"
    p1 = models.save(first, ckpt)
    p2 = models.save(second, ckpt)
    assert p1 != p2 and not os.path.exists(p1)
    assert sorted(os.listdir(ckpt)) == ["LATEST", os.path.basename(p2)]
    _assert_bitwise(models.load(ckpt), second)


@pytest.mark.parametrize("stage", ["state", "metadata"])
def test_interrupted_save_keeps_previous_checkpoint(hf_dir, tmp_path, monkeypatch, stage):
    first = models.from_pretrained(hf_dir, progress=False)
    ckpt = tmp_path / "ckpt"
    models.save(first, ckpt)

    class Interrupt(BaseException):
        pass

    def fail_after_partial_state(path, arrays):
        os.makedirs(path)
        with open(os.path.join(path, "partial"), "w") as f:
            f.write("half a checkpoint")
        raise Interrupt

    def fail_writing_metadata(path, data):
        with open(path, "w") as f:
            f.write('{"format": ')
        raise Interrupt

    if stage == "state":
        monkeypatch.setattr(checkpoint, "_write_state", fail_after_partial_state)
    else:
        monkeypatch.setattr(checkpoint, "_write_json", fail_writing_metadata)
    with pytest.raises(Interrupt):
        models.save(_perturbed(first), ckpt)
    assert any(e.startswith(".tmp-") for e in os.listdir(ckpt))  # the torn write is there ...
    _assert_bitwise(models.load(ckpt), first)  # ... but LATEST still names the old version
    monkeypatch.undo()
    second = _perturbed(first)
    models.save(second, ckpt)  # the next save cleans the leftovers
    assert not any(e.startswith(".tmp-") for e in os.listdir(ckpt))
    _assert_bitwise(models.load(ckpt), second)


def _version_dir(ckpt):
    with open(os.path.join(ckpt, "LATEST")) as f:
        return os.path.join(ckpt, f.read().strip())


def _edit_meta(ckpt, fn):
    path = os.path.join(_version_dir(ckpt), "model.json")
    with open(path) as f:
        meta = json.load(f)
    fn(meta)
    with open(path, "w") as f:
        json.dump(meta, f)


@pytest.fixture
def saved(hf_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    models.save(models.from_pretrained(hf_dir, progress=False), ckpt)
    return ckpt


def test_restore_is_strict_about_shapes(saved):
    _edit_meta(saved, lambda m: m["config"].update(intermediate_size=96))
    with pytest.raises(models.CheckpointError,
                       match=r"layers/0/mlp/down_proj/kernel: stored float32\[128, 64\], model "
                             r"needs float32\[96, 64\]"):
        models.load(saved)


def test_restore_is_strict_about_dtypes(saved):
    _edit_meta(saved, lambda m: m.update(dtype="bfloat16"))
    with pytest.raises(models.CheckpointError, match="embed/embedding: stored float32"):
        models.load(saved)


def test_restore_is_strict_about_names(saved):
    _edit_meta(saved, lambda m: m["config"].update(tie_embeddings=False))
    with pytest.raises(models.CheckpointError, match="missing lm_head/kernel"):
        models.load(saved)


def test_load_errors(saved, tmp_path):
    with pytest.raises(models.CheckpointError, match="no checkpoint"):
        models.load(tmp_path / "empty")
    _edit_meta(saved, lambda m: m.update(family="gpt9"))
    with pytest.raises(ValueError, match="unknown model family 'gpt9'"):
        models.load(saved)
    _edit_meta(saved, lambda m: m.update(family="qwen3", format="other/2"))
    with pytest.raises(models.CheckpointError, match="format='other/2'"):
        models.load(saved)
    _edit_meta(saved, lambda m: m.update(format=checkpoint.FORMAT, config={"bogus": 1}))
    with pytest.raises(models.ConfigError, match=r"unknown config fields \['bogus'\]"):
        models.load(saved)


def test_save_refuses_foreign_directory(hf_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds \['notes.txt'\], not a longctx checkpoint"):
        models.save(models.from_pretrained(hf_dir, progress=False), tmp_path)
    with pytest.raises(TypeError, match="not a registered model family"):
        models.save(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path / "x")


def test_convert_cli(hf_dir, tmp_path, capsys):
    dst = tmp_path / "out"
    assert convert.main([hf_dir, str(dst), "--dtype", "bfloat16"]) == 0
    assert "family qwen3" in capsys.readouterr().out
    _assert_bitwise(models.load(dst), models.from_pretrained(hf_dir, dtype="bfloat16",
                                                             progress=False))
    assert convert.main([str(tmp_path / "missing"), str(dst), "--quiet"]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
