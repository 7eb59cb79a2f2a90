"""The input contract (README, "Input contract"): eager checks name the bad value, identically on
every backend; traced values keep their documented meaning; `attn.debug_checks()` turns traced
violations into run-time errors.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import gdn
from attn.block_sparse import block_sparse_attention
from attn.dense import attention, paged_prefill_attention
from attn.mla import mla_paged_decode
from attn.paged_decode import paged_decode
from tests.utils import randn, rng

P, M, NUM_PAGES, K, G, H = 4, 2, 5, 2, 2, 8


def _dense(gen, b=2, t=4, s=8):
    return (randn(gen, (b, t, K * G, H)), randn(gen, (b, s, K, H)), randn(gen, (b, s, K, H)))


def _paged(gen, b=2):
    q = randn(gen, (b, K * G, H))
    pages = randn(gen, (K, NUM_PAGES, P, H))
    table = jnp.asarray(np.tile(np.array([1, 2], np.int32), (b, K, 1)))
    return q, pages, table


def _mla(gen, b=2, n=4, l=8, r=4):
    return (randn(gen, (b, n, l)), randn(gen, (b, n, r)), randn(gen, (NUM_PAGES, P, l + r)),
            jnp.asarray(np.tile(np.array([1, 2], np.int32), (b, 1))))


def _gdn(gen, g=-0.5, beta=0.5):
    q, k = randn(gen, (1, 3, 1, 4)), randn(gen, (1, 3, 1, 4))
    v = randn(gen, (1, 3, 1, 4))
    return q, k, v, jnp.full((1, 3, 1), g, jnp.float32), jnp.full((1, 3, 1), beta, jnp.float32)


# -- eager checks --------------------------------------------------------------------------------


def test_dense_negative_sinks_array_is_refused():
    q, k, v = _dense(rng())
    with pytest.raises(ValueError, match=r"sinks=\[1, -2\] must be >= 0"):
        attention(q, k, v, window=2, sinks=np.array([1, -2], np.int32), implementation="xla")
    with pytest.raises(ValueError, match=r"sinks=\[0, -1\] must be >= 0"):
        attention(q, k, v, window=2, sinks=jnp.asarray([0, -1], jnp.int32),
                  implementation="triton")


@pytest.mark.parametrize("name,value",
                         [("window", 2**31), ("sinks", 2**40), ("window", -(2**31) - 1)])
def test_ints_past_int32_name_the_value(name, value):
    gen = rng()
    q, k, v = _dense(gen)
    opts = dict(window=4) | {name: value}
    with pytest.raises(ValueError, match=f"{name}={value} does not fit int32"):
        attention(q, k, v, implementation="xla", **opts)
    qd, pages, table = _paged(gen)
    lens = jnp.asarray([5, 8], jnp.int32)
    with pytest.raises(ValueError, match=f"{name}={value} does not fit int32"):
        paged_decode(qd, pages, pages, table, lens, implementation="xla", **{name: value})
    with pytest.raises(ValueError, match=f"{name}={value} does not fit int32"):
        paged_prefill_attention(q[:, :1], pages, pages, table, lens - 1, lens,
                                implementation="xla", **{name: value})


def _length_calls(gen, lengths):
    """Each op that takes lengths, called with `lengths` ([B] int32, B = 2)."""
    q, k, v = _dense(gen)
    qd, pages, table = _paged(gen)
    q_lat, q_pe, latent, mla_table = _mla(gen)
    lens = jnp.asarray(lengths, jnp.int32)
    return {
        "attention": lambda: attention(q, k, v, causal=False, kv_lengths=lens),
        "paged_decode": lambda: paged_decode(qd, pages, pages, table, lens),
        "paged_prefill": lambda: paged_prefill_attention(q[:, :1], pages, pages, table, 0, lens),
        "mla_paged_decode": lambda: mla_paged_decode(q_lat, q_pe, latent, mla_table, lens,
                                                     kv_lora_rank=8, scale=0.3),
        "block_sparse": lambda: block_sparse_attention(
            q, k, v, jnp.zeros((2, K * G), jnp.int32), block_size=4, kv_lengths=lens),
    }


@pytest.mark.parametrize("op", ["attention", "paged_decode", "paged_prefill", "mla_paged_decode",
                                "block_sparse"])
def test_negative_and_past_capacity_lengths_are_refused_when_concrete(op):
    """One rule for every op: concrete lengths must lie in [0, capacity] (S, or M * P)."""
    gen = rng()
    name = {"attention": "kv_lengths", "paged_prefill": "kv_lengths",
            "block_sparse": "kv_lengths"}.get(op, "lengths")
    with pytest.raises(ValueError, match=rf"{name}=\[-1, 3\] must lie in \[0, 8\]"):
        _length_calls(gen, [-1, 3])[op]()
    with pytest.raises(ValueError, match=rf"{name}=\[9, 3\] must lie in \[0, 8\]"):
        _length_calls(gen, [9, 3])[op]()


def _scale_calls(gen, scale, impl):
    q, k, v = _dense(gen)
    qd, pages, table = _paged(gen)
    q_lat, q_pe, latent, mla_table = _mla(gen)
    lens = jnp.asarray([5, 8], jnp.int32)
    gq, gk, gv, g, beta = _gdn(gen)
    return {
        "attention": lambda: attention(q, k, v, scale=scale, implementation=impl),
        "paged_decode": lambda: paged_decode(qd, pages, pages, table, lens, scale=scale,
                                             implementation=impl),
        "paged_prefill": lambda: paged_prefill_attention(q[:, :1], pages, pages, table, lens - 1,
                                                         lens, scale=scale, implementation=impl),
        "mla_paged_decode": lambda: mla_paged_decode(q_lat, q_pe, latent, mla_table, lens,
                                                     kv_lora_rank=8, scale=scale,
                                                     implementation=impl),
        "block_sparse": lambda: block_sparse_attention(
            q, k, v, jnp.zeros((2, K * G), jnp.int32), block_size=4, scale=scale,
            implementation=impl),
        "gdn_decode_pool": lambda: gdn.gdn_decode_pool(
            gq[:, :1], gk[:, :1], gv[:, :1], g[:, :1], beta[:, :1], jnp.zeros((2, 1, 4, 4)),
            jnp.asarray([1], jnp.int32), scale=scale, implementation=impl),
    }


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan")])
@pytest.mark.parametrize("op", ["attention", "paged_decode", "paged_prefill", "mla_paged_decode",
                                "block_sparse", "gdn_decode_pool"])
def test_scale_rule_is_one_on_every_backend(op, scale, impl):
    """`scale <= 0` (or NaN) is a ValueError naming it on every backend, raised before dispatch
    (never a NotImplementedError from one kernel and a result from another)."""
    with pytest.raises(ValueError, match=f"scale={scale} must be positive and finite"):
        _scale_calls(rng(), scale, impl)[op]()


@pytest.mark.parametrize("fn", ["gdn_recurrent", "gdn_chunked"])
def test_gdn_gates_out_of_range_are_refused(fn):
    gen = rng()
    call = getattr(gdn, fn)
    if fn == "gdn_chunked":
        call = functools.partial(call, implementation="xla")
    q, k, v, g, beta = _gdn(gen, g=0.5)
    with pytest.raises(ValueError, match=r"g=.*0\.5.* must be <= 0\.0"):
        call(q, k, v, g, beta)
    for bad in (1.5, -0.25):
        q, k, v, g, beta = _gdn(gen, beta=bad)
        with pytest.raises(ValueError, match=rf"beta=.*{bad}.* must lie in \[0\.0, 1\.0\]"):
            call(q, k, v, g, beta)
    q, k, v, g, beta = _gdn(gen, g=0.0, beta=1.0)  # the bounds themselves are valid
    call(q, k, v, g, beta)


def test_traced_values_are_not_checked_eagerly():
    """Under jit the same values take their traced meaning: no error, clamped lengths."""
    gen = rng()
    qd, pages, table = _paged(gen)
    run = jax.jit(lambda lens: paged_decode(qd, pages, pages, table, lens, implementation="xla"))
    past, full = run(jnp.asarray([9, -3], jnp.int32)), run(jnp.asarray([8, 0], jnp.int32))
    # Length 9 keeps its query position for a window but reads the 8 keys of the table; -3 is an
    # empty row.
    np.testing.assert_array_equal(np.asarray(past[1]), np.asarray(full[1]))


# -- checked mode ----------------------------------------------------------------------------------


def _fails_in_checked_mode(fn, *args, match):
    """`jit(fn)(*args)` runs without the checked mode and fails with `match` inside it (a fresh
    function each time: the flag is read when tracing, and jit caches traces per function)."""
    jax.block_until_ready(jax.jit(lambda *a: fn(*a))(*args))
    with attn.debug_checks():
        assert attn.debug_checks_enabled()
        with pytest.raises(RuntimeError, match=match):
            jax.block_until_ready(jax.jit(lambda *a: fn(*a))(*args))
    assert not attn.debug_checks_enabled()


def test_checked_mode_table_ids_and_lengths_paged_decode():
    gen = rng()
    qd, pages, table = _paged(gen)
    lens = jnp.asarray([5, 8], jnp.int32)
    bad_table = table.at[0, 1, 1].set(NUM_PAGES)
    run = lambda t, n: paged_decode(qd, pages, pages, t, n, implementation="xla")
    _fails_in_checked_mode(run, bad_table, lens,
                           match=rf"block_tables=.*must lie in \[-1, {NUM_PAGES - 1}\]")
    _fails_in_checked_mode(run, table, jnp.asarray([9, 8], jnp.int32),
                           match=r"lengths=\[9, 8\] must lie in \[0, 8\]")


def test_checked_mode_other_ops():
    gen = rng()
    q, k, v = _dense(gen)
    _, pages, table = _paged(gen)
    q_lat, q_pe, latent, mla_table = _mla(gen)
    lens = jnp.asarray([5, 8], jnp.int32)
    _fails_in_checked_mode(
        lambda t: paged_prefill_attention(q[:, :1], pages, pages, t, lens - 1, lens,
                                          implementation="xla"),
        table.at[1, 0, 0].set(-7), match=r"block_tables=.*must lie in \[-1, 4\]")
    _fails_in_checked_mode(
        lambda n: mla_paged_decode(q_lat, q_pe, latent, mla_table, n, kv_lora_rank=8, scale=0.3,
                                   implementation="xla"),
        jnp.asarray([-1, 8], jnp.int32), match=r"lengths=\[-1, 8\] must lie in \[0, 8\]")
    _fails_in_checked_mode(
        lambda n: attention(q, k, v, causal=False, kv_lengths=n, implementation="xla"),
        jnp.asarray([3, 12], jnp.int32), match=r"kv_lengths=\[3, 12\] must lie in \[0, 8\]")
    gq, gk, gv, g, beta = _gdn(gen)
    _fails_in_checked_mode(
        lambda g: gdn.gdn_recurrent(gq, gk, gv, g, beta),
        g + 1.0, match=r"g=.* must be <= 0\.0")
