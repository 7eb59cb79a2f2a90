"""Head selection: mixed / probe attends, scores, masks, gate training, the selection file, the
train_heads and longctx_eval CLIs (tiny random Llama, byte tokenizer)."""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attn.dense import attention
from experiments import longctx_eval, tasks, train_heads
from models.heads import (
    Batch,
    Gate,
    GatedLM,
    HeadScores,
    HeadSelection,
    MixedAttend,
    ProbeAttend,
    batch_from_samples,
    binarize,
    distill_loss,
    make_optimizer,
    score_heads,
    streaming_mask,
    train_step,
)
from models.layers.attention import QKV, AttendSpec, DenseAttend
from tests.models.tiny import ByteTokenizer, tiny_llama
from tests.utils import assert_close, rng


def tiny_batch(b: int = 2, t: int = 48, a: int = 3, seed: int = 0) -> Batch:
    gen = rng(seed)
    ids = gen.integers(1, 256, (b, t)).astype(np.int32)
    pos = np.stack([np.arange(t - a - 1, t - 1)] * b).astype(np.int32)
    needle = np.zeros((b, t), bool)
    needle[:, 5:9] = True
    return Batch(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(ids[:, -a:]),
                 jnp.ones((b, a), bool), jnp.asarray(needle))


def qkv_case(seed=0, b=2, t=40, n=4, k=2, h=8):
    gen = rng(seed)
    q, kk, v = (jnp.asarray(gen.standard_normal((b, t, m, h)), jnp.float32)
                for m in (n, k, k))
    return AttendSpec(layer=1, scale=h ** -0.5), QKV(q, kk, v)


def test_mixed_attend_endpoints_and_linearity():
    spec, qkv = qkv_case()
    full, _ = attention(qkv.q, qkv.k, qkv.v, scale=spec.scale)
    stream, _ = attention(qkv.q, qkv.k, qkv.v, scale=spec.scale, window=6, sinks=2)
    assert float(jnp.max(jnp.abs(full - stream))) > 1e-2  # the window matters here
    gates = jnp.array([[0.0, 0.0], [1.0, 0.0]])  # layer 1: KV head 0 full, head 1 streaming
    o, g = MixedAttend(gates, window=6, sinks=2)(spec, qkv)
    assert g.shape == (2, 2)
    assert_close(o[:, :, :2], full[:, :, :2])  # query heads 0, 1 use KV head 0
    assert_close(o[:, :, 2:], stream[:, :, 2:])
    half, _ = MixedAttend(jnp.full((2, 2), 0.25), window=6, sinks=2)(spec, qkv)
    assert_close(half, stream + 0.25 * (full - stream))


def test_probe_attend_mass_matches_numpy():
    spec, qkv = qkv_case(seed=1)
    pos = jnp.array([[30, 35], [20, 39]], jnp.int32)
    key_mask = jnp.zeros((2, 40), bool).at[:, 3:7].set(True)
    o, probe = ProbeAttend(pos, key_mask, window=8, sinks=2)(spec, qkv)
    full, _ = attention(qkv.q, qkv.k, qkv.v, scale=spec.scale)
    assert_close(o, full)
    q, k = np.asarray(qkv.q, np.float64), np.asarray(qkv.k, np.float64)
    for b in range(2):
        for i, p in enumerate(np.asarray(pos[b])):
            for kv in range(2):
                masses = []
                for n in (2 * kv, 2 * kv + 1):
                    logits = k[b, :p + 1, kv] @ q[b, p, n] * spec.scale
                    w = np.exp(logits - logits.max())
                    w /= w.sum()
                    masses.append(w[3:7].sum())
                np.testing.assert_allclose(probe.mass[b, i, kv], np.mean(masses), rtol=1e-5)
    stream, _ = attention(qkv.q, qkv.k, qkv.v, scale=spec.scale, window=8, sinks=2)
    assert_close(probe.stream, jax.vmap(lambda x, i: x[i])(stream, pos))


def test_score_heads_shapes_and_window_covering_everything():
    model = tiny_llama()
    batch = tiny_batch()
    scores = score_heads(model, [batch, tiny_batch(seed=1)], window=4, sinks=1)
    assert scores.retrieval.shape == scores.streaming_error.shape == (2, 2)
    assert scores.prompts == 4
    assert np.all((scores.retrieval >= 0) & (scores.retrieval <= 1))
    assert np.all(scores.streaming_error > 0)
    # A window as long as the prompt streams nothing away: zero error everywhere.
    same = score_heads(model, [batch], window=48, sinks=0)
    np.testing.assert_allclose(same.streaming_error, 0.0, atol=1e-6)
    with pytest.raises(ValueError, match="window=0"):
        score_heads(model, [batch], window=0, sinks=0)
    with pytest.raises(ValueError, match="batches is empty"):
        score_heads(model, [], window=4, sinks=0)


