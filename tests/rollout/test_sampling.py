"""The rollout sampler's inverse-CDF draw (``rollout.engine.inverse_cdf_index``): hand tables
(one level and across blocks), jit and eager, fp32 edge cases, and a property against numpy's
searchsorted."""

import chex
import pytest
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.engine import inverse_cdf_index

HSET = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


class InverseCdfTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_table(self):
        # p = [0, .5, 0, .5] (unnormalised x2 in the second row): running mass 0, .5, .5, 1
        p = jnp.asarray([[0.0, 0.5, 0.0, 0.5]] * 5 + [[0.0, 1.0, 0.0, 1.0]], jnp.float32)
        u = jnp.asarray([0.0, 0.25, 0.4999, 0.5, 0.99999994, 0.75], jnp.float32)
        got = self.variant(inverse_cdf_index)(p, u)
        # u = 0 skips the leading zero-mass entry; u = .5 lands on the flat step and moves past
        # the zero-mass entry 2 to entry 3; the second row is scaled by its total (2)
        chex.assert_trees_all_close(got, jnp.asarray([1, 1, 1, 3, 3, 3], jnp.int32))
        assert got.dtype == jnp.int32

    @chex.variants(with_jit=True, without_jit=True)
    def test_rounding_to_the_total_never_picks_a_zero_mass_tail(self):
        # u * total can round up to the total in fp32; the draw must stay on the last positive
        # entry, not run into the truncated tail
        p = jnp.asarray([[0.1, 0.3, 0.7, 0.0, 0.0]], jnp.float32)
        u = jnp.asarray([np.nextafter(np.float32(1.0), np.float32(0.0))], jnp.float32)
        assert int(self.variant(inverse_cdf_index)(p, u)[0]) == 2

    @chex.variants(with_jit=True, without_jit=True)
    def test_one_positive_entry(self):
        p = jnp.zeros((3, 7), jnp.float32).at[jnp.arange(3), jnp.asarray([0, 4, 6])].set(1e-30)
        got = self.variant(inverse_cdf_index)(p, jnp.asarray([0.0, 0.5, 0.9], jnp.float32))
        chex.assert_trees_all_close(got, jnp.asarray([0, 4, 6], jnp.int32))

    @chex.variants(with_jit=True, without_jit=True)
    def test_blocks(self):
        # 3 blocks of 4: masses 0 | 2 | 0.5 (the middle block's last entry is zero, the last
        # block is unpadded); the draw crosses block boundaries like a flat running sum
        p = jnp.asarray([[0, 0, 0, 0, 1, 1, 0, 0, 0, 0.5, 0, 0]] * 4, jnp.float32)
        u = jnp.asarray([0.0, 0.39, 0.4, 0.9], jnp.float32)  # x = u * 2.5: 0, 0.975, 1.0, 2.25
        got = self.variant(lambda p, u: inverse_cdf_index(p, u, block=4))(p, u)
        chex.assert_trees_all_close(got, jnp.asarray([4, 4, 5, 9], jnp.int32))

    @HSET
    @given(data=st.data(), V=st.integers(1, 70), block=st.sampled_from([8, 16, 128]))
    def test_matches_searchsorted_and_hits_positive_mass(self, data, V, block):
        # masses whose fp32 sums are exact, so the blocked sums equal numpy's running sum
        w = data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.125, 0.5, 1.0, 3.0]), min_size=V, max_size=V))
        if not any(w):
            w[data.draw(st.integers(0, V - 1))] = 1.0
        u = data.draw(st.floats(0.0, 1.0, exclude_max=True, width=32))
        p = np.asarray(w, np.float32)
        got = int(inverse_cdf_index(jnp.asarray(p)[None], jnp.asarray([u], jnp.float32), block=block)[0])
        assert p[got] > 0
        cdf = np.cumsum(p, dtype=np.float32)
        want = min(int(np.searchsorted(cdf, np.float32(u) * cdf[-1], side="right")), int(np.flatnonzero(p)[-1]))
        assert got == want, (p, u, got, want)


def _sample_reference(logits, keys, temperature, top_k=0, top_p=1.0):
    """``sample_tokens`` written the direct way (the engine's sampler before the gathers were moved):
    ``[B, V]`` masses ``exp(logp)`` materialised and drawn from by :func:`inverse_cdf_index`."""
    import jax

    from jax_rl.sampling import kept_set, log_kept_mass, truncates

    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    logp_s = jax.nn.log_softmax(logits / t[:, None], axis=-1)
    kept_mass = jnp.ones(logits.shape[:1], jnp.float32)
    if truncates(top_k, top_p):
        kept = kept_set(logp_s, top_k, top_p)
        lkm = log_kept_mass(logp_s, kept)
        kept_mass = jnp.exp(lkm)
        logp_s = jnp.where(kept, logp_s - lkm[:, None], -jnp.inf)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    tokens = jnp.where(greedy, jnp.argmax(logp_s, axis=-1), inverse_cdf_index(jnp.exp(logp_s), u)).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp_s, tokens[:, None], axis=-1)[:, 0], kept_mass


@pytest.mark.parametrize("V,trunc", [(64, (0, 1.0)), (100, (0, 1.0)), (40, (7, 1.0)), (384, (5, 0.9)),
                                     (384, (0, 0.9)), (1000, (0, 0.95))])
def test_sample_tokens_keeps_the_direct_draws_stream(V, trunc):
    """The one-pass sampler (block max and sum of exps in one read, the truncated draw over a
    ``lax.top_k`` candidate set in vocabulary order) draws the same tokens for the same keys as the
    direct draw over a materialised ``[B, V]`` of ``exp(logp)`` (the random stream kept), with
    ``behav_logp`` and the kept mass equal to fp32 rounding; greedy rows, a -inf tail and a tie at
    the max (V 100: the padded-block path; V 1000 top-p alone: 64 candidates, rows of 20x-scaled
    logits decide from them, 0.5x-scaled rows do not and the batch takes the sort path)."""
    import jax

    from rollout.engine import sample_tokens

    rng = np.random.default_rng(V)
    B = 24
    lg = (rng.normal(size=(B, V)) * rng.choice([0.5, 4.0, 20.0], size=(B, 1))).astype(np.float32)
    lg[1, V // 2:] = -np.inf
    lg[2, 3] = lg[2, 5] = float(lg[2].max()) + 1.0
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B) + V)
    temp = jnp.asarray(rng.uniform(0.3, 1.5, size=B).astype(np.float32)).at[0].set(0.0)
    k, p = trunc
    got = jax.jit(lambda *a: sample_tokens(*a, top_k=k, top_p=p, candidates=64))(jnp.asarray(lg), keys, temp)
    want = jax.jit(lambda *a: _sample_reference(*a, top_k=k, top_p=p))(jnp.asarray(lg), keys, temp)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    # equal to fp32 rounding: the sum of exps is summed in another order, and x / T is rounded where each
    # side computes it (the sampler's statistics fuse it into their reduce), so a log-prob moves by up to
    # ~an ulp of the row's largest |x / T| (20x-scaled logits at T 0.45: |x / T| ~90, ulp 7.6e-6)
    t = np.where(np.asarray(temp) <= 0, 1.0, np.asarray(temp))
    xt = np.abs(np.where(np.isfinite(lg), lg, 0.0) / t[:, None]).max(axis=1)
    err = np.abs(np.asarray(got[1], np.float64) - np.asarray(want[1], np.float64))
    assert np.all(err <= 1e-6 + 2 * np.finfo(np.float32).eps * xt), (err, xt)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5)
