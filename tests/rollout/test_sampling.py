"""The rollout sampler's inverse-CDF draw (``rollout.engine.inverse_cdf_index``): hand tables
(one level and across blocks), jit and eager, fp32 edge cases, and a property against numpy's
searchsorted."""

import chex
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