def test_streaming_mask_counts_ties_and_errors():
    scores = np.array([[0.3, 0.1, 0.2], [0.1, 0.9, 0.5]])
    m = streaming_mask(scores, 0.5)
    assert m.sum() == 3
    np.testing.assert_array_equal(m, [[False, True, True], [True, False, False]])
    assert not streaming_mask(scores, 0.0).any() and streaming_mask(scores, 1.0).all()
    ties = streaming_mask(np.zeros((2, 2)), 0.5)
    np.testing.assert_array_equal(ties, [[True, True], [False, False]])  # lower index first
    with pytest.raises(ValueError, match="fraction=1.5"):
        streaming_mask(scores, 1.5)
    with pytest.raises(ValueError, match=r"\[L, K\]"):
        streaming_mask(np.zeros(4), 0.5)
    with pytest.raises(ValueError, match="finite"):
        streaming_mask(np.array([[np.nan, 0.0]]), 0.5)


def test_gate_gradient_matches_finite_differences():
    model = tiny_llama()
    batch = tiny_batch()
    gated = GatedLM(model, window=4, sinks=1, init=0.5)
    loss = nnx.jit(lambda g: distill_loss(g, batch, l1=0.0)[0])
    grads = nnx.jit(nnx.grad(lambda g: distill_loss(g, batch, l1=0.0)[0],
                             argnums=nnx.DiffState(0, Gate)))(gated)
    grad = np.asarray(grads["alpha"][...], np.float64)
    assert np.abs(grad).max() > 1e-5  # the KL depends on the gates
    alpha = np.asarray(gated.alpha[...])
    eps = 1e-2
    for idx in [(0, 0), (1, 1)]:
        vals = []
        for sign in (1, -1):
            a = alpha.copy()
            a[idx] += sign * eps
            gated.alpha[...] = jnp.asarray(a)
            vals.append(float(loss(gated)))
        gated.alpha[...] = jnp.asarray(alpha)
        np.testing.assert_allclose(grad[idx], (vals[0] - vals[1]) / (2 * eps), rtol=0.05,
                                   atol=1e-6)


def test_gates_at_one_equal_the_dense_model():
    model = tiny_llama()
    batch = tiny_batch()
    gated = GatedLM(model, window=4, sinks=1)
    b, t = batch.input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    dense, _ = model.forward(batch.input_ids, positions, attend=DenseAttend())
    assert_close(gated.hidden(batch.input_ids), dense)
    loss, metrics = distill_loss(gated, batch, l1=0.1)
    assert abs(float(metrics["kl"])) < 1e-6
    np.testing.assert_allclose(float(loss), 0.1, rtol=1e-6)


def test_train_steps_update_only_gates_and_lower_the_loss():
    model = tiny_llama()
    batch = tiny_batch()
    gated = GatedLM(model, window=4, sinks=1)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    opt = make_optimizer(gated, 0.05)
    losses = [float(train_step(gated, opt, batch, l1=0.05)["loss"]) for _ in range(6)]
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))  # bit-identical backbone
    assert losses[-1] < losses[0]
    alpha = np.asarray(gated.alpha[...])
    assert alpha.min() >= 0 and alpha.max() <= 1 and alpha.max() < 1
    assert binarize(alpha, 0.5).sum() == 2


def test_gated_lm_rejects_bad_settings():
    model = tiny_llama()
    with pytest.raises(ValueError, match="init=2"):
        GatedLM(model, window=4, sinks=0, init=2.0)
    with pytest.raises(ValueError, match="sinks=-1"):
        GatedLM(model, window=4, sinks=-1)


