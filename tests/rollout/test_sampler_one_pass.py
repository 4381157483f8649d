"""The rollout sampler in one pass over ``[slots, vocab]`` (issue 46 item 4): the distribution it
samples (exact enumeration of a tiny vocabulary, chi-square over many keys), its ``behav_logp``
against a float64 log-softmax, and the bounded-candidate kept set (``jax_rl.sampling.kept_set``,
``lax.top_k`` instead of a sort over V) against the sort-based rule it replaced, ties included."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from jax_rl.sampling import kept_set, threshold_by_search
from rollout.engine import sample_tokens

HSET = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _sorted_kept_set(lp, top_k=0, top_p=1.0):
    """The kept set as written before issue 46 (a sort over V for top-p alone): the reference rule."""
    lp = jnp.asarray(lp, jnp.float32)
    kept = jnp.ones(lp.shape, bool)
    srt = None
    if top_k > 0:
        srt = jax.lax.top_k(lp, min(top_k, lp.shape[-1]))[0]
        kept = lp >= srt[..., -1:]
    if top_p < 1.0:
        if srt is None:
            srt = jnp.flip(jnp.sort(lp, axis=-1), axis=-1)
        lse = jax.nn.logsumexp(jnp.where(kept, lp, -jnp.inf), axis=-1, keepdims=True)
        p = jnp.exp(srt - lse)
        before = jnp.cumsum(p, axis=-1) - p
        kept = kept & (lp >= jnp.min(jnp.where(before < top_p, srt, jnp.inf), axis=-1, keepdims=True))
    return kept


def _truth(logits, t, top_k, top_p):
    """float64 probabilities of the tempered, truncated, renormalised distribution (numpy)."""
    lp = logits.astype(np.float64) / t
    lp = lp - np.log(np.sum(np.exp(lp - lp.max()))) - lp.max()
    kept = np.asarray(_sorted_kept_set(lp.astype(np.float32)[None], top_k, top_p))[0]
    p = np.where(kept, np.exp(lp), 0.0)
    return p / p.sum(), lp, kept


@pytest.mark.parametrize("top_k,top_p,cand", [(0, 1.0, 256), (3, 1.0, 256), (0, 0.8, 4), (0, 0.8, 2), (4, 0.7, 256)])
def test_samples_the_truncated_tempered_distribution(top_k, top_p, cand):
    """6 tokens (a tie included), 40,000 keys: the sampled frequencies fit the float64 truncated,
    tempered softmax (chi-square, p > 1e-4); truncated tokens are never drawn. ``cand`` 2 with
    top-p alone: the nucleus is wider than the candidates, so the sort path draws."""
    logits = np.asarray([2.0, 1.0, 1.0, 0.2, -1.0, 0.5], np.float32)
    t, n = 0.8, 40_000
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n))
    fn = jax.jit(functools.partial(sample_tokens, top_k=top_k, top_p=top_p, candidates=cand))
    tok, _, _ = fn(jnp.broadcast_to(jnp.asarray(logits), (n, 6)), keys, jnp.full((n,), t, jnp.float32))
    p, _, kept = _truth(logits, t, top_k, top_p)
    counts = np.bincount(np.asarray(tok), minlength=6)
    assert counts[~kept].sum() == 0, counts
    assert stats.chisquare(counts[kept], n * p[kept]).pvalue > 1e-4, (counts, n * p)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.9), (20, 0.95)])
def test_behav_logp_is_the_log_softmax_of_the_token(top_k, top_p):
    """``behav_logp`` = float64 ``log_softmax(logits / T)[tok] - log(kept mass)`` to 1e-6 (fp32),
    greedy rows at T = 1 and their token the argmax; the kept mass is the float64 one."""
    rng = np.random.default_rng(top_k)
    B, V = 16, 300
    lg = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    temp = rng.uniform(0.5, 1.5, size=B).astype(np.float32)
    temp[:3] = 0.0
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B))
    fn = jax.jit(functools.partial(sample_tokens, top_k=top_k, top_p=top_p))
    tok, logp, km = (np.asarray(a) for a in fn(jnp.asarray(lg), keys, jnp.asarray(temp)))
    for i in range(B):
        _, lp, kept = _truth(lg[i], temp[i] if temp[i] > 0 else 1.0, top_k, top_p)
        mass = np.exp(lp)[kept].sum()
        assert kept[tok[i]]
        np.testing.assert_allclose(logp[i], lp[tok[i]] - np.log(mass), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(km[i], mass, rtol=1e-6)
        if temp[i] <= 0:
            assert tok[i] == int(np.argmax(lg[i]))


@given(st.lists(st.integers(-4, 4), min_size=1, max_size=12), st.integers(0, 13), st.sampled_from([1.0, 0.25, 0.5, 0.9]),
       st.integers(1, 13), st.sampled_from([0.5, 1.0, 3.0]))
@HSET
def test_kept_set_equals_the_sort_based_rule(vals, top_k, top_p, cand, scale):
    """Integer logits (many ties, at the k-th value and at the nucleus' edge): the candidate kept set
    (top-k of ``k + 1`` / ``cand`` values, the sort only where those do not decide) equals the sort
    over V, for every candidate count."""
    if top_k == 0 and top_p == 1.0:
        top_k = 1
    lp = jax.nn.log_softmax(jnp.asarray(vals, jnp.float32) * scale)[None]
    got = kept_set(lp, top_k, top_p, candidates=cand)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_sorted_kept_set(lp, top_k, top_p)))


@given(st.lists(st.integers(-4, 4), min_size=1, max_size=40), st.integers(0, 41), st.sampled_from([1.0, 0.25, 0.5, 0.9, 0.99]),
       st.sampled_from([0.5, 1.0, 3.0]))
@HSET
def test_threshold_by_search_equals_the_sort_based_rule(vals, top_k, top_p, scale):
    """The bisection every undecided batch takes (no sort of V) keeps the same set as the sort over V, ties at
    the k-th value and at the nucleus' edge included (integer logits), in fp32."""
    if top_k == 0 and top_p == 1.0:
        top_k = 1
    lp = jax.nn.log_softmax(jnp.asarray(vals, jnp.float32) * scale)[None]
    got = lp >= jax.jit(threshold_by_search, static_argnums=(1, 2))(lp, top_k, top_p)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_sorted_kept_set(lp, top_k, top_p)))


