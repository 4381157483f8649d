"""How metrics combine: each metric declares a :class:`Reduction` (a sum, an extreme, a mean weighted by a
declared count), and :func:`combine_metrics` / :func:`combine_updates` apply the declarations. Nothing is
inferred from a metric's name. Pure and jit-able.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

__all__ = ["Reduction", "SUM", "MAX", "MIN", "combine_metrics", "combine_updates"]


class Reduction(NamedTuple):
    """How one metric combines over the microbatches of a minibatch (each metric declares one in
    :data:`METRIC_REDUCTIONS`; nothing is inferred from its name). Over processes nothing is left to
    combine: the step runs under ``jit`` on the global batch, so every sum / max / mean in
    :func:`policy_loss` already spans every process's rows. Over the optimizer updates of one step the
    train step averages each metric (:attr:`over_updates`).

    Attributes:
        kind: ``sum`` (counts), ``max`` / ``min`` (extremes), ``mean`` (a mean weighted by the count
            metric :attr:`weight`), ``ess`` (``is_weight_mean**2 / is_weight_sq_mean`` recomputed
            from the combined means) or ``update`` (one value per optimizer update, such as the loss
            or the gradient norm: never a microbatch metric).
        weight: the count metric a ``mean`` is weighted by.
        over_updates: ``mean`` or ``sum`` over the step's optimizer updates.
    """

    kind: str
    weight: Optional[str] = None
    over_updates: str = "mean"


SUM, MAX, MIN = Reduction("sum"), Reduction("max"), Reduction("min")


def combine_metrics(parts: Sequence[Mapping[str, Any]] | Mapping[str, Any],
                    reductions: Mapping[str, Reduction]) -> dict[str, jax.Array]:
    """Combine per-microbatch metrics into full-batch metrics (jit-able), each by its declared
    :class:`Reduction`.

    Args:
        parts: a list of metric dicts (e.g. from :func:`jax_rl.learner.losses.policy_loss`), or one dict whose
            values are stacked along a leading axis (e.g. the output of ``lax.scan``).
        reductions: every metric's declaration (:data:`jax_rl.learner.losses.METRIC_REDUCTIONS` for
            ``policy_loss``'s; a caller with metrics of its own adds theirs).

    Returns:
        dict with the same keys: counts summed, extremes max/min-ed, means weighted by their
        declared count, ``ess_frac`` recomputed. A mean whose total weight is 0 takes the first
        part's value.

    Raises:
        ValueError: a metric without a declared reduction (named), or a mean whose weight metric
            is missing.
    """
    if isinstance(parts, Mapping):
        stacked = {k: jnp.asarray(v, jnp.float32) for k, v in parts.items()}
    else:
        parts = list(parts)
        stacked = {k: jnp.stack([jnp.asarray(p[k], jnp.float32) for p in parts]) for k in parts[0]}
    undeclared = sorted(k for k in stacked if k not in reductions)
    if undeclared:
        raise ValueError(f"metrics {undeclared} have no declared reduction: add them to the reductions passed to "
                         "combine_metrics (jax_rl.learner.losses.METRIC_REDUCTIONS declares policy_loss's own)")
    out: dict[str, jax.Array] = {}
    for k, v in stacked.items():
        red = reductions[k]
        if red.kind == "sum":
            out[k] = jnp.sum(v)
        elif red.kind == "max":
            out[k] = jnp.max(v)
        elif red.kind == "min":
            out[k] = jnp.min(v)
        elif red.kind == "mean":
            if red.weight not in stacked:
                raise ValueError(f"metric {k!r} is a mean weighted by {red.weight!r}, which is not among the metrics")
            w = stacked[red.weight]
            W = jnp.sum(w)
            out[k] = jnp.where(W > 0, jnp.sum(w * v) / jnp.maximum(W, 1e-30), v[0])
        elif red.kind != "ess":
            raise ValueError(f"metric {k!r}: a {red.kind!r} metric is not combined over microbatches")
    for k, v in stacked.items():
        if reductions[k].kind == "ess":
            out[k] = out["is_weight_mean"] ** 2 / jnp.maximum(out["is_weight_sq_mean"], 1e-30)
    return out


def combine_updates(per_update: Mapping[str, jax.Array], reductions: Mapping[str, Reduction]) -> dict[str, jax.Array]:
    """Combine metrics stacked over a step's optimizer updates (leading axis), each by its declared
    :attr:`Reduction.over_updates` (``mean`` or ``sum``).

    Raises:
        ValueError: a metric without a declared reduction (named).
    """
    undeclared = sorted(k for k in per_update if k not in reductions)
    if undeclared:
        raise ValueError(f"metrics {undeclared} have no declared reduction over the step's updates")
    return {k: (jnp.sum(v) if reductions[k].over_updates == "sum" else jnp.mean(v)) for k, v in per_update.items()}
