"""Gated DeltaNet: chunked == recurrent == float64 numpy, state carry, varlen, decode, slot pools.

Shapes are small (H = Hv = 16, a few heads) and reused across tests so each jitted function
compiles once per shape; the float64 numpy recurrence is the independent oracle.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import gdn
from tests.attn.gdn_base import (
    HV,
    NV,
    C,
    GdnTests,
    cu_seqlens_of,
    inputs,
    naive64,
    pool_case,
    randn,
    random_state,
)
from tests.utils import assert_close, case_id, rng


class TestXla(GdnTests):
    implementation = "xla"


_STATIC = ("scale", "use_qk_l2norm", "chunk_size")
chunked = jax.jit(gdn.gdn_chunked, static_argnames=_STATIC)
recurrent = jax.jit(gdn.gdn_recurrent, static_argnames=_STATIC[:2])
decode_step = jax.jit(gdn.gdn_decode_step, static_argnames=_STATIC[:2])
decode_pool = jax.jit(gdn.gdn_decode_pool, static_argnames=_STATIC[:2])
prefill_pool = jax.jit(gdn.gdn_prefill_pool, static_argnames=_STATIC)


def test_gating_and_l2norm():
    gen = rng()
    a = np.concatenate([gen.normal(0, 8, (3, 5)), [[25.0, 20.5, -40, 0, 19.9]]])
    a = a.astype(jnp.bfloat16)  # any float dtype goes in; the gates come out float32
    b, a_log, dt_bias = randn(gen, (4, 5)), randn(gen, (5,)), randn(gen, (5,))
    g, beta = gdn.gdn_gating(a, b, a_log, dt_bias)
    assert g.dtype == beta.dtype == jnp.float32
    x = a.astype(np.float64) + dt_bias
    softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))  # torch's threshold
    assert_close(g, -np.exp(a_log.astype(np.float64)) * softplus)
    assert_close(beta, 1 / (1 + np.exp(-b.astype(np.float64))))
    assert (np.asarray(g) <= 0).all()
    x = randn(gen, (3, 7, 16))
    x64 = x.astype(np.float64)
    assert_close(gdn.l2norm(x), x64 / np.sqrt((x64 ** 2).sum(-1, keepdims=True) + 1e-6))
    assert_close(gdn.l2norm(np.zeros((2, 4), np.float32)), np.zeros((2, 4)))  # eps: 0 stays 0


@pytest.mark.parametrize("t", [1, C - 1, C, C + 1, 200], ids=lambda t: case_id(T=t))
def test_chunked_recurrent_naive_agree(t):
    gen = rng()
    q, k, v, g, beta = inputs(gen, 1, t)
    h0 = random_state(gen, 1)
    o_c, s_c = chunked(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    o_n, s_n = naive64(q, k, v, g, beta, h0)
    assert s_c.dtype == s_r.dtype == jnp.float32 and o_c.dtype == jnp.float32
    assert_close(o_c, o_r, err_msg="chunked vs recurrent")
    assert_close(s_c, s_r, err_msg="chunked vs recurrent state")
    assert_close(o_r, o_n, atol=1e-4, rtol=1e-4, err_msg="recurrent vs float64")
    assert_close(s_r, s_n, atol=1e-4, rtol=1e-4, err_msg="recurrent state vs float64")
    assert_close(o_c, o_n, atol=1e-4, rtol=1e-4, err_msg="chunked vs float64")


def test_gva_3_odd_dims_custom_scale_without_l2norm():
    """GVA 3, odd head dims, explicit scale, no l2norm, chunk 4 with T not a multiple of it."""
    gen = rng()
    q, k, v, g, beta = inputs(gen, 2, 11, nk=1, nv=3, h=5, hv=3)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # keeps the rule stable without l2norm
    h0 = randn(gen, (2, 3, 5, 3))
    o_n, s_n = naive64(q, k, v, g, beta, h0, scale=0.3, use_qk_l2norm=False)
    o_c, s_c = chunked(q, k, v, g, beta, scale=0.3, initial_state=h0, chunk_size=4)
    assert_close(o_c, o_n, atol=1e-4, rtol=1e-4)
    assert_close(s_c, s_n, atol=1e-4, rtol=1e-4)


# Piece lengths summing to 200, all among the lengths compiled above: splits inside chunks
# (63, 65, 195, ...), on chunk borders (64, 128, 192) and one-token pieces.
_SPLITS = [(65, 65, 65, 1, 1, 1, 1, 1), (64, 64, 64) + (1,) * 8, (63, 63, 63) + (1,) * 11,
           (1, 63, 1, 65, 1, 64, 1, 1, 1, 1, 1)]


@pytest.mark.parametrize("pieces", _SPLITS, ids=lambda p: "pieces" + "-".join(map(str, p[:4])))
def test_split_prefill_carries_state(pieces):
    """Prefill in pieces, each starting from the previous final state == one prefill."""
    gen = rng()
    xs = inputs(gen, 1, sum(pieces))
    h0 = random_state(gen, 1)
    o_full, s_full = chunked(*xs, initial_state=h0, use_qk_l2norm=True)
    state, outs, lo = h0, [], 0
    for n in pieces:
        o, state = chunked(*(x[:, lo : lo + n] for x in xs), initial_state=state,
                           use_qk_l2norm=True)
        outs.append(np.asarray(o))
        lo += n
    assert_close(np.concatenate(outs, axis=1), o_full)
    assert_close(state, s_full)


def test_matches_hf_torch_chunk_and_recurrent():
    """Parity target: transformers' torch fallbacks (Qwen3.5), l2norm on, with initial state."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("transformers dispatches to fla's CUDA kernels when fla is installed; "
                    "test_matches_fla_triton_kernels_on_gpu covers those")
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = rng()
    xs = inputs(gen, 1, C + 1)
    h0 = random_state(gen, 1)
    o, s = chunked(*xs, initial_state=h0, use_qk_l2norm=True)
    tq, tk, tv, tg, tb, th = (torch.from_numpy(x) for x in (*xs, h0))
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        o_hf, s_hf = fn(tq, tk, tv, g=tg, beta=tb, initial_state=th, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        assert_close(o, o_hf.numpy(), err_msg=fn.__name__)
        assert_close(s, s_hf.numpy(), err_msg=fn.__name__)


def test_gradients_match_float64_directional_derivatives():
    """d loss / d input of the chunked form (chunk 4 over 11 tokens: several chunk borders),
    projected on a random direction per input, against central differences of the float64
    recurrence."""
    gen = rng()
    xs = inputs(gen, 1, 11)
    h0, w = random_state(gen, 1), randn(gen, (1, 11, NV, HV))

    def loss(*xs):
        o, s = gdn.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True, chunk_size=4)
        return jnp.sum(o * w) + jnp.sum(s)

    def loss64(*xs):
        o, s = naive64(*xs, h0)
        return (o * w).sum() + s.sum()

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*xs)
    eps = 1e-4
    for i, name in enumerate("q k v g beta".split()):
        d = gen.standard_normal(xs[i].shape)
        shifted = [[x.astype(np.float64) for x in xs] for _ in range(2)]
        shifted[0][i] = shifted[0][i] + eps * d
        shifted[1][i] = shifted[1][i] - eps * d
        numeric = (loss64(*shifted[0]) - loss64(*shifted[1])) / (2 * eps)
        analytic = float((np.asarray(grads[i], np.float64) * d).sum())
        assert abs(numeric - analytic) <= 1e-3 * (1 + abs(numeric)), (name, numeric, analytic)