def test_threshold_by_search_on_a_wide_row_with_masked_tokens():
    """A 2,000-token row of normal logits with -inf tokens (the shape of a real nucleus wider than the
    candidates): the kept set equals the sort's for top-p alone and after top-k."""
    rng = np.random.default_rng(0)
    lg = rng.normal(size=(3, 2000)).astype(np.float32)
    lg[:, ::7] = -np.inf
    lp = jax.nn.log_softmax(jnp.asarray(lg), axis=-1)
    for k, p in ((0, 0.9), (0, 0.5), (700, 0.95), (50, 1.0)):
        got = lp >= threshold_by_search(lp, k, p)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(_sorted_kept_set(lp, k, p)))
        assert 1 < int(got[0].sum()) < 1715  # a wide nucleus, the masked tokens out


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 0.9), (5, 1.0)])
def test_no_sort_of_the_vocabulary_in_sampler_or_learner(top_k, top_p):
    """Item 4's "never a full sort": neither the sampler's program nor the learner's kept set holds a sort
    (the full-vocabulary fallback is a bisection); the argsort of the sampler's candidates is over C, not V."""
    B, V, C = 4, 1024, 256
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B))
    sampler = jax.make_jaxpr(functools.partial(sample_tokens, top_k=top_k, top_p=top_p))(
        jnp.zeros((B, V)), keys, jnp.ones((B,)))
    learner = jax.make_jaxpr(lambda x: kept_set(x, top_k, top_p))(jnp.zeros((B, 8, V)))

    def sorts(jaxpr):
        out = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "sort":
                out.append(eqn.invars[0].aval.shape[-1])
            for p in eqn.params.values():
                for j in (p if isinstance(p, (tuple, list)) else (p,)):
                    if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
                        out += sorts(j.jaxpr)
                    elif hasattr(j, "eqns"):
                        out += sorts(j)
        return out

    assert V not in sorts(sampler.jaxpr), sorts(sampler.jaxpr)
    assert V not in sorts(learner.jaxpr), sorts(learner.jaxpr)
    assert all(n <= C for n in sorts(sampler.jaxpr))
