"""The publish stage (:class:`jax_rl.publish.Publisher`): what a publish hands the engines and how."""

from __future__ import annotations

import jax
import numpy as np

from jax_rl.learner.learner import Learner
from jax_rl.publish import Publisher
from jax_rl.sharding import make_mesh

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff


class _Gen:
    """A generator stand-in: records each ``update_params`` and reports a fixed cast time."""

    def __init__(self, cast_s):
        self.cast_s, self.got = cast_s, []

    def update_params(self, params, version):
        self.got.append((params, int(version)))
        return self.cast_s


class _Route:
    def __init__(self):
        self.calls = []

    def publish(self, version, params, generators, *, scorer, retirer):
        self.calls.append((version, params, list(generators), scorer, retirer))
        return 0.5


def test_publish_hands_a_copy_of_the_version_to_every_generator_or_to_the_route():
    cfg = make_cfg("ppo")
    lrn = Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))
    pub = Publisher(lrn.held.params, lrn.mesh, cfg.rollout.dtype)
    lrn.train_step(make_batch(1))
    gens = [_Gen(0.25), _Gen(0.5)]
    cast_s, moved = pub.publish(1, gens)
    assert cast_s == 0.75 and moved is None
    for g in gens:
        (params, v), = g.got
        assert v == 1 and max_abs_diff(host(params), host(lrn.params)) == 0.0
        # a copy: the next train step donates the learner's buffers, the engines keep theirs
        assert all(a is not b for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(lrn.params)))
    route, scorer = _Route(), object()
    assert pub.publish(2, gens, route=route, scorer=scorer) == (0.5, None)
    (v, params, got_gens, got_scorer, retirer), = route.calls
    assert v == 2 and got_gens == gens and got_scorer is scorer and retirer is None
    assert all(len(g.got) == 1 for g in gens)  # the route hands them over, not the publisher
    # the Ray learner actor's copy: numpy, the same values
    h = pub.params(host=True)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(h))
    assert max_abs_diff(h, host(lrn.params)) == 0.0