def test_selection_round_trip_and_errors(tmp_path):
    scores = HeadScores(np.array([[0.1, 0.5], [0.3, 0.2]]), np.array([[1.0, 0.2], [0.1, 0.4]]), 3)
    sel = HeadSelection(2, 2, 8, 2, gates=np.array([[0.0, 1.0], [0.2, 0.9]]), scores=scores,
                        meta=dict(steps=3))
    path = str(tmp_path / "heads.json")
    sel.save(path)
    back = HeadSelection.load(path)
    np.testing.assert_array_equal(back.streaming("trained", 0.5), [[True, False], [True, False]])
    np.testing.assert_array_equal(back.streaming("scored:retrieval", 0.25),
                                  [[True, False], [False, False]])
    assert back.streaming("scored", 0.5).sum() == 2
    assert back.meta == {"steps": 3}
    with pytest.raises(ValueError, match="no trained gates"):
        HeadSelection(2, 2, 8, 2, scores=scores).streaming("trained", 0.5)
    with pytest.raises(ValueError, match="source='bogus'"):
        back.ranking("bogus")
    with pytest.raises(ValueError, match=r"gates.shape=\(3,\)"):
        HeadSelection(2, 2, 8, 2, gates=np.zeros(3))
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not a head selection"):
        HeadSelection.load(str(tmp_path / "x.json"))


def test_task_needles_and_disjoint_training_seeds():
    tok = ByteTokenizer()
    evals = tasks.make_samples(tok, tasks=("passkey", "multikey"), lengths=[600], depths=[0.5],
                               samples=3)
    train = tasks.training_samples(tok, count=12, lengths=[600, 700])
    assert {tuple(s.prompt) for s in evals}.isdisjoint({tuple(s.prompt) for s in train})
    assert {s.length for s in train} <= {600, 700}
    for s in evals + train:
        assert len(s.needle_spans) == 1
        lo, hi = s.needle_spans[0]
        assert s.answer in tok.decode(s.prompt[lo:hi])
    batch = batch_from_samples(train[:2], tok, pad_to=720)
    assert batch.input_ids.shape == (2, 720)
    for i, s in enumerate(train[:2]):
        n = int(batch.answer_valid[i].sum())
        np.testing.assert_array_equal(batch.input_ids[i, len(s.prompt):len(s.prompt) + n],
                                      batch.answer_ids[i, :n])
        assert int(batch.answer_pos[i, 0]) == len(s.prompt) - 1
        assert int(batch.needle_mask[i].sum()) == s.needle_spans[0][1] - s.needle_spans[0][0]
    with pytest.raises(ValueError, match="pad_to=10"):
        batch_from_samples(train[:1], tok, pad_to=10)


def _train_args(tmp_path, steps):
    return argparse.Namespace(prompts=6, lengths=[400], tasks=["passkey"], seed=0,
                              window=16, sinks=2, lr=0.05, batch=2, steps=steps, l1=0.05,
                              checkpoint_every=2)


def test_train_gates_resumes_after_a_kill(tmp_path):
    tok = ByteTokenizer()
    full_gates, full_hist, _ = train_heads.train_gates(tiny_llama(), tok,
                                                       _train_args(tmp_path, 4),
                                                       str(tmp_path / "a"))
    # "Killed" after step 2 (its last checkpoint), then started again with the same command.
    train_heads.train_gates(tiny_llama(), tok, _train_args(tmp_path, 2), str(tmp_path / "b"))
    gates, hist, _ = train_heads.train_gates(tiny_llama(), tok, _train_args(tmp_path, 4),
                                             str(tmp_path / "b"))
    assert [h["step"] for h in hist] == [0, 1, 2, 3]
    np.testing.assert_allclose([h["loss"] for h in hist], [h["loss"] for h in full_hist],
                               rtol=1e-6)
    np.testing.assert_allclose(gates, full_gates, rtol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "32"], "must be >= 64"),
    (["--fractions", "1.5"], "--fractions 1.5 must be in"),
    (["--tasks", "bogus"], "unknown"),
    (["--model", "/nonexistent.gguf"], "no such file"),
    (["--batch", "0"], "must be >= 1"),
    (["--no-score", "--train", "none"], "nothing to do"),
    (["--train", "gates,bogus"], "unknown"),
    (["--target", "2"], "--target 2.0 must be in"),
])
def test_train_heads_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_heads.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--policies", "headwise-trained"], "need --heads"),
    (["--stream-fraction", "-0.1"], "must be in [0, 1]"),
    (["--depths", "1.5"], "must be in [0, 1]"),
    (["--policies", "bogus"], "unknown"),
    (["--dtype", "bogus"], "invalid choice"),
    (["--heads", "/nonexistent.json", "--policies", "headwise-scored"], "no such file"),
])
def test_longctx_eval_bad_input_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        longctx_eval.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_longctx_eval_builds_selected_policies(tmp_path):
    gates = np.array([[0.0, 1.0], [0.2, 0.9], [1.0, 0.1]])
    HeadSelection(3, 2, 16, 2, gates=gates).save(str(tmp_path / "h.json"))
    args = longctx_eval.parse_args(["--heads", str(tmp_path / "h.json"), "--policies",
                                    "dense,headwise-trained", "--stream-fraction", "0.5,1",
                                    "--window", "16", "--sinks", "2"])
    policies = longctx_eval.build_policies(args, 3, 2)
    assert list(policies) == ["dense", "headwise-trained@0.5", "headwise-trained@1"]
    half, engine = policies["headwise-trained@0.5"]
    assert engine == "model"
    np.testing.assert_array_equal(half.window > 0, [[True, False], [True, False], [False, True]])
    assert (half.sinks[half.window > 0] == 2).all()
    with pytest.raises(SystemExit, match="for \\[L, K\\] = \\[3, 2\\]"):
        longctx_eval.build_policies(args, 4, 2)