def test_decode_step_equals_recurrent_step_and_continues_prefill():
    gen = rng()
    xs = inputs(gen, 1, C + 1)
    h0 = random_state(gen, 1)
    first = [x[:, :1] for x in xs]
    o_r, s_r = recurrent(*first, initial_state=h0, use_qk_l2norm=True)
    o_d, s_d = decode_step(*first, h0, use_qk_l2norm=True)
    assert_close(o_d, o_r)
    assert_close(s_d, s_r)
    # Prefill C tokens, then decode the last one: same as prefilling all C + 1.
    _, state = chunked(*(x[:, :C] for x in xs), initial_state=h0, use_qk_l2norm=True)
    o_last, state = decode_step(*(x[:, C:] for x in xs), state, use_qk_l2norm=True)
    o_full, s_full = chunked(*xs, initial_state=h0, use_qk_l2norm=True)
    assert_close(o_last, np.asarray(o_full)[:, C:])
    assert_close(state, s_full)


def _ones(shape, dtype=np.float32):
    return np.ones(shape, dtype)


_GOOD = dict(q=(1, 3, 2, 4), k=(1, 3, 2, 4), v=(1, 3, 4, 5), g=(1, 3, 4), beta=(1, 3, 4))


def _bad(fn, **override):
    args = {name: override.pop(name, _ones(shape, np.float32)) for name, shape in _GOOD.items()}
    return lambda: fn(*args.values(), **override)


