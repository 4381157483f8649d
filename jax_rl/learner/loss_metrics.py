"""The policy loss's metrics: groups with fixed keys, declared once in :data:`METRIC_GROUPS`.

A function's metric keys never depend on what it was passed. :func:`jax_rl.learner.losses.policy_loss`
returns the ``policy`` group whatever optional inputs it gets; each optional input's metrics are a group of
their own, a pure jit-able function of [B, T] arrays returning a dict of detached fp32 scalars. The train
step (:mod:`jax_rl.learner.train_step`) calls the groups its static config enables, so a step row's keys are
a function of the config (and of the batch carrying ``old_logp``) only.

=============  ==================================================  ======================================
group          function                                            the train step calls it
=============  ==================================================  ======================================
policy         :func:`jax_rl.learner.losses.policy_loss`           always
staleness      :func:`staleness_metrics`                           always (every batch carries versions)
prox_error     :func:`prox_error_metrics`                          the batch carries ``old_logp``
                                                                   (``old_logits.measure_error``)
entropy        :func:`entropy_metrics`                             ``loss.entropy_coef != 0``
truncation     :func:`truncation_metrics`                          ``rollout.top_k`` / ``top_p`` truncate
=============  ==================================================  ======================================

Token metrics are means over the VALID tokens (``loss_mask``) unless a group says otherwise.

- ``policy``: ``valid_tokens``, ``denominator`` (Z), ``train_infer_retained`` / ``_out_of_band_frac`` /
  ``_catastrophic_frac``, ``masked_nonfinite_behav`` / ``_prox`` (counts; under truncation a ``-inf``
  pi_prox is counted by ``truncation``, not here), ``clip_frac`` / ``clip_active_frac`` / ``dual_clip_frac``
  / ``ratio_out_of_band_frac``, ``is_weight_mean`` / ``_sq_mean`` / ``_max``, ``ess_frac``,
  ``kl_train_infer_k1`` / ``_k3``, ``kl_drift_k1`` / ``_k3``, ``ratio_mean`` / ``_min`` / ``_max``
  (definitions: :mod:`jax_rl.learner.losses`).
- ``staleness``: g - v of the valid tokens with a version v >= 0: ``staleness_tokens`` / ``_mean`` /
  ``_max``, and per bucket ``staleness/<k>/tokens``, ``/retained`` (kept fraction; 1 when empty),
  ``/clip_frac`` (k = 0 .. ``STALENESS_MAX_BUCKET - 1`` and the open ``<STALENESS_MAX_BUCKET>+``).
- ``prox_error``: ``prox_abs_err_mean`` / ``_max``: \\|log pi_prox - log pi_v\\| of an approximate
  pi_prox against the exact ``old_logp`` (``correction.old_logits.measure_error``).
- ``entropy``: ``entropy_mean``, the per-token entropy's mean.
- ``truncation``: ``masked_trunc_outside`` (tokens) and ``trunc_outside_frac``: valid tokens outside the
  learner's truncated kept set (``-inf`` logp or prox_logp, :mod:`jax_rl.sampling`).

Each metric declares how it combines over microbatches (:class:`jax_rl.learner.reductions.Reduction`: sums for
counts, max/min for extremes, means weighted by ``valid_tokens`` or a bucket's ``tokens``; ``ess_frac``
recomputed); :data:`METRIC_REDUCTIONS` is the union of the groups' declarations.
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_rl.learner.reductions import MAX, MIN, SUM, Reduction

__all__ = ["METRIC_GROUPS", "METRIC_REDUCTIONS", "STALENESS_MAX_BUCKET", "staleness_metrics",
           "prox_error_metrics", "entropy_metrics", "truncation_metrics", "outside_kept_set"]

STALENESS_MAX_BUCKET = 8
"""Staleness buckets ``staleness/0`` .. ``staleness/7`` and ``staleness/8+`` (>= 8)."""


def _f32(x) -> jax.Array:
    return jnp.asarray(x, dtype=jnp.float32)


def _check_2d(name: str, x, shape: Optional[tuple] = None) -> None:
    shp = tuple(jnp.shape(x))
    if len(shp) != 2:
        raise ValueError(f"{name} must be [B, T], got shape {shp}")
    if shape is not None and shp != tuple(shape):
        raise ValueError(f"{name} has shape {shp}, expected {tuple(shape)} (the shape of loss_mask)")


def _vmean(x, valid, nv, empty: float = 0.0):
    """The mean of ``x`` over ``valid`` (``nv`` = its count; ``empty`` when there is none)."""
    s = jnp.sum(jnp.where(valid, _f32(x), 0.0))
    return jnp.where(nv > 0, s / jnp.maximum(nv, 1.0), jnp.float32(empty))


def _valid(loss_mask) -> tuple[jax.Array, jax.Array, tuple]:
    """``(valid bool [B, T], its count fp32, shape)`` of a checked ``loss_mask``."""
    _check_2d("loss_mask", loss_mask)
    valid = jnp.asarray(loss_mask, dtype=bool)
    return valid, jnp.sum(valid.astype(jnp.float32)), tuple(jnp.shape(loss_mask))


def fixed(group: str, metrics: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """``metrics`` as detached fp32 scalars, in :data:`METRIC_GROUPS` ``[group]``'s order.

    Raises:
        ValueError: its keys are not exactly the group's declared keys (checked when traced).
    """
    want = METRIC_GROUPS[group]
    if set(metrics) != set(want):
        raise ValueError(f"metric group {group!r} returned keys {sorted(set(metrics) ^ set(want))} against its "
                         "declaration in METRIC_GROUPS")
    return {k: lax.stop_gradient(jnp.asarray(metrics[k], jnp.float32)) for k in want}


def staleness_metrics(versions, current_version, loss_mask, kept, clipped) -> dict[str, jax.Array]:
    """The ``staleness`` group: staleness g - v of the valid tokens with a version, its mean and max, and per
    bucket (0 .. the open last one) the tokens, the kept fraction and the clip fraction.

    Args:
        versions: int [B, T], the behaviour version v of each token (-1 where not generated).
        current_version: int scalar g (may be traced), the version being trained.
        loss_mask: bool [B, T].
        kept: bool [B, T], the tokens the loss keeps (``PolicyTokens.kept`` of
            :func:`jax_rl.learner.losses.policy_loss`).
        clipped: bool [B, T], the tokens whose clip is active (``PolicyTokens.clipped``).

    Returns:
        dict of fp32 scalars with the keys of ``METRIC_GROUPS["staleness"]``.

    Raises:
        ValueError: an input not of loss_mask's [B, T] shape.
    """
    valid, _, shape = _valid(loss_mask)
    for name, x in (("versions", versions), ("kept", kept), ("clipped", clipped)):
        _check_2d(name, x, shape)
    ver = jnp.asarray(versions, jnp.int32)
    g = jnp.asarray(current_version, jnp.int32)
    has_v = valid & (ver >= 0)
    st = jnp.where(has_v, g - ver, 0)
    stc = jnp.clip(st, 0, STALENESS_MAX_BUCKET)
    n_v = jnp.sum(has_v.astype(jnp.float32))
    m: dict[str, jax.Array] = {}
    m["staleness_tokens"] = n_v
    m["staleness_mean"] = _vmean(st, has_v, n_v)
    m["staleness_max"] = jnp.max(jnp.where(has_v, st, 0)).astype(jnp.float32)
    for k in range(STALENESS_MAX_BUCKET + 1):
        name = _bucket(k)
        in_k = has_v & (stc == k)
        n_k = jnp.sum(in_k.astype(jnp.float32))
        m[f"{name}/tokens"] = n_k
        m[f"{name}/retained"] = _vmean(kept, in_k, n_k, empty=1.0)
        m[f"{name}/clip_frac"] = _vmean(clipped, in_k, n_k)
    return fixed("staleness", m)


def prox_error_metrics(prox_logp, old_logp, loss_mask, usable) -> dict[str, jax.Array]:
    """The ``prox_error`` group: \\|log pi_prox - log pi_v\\| at the usable tokens where the exact ``old_logp``
    is finite (0 elsewhere); its mean over the valid tokens and its max (``old_logits.measure_error``).

    Args:
        prox_logp: float [B, T], log pi_prox (the approximate one the loss used).
        old_logp: float [B, T], the exact log pi_v (any float dtype; non-finite values are skipped).
        loss_mask: bool [B, T].
        usable: bool [B, T], the valid tokens with finite behav and prox log-probs (``PolicyTokens.usable``).

    Returns:
        dict of fp32 scalars with the keys of ``METRIC_GROUPS["prox_error"]`` (nats).
    """
    valid, nv, shape = _valid(loss_mask)
    for name, x in (("prox_logp", prox_logp), ("old_logp", old_logp), ("usable", usable)):
        _check_2d(name, x, shape)
    ex = lax.stop_gradient(_f32(old_logp))
    prox = jnp.where(usable, lax.stop_gradient(_f32(prox_logp)), 0.0)
    ok = usable & jnp.isfinite(ex)
    err = jnp.where(ok, jnp.abs(prox - jnp.where(ok, ex, 0.0)), 0.0)
    return fixed("prox_error", {"prox_abs_err_mean": _vmean(err, valid, nv), "prox_abs_err_max": jnp.max(err)})


def entropy_metrics(entropy, loss_mask) -> dict[str, jax.Array]:
    """The ``entropy`` group: ``entropy_mean``, the mean per-token entropy (nats) over the valid tokens.

    Args:
        entropy: float [B, T], the entropy of pi_theta's next-token distribution (detached here; values
            outside loss_mask never reach arithmetic).
        loss_mask: bool [B, T].
    """
    valid, nv, shape = _valid(loss_mask)
    _check_2d("entropy", entropy, shape)
    return fixed("entropy", {"entropy_mean": _vmean(jnp.where(valid, lax.stop_gradient(_f32(entropy)), 0.0), valid, nv)})


def outside_kept_set(logp, prox_logp, valid) -> tuple[jax.Array, jax.Array]:
    """``(out_prox, out_theta)`` bool [B, T]: the valid tokens whose ``prox_logp`` / ``logp`` (float [B, T]) is
    ``-inf``, i.e. outside pi_prox's / pi_theta's truncated kept set (only -inf; a NaN is not "outside")."""
    out_prox = valid & (lax.stop_gradient(_f32(prox_logp)) == -jnp.inf)
    out_theta = valid & (lax.stop_gradient(_f32(logp)) == -jnp.inf)
    return out_prox, out_theta


def truncation_metrics(logp, prox_logp, loss_mask) -> dict[str, jax.Array]:
    """The ``truncation`` group (``rollout.top_k`` / ``top_p`` sampling): the valid tokens outside pi_prox's
    or pi_theta's kept set (:func:`outside_kept_set`), as a count (``masked_trunc_outside``) and a fraction
    of the valid tokens (``trunc_outside_frac``). :func:`jax_rl.learner.losses.policy_loss` with
    ``truncated=True`` masks exactly these tokens.

    Args:
        logp, prox_logp: float [B, T], log pi_theta / log pi_prox (truncated distributions).
        loss_mask: bool [B, T].
    """
    valid, nv, shape = _valid(loss_mask)
    _check_2d("logp", logp, shape)
    _check_2d("prox_logp", prox_logp, shape)
    out_prox, out_theta = outside_kept_set(logp, prox_logp, valid)
    out = out_prox | out_theta
    return fixed("truncation", {"masked_trunc_outside": jnp.sum(out.astype(jnp.float32)),
                                "trunc_outside_frac": _vmean(out, valid, nv)})


# --------------------------------------------------------------------------------------
# The one declaration of every group's keys and reductions
# --------------------------------------------------------------------------------------


TOKEN_MEAN = Reduction("mean", "valid_tokens")


def _bucket(k: int) -> str:
    return f"staleness/{k}+" if k == STALENESS_MAX_BUCKET else f"staleness/{k}"


def _staleness_buckets() -> dict[str, Reduction]:
    out = {}
    for k in range(STALENESS_MAX_BUCKET + 1):
        name = _bucket(k)
        out.update({f"{name}/tokens": SUM, f"{name}/retained": Reduction("mean", f"{name}/tokens"),
                    f"{name}/clip_frac": Reduction("mean", f"{name}/tokens")})
    return out


POLICY = {
    "valid_tokens": SUM,
    "denominator": MAX,
    "train_infer_retained": TOKEN_MEAN,
    "train_infer_out_of_band_frac": TOKEN_MEAN,
    "train_infer_catastrophic_frac": TOKEN_MEAN,
    "masked_nonfinite_behav": SUM,
    "masked_nonfinite_prox": SUM,
    "clip_frac": TOKEN_MEAN,
    "clip_active_frac": TOKEN_MEAN,
    "ratio_out_of_band_frac": TOKEN_MEAN,
    "dual_clip_frac": TOKEN_MEAN,
    "is_weight_mean": TOKEN_MEAN,
    "is_weight_sq_mean": TOKEN_MEAN,
    "is_weight_max": MAX,
    "ess_frac": Reduction("ess"),
    "kl_train_infer_k1": TOKEN_MEAN,
    "kl_train_infer_k3": TOKEN_MEAN,
    "kl_drift_k1": TOKEN_MEAN,
    "kl_drift_k3": TOKEN_MEAN,
    "ratio_mean": TOKEN_MEAN,
    "ratio_min": MIN,
    "ratio_max": MAX,
}

METRIC_GROUPS: dict[str, dict[str, Reduction]] = {
    "policy": POLICY,
    "staleness": {"staleness_tokens": SUM, "staleness_mean": Reduction("mean", "staleness_tokens"),
                  "staleness_max": MAX, **_staleness_buckets()},
    "prox_error": {"prox_abs_err_mean": TOKEN_MEAN, "prox_abs_err_max": MAX},
    "entropy": {"entropy_mean": TOKEN_MEAN},
    "truncation": {"masked_trunc_outside": SUM, "trunc_outside_frac": TOKEN_MEAN},
}
"""Every metric group's keys, in order, each with its declared :class:`~jax_rl.learner.reductions.Reduction`
(the only place a key is declared; :func:`fixed` holds each group function to it). A mean's weight is
``valid_tokens`` (the ``policy`` group, always present beside the others) or a count of its own group."""


def _union(groups: Mapping[str, Mapping[str, Reduction]]) -> dict[str, Reduction]:
    out: dict[str, Reduction] = {}
    for name, group in groups.items():
        twice = sorted(set(out) & set(group))
        if twice:
            raise ValueError(f"metric group {name!r} declares {twice} again")
        out.update(group)
    return out


METRIC_REDUCTIONS: dict[str, Reduction] = _union(METRIC_GROUPS)
"""The declared reduction of every metric of every group. A caller adding metrics of its own passes theirs beside
these to :func:`jax_rl.learner.reductions.combine_metrics` (the train step: ``train_step.STEP_REDUCTIONS``)."""
