"""The learner's truncated log-probs (top-k / top-p, issue 14 item 7): a hand-computed table on a
fixed distribution, the gradient of the renormalisation, chunking, and agreement with the
rollout sampler's kept mass."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_rl.learner.logprobs import token_logprobs
from jax_rl.sampling import check_truncation, kept_set, log_kept_mass
from rollout.engine import sample_tokens

# a fixed next-token distribution over V = 6, sorted: p = 0.4, 0.25, 0.15, 0.1, 0.06, 0.04
P6 = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
TEMP = 0.5
LOGITS6 = (np.log(P6) * TEMP).astype(np.float32)  # softmax(LOGITS6 / TEMP) == P6: temperature first
NINF = -math.inf

# (top_k, top_p) -> (kept set, kept mass) by hand:
#   top-k 3:            {0,1,2}, 0.8
#   top-p 0.6:          sorted mass before = 0, .4, .65: {0,1} (token 1 crosses 0.6 and is kept), 0.65
#   top-p 0.7:          before = 0, .4, .65, .8: {0,1,2}, 0.8
#   top-k 3, top-p 0.7: top-3 renormalised = .5, .3125, .1875, before = 0, .5, .8125: {0,1}, 0.65
#                       (the reverse order, top-p then top-k, would keep {0,1,2}: HF order pinned)
#   top-p 0.1:          only the argmax, mass 0.4
#   top-k 6, top-p 1:   everything (a top-k that keeps all), mass 1
HAND = {
    (3, 1.0): ({0, 1, 2}, 0.8),
    (0, 0.6): ({0, 1}, 0.65),
    (0, 0.7): ({0, 1, 2}, 0.8),
    (3, 0.7): ({0, 1}, 0.65),
    (0, 0.1): ({0}, 0.4),
    (6, 1.0): (set(range(6)), 1.0),
}


def _lp(top_k, top_p, logits=LOGITS6, temp=TEMP):
    V = logits.shape[-1]
    lg = jnp.asarray(np.tile(logits, (V, 1))[None])  # [1, V, V]: position t predicts token t
    tg = jnp.arange(V, dtype=jnp.int32)[None]
    return np.asarray(token_logprobs(lg, tg, temp, top_k=top_k, top_p=top_p))[0]


@pytest.mark.parametrize("top_k,top_p", sorted(HAND))
def test_hand_table(top_k, top_p):
    keep, mass = HAND[(top_k, top_p)]
    want = np.array([math.log(P6[i] / mass) if i in keep else NINF for i in range(6)])
    got = _lp(top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], atol=2e-6, rtol=0)
    # the rollout sampler keeps the same set with the same mass (one shared rule)
    _, _, km = sample_tokens(jnp.asarray(LOGITS6)[None], jax.random.PRNGKey(0)[None], jnp.full((1,), TEMP, jnp.float32),
                             top_k=top_k, top_p=top_p)
    np.testing.assert_allclose(float(km[0]), mass, rtol=1e-6)


def test_ties_at_the_kth_value_are_all_kept():
    p = np.array([0.4, 0.2, 0.2, 0.1, 0.1])
    got = _lp(2, 1.0, logits=np.log(p).astype(np.float32), temp=1.0)  # top-2 with a tie for 2nd
    want = np.log(p[:3] / 0.8)
    np.testing.assert_allclose(got[:3], want, atol=2e-6)
    assert np.all(np.isneginf(got[3:]))


def test_untruncated_is_the_plain_path_bitwise():
    rng = np.random.default_rng(0)
    lg = jnp.asarray(rng.normal(size=(2, 5, 30)), jnp.float32)
    tg = jnp.asarray(rng.integers(0, 30, (2, 5)), jnp.int32)
    a = np.asarray(token_logprobs(lg, tg, 0.7))
    b = np.asarray(token_logprobs(lg, tg, 0.7, top_k=0, top_p=1.0))
    assert a.tobytes() == b.tobytes()


def test_gradient_of_the_renormalisation():
    # d log pi_trunc(tok) / d logits = (onehot(tok) - q) / T with q the truncated distribution;
    # the kept set itself carries no gradient, tokens outside it none either
    lg = jnp.asarray(np.tile(LOGITS6, (1, 1, 1)))
    g = np.asarray(jax.grad(lambda x: token_logprobs(x, jnp.zeros((1, 1), jnp.int32), TEMP, top_k=3).sum())(lg))[0, 0]
    q = np.array([0.5, 0.3125, 0.1875, 0, 0, 0])
    np.testing.assert_allclose(g, (np.eye(6)[0] - q) / TEMP, atol=1e-5)
    # a target outside the kept set: -inf value, all-zero (finite) gradient
    f = lambda x: token_logprobs(x, jnp.full((1, 1), 4, jnp.int32), TEMP, top_k=3)  # noqa: E731
    assert np.isneginf(float(f(lg)[0, 0]))
    g_out = np.asarray(jax.grad(lambda x: jnp.where(jnp.isfinite(f(x)), f(x), 0.0).sum())(lg))
    assert np.all(g_out == 0.0)


def test_truncated_entropy_hand():
    from jax_rl.learner.logprobs import _trunc_logp_from_logits

    out = np.asarray(_trunc_logp_from_logits(jnp.asarray(LOGITS6)[None], jnp.zeros((1,), jnp.int32), TEMP, 3, 1.0,
                                             return_entropy=True))[0]
    q = np.array([0.5, 0.3125, 0.1875])
    np.testing.assert_allclose(out, [math.log(0.5), -np.sum(q * np.log(q))], atol=2e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_chunked_equals_unchunked_with_truncation(jit):
    rng = np.random.default_rng(1)
    lg = jnp.asarray(rng.normal(size=(2, 12, 40)) * 2, jnp.float32)
    tg = jnp.asarray(rng.integers(0, 40, (2, 12)), jnp.int32)

    def both(lg, tg):
        return (token_logprobs(lg, tg, 0.7, top_k=8, top_p=0.8),
                token_logprobs(lg, tg, 0.7, top_k=8, top_p=0.8, chunk_elems=2 * 3 * 40))  # 4 chunks of 3

    a, b = map(np.asarray, (jax.jit(both) if jit else both)(lg, tg))
    np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
    np.testing.assert_allclose(a[np.isfinite(a)], b[np.isfinite(b)], atol=1e-6)
    assert np.isinf(a).any() and np.isfinite(a).any()


@functools.partial(jax.jit, static_argnums=(2, 3))
def _sample_and_score(logits, keys, top_k, top_p):
    B = logits.shape[0]
    tok, lp_s, km = sample_tokens(logits, keys, jnp.full((B,), 0.7, jnp.float32), top_k=top_k, top_p=top_p)
    lp_l = token_logprobs(logits[:, None], tok[:, None], 0.7, top_k=top_k, top_p=top_p)[:, 0]
    full = jax.nn.log_softmax(logits / 0.7, -1)
    return lp_s, km, lp_l, jnp.exp(log_kept_mass(full, kept_set(full, top_k, top_p)))


@pytest.mark.parametrize("top_k,top_p", [(20, 0.9), (0, 0.9), (1, 1.0), (17, 0.3)])
def test_sampler_and_learner_agree_on_random_logits(top_k, top_p):
    """Same fp32 logits: the sampled token is inside the learner's kept set and the learner's
    log pi_trunc equals the sampler's behav logp (pi/mu = 1 when numerics agree), 64 rows."""
    rng = np.random.default_rng(top_k)
    B, V = 64, 96
    logits = jnp.asarray(rng.normal(size=(B, V)) * rng.uniform(0.1, 4.0, (B, 1)), jnp.float32)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B, dtype=jnp.uint32))
    lp_s, km, lp_l, km_l = map(np.asarray, _sample_and_score(logits, keys, top_k, top_p))
    np.testing.assert_allclose(lp_l, lp_s, atol=1e-6, rtol=0)
    np.testing.assert_allclose(km_l, km, rtol=1e-6)


def test_check_truncation():
    check_truncation(0, 1.0)
    check_truncation(20, 0.9)
    for bad in ((-1, 1.0), (1.5, 1.0), (0, 0.0), (0, 1.5), (True, 1.0)):
        with pytest.raises(ValueError):
            check_truncation(*bad)