@pytest.mark.parametrize("case", [
    ("q rank", ValueError, "q must have shape", _bad(gdn.gdn_chunked, q=_ones((3, 2, 4)))),
    ("k shape", ValueError, "k.shape", _bad(gdn.gdn_chunked, k=_ones((1, 3, 1, 4)))),
    ("v batch", ValueError, "v.shape", _bad(gdn.gdn_recurrent, v=_ones((2, 3, 4, 5)))),
    ("gva", ValueError, "Nv=3 must be divisible by Nk=2",
     _bad(gdn.gdn_chunked, v=_ones((1, 3, 3, 5)), g=_ones((1, 3, 3)),
          beta=_ones((1, 3, 3)))),
    ("g shape", ValueError, "g.shape", _bad(gdn.gdn_chunked, g=_ones((1, 3, 2)))),
    ("beta shape", ValueError, "beta.shape", _bad(gdn.gdn_recurrent, beta=_ones((1, 3)))),
    ("int q", TypeError, "q.dtype", _bad(gdn.gdn_chunked, q=_ones((1, 3, 2, 4), np.int32))),
    ("empty", ValueError, "at least one token",
     lambda: gdn.gdn_chunked(*(_ones((1, 0) + s[2:]) for s in _GOOD.values()))),
    ("scale", ValueError, "scale=0.0", _bad(gdn.gdn_recurrent, scale=0.0)),
    ("chunk size", ValueError, "chunk_size=0", _bad(gdn.gdn_chunked, chunk_size=0)),
    ("chunk type", TypeError, "chunk_size=64.0", _bad(gdn.gdn_chunked, chunk_size=64.0)),
    ("state shape", ValueError, "initial_state.shape",
     _bad(gdn.gdn_chunked, initial_state=_ones((1, 4, 5, 4)))),
    ("state shape rec", ValueError, "initial_state.shape",
     _bad(gdn.gdn_recurrent, initial_state=_ones((2, 4, 4, 5)))),
    ("cu dtype", TypeError, "cu_seqlens.dtype",
     _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0.0, 3.0]))),
    ("cu rank", ValueError, "cu_seqlens must have shape",
     _bad(gdn.gdn_chunked, cu_seqlens=np.zeros((2, 2), np.int32))),
    ("cu short", ValueError, "at least 2 entries",
     _bad(gdn.gdn_chunked, cu_seqlens=np.zeros((1,), np.int32))),
    ("cu values", ValueError, "rise from 0",
     _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0, 2, 1, 3], np.int32))),
    ("cu end", ValueError, "token count 3", _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0, 2]))),
    ("cu batch", ValueError, "batch=2 must be 1",
     lambda: gdn.gdn_chunked(*(_ones((2,) + s[1:]) for s in _GOOD.values()),
                             cu_seqlens=np.asarray([0, 3]))),
    ("cu states", ValueError, "initial_state.shape",
     _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0, 1, 3]),
          initial_state=_ones((1, 4, 4, 5)))),
    ("decode T", ValueError, "T=1", _bad(gdn.gdn_decode_step, state=_ones((1, 4, 4, 5)))),
    ("impl", ValueError, "implementation=", _bad(gdn.gdn_chunked, implementation="cuda")),
    ("xla only", TypeError, "implementation", _bad(gdn.gdn_recurrent, implementation="xla")),
    ("gating shapes", ValueError, "b.shape",
     lambda: gdn.gdn_gating(_ones((3, 4)), _ones((3, 2)), _ones(4), _ones(4))),
    ("gating A_log", ValueError, "A_log.shape",
     lambda: gdn.gdn_gating(_ones((3, 4)), _ones((3, 4)), _ones(2), _ones(4))),
    ("gating dtype", TypeError, "dt_bias.dtype",
     lambda: gdn.gdn_gating(_ones((3, 4)), _ones((3, 4)), _ones(4),
                            _ones(4, np.int32))),
    ("l2norm dtype", TypeError, "x.dtype", lambda: gdn.l2norm(_ones(4, np.int32))),
    ("l2norm eps", ValueError, "eps=0", lambda: gdn.l2norm(_ones(4), eps=0)),
], ids=lambda case: case[0])
def test_bad_input(case):
    _, error, match, call = case
    with pytest.raises(error, match=match):
        call()


