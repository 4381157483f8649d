"""Policy losses with off-policy correction: train-infer factor + PPO clip on pi_prox.

Pure, jit-able functions (no I/O, no host round-trips). Formula sources:
paper 2605.12070 via docs/design.md §2.1 The loss per token (the skeleton below), AReaL
``ppo_actor_loss_fn`` / ``apply_rejection_sampling`` (the two-factor loss, keep-in-denominator),
ROLL ``agg_loss`` / ``InferCorrectionHandler`` (aggregations, MIS/TIS levels, catastrophic
rejection).

Per valid token t of row b (``loss_mask`` True)::

    rho_t = exp(clamp(logp_t - sg(prox_logp_t), +-M))          staleness factor, PPO clip
    s_t   = level statistic of log(pi_prox/mu) (see below)     train-infer factor, detached
    m_t   = mask (MIS): low <= exp(s_t) <= high   [mode=mask]    else 1
    w_t   = TIS weight: clamp(exp(s_t), low, high) [mode=truncate] else 1
    l_t   = -A_t * rho_t, or -A_t * bound when the clipped branch is chosen (below),
            then min(l_t, -c * A_t) for A_t < 0 when dual_clip_c = c is set
    loss  = sum_bt [kept_bt] * c_bt * w_bt * l_bt / Z

The two factors are never folded into one ratio: rho only sees pi_theta/pi_prox, m and w
only see pi_prox/mu, and m/w do not depend on the sign of A (symmetric band in log space,
``low`` defaults to ``1/high``).

Levels of s_t (all computed in log space, fp32, over the row's *usable* tokens):
    token      s_t = log(pi_prox/mu)_t
    sequence   s_t = sum_t' log(pi_prox/mu)_t'   (product of ratios; the mask decision is
               taken on the raw sum, exp() arguments are clamped to +-max_log_ratio, so a
               long sequence saturates at exp(M) and is masked, never inf/NaN)
    geometric  s_t = mean_t' log(pi_prox/mu)_t'  (length-normalised; AReaL sequence level)
    turn       s_t = mean over the tokens of the same assistant turn (``turn_ids``); the
               geometric mean per turn, so turns of different length are comparable
               (ROLL "segment"-style). Valid tokens with turn_id < 0 form their own turn.
               turn_ids must be < T.

``catastrophic_logratio`` (any mode, also ``none``): drop the whole row when any usable
token has log(pi_prox/mu) < catastrophic_logratio (ROLL ``infer_catastrophic_threshold``).

Non-finite inputs: a valid token whose ``behav_logp`` or ``prox_logp`` is NaN/+-inf is
masked (never reaches arithmetic) and counted in ``masked_nonfinite_behav`` /
``masked_nonfinite_prox``; it is treated like a train-infer-rejected token (it stays in the
denominator iff ``keep_masked_in_denominator``). Every input is passed through
``jnp.where(mask, x, 0)`` *before* any arithmetic, so NaN/inf outside ``loss_mask`` change
neither the loss nor the gradient by one bit (the cotangent of a where-ed-out entry is an
exact 0, and no downstream value is ever non-finite).

Gradient convention at the clip boundary (pinned, tested): the band is CLOSED. The clipped
branch is chosen only strictly outside it: for A > 0 when rho > 1 + eps_high, for A < 0 when
rho < 1 - eps_low; the dual clip only when rho > c (A < 0). Exactly at a boundary the
unclipped branch is used, so d l_t / d logp_t = -A_t * rho_t (e.g. -(1+eps_high) for A = +1
at rho = 1+eps_high, +(1-eps_low) for A = -1 at rho = 1-eps_low), and ``clip_frac`` does not
count the token.

Clip metrics (fractions of valid tokens): ``clip_frac`` = the clip is ACTIVE, i.e. a clipped
term was chosen and the token's gradient is zero (PPO clip for A > 0 above 1+eps_high or A < 0
below 1-eps_low, or the dual clip); verl's ``pg_clipfrac`` / TRL's ``clip_ratio`` (plus the
dual clip). ``clip_active_frac``: the PPO clip alone; ``dual_clip_frac``: the dual clip alone.
``ratio_out_of_band_frac``: rho outside [1-eps_low, 1+eps_high] whatever the sign of A (a drift
measure; a token can be out of band and still get a gradient). Per staleness bucket,
``staleness/<k>/clip_frac`` uses the same active definition. (``jnp.maximum``/``jnp.clip`` would split the gradient 50/50 at ties;
we use explicit ``jnp.where`` instead.) Tokens with |log rho| > max_log_ratio get zero
gradient (the exp argument is clamped).

Aggregation (``cfg.agg``; ROLL ``agg_loss`` names). Let D_bt = loss_mask if
``keep_masked_in_denominator`` (AReaL) else kept (ROLL/verl), n_b = sum_t D_bt and
N_seq = #{b : n_b > 0} (an all-padding row is never a sequence):

    token_mean               c_bt = 1            Z = sum_b n_b
    seq_mean_token_mean      c_bt = 1 / n_b      Z = N_seq
    seq_mean_token_sum       c_bt = 1            Z = N_seq
    seq_mean_token_sum_norm  c_bt = 1 / L        Z = N_seq   (Dr. GRPO; L = cfg.seq_sum_norm_len,
                                                             default T = loss_mask.shape[-1] as in
                                                             ROLL/verl; ROLL divides sum_b by T only,
                                                             we also average over sequences)

Microbatches and data shards: c_bt depends only on row b, so as long as the batch is split
along rows (never along T), passing the full batch's Z (:func:`loss_denominator`) as
``denominator`` to every piece makes ``sum(piece losses) == full-batch loss`` and likewise
for gradients. For seq_mean_token_sum_norm with the default L = T every piece must keep the
full padded T (or set ``seq_sum_norm_len``).

Truncated sampling (``truncated=True``: the rollout sampled under ``rollout.top_k`` /
``rollout.top_p`` and the learner's log-probs are log pi_trunc, ``jax_rl.sampling``): a valid
token with ``prox_logp == -inf`` or ``logp == -inf`` lies outside the learner's kept set
(pi_prox's or pi_theta's). It is masked out of the policy term (and the entropy term) like a
train-infer-rejected token, counted by the ``truncation`` metric group (``masked_trunc_outside``,
``trunc_outside_frac``; :func:`truncation_metrics`), not in ``masked_nonfinite_prox``. Outside
pi_prox's kept set it is not usable (it leaves the train-infer level statistic and
``train_infer_retained``); outside only pi_theta's (theta moved during the step) it stays in
the train-infer statistic and the denominator, which pi_prox and mu fix before any update. Its
gradient is an exact 0 (the -inf never reaches arithmetic), and a token outside pi_theta's set
reads log rho = 0 in the metrics. Only -inf means "outside": a NaN prox is still counted in
``masked_nonfinite_prox``, a NaN logp still poisons the loss so the update is skipped.

Metrics (:mod:`jax_rl.learner.loss_metrics`): :func:`policy_loss` returns the ``policy`` group, a dict
of fp32 scalars whose keys are the same whatever optional arguments it gets; the metrics of an
optional input are a group function of their own (:func:`staleness_metrics`, :func:`prox_error_metrics`,
:func:`entropy_metrics`, :func:`truncation_metrics`), fed by the per-token masks policy_loss returns
(:class:`PolicyTokens`). Every group's keys and reductions are declared once,
:data:`METRIC_GROUPS` (:data:`METRIC_REDUCTIONS` their union). Token metrics are means over VALID
tokens (loss_mask); at a valid token with non-finite behav/prox every log-ratio is taken as 0
(ratio 1, KL 0, not clipped). :func:`jax_rl.learner.reductions.combine_metrics` combines them over
microbatches by their declarations: a name alone (``foo_max``) decides nothing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_rl.learner.loss_metrics import (
    METRIC_GROUPS,
    METRIC_REDUCTIONS,
    STALENESS_MAX_BUCKET,
    _check_2d,
    _f32,
    _vmean,
    entropy_metrics,
    fixed,
    outside_kept_set,
    prox_error_metrics,
    staleness_metrics,
    truncation_metrics,
)

if TYPE_CHECKING:  # annotations only
    from jax_rl.config import LossConfig

__all__ = [
    "policy_loss",
    "BatchTerms",
    "PolicyTokens",
    "loss_denominator",
    "train_infer_factor",
    "TrainInfer",
    "METRIC_GROUPS",
    "METRIC_REDUCTIONS",
    "STALENESS_MAX_BUCKET",
    "staleness_metrics",
    "prox_error_metrics",
    "entropy_metrics",
    "truncation_metrics",
]

_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def _log_bound(x: float) -> float:
    return -math.inf if x <= 0 else math.log(x)


class TrainInfer(NamedTuple):
    """Result of :func:`train_infer_factor` (all [B, T] unless noted; all detached)."""

    valid: jax.Array  # bool, loss_mask
    usable: jax.Array  # bool, valid & finite behav & finite prox
    kept: jax.Array  # bool, usable & not catastrophic-dropped & (in band if mode=mask)
    weight: jax.Array  # f32, TIS weight (1 unless mode=truncate)
    level_logratio: jax.Array  # f32, s_t (0 where not usable)
    token_logratio: jax.Array  # f32, log(pi_prox/mu)_t (0 where not usable)
    in_band: jax.Array  # bool, low <= exp(s_t) <= high (computed in log space)
    catastrophic_row: jax.Array  # bool [B]
    prox: jax.Array  # f32, sanitised sg(prox_logp) (0 where not usable)
    nonfinite_behav: jax.Array  # bool, valid & non-finite behav
    nonfinite_prox: jax.Array  # bool, valid & non-finite prox


def _sequence_level(lr, use_f, usable, turn_ids):  # the row's summed log-ratio, on each of its tokens
    return jnp.broadcast_to(jnp.sum(lr, axis=-1, keepdims=True), lr.shape)


def _geometric_level(lr, use_f, usable, turn_ids):  # the row's mean log-ratio over its usable tokens
    tot = jnp.sum(lr, axis=-1, keepdims=True)
    return jnp.broadcast_to(tot / jnp.maximum(jnp.sum(use_f, axis=-1, keepdims=True), 1.0), lr.shape)


def _turn_level(lr, use_f, usable, turn_ids):
    """The mean log-ratio of each token's assistant turn (``turn_ids``; a token without a turn is its own
    segment), on every token of the turn."""
    shape = tuple(jnp.shape(lr))
    if turn_ids is None:
        raise ValueError("loss.train_infer_level='turn' needs turn_ids [B, T]")
    _check_2d("turn_ids", turn_ids, shape)
    B, T = shape
    tid = jnp.asarray(turn_ids, dtype=jnp.int32)
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]
    cols = jnp.arange(T, dtype=jnp.int32)[None, :]
    seg = jnp.where(tid >= 0, rows * T + jnp.clip(tid, 0, T - 1), B * T + rows * T + cols)
    nseg = 2 * B * T + 1
    seg = jnp.where(usable, seg, nseg - 1).reshape(-1)  # non-usable -> dummy segment
    sums = jax.ops.segment_sum(lr.reshape(-1), seg, num_segments=nseg)
    cnts = jax.ops.segment_sum(use_f.reshape(-1), seg, num_segments=nseg)
    return (sums / jnp.maximum(cnts, 1.0))[seg].reshape(shape)


LEVELS = {"token": lambda lr, use_f, usable, turn_ids: lr, "sequence": _sequence_level, "geometric": _geometric_level, "turn": _turn_level}
"""``loss.train_infer_level`` -> ``(log-ratio [B, T], usable as float, usable, turn_ids) -> the level's statistic
[B, T]`` (fp32; the caller zeroes the unusable tokens)."""


def _catastrophic_rows(lr, usable, threshold) -> jax.Array:
    """bool [B]: rows with a usable token whose log-ratio is below ``loss.catastrophic_logratio`` (None: none)."""
    if threshold is None:
        return jnp.zeros((lr.shape[0],), dtype=bool)
    return jnp.any(usable & (lr < float(threshold)), axis=-1)


def train_infer_factor(
    prox_logp, behav_logp, loss_mask, cfg: LossConfig, *, turn_ids=None
) -> TrainInfer:
    """The train-infer factor pi_prox/mu: level statistic, MIS mask, TIS weight, catastrophic drop.

    Args:
        prox_logp, behav_logp: float [B, T] (any float dtype; computed in fp32, detached).
        loss_mask: bool [B, T].
        cfg: :class:`LossConfig` (uses train_infer_mode/level/low/high, catastrophic_logratio,
            max_log_ratio).
        turn_ids: int [B, T], required when ``train_infer_level == "turn"``.

    Returns:
        :class:`TrainInfer`.

    Raises:
        ValueError: shape mismatch, or level ``turn`` without ``turn_ids``.
    """
    _check_2d("loss_mask", loss_mask)
    shape = tuple(jnp.shape(loss_mask))
    _check_2d("prox_logp", prox_logp, shape)
    _check_2d("behav_logp", behav_logp, shape)
    valid = jnp.asarray(loss_mask, dtype=bool)
    prox = lax.stop_gradient(_f32(prox_logp))
    behav = lax.stop_gradient(_f32(behav_logp))
    fin_b = jnp.isfinite(behav)
    fin_p = jnp.isfinite(prox)
    usable = valid & fin_b & fin_p
    prox0 = jnp.where(usable, prox, 0.0)
    behav0 = jnp.where(usable, behav, 0.0)
    lr = prox0 - behav0  # 0 where not usable
    use_f = usable.astype(jnp.float32)

    level = LEVELS.get(cfg.train_infer_level)
    if level is None:  # pragma: no cover - pydantic validates
        raise ValueError(f"loss.train_infer_level={cfg.train_infer_level!r} must be one of {', '.join(LEVELS)}")
    s = level(lr, use_f, usable, turn_ids)
    s = jnp.where(usable, s, 0.0)

    low, high = cfg.train_infer_bounds
    log_lo, log_hi = _log_bound(low), _log_bound(high)
    in_band = (s >= log_lo) & (s <= log_hi)

    cat_row = _catastrophic_rows(lr, usable, cfg.catastrophic_logratio)

    kept = usable & ~cat_row[:, None]
    if cfg.train_infer_mode == "mask":
        kept = kept & in_band
    M = float(cfg.max_log_ratio)
    if cfg.train_infer_mode == "truncate":
        weight = jnp.exp(jnp.clip(s, max(log_lo, -M), min(log_hi, M)))
    else:
        weight = jnp.ones(shape, jnp.float32)
    return TrainInfer(
        valid=valid,
        usable=usable,
        kept=kept,
        weight=lax.stop_gradient(weight),
        level_logratio=s,
        token_logratio=lr,
        in_band=in_band,
        catastrophic_row=cat_row,
        prox=prox0,
        nonfinite_behav=valid & ~fin_b,
        nonfinite_prox=valid & ~fin_p,
    )


def _agg_parts(denom_mask: jax.Array, cfg: LossConfig):
    """(c [B,1] or scalar, Z scalar) of the aggregation; see the module docstring."""
    T = denom_mask.shape[-1]
    n_b = jnp.sum(denom_mask.astype(jnp.float32), axis=-1, keepdims=True)
    has = n_b > 0
    n_seq = jnp.sum(has.astype(jnp.float32))
    agg = cfg.agg
    if agg == "token_mean":
        return jnp.float32(1.0), jnp.sum(n_b)
    if agg == "seq_mean_token_mean":
        return jnp.where(has, 1.0 / jnp.maximum(n_b, 1.0), 0.0), n_seq
    if agg == "seq_mean_token_sum":
        return jnp.float32(1.0), n_seq
    if agg == "seq_mean_token_sum_norm":
        L = cfg.seq_sum_norm_len if cfg.seq_sum_norm_len is not None else T
        return jnp.float32(1.0 / float(L)), n_seq
    raise ValueError(f"loss.agg={agg!r} must be one of {_AGGS}")  # pragma: no cover


def loss_denominator(loss_mask, cfg: LossConfig, *, prox_logp=None, behav_logp=None, turn_ids=None,
                     train_infer: Optional[TrainInfer] = None) -> jax.Array:
    """The normaliser Z of the FULL batch, to pass as ``policy_loss(..., denominator=Z)``.

    token_mean: the number of denominator tokens (valid tokens if
    ``keep_masked_in_denominator`` else kept tokens); seq-mean modes: the number of rows with
    at least one denominator token. With Z of the full batch, summing ``policy_loss`` over
    row-microbatches / data shards reproduces the full-batch loss and gradient exactly.

    Args:
        loss_mask: bool [B, T] of the full batch.
        cfg: :class:`LossConfig`.
        prox_logp, behav_logp: float [B, T]; required when ``keep_masked_in_denominator`` is
            False (the kept set depends on them).
        turn_ids: int [B, T], needed for level ``turn`` with keep_masked_in_denominator False.
        train_infer: the :func:`train_infer_factor` of these inputs, already computed (its ``kept``
            [B, T] is used instead of recomputing it; prox/behav are then not needed).

    Returns:
        fp32 scalar (may be 0 for an empty batch; policy_loss then returns 0).

    Raises:
        ValueError: missing prox/behav when they are needed; bad shapes.
    """
    _check_2d("loss_mask", loss_mask)
    if cfg.keep_masked_in_denominator:
        denom_mask = jnp.asarray(loss_mask, bool)
    elif train_infer is not None:
        _check_2d("train_infer.kept", train_infer.kept, tuple(jnp.shape(loss_mask)))
        denom_mask = train_infer.kept
    else:
        if prox_logp is None or behav_logp is None:
            raise ValueError(
                "loss_denominator needs prox_logp and behav_logp when loss.keep_masked_in_denominator=False"
            )
        denom_mask = train_infer_factor(prox_logp, behav_logp, loss_mask, cfg, turn_ids=turn_ids).kept
    return _agg_parts(denom_mask, cfg)[1]


class PolicyTokens(NamedTuple):
    """The per-token masks :func:`policy_loss` returns beside its metrics, for the metric groups that read
    them (:func:`staleness_metrics`, :func:`prox_error_metrics`). All bool [B, T], detached."""

    usable: jax.Array  # valid, finite behav_logp and prox_logp
    kept: jax.Array  # usable, not catastrophic-dropped, in band under train_infer_mode=mask
    clipped: jax.Array  # the clip is active: a clipped term chosen, zero gradient (clip_frac's tokens)


class BatchTerms(NamedTuple):
    """What the train step computes once over the whole batch and hands each microbatch's
    :func:`policy_loss` (default: neither; the microbatch's own).

    Attributes:
        denominator: scalar Z replacing the batch's own normaliser (:func:`loss_denominator`).
        train_infer: :func:`train_infer_factor` of exactly the loss's ``prox_logp``, ``behav_logp``,
            ``loss_mask`` (and ``turn_ids``), already computed: the train step computes it once per
            step over the whole batch (none of its inputs moves during the updates) and hands each
            microbatch its rows; None computes it in the loss. Same result either way (it is per row).
    """

    denominator: Optional[jax.Array] = None
    train_infer: Optional[TrainInfer] = None


def policy_loss(
    logp,
    prox_logp,
    behav_logp,
    advantages,
    loss_mask,
    cfg: LossConfig,
    *,
    turn_ids=None,
    entropy=None,
    truncated: bool = False,
    batch: BatchTerms = BatchTerms(),
) -> tuple[jax.Array, dict[str, jax.Array], PolicyTokens]:
    """Decoupled PPO loss with a separate train-infer factor (see the module docstring).

    Args:
        logp: float [B, T], log pi_theta of the taken tokens, WITH gradient.
        prox_logp: float [B, T], log pi_prox (stop-gradient applied inside).
        behav_logp: float [B, T], log mu (rollout log-probs), detached.
        advantages: float [B, T] (broadcast per trajectory, see ``advantages.py``).
        loss_mask: bool [B, T], True on tokens the policy generated.
        cfg: :class:`jax_rl.config.LossConfig` (static: Python values, closed over under jit).
        turn_ids: int [B, T] assistant turn index (-1 elsewhere); needed for level ``turn``.
        entropy: float [B, T] per-token entropy; adds ``-cfg.entropy_coef * agg(entropy)``
            (same kept tokens, weights c_bt and Z as the policy term). Its metric is
            :func:`entropy_metrics`'.
        truncated: static; the log-probs are under top-k/top-p truncated sampling: ``-inf``
            logp / prox at a valid token means outside the learner's kept set (masked; counted by
            :func:`truncation_metrics`; see the module docstring).
        batch: the whole batch's normaliser Z and train-infer factor, when the train step computed
            them (:class:`BatchTerms`; default: this call's own).

    Returns:
        ``(loss, metrics, tokens)``: the loss (fp32 scalar); the ``policy`` metric group (dict of
        detached fp32 scalars, the keys of ``METRIC_GROUPS["policy"]`` whatever optional arguments are
        given); :class:`PolicyTokens`, the per-token masks the other groups read.

    Raises:
        ValueError: shapes differ from loss_mask's [B, T]; level ``turn`` without turn_ids.
    """
    _check_2d("loss_mask", loss_mask)
    shape = tuple(jnp.shape(loss_mask))
    for name, x in (("logp", logp), ("advantages", advantages)):
        _check_2d(name, x, shape)
    denominator, train_infer = batch
    if train_infer is None:
        ti = train_infer_factor(prox_logp, behav_logp, loss_mask, cfg, turn_ids=turn_ids)
    else:
        ti = train_infer
        _check_2d("train_infer.kept", ti.kept, shape)
    pg_ok, trunc_out = _truncation(ti, prox_logp, logp, truncated)
    clip = _ppo_clip(logp, advantages, ti, pg_ok, truncated, cfg)
    loss, Z, kept_pg = _aggregate(clip.pg, ti, pg_ok, truncated, cfg, denominator, entropy, shape)
    m = fixed("policy", _ratio_metrics(ti, clip, Z, trunc_out, cfg))
    sg = lax.stop_gradient
    return loss, m, PolicyTokens(usable=sg(ti.usable), kept=sg(ti.kept), clipped=sg(clip.clipped))


def _truncation(ti: TrainInfer, prox_logp, logp, truncated: bool):
    """``(pg_ok, trunc_out)``: the tokens whose policy term can be computed (usable, and inside pi_theta's kept
    set under truncation) and, under truncation, the valid tokens outside pi_prox's or pi_theta's kept set
    (``-inf`` log-prob, :func:`outside_kept_set`; else None)."""
    if not truncated:
        return ti.usable, None
    out_prox, out_theta = outside_kept_set(logp, prox_logp, ti.valid)
    return ti.usable & ~out_theta, out_prox | out_theta


class _Clip(NamedTuple):  # the PPO clip's per-token pieces (_ppo_clip)
    pg: jax.Array  # the per-token policy term, with gradient through logp
    ratio: jax.Array
    log_ratio: jax.Array
    clip_active: jax.Array
    dual_active: jax.Array
    clipped: jax.Array  # the clipped term is chosen: zero gradient (verl pg_clipfrac)
    lo: float
    hi: float


def _ppo_clip(logp, advantages, ti: TrainInfer, pg_ok, truncated: bool, cfg: LossConfig) -> _Clip:
    """The PPO clip on rho = pi_theta / pi_prox (gradient only through logp), asymmetric in the advantage's
    sign, with the dual clip when ``loss.dual_clip_c`` is set."""
    M = float(cfg.max_log_ratio)
    logp_s = jnp.where(pg_ok, _f32(logp), 0.0)  # double-where: NaN/inf never reach arithmetic
    log_ratio = logp_s - ti.prox  # 0 where not usable
    if truncated:
        log_ratio = jnp.where(pg_ok, log_ratio, 0.0)  # and 0 outside pi_theta's kept set
    ratio = jnp.exp(jnp.clip(log_ratio, -M, M))
    adv = jnp.where(ti.valid, _f32(advantages), 0.0)
    lo = 1.0 - float(cfg.clip_eps_low)
    hi = 1.0 + float(cfg.clip_eps_high)
    pos, neg = adv > 0, adv < 0
    above, below = ratio > hi, ratio < lo
    clip_active = (pos & above) | (neg & below)
    bound = jnp.where(above, hi, lo).astype(jnp.float32)
    pg = jnp.where(clip_active, -adv * bound, -adv * ratio)
    if cfg.dual_clip_c is not None:
        cap = -float(cfg.dual_clip_c) * adv  # > 0 where A < 0
        dual_active = neg & (pg > cap)
        pg = jnp.where(dual_active, cap, pg)
    else:
        dual_active = jnp.zeros(jnp.shape(adv), bool)
    return _Clip(pg, ratio, log_ratio, clip_active, dual_active, clip_active | dual_active, lo, hi)


def _aggregate(pg, ti: TrainInfer, pg_ok, truncated: bool, cfg: LossConfig, denominator, entropy, shape):
    """``(loss, Z, kept_pg)``: the kept tokens' weighted policy terms over the denominator Z (the batch's own, or
    ``denominator``), minus the entropy bonus when ``entropy`` is given."""
    denom_mask = ti.valid if cfg.keep_masked_in_denominator else ti.kept
    c, Z_local = _agg_parts(denom_mask, cfg)
    Z = Z_local if denominator is None else _f32(denominator)
    Z_safe = jnp.where(Z > 0, Z, 1.0)
    kept_pg = ti.kept & pg_ok if truncated else ti.kept
    tok_loss = jnp.where(kept_pg, ti.weight * pg * c, 0.0)
    loss = jnp.sum(tok_loss) / Z_safe
    if entropy is not None:
        _check_2d("entropy", entropy, shape)
        ent = jnp.where(kept_pg, jnp.where(kept_pg, _f32(entropy), 0.0) * c, 0.0)
        loss = loss - float(cfg.entropy_coef) * (jnp.sum(ent) / Z_safe)
    return loss, Z, kept_pg


def _ratio_metrics(ti: TrainInfer, clip: _Clip, Z, trunc_out, cfg: LossConfig) -> dict[str, jax.Array]:
    """The ``policy`` metric group: the train-infer factor, the clip and the ratios (module docstring). Under
    truncation (``trunc_out`` given) a -inf pi_prox is the ``truncation`` group's, not a non-finite prox."""
    sg, M = lax.stop_gradient, float(cfg.max_log_ratio)
    valid, usable, kept = ti.valid, ti.usable, ti.kept
    ratio_d, lr_d = sg(clip.ratio), sg(clip.log_ratio)
    nv = jnp.sum(valid.astype(jnp.float32))
    raw_is = jnp.exp(jnp.clip(ti.level_logratio, -M, M))
    tl = ti.token_logratio
    out_of_band = (ratio_d < clip.lo) | (ratio_d > clip.hi)
    m: dict[str, jax.Array] = {}
    m["valid_tokens"] = nv
    m["denominator"] = sg(Z)
    m["train_infer_retained"] = _vmean(kept, valid, nv, empty=1.0)
    m["train_infer_out_of_band_frac"] = _vmean(usable & ~ti.in_band, valid, nv)
    m["train_infer_catastrophic_frac"] = _vmean(usable & ti.catastrophic_row[:, None], valid, nv)
    m["masked_nonfinite_behav"] = jnp.sum(ti.nonfinite_behav.astype(jnp.float32))
    nonfinite_prox = ti.nonfinite_prox if trunc_out is None else ti.nonfinite_prox & ~trunc_out
    m["masked_nonfinite_prox"] = jnp.sum(nonfinite_prox.astype(jnp.float32))
    m["clip_frac"] = _vmean(clip.clipped, valid, nv)
    m["clip_active_frac"] = _vmean(clip.clip_active, valid, nv)
    m["ratio_out_of_band_frac"] = _vmean(out_of_band, valid, nv)
    m["dual_clip_frac"] = _vmean(clip.dual_active, valid, nv)
    m["is_weight_mean"] = _vmean(raw_is, valid, nv, empty=1.0)
    m["is_weight_sq_mean"] = _vmean(raw_is * raw_is, valid, nv, empty=1.0)
    m["is_weight_max"] = jnp.max(jnp.where(valid, raw_is, 0.0))
    m["ess_frac"] = m["is_weight_mean"] ** 2 / jnp.maximum(m["is_weight_sq_mean"], 1e-30)
    m["kl_train_infer_k1"] = _vmean(-tl, valid, nv)
    m["kl_train_infer_k3"] = _vmean(jnp.exp(jnp.clip(tl, -M, M)) - 1.0 - tl, valid, nv)
    m["kl_drift_k1"] = _vmean(-lr_d, valid, nv)
    m["kl_drift_k3"] = _vmean(ratio_d - 1.0 - lr_d, valid, nv)
    m["ratio_mean"] = _vmean(ratio_d, valid, nv, empty=1.0)
    m["ratio_min"] = jnp.min(jnp.where(valid, ratio_d, jnp.float32(math.exp(min(M, 88.0)))))
    m["ratio_max"] = jnp.max(jnp.where(valid, ratio_d, 0.0))
    return m
