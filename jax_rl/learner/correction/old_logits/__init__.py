"""Exact old logits: log pi_v at each token's own behaviour version v (``loss.correction=exact``).

The map (docs/design.md §4 Layout):

- :mod:`jax_rl.learner.correction.old_logits.routes`: the ``old_logits.route`` registry. A :class:`Route` declares
  its cost, its learner-side inputs, its producer hooks and what it refuses;
  :class:`jax_rl.learner.correction.Exact` asks its route, and nothing else branches on a route's name.
- :mod:`jax_rl.learner.correction.old_logits.store`: the snapshot route's store (:class:`SnapshotStore`, the last
  K+1 versions' params in host memory or on disk) and its per-version forwards
  (:func:`snapshot_logprobs`, :func:`logprobs_by_version`).
- :mod:`jax_rl.learner.correction.old_logits.scorer`: the rollout-side scorer (:class:`OldLogitScorer`) and the
  bounded queue and thread that feed it finished groups (:class:`ScoringQueue`): the dedicated route.
- :mod:`jax_rl.learner.correction.old_logits.retire`: interrupt and retire (:class:`RetiringScorer`): version v's
  tokens, finished and partial, scored when the fleet leaves v.
- :mod:`jax_rl.learner.correction.old_logits.stage`: the learner's old-logit stage (``Learner.old_logits``,
  :class:`~jax_rl.learner.correction.old_logits.stage.OldLogitStage`): its no-grad forward, its store, the run's scorer.

Which devices a scorer runs on is a placement question (``placement.scorer``,
:func:`jax_rl.placement.resolve_roles`); the learner builds the scorer of its run
(:meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.make_scorer`) with its public forward
(:meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.logprob_fn`).
"""

from jax_rl.learner.correction.old_logits.retire import RetiringScorer, trajectory_key
from jax_rl.learner.correction.old_logits.routes import ROUTES, Route, make_route, register_route
from jax_rl.learner.correction.old_logits.scorer import OldLogitScorer, ScoringQueue
from jax_rl.learner.correction.old_logits.store import (SnapshotStore, StaleVersionError, logprobs_by_version, snapshot_logprobs,
                                     versions_needed)

__all__ = ["SnapshotStore", "StaleVersionError", "snapshot_logprobs", "versions_needed", "logprobs_by_version",
           "OldLogitScorer", "ScoringQueue", "RetiringScorer", "trajectory_key", "Route", "ROUTES", "make_route",
           "register_route"]