def _one_token(b=2):
    return [_ones((b, 1) + s[2:]) for s in _GOOD.values()]


@pytest.mark.parametrize("case", [
    ("pool shape", ValueError, "ssm_pool.shape",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 5, 4)), np.asarray([1, 2]))),
    ("slot dtype", TypeError, "slot_ids.dtype",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1.0, 2]))),
    ("slot count", ValueError, "slot_ids.shape",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1]))),
    ("slot range", ValueError, r"must lie in \[0, 4\)",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1, 4]))),
    ("slot negative", ValueError, "must lie in",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([-2, 1]))),
    ("slot shared", ValueError, "share a slot",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([3, 3]))),
    ("has_init dtype", TypeError, "has_initial_state.dtype",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1, 2]),
                                 has_initial_state=np.asarray([1, 0]))),
    ("has_init shape", ValueError, "has_initial_state.shape",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1, 2]),
                                 has_initial_state=np.asarray([True]))),
    ("prefill slots per seq", ValueError, "slot_ids.shape",
     lambda: gdn.gdn_prefill_pool(*_bad(lambda *a: a)(), _ones((4, 4, 4, 5)),
                                  np.asarray([1]), cu_seqlens=np.asarray([0, 1, 3]))),
], ids=lambda case: case[0])
def test_bad_pool_input(case):
    _, error, match, call = case
    with pytest.raises(error, match=match):
        call()


def test_padding_slot_minus_one_maps_to_null_slot_under_jit():
    """A stray -1 never wraps to the last slot: it is padding (output 0, writes slot 0 only)."""
    gen = rng()
    xs, pool, _, has_init = pool_case(gen, 1)
    o, new_pool = map(np.asarray, decode_pool(*xs, pool, np.asarray([-1, 3, 0, 5], np.int32),
                                              has_initial_state=has_init, use_qk_l2norm=True))
    np.testing.assert_array_equal(o[[0, 2]], 0)
    untouched = [1, 2, 4, 6, 7]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.gpu
def test_matches_fla_triton_kernels_on_gpu(tmp_path, monkeypatch):
    """Parity with fla's chunked and fused-recurrent Triton kernels at model dims (GVA 2,
    H = Hv = 128), varlen with per-sequence initial states."""
    torch = pytest.importorskip("torch")
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    import triton

    # fla's autotuner caches on disk: a writable cache folder, or its first compile fails.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path), raising=False)
    gen = rng()
    cu = cu_seqlens_of([1, C - 1, C, C + 1, 700, 1000])
    xs = inputs(gen, 1, int(cu[-1]), nk=4, nv=8, h=128, hv=128)
    h0 = randn(gen, (len(cu) - 1, 8, 128, 128), scale=0.5)
    o, s = chunked(*xs, initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu)
    tx = [torch.from_numpy(x).cuda() for x in (*xs, h0)]
    kw = dict(initial_state=tx[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.from_numpy(cu).long().cuda())
    # fla's chunk kernel multiplies in TF32 (measured on H100: 2e-4 on o, 1e-3 on the state);
    # its fused recurrent kernel is float32 throughout (7e-8 and 5e-7).
    for fn, tol in ((fla.chunk_gated_delta_rule, 5e-3), (fla.fused_recurrent_gated_delta_rule,
                                                         2e-5)):
        o_f, s_f = fn(*tx[:3], g=tx[3], beta=tx[4], **kw)
        assert_close(o, o_f.cpu().numpy(), atol=tol, rtol=tol, err_msg=fn.__name__)
        assert_close(s, s_f.cpu().numpy(), atol=tol, rtol=tol, err_msg=fn.__name__)
