"""Errors shared by packages that do not otherwise import each other, a leaf: :class:`BatchError` is raised by the
learner's batch code (:mod:`jax_rl.learner.batch`) and by :mod:`jax_rl.placement` and :mod:`jax_rl.routing_replay`,
which the learner imports (so they cannot import the learner package)."""

__all__ = ["BatchError"]


class BatchError(ValueError):
    """A malformed learner batch: missing field, wrong shape/dtype, too long, bad masks."""
