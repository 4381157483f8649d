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

Cost per position: top-k is one ``lax.top_k`` over V (no full sort); top-p with top-k > 0
cumulates over the k sorted top-k values (O(V) for the renormalisation, O(k) for the cumsum);
top-p alone sorts V (O(V log V) per position, next to the LM head's O(d V) matmul). Off
(``top_k = 0``, ``top_p = 1``) costs nothing: the callers take their untruncated path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["truncates", "check_truncation", "kept_set", "log_kept_mass"]


def truncates(top_k: int = 0, top_p: float = 1.0) -> bool:
    """True when ``top_k > 0`` or ``top_p < 1`` (static Python values)."""
    return int(top_k) > 0 or float(top_p) < 1.0


def check_truncation(top_k: int, top_p: float) -> None:
    """Raise ValueError unless ``top_k`` is an int >= 0 and ``top_p`` a float in (0, 1]."""
    if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def kept_set(logp_full: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """bool [..., V]: the tokens the HF warpers keep, top-k then top-p (stop-gradient).

    Args:
      logp_full: fp32 [..., V], ``log_softmax(logits / temperature)`` (temperature applied).
      top_k: static; 0 = off. Keeps every token whose log-prob is >= the k-th largest (ties at
        the k-th value are all kept, as HF's ``TopKLogitsWarper``).
      top_p: static; 1.0 = off. Over the top-k-renormalised distribution sorted in decreasing
        order, keeps a token when the mass strictly before it is < ``top_p`` (so the token that
        crosses ``top_p`` is kept; the most likely token always is), and every token tied with
        the last kept value.

    With top-k on, the top-p cumsum runs over the k sorted top-k values only: a token tied with
    the k-th value beyond position k has at least the k-th token's mass before it, so it is kept
    iff the k-th is, exactly as in a sort over all V.
    """
    lp = jax.lax.stop_gradient(jnp.asarray(logp_full, jnp.float32))
    V = lp.shape[-1]
    kept = jnp.ones(lp.shape, bool)
    srt = None
    if top_k > 0:
        srt = jax.lax.top_k(lp, min(int(top_k), V))[0]  # [..., k], decreasing
        kept = lp >= srt[..., -1:]
    if top_p < 1.0:
        if srt is None:
            srt = jnp.flip(jnp.sort(lp, axis=-1), axis=-1)  # [..., V], decreasing
        lse = jax.nn.logsumexp(jnp.where(kept, lp, -jnp.inf), axis=-1, keepdims=True)
        p = jnp.exp(srt - lse)  # renormalised over the (top-k) kept set, sorted
        before = jnp.cumsum(p, axis=-1) - p  # mass strictly before each sorted token
        thresh = jnp.min(jnp.where(before < top_p, srt, jnp.inf), axis=-1, keepdims=True)
        kept = kept & (lp >= thresh)
    return kept


def log_kept_mass(logp_full: jax.Array, kept: jax.Array) -> jax.Array:
    """[...]: ``log(sum(softmax over kept))`` = log of the kept set's tempered mass (<= 0).

    Differentiable in ``logp_full`` (the kept set is not); finite whenever one token is kept
    (the most likely one always is)."""
    return jnp.log(jnp.sum(jnp.where(kept, jnp.exp(logp_full), 0.0), axis=-1))
