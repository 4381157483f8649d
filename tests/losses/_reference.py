"""Straightforward float64 numpy reference of jax_rl.learner.losses.policy_loss (loss and d loss/d logp).

Written independently of the JAX code, with loops and the textbook max/min PPO form.
"""

from __future__ import annotations

import math

import numpy as np


def ref_policy_loss(logp, prox, behav, adv, mask, cfg, turn_ids=None, denominator=None):
    """Return (loss, grad wrt logp [B,T], kept [B,T]) in float64."""
    logp = np.asarray(logp, np.float64)
    prox = np.asarray(prox, np.float64)
    behav = np.asarray(behav, np.float64)
    adv = np.asarray(adv, np.float64)
    mask = np.asarray(mask, bool)
    B, T = mask.shape
    M = cfg.max_log_ratio
    low, high = cfg.train_infer_bounds
    with np.errstate(all="ignore"):
        usable = mask & np.isfinite(prox) & np.isfinite(behav)
        lr = np.where(usable, prox - behav, 0.0)

    s = np.zeros((B, T))
    for b in range(B):
        idx = [t for t in range(T) if usable[b, t]]
        if not idx:
            continue
        if cfg.train_infer_level == "token":
            for t in idx:
                s[b, t] = lr[b, t]
        elif cfg.train_infer_level == "sequence":
            tot = sum(lr[b, t] for t in idx)
            for t in idx:
                s[b, t] = tot
        elif cfg.train_infer_level == "geometric":
            tot = sum(lr[b, t] for t in idx) / len(idx)
            for t in idx:
                s[b, t] = tot
        elif cfg.train_infer_level == "turn":
            groups: dict = {}
            for t in idx:
                key = int(turn_ids[b, t]) if turn_ids[b, t] >= 0 else ("solo", t)
                groups.setdefault(key, []).append(t)
            for ts in groups.values():
                g = sum(lr[b, t] for t in ts) / len(ts)
                for t in ts:
                    s[b, t] = g

    log_lo = -math.inf if low <= 0 else math.log(low)
    log_hi = math.log(high)
    in_band = (s >= log_lo) & (s <= log_hi)
    cat = np.zeros(B, bool)
    if cfg.catastrophic_logratio is not None:
        cat = np.any(usable & (lr < cfg.catastrophic_logratio), axis=1)
    kept = usable & ~cat[:, None]
    if cfg.train_infer_mode == "mask":
        kept &= in_band
    w = np.ones((B, T))
    if cfg.train_infer_mode == "truncate":
        w = np.clip(np.exp(np.clip(s, -M, M)), low, high)

    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    d = np.where(usable, logp - np.where(usable, prox, 0), 0.0)
    r = np.exp(np.clip(d, -M, M))
    pg = np.maximum(-adv * r, -adv * np.clip(r, lo, hi))
    dpg = np.where(-adv * r >= -adv * np.clip(r, lo, hi), -adv * r, 0.0)  # no ties on random data
    if cfg.dual_clip_c is not None:
        c = cfg.dual_clip_c
        dual = (adv < 0) & (pg > -c * adv)
        pg = np.where(dual, -c * adv, pg)
        dpg = np.where(dual, 0.0, dpg)
    dpg = np.where(np.abs(d) <= M, dpg, 0.0)

    D = mask if cfg.keep_masked_in_denominator else kept
    n = D.sum(1).astype(np.float64)
    nseq = float((n > 0).sum())
    if cfg.agg == "token_mean":
        coef = np.ones((B, 1))
        Z = n.sum()
    elif cfg.agg == "seq_mean_token_mean":
        coef = np.where(n > 0, 1.0 / np.maximum(n, 1), 0.0)[:, None]
        Z = nseq
    elif cfg.agg == "seq_mean_token_sum":
        coef = np.ones((B, 1))
        Z = nseq
    else:
        L = cfg.seq_sum_norm_len or T
        coef = np.full((B, 1), 1.0 / L)
        Z = nseq
    if denominator is not None:
        Z = float(denominator)
    Z = Z if Z > 0 else 1.0
    loss = 0.0
    grad = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if kept[b, t]:
                loss += coef[b, 0] * w[b, t] * pg[b, t] / Z
                grad[b, t] = coef[b, 0] * w[b, t] * dpg[b, t] / Z
    return loss, grad, kept


def plain_pg_loss(adv, mask, agg, T_norm=None):
    """-agg(A) and its per-token gradient weights for ratio == 1 everywhere."""
    adv = np.asarray(adv, np.float64)
    mask = np.asarray(mask, bool)
    B, T = mask.shape
    n = mask.sum(1)
    nseq = (n > 0).sum()
    if agg == "token_mean":
        coef = np.full((B, 1), 1.0 / max(n.sum(), 1))
    elif agg == "seq_mean_token_mean":
        coef = (np.where(n > 0, 1.0 / np.maximum(n, 1), 0.0) / max(nseq, 1))[:, None]
    elif agg == "seq_mean_token_sum":
        coef = np.full((B, 1), 1.0 / max(nseq, 1))
    else:
        coef = np.full((B, 1), 1.0 / ((T_norm or T) * max(nseq, 1)))
    wt = np.where(mask, coef, 0.0)
    return float(np.sum(-adv * wt)), -adv * wt