def test_wilson_interval():
    lo, hi = longctx_eval.wilson(12, 12)
    assert hi == 1.0 and abs(lo - 0.7575) < 1e-3
    lo, hi = longctx_eval.wilson(0, 12)
    assert lo == 0.0 and abs(hi - 0.2425) < 1e-3
    assert longctx_eval.wilson(0, 0) == (0.0, 1.0)


def test_heads_report_table(tmp_path):
    from experiments import heads_report

    rows = [dict(policy=p, task=t, length=n, n=4, accuracy=acc, kv_bytes=kv)
            for p, acc, kv in (("dense", 1.0, 100), ("headwise-trained@0.5", 0.75, 55))
            for t in ("passkey",) for n in (256, 512)]
    results = dict(rows=rows, model="m.gguf", device="cpu", commit="abc",
                   args=dict(tasks=["passkey"], dtype="float32", sinks=2, window=16, samples=4,
                             depths=[0.5]),
                   timing={"dense": {"streaming": 0.0}, "headwise-trained@0.5": {"streaming": 0.5}})
    md, data = heads_report.report(dict(meta=dict(steps=3, lengths=[256])), results)
    assert "| headwise-trained@0.5 | 0.50 | 0.75 [" in md
    assert data["policies"][1]["passkey"]["ratio_to_dense"] == 0.75
    assert data["policies"][1]["kv_fraction"] == 0.55
    json.dumps(data)


def test_elastic_from_shares_the_backbone():
    from models.heads.elastic import elastic_from

    model = tiny_llama()
    routed = elastic_from(model, window=16, sinks=4)
    ids = tiny_batch(t=40).input_ids
    np.testing.assert_array_equal(np.asarray(routed(ids, elastic=False)), np.asarray(model(ids)))
    kernel = routed.layers[0].mixer.router.cls_feat_extractor.layers[0].kernel[...]
    assert kernel.dtype == jnp.float32
    with pytest.raises(TypeError, match="DecoderConfig"):
        elastic_from(routed, window=16, sinks=4)


def test_router_training_round_trip_through_the_eval(tmp_path):
    tok = ByteTokenizer()
    args = _train_args(tmp_path, 2)
    vars(args).update(router_lr=1e-3, lagrangian_lr=1e-2, target=0.5, target_ramp=0.5)
    model = tiny_llama()
    facts, hist, _ = train_heads.train_router(model, tok, args, str(tmp_path))
    assert [h["step"] for h in hist] == [0, 1] and facts["path"] == "router.safetensors"
    assert 0.0 <= facts["final_sparse_fraction"] <= 1.0
    HeadSelection(2, 2, 16, 2, meta=dict(router=facts)).save(str(tmp_path / "heads.json"))
    routed = longctx_eval.elastic_model(model, str(tmp_path / "heads.json"))
    ids = tiny_batch(t=40).input_ids
    from models.heads.router import router_tensors

    np.testing.assert_array_equal(np.asarray(routed(ids, elastic=False)), np.asarray(model(ids)))
    saved = router_tensors(routed)
    assert any(np.abs(v).sum() > 0 for v in saved.values())
    eval_args = longctx_eval.parse_args(["--heads", str(tmp_path / "heads.json"), "--policies",
                                         "dense,elastic-trained"])
    policies = longctx_eval.build_policies(eval_args, 2, 2)
    assert policies["elastic-trained"] == (None, "elastic")
    HeadSelection(2, 2, 16, 2, gates=np.ones((2, 2))).save(str(tmp_path / "gates.json"))
    eval_args.heads = str(tmp_path / "gates.json")
    with pytest.raises(SystemExit, match="no trained router"):
        longctx_eval.build_policies(eval_args, 2, 2)
