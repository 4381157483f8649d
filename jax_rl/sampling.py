"""Top-k / top-p truncation, shared by the rollout sampler and the learner's log-prob forward.

The rollout engine (:func:`rollout.engine.sample_tokens`) samples from the tempered
distribution truncated by the HF warpers in HF order: temperature, then top-k, then top-p
over the top-k-renormalised distribution (the token that crosses ``top_p`` is kept), and
reports ``behav_logp`` = log mu under that truncated, renormalised distribution. The learner
(:func:`jax_rl.learner.logprobs.sequence_logprobs` with ``top_k`` / ``top_p``) computes log pi
under the same truncation of its own logits, with this same :func:`kept_set`, so pi_prox / mu
is exactly 1 when the two sides' logits agree and differs only by numerics otherwise::

    log pi_trunc(tok) = log_softmax(logits / T)[tok] - log(kept mass)   if tok is kept
                      = -inf                                            otherwise

``kept mass`` = sum of softmax(logits / T) over the kept set. The kept set is a discrete,
stop-gradient choice; ``log(kept mass)`` is a smooth function of the logits and carries
gradient (it is part of log pi_trunc).

Cost per position: one ``lax.top_k`` over V of ``top_k + 1`` values (top-k, and top-p after
top-k: the cumsum runs over the k sorted values) or of :data:`TOP_P_CANDIDATES` values (top-p
alone, plus one logsumexp pass); never a sort of V: where a tie at the k-th value or a nucleus
wider than the candidates makes the candidates undecided, the batch takes a bisection for the same
threshold under a ``lax.cond`` (:func:`threshold_by_search`: 32 counting passes over V for the
k-th value, 32 mass passes for the nucleus' edge), and the kept set is the same. Off
(``top_k = 0``, ``top_p = 1``) costs nothing: the callers take their untruncated path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["truncates", "check_truncation", "kept_set", "kept_threshold", "threshold_from_sorted",
           "threshold_by_search", "log_kept_mass", "TOP_P_CANDIDATES"]

# top-p alone: the threshold is read from this many largest log-probs (a sort over V only when the
# nucleus holds more tokens than this)
TOP_P_CANDIDATES = 256


def truncates(top_k: int = 0, top_p: float = 1.0) -> bool:
    """True when ``top_k > 0`` or ``top_p < 1`` (static Python values)."""
    return int(top_k) > 0 or float(top_p) < 1.0


def check_truncation(top_k: int, top_p: float) -> None:
    """Raise ValueError unless ``top_k`` is an int >= 0 and ``top_p`` a float in (0, 1]."""
    if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def kept_set(logp_full: jax.Array, top_k: int = 0, top_p: float = 1.0, *,
             candidates: int = TOP_P_CANDIDATES) -> jax.Array:
    """bool [..., V]: the tokens the HF warpers keep, top-k then top-p (stop-gradient).

    Args:
      logp_full: fp32 [..., V], ``log_softmax(logits / temperature)`` (temperature applied).
      top_k: static; 0 = off. Keeps every token whose log-prob is >= the k-th largest (ties at
        the k-th value are all kept, as HF's ``TopKLogitsWarper``).
      top_p: static; 1.0 = off. Over the top-k-renormalised distribution sorted in decreasing
        order, keeps a token when the mass strictly before it is < ``top_p`` (so the token that
        crosses ``top_p`` is kept; the most likely token always is), and every token tied with
        the last kept value.
      candidates: static; top-p alone reads its threshold from this many largest values
        (:func:`kept_threshold`; a sort over V only when the nucleus is wider).

    The kept set is ``logp_full >= thr`` for one threshold per row (:func:`kept_threshold`):
    with top-k on, the top-p cumsum runs over the k sorted top-k values only: a token tied with
    the k-th value beyond position k has at least the k-th token's mass before it, so it is kept
    iff the k-th is, exactly as in a sort over all V.
    """
    lp = jax.lax.stop_gradient(jnp.asarray(logp_full, jnp.float32))
    return lp >= kept_threshold(lp, top_k, top_p, candidates=candidates)


def kept_threshold(logp_full: jax.Array, top_k: int = 0, top_p: float = 1.0, *,
                   candidates: int = TOP_P_CANDIDATES, lse_all: jax.Array | None = None) -> jax.Array:
    """fp32 [..., 1]: the per-row log-prob threshold of the kept set, ``kept = logp_full >= thr``
    (the kept set of the HF warpers is always an upper set of the values; :func:`kept_set`).

    Read from a bounded candidate set, never a sort of the vocabulary in the common case: one
    ``lax.top_k`` of ``top_k + 1`` values (top-k, and top-p after top-k) or of ``candidates``
    values (top-p alone). The candidates decide the threshold exactly when every kept token is
    among them: the first candidate left out is strictly below the threshold (no tie at the
    threshold spills past the candidates, and for top-p alone the nucleus closed inside them).
    Where a row of the batch is not decided so, the whole batch takes :func:`threshold_by_search`
    (``lax.cond``: the same rule by bisection, no sort of V, so the kept set is the same either way).

    Args:
      logp_full: fp32 [..., V], the tempered log-softmax.
      top_k, top_p: static, as :func:`kept_set`.
      candidates: static, the top-p-alone candidate count (clipped to V).
      lse_all: optional [...] log of the total mass of ``logp_full`` (top-p alone renormalises
        by it); None computes ``logsumexp(logp_full)`` (one pass over V). The sampler passes
        0 (its log-probs are normalised to fp32 rounding) to save that pass.
    """
    lp = jax.lax.stop_gradient(jnp.asarray(logp_full, jnp.float32))
    V = lp.shape[-1]
    if not truncates(top_k, top_p):
        return jnp.full(lp.shape[:-1] + (1,), -jnp.inf, jnp.float32)
    if top_p < 1.0 and top_k <= 0 and lse_all is None:
        lse_all = jax.nn.logsumexp(lp, axis=-1)
    C = min(V, int(top_k) + 1 if top_k > 0 else max(int(candidates), 1))
    srt = jax.lax.top_k(lp, C)[0]  # [..., C], decreasing
    thr, safe = threshold_from_sorted(srt, top_k, top_p, complete=C == V, lse_all=lse_all)
    if C == V:
        return thr

    return jax.lax.cond(jnp.all(safe), lambda _: thr, lambda _: threshold_by_search(lp, top_k, top_p, lse_all), None)


def threshold_from_sorted(srt: jax.Array, top_k: int, top_p: float, *, complete: bool,
                          lse_all: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(thr [..., 1], decided [...] bool)`` from the largest log-probs ``srt`` [..., C] in
    decreasing order (all V of them when ``complete``): the kept set's threshold under the rule
    of :func:`kept_set`, and whether the C values decide it (always True when ``complete``).
    ``lse_all`` [...]: the log total mass (top-p alone; top-p after top-k renormalises over the
    top-k kept set)."""
    C = srt.shape[-1]
    thr = jnp.full(srt.shape[:-1] + (1,), -jnp.inf, jnp.float32)
    decided = jnp.ones(srt.shape[:-1], bool)
    head = srt
    if top_k > 0:
        k = min(int(top_k), C)
        thr = srt[..., k - 1:k]
        if not complete:
            decided = srt[..., k] < srt[..., k - 1]  # no tie at the k-th value past the candidates
        head = srt[..., :k]  # the top-k kept set (ties past k have the k-th value: kept iff it is)
    if top_p < 1.0:
        if top_k > 0:  # over the whole top-k kept set (ties past k included, as they are kept)
            lse = jax.nn.logsumexp(jnp.where(srt >= thr, srt, -jnp.inf), axis=-1, keepdims=True)
        else:
            lse = jnp.zeros(srt.shape[:-1] + (1,), jnp.float32) if lse_all is None else lse_all[..., None]
        p = jnp.exp(head - lse)
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each sorted token
        thr_p = jnp.min(jnp.where(before < top_p, head, jnp.inf), axis=-1, keepdims=True)
        if top_k <= 0 and not complete:
            decided = head[..., -1] < thr_p[..., 0]  # the nucleus closed inside the candidates
        thr = jnp.maximum(thr, thr_p)
    return thr, decided


def log_kept_mass(logp_full: jax.Array, kept: jax.Array) -> jax.Array:
    """[...]: ``log(sum(softmax over kept))`` = log of the kept set's tempered mass (<= 0).

    Differentiable in ``logp_full`` (the kept set is not); finite whenever one token is kept
    (the most likely one always is)."""
    return jnp.log(jnp.sum(jnp.where(kept, jnp.exp(logp_full), 0.0), axis=-1))


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the fp32 values ``x`` (-inf lowest; no NaN): the sign bit flipped for
    x >= 0, every bit for x < 0 (IEEE-754's total order)."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(0x80000000))


def _from_key(k: jax.Array) -> jax.Array:
    """The fp32 value of an :func:`_order_key` key."""
    return jax.lax.bitcast_convert_type(jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k), jnp.float32)


def _smallest_true(lp: jax.Array, pred) -> jax.Array:
    """fp32 [..., 1]: the smallest value ``v`` of each row of ``lp`` [..., V] with ``pred(v [..., 1])``
    true, for a ``pred`` monotone in ``v`` (false below some value of the row, true from it on) and true
    at the row's maximum: a bisection over the 32-bit order keys, each step one pass over ``lp``."""
    lo = _order_key(jnp.min(lp, axis=-1, keepdims=True))
    hi = _order_key(jnp.max(lp, axis=-1, keepdims=True))

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(_from_key(mid))
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return _from_key(lo)


def threshold_by_search(logp_full: jax.Array, top_k: int = 0, top_p: float = 1.0,
                        lse_all: jax.Array | None = None) -> jax.Array:
    """fp32 [..., 1]: :func:`kept_threshold` over all V without a sort (its fallback where the candidates
    do not decide a row): the same rule, each threshold found by bisection on the values.

    top-k: the k-th largest value is the smallest ``v`` with fewer than k values above it (``count(x > v)
    < k``, so ties at the k-th value are kept). top-p: over the top-k kept set renormalised (or the whole
    row over ``exp(lse_all)``), the smallest ``v`` whose mass strictly above it is below ``top_p``, which is
    :func:`threshold_from_sorted`'s "mass strictly before the first of its tie group < top_p" with the mass
    summed per value instead of run down the sorted row (the same up to the fp32 rounding of the sums).
    The kept set is ``logp_full >= thr``. Cost: up to 64 passes over ``[..., V]`` (32 per threshold) and,
    for top-p, one ``[..., V]`` array of masses, against a sort's ~log2(V)^2 / 2 passes.

    Args:
      logp_full: fp32 [..., V] tempered log-softmax (``-inf``: a token of no mass; no NaN).
      top_k, top_p: static, as :func:`kept_set`.
      lse_all: optional [...] log total mass (top-p alone); None computes it.
    """
    lp = jax.lax.stop_gradient(jnp.asarray(logp_full, jnp.float32))
    thr = jnp.full(lp.shape[:-1] + (1,), -jnp.inf, jnp.float32)
    if top_k > 0 and top_k < lp.shape[-1]:
        thr = _smallest_true(lp, lambda v: jnp.sum(lp > v, axis=-1, keepdims=True) < top_k)
    if top_p < 1.0:
        if top_k > 0:
            lse = jax.nn.logsumexp(jnp.where(lp >= thr, lp, -jnp.inf), axis=-1, keepdims=True)
        else:
            lse = (jax.nn.logsumexp(lp, axis=-1) if lse_all is None else lse_all)[..., None]
        mass = jnp.where(lp >= thr, jnp.exp(lp - lse), 0.0)
        thr_p = _smallest_true(lp, lambda v: jnp.sum(jnp.where(lp > v, mass, 0.0), axis=-1, keepdims=True) < top_p)
        thr = jnp.maximum(thr, thr_p)
    return thr
