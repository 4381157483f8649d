"""The RL log-prob heads: :func:`sequence_logprobs` (per-token log-probs of a sequence under a
Qwen3 model, the LM head chunked over T, as a :class:`LogprobOutput`) and :func:`token_logprobs`
(from logits), with the sampler's top-k / top-p truncation (:mod:`jax_rl.sampling`) and the
entropy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jax_rl.models.bitwise import token_logprobs_rows
from jax_rl.models.qwen3.outputs import MoeDrops
from jax_rl.sampling import check_truncation, kept_set, log_kept_mass, truncates

Array = jax.Array

__all__ = ["LogprobOutput", "HeadOptions", "token_logprobs", "sequence_logprobs", "CHUNK_ELEMS", "chunk_len"]


@flax.struct.dataclass
class LogprobOutput:
    """What :func:`sequence_logprobs` (and the train step's log-prob forward,
    :func:`jax_rl.learner.train_step.make_logprob_fn`) returns: a pytree, so it passes through ``jax.jit``
    and ``lax.map``; a field not asked for is None.

    Attributes:
        logp: float32 [B,T], ``logp[:, t] = log p(tokens[t] | tokens[:t])`` (temperature and any
            truncation applied), ``logp[:, 0] = 0``, 0 where attention_mask is False (the
            alignment of ``behav_logp``).
        entropy: float32 [B,T] (nats, same alignment and zeros), with ``return_entropy``.
        expert_ids: tuple of int32 [B,T,k], one per MoE layer (empty for a dense model), with
            ``return_expert_ids``.
        moe_drops: :class:`jax_rl.models.qwen3.MoeDrops` (``dropped``, ``copies``: float32 []),
            with ``return_moe_drops``.
    """

    logp: Array
    entropy: Optional[Array] = None
    expert_ids: Optional[tuple[Array, ...]] = None
    moe_drops: Optional[MoeDrops] = None

CHUNK_ELEMS = 1 << 22
"""Default fp32 logits per LM-head chunk (~16 MB; ``sequence_logprobs`` chunk_elems, :func:`chunk_len`)."""
_UNROLL_CHUNKS: bool | int = 1  # scan unroll of the LM-head chunk loop (1: a loop)


def chunk_len(B: int, T: int, V: int, chunk_elems: int, chunk_tokens: int | None = None) -> int:
    """Largest divisor of T with B*C*V <= chunk_elems, or, with ``chunk_tokens``, the largest
    divisor of T not above it (at least 1)."""
    target = max(1, chunk_elems // max(1, B * V)) if chunk_tokens is None else max(1, int(chunk_tokens))
    if target >= T:
        return T
    for c in range(target, 0, -1):
        if T % c == 0:
            return c
    return 1


def _map_over_t(fn: Callable[..., Array], arrays: Sequence[Array], B: int, T: int, V: int,
                chunk_elems: int, chunk_tokens: int | None = None) -> Array:
    """Apply ``fn(*chunks) -> [B,C,...]`` over T-chunks of ``arrays`` (each [B,T,...]) with a
    rematerialised lax.map, so neither the forward nor the backward keeps a [B,T,V]."""
    C = chunk_len(B, T, V, chunk_elems, chunk_tokens)
    if C == T:
        return fn(*arrays)
    n = T // C

    @jax.checkpoint
    def body(i):
        return fn(*[jax.lax.dynamic_slice_in_dim(a, i * C, C, axis=1) for a in arrays])

    # lax.map as a scan; _UNROLL_CHUNKS writes the loop out (tests of jax_rl.compile's cost
    # analysis, which counts a loop body once)
    out = jax.lax.scan(lambda c, i: (c, body(i)), None, jnp.arange(n), unroll=_UNROLL_CHUNKS)[1]  # [n,B,C,...]
    return jnp.moveaxis(out, 0, 1).reshape(B, T, *out.shape[3:])


def _scaled_lse_picked(logits: Array, targets: Array, temperature) -> tuple[Array, Array, Array]:
    """fp32 ``logits / temperature`` [..., V], its logsumexp and the targets' scaled logits [...]."""
    lg = logits.astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lg, lse, picked


def _logp_from_logits(logits: Array, targets: Array, temperature) -> Array:
    _, lse, picked = _scaled_lse_picked(logits, targets, temperature)
    return picked - lse


def _logp_entropy_from_logits(logits: Array, targets: Array, temperature) -> Array:
    """[..., 2]: log-prob of ``targets`` and the entropy ``H = lse - sum softmax * logits`` (nats)
    of ``softmax(logits / temperature)``."""
    lg, lse, picked = _scaled_lse_picked(logits, targets, temperature)
    ent = lse - jnp.sum(jax.nn.softmax(lg, axis=-1) * lg, axis=-1)
    return jnp.stack([picked - lse, ent], axis=-1)


def _trunc_logp_from_logits(logits: Array, targets: Array, temperature, top_k: int, top_p: float,
                            return_entropy: bool = False) -> Array:
    """log pi_trunc of ``targets`` under ``softmax(logits / temperature)`` truncated by top-k then
    top-p (:func:`jax_rl.sampling.kept_set`, the rollout sampler's own rule) and renormalised
    over the kept set: ``log_softmax[tok] - log(kept mass)`` if ``tok`` is kept, ``-inf`` if not.
    The kept set is stop-gradient, the kept mass carries gradient; a ``-inf`` entry has an exact
    zero gradient. With ``return_entropy`` [..., 2]: also the entropy (nats) of the truncated,
    renormalised distribution."""

    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # as the sampler
    kept = kept_set(lp, top_k, top_p)
    lkm = log_kept_mass(lp, kept)
    tg = targets[..., None].astype(jnp.int32)
    picked = jnp.take_along_axis(lp, tg, axis=-1)[..., 0]
    inside = jnp.take_along_axis(kept, tg, axis=-1)[..., 0]
    logp = jnp.where(inside, picked - lkm, -jnp.inf)
    if not return_entropy:
        return logp
    lq = jnp.where(kept, lp - lkm[..., None], 0.0)  # log q on the kept set, 0 elsewhere (no -inf)
    ent = -jnp.sum(jnp.where(kept, jnp.exp(lq) * lq, 0.0), axis=-1)
    return jnp.stack([logp, ent], axis=-1)


def _per_token_fn(temperature, top_k: int, top_p: float, return_entropy: bool) -> Callable[[Array, Array], Array]:
    """``(logits [...,V], targets [...]) -> [...]`` (or [..., 2] with the entropy): the plain
    tempered log-softmax when no truncation is on (the untruncated code path, unchanged), else
    :func:`_trunc_logp_from_logits`."""

    check_truncation(top_k, top_p)
    if truncates(top_k, top_p):
        return lambda lg, tg: _trunc_logp_from_logits(lg, tg, temperature, int(top_k), float(top_p), return_entropy)
    per_token = _logp_entropy_from_logits if return_entropy else _logp_from_logits
    return lambda lg, tg: per_token(lg, tg, temperature)


def token_logprobs(logits: Array, targets: Array, temperature: float | Array = 1.0, *,
                   chunk_elems: int = CHUNK_ELEMS, top_k: int = 0, top_p: float = 1.0) -> Array:
    """``log softmax(logits / temperature)[targets]``.

    logits [B,T,V] (any float dtype), targets [B,T] int -> [B,T] float32. Chunked over T
    (rematerialised ``lax.map``) when B*T*V exceeds ``chunk_elems``, so no second [B,T,V]
    (log-softmax) array is kept alive in the forward or the backward. ``top_k`` / ``top_p``
    (static): the log-prob under the sampler's truncated distribution, as in
    :func:`sequence_logprobs`.
    """
    B, T, V = logits.shape
    return _map_over_t(_per_token_fn(temperature, top_k, top_p, False), (logits, targets), B, T, V, chunk_elems)


def _logprob_args(model_or_graphdef, args: tuple, temperature):
    """:func:`sequence_logprobs`'s positional arguments, ``(model, tokens, attention_mask=None, temperature)`` or
    ``(graphdef, state, tokens, ...)``, as ``(model, tokens [B, T], attention_mask or None, temperature)``.
    Raises TypeError without tokens or with too many positional arguments."""
    if isinstance(model_or_graphdef, nnx.GraphDef):
        state, *rest = args
        model = nnx.merge(model_or_graphdef, state)
    else:
        model, rest = model_or_graphdef, list(args)
    if not rest:
        raise TypeError("sequence_logprobs needs tokens")
    tokens = jnp.asarray(rest[0])
    attention_mask = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        temperature = rest[2]
    if len(rest) > 3:
        raise TypeError("too many positional arguments to sequence_logprobs")
    return model, tokens, attention_mask, temperature


class HeadOptions(NamedTuple):
    """How :func:`sequence_logprobs` runs its chunked LM head (static Python values):
    ``chunk_elems`` / ``chunk_tokens`` the T-chunk size (a logit budget B*C*V, default 4M; or a length
    cap, ``model.logits_chunk_tokens``), ``top_k`` / ``top_p`` the rollout sampler's truncation
    (``rollout.top_k`` / ``rollout.top_p``; the defaults 0 / 1.0: untruncated)."""

    chunk_elems: int = CHUNK_ELEMS
    chunk_tokens: int | None = None
    top_k: int = 0
    top_p: float = 1.0


def sequence_logprobs(model_or_graphdef, *args, temperature: float | Array = 1.0,
                      positions: Array | None = None, forced_expert_ids=None,
                      return_expert_ids: bool = False, return_entropy: bool = False,
                      head: HeadOptions = HeadOptions(), return_moe_drops: bool = False) -> LogprobOutput:
    """Per-token log-probs of a sequence under the model (pure, jit-friendly).

    Call as ``sequence_logprobs(model, tokens, attention_mask=None, temperature=1.0)`` or
    ``sequence_logprobs(graphdef, state, tokens, attention_mask=None, temperature=1.0)``.
    tokens [B,T] int32, attention_mask [B,T] bool (right padding). Returns a
    :class:`LogprobOutput` whose ``logp`` [B,T] float32 has ``logp[:, 0] = 0`` and
    ``logp[:, t] = log p(tokens[t] | tokens[:t])`` (temperature applied), zero where
    attention_mask is False - the alignment of ``behav_logp``. The LM head and log-softmax run
    chunked over T, so the full [B,T,V] logits are never materialised. The flags fill the other
    fields (None otherwise): ``return_entropy``: ``entropy`` [B,T] float32 in nats of the
    temperature-scaled next-token distribution that predicts ``tokens[t]`` (same alignment and
    zeros as logp; verl's ``entropy_from_logits``); ``return_expert_ids``: the per-MoE-layer
    ``expert_ids``; ``return_moe_drops``: ``moe_drops`` (``dropped``, ``copies``, float32 []
    each): the token copies the MoE layers' expert-parallel dispatch dropped for capacity
    (``model.moe_capacity_factor``; 0 when dropless or without EP) and the copies routed, over
    the valid tokens (attention_mask) and every MoE layer (0, 0 for a dense model). Padding takes
    no MoE capacity.

    ``head`` (:class:`HeadOptions`) holds the LM head's chunking and truncation options below.
    The LM head runs over T-chunks of C positions (a rematerialised ``lax.map``): C is the
    largest divisor of T with B*C*V <= ``chunk_elems`` (default 4M logits, ~16 MB of fp32), or
    the largest divisor of T not above ``chunk_tokens`` when given (``model.logits_chunk_tokens``:
    on a TPU, a few hundred tokens keep the head's matmuls MXU-sized). All T positions go
    through the head (the last one predicts a pad target and is dropped), so a power-of-two T
    chunks evenly.

    Truncated sampling (``top_k > 0`` or ``top_p < 1``, static: ``rollout.top_k`` /
    ``rollout.top_p``): ``out[:, t]`` is log pi_trunc, the log-prob under the distribution the
    rollout sampler draws from: temperature, then top-k, then top-p (HF warper order, the
    sampler's own :func:`jax_rl.sampling.kept_set`), renormalised over the kept set, i.e.
    ``log_softmax(logits/T)[tok] - log(kept mass)``; ``-inf`` where ``tokens[t]`` is outside
    the kept set (prompt tokens can be; a generated token only when the two sides' numerics put
    it across the boundary). The kept set is stop-gradient, the kept mass carries gradient, a
    ``-inf`` entry has a zero gradient. The entropy is that of the truncated distribution. The
    cost is inside the chunked head: one ``lax.top_k`` over V per position for top-k, one of
    :data:`jax_rl.sampling.TOP_P_CANDIDATES` values for top-p alone, and where those do not decide a
    position's kept set a bisection over V for the whole chunk (:func:`jax_rl.sampling.threshold_by_search`:
    up to 64 passes, never a sort), recomputed in the backward by the chunk's remat. The engine's per-token kept mass is not needed here: the learner recomputes the
    kept set from its own logits, and any difference from the engine's is exactly what
    ``train_infer_ratio`` (pi_prox / mu) measures. Off (the defaults): the untruncated code
    path, bit for bit.
    """
    model, tokens, attention_mask, temperature = _logprob_args(model_or_graphdef, args, temperature)
    chunk_elems, chunk_tokens, top_k, top_p = head
    B, T = tokens.shape
    trunk = model.hidden_states(tokens, positions, attention_mask, forced_expert_ids=forced_expert_ids,
                                return_moe_drops=return_moe_drops)
    h = trunk.hidden
    V = model.config.vocab_size

    per_token = _per_token_fn(temperature, top_k, top_p, return_entropy)
    if getattr(model, "bitwise", False) and not return_entropy and not truncates(top_k, top_p):
        # the bitwise mode: the engine's behaviour log-prob's own function (jax_rl.models.bitwise)
        per_token = lambda lg, tg: token_logprobs_rows(lg, tg, temperature)  # noqa: E731

    def fn(hc, tc):
        return per_token(model.lm_logits(hc), tc)

    k = (2,) if return_entropy else ()
    if T > 1:
        # position t predicts tokens[t + 1]; the last position's target is a pad (dropped)
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
        lp = _map_over_t(fn, (h, targets), B, T, V, chunk_elems, chunk_tokens)
        out = jnp.concatenate([jnp.zeros((B, 1, *k), jnp.float32), lp[:, :-1]], axis=1)
    else:
        out = jnp.zeros((B, T, *k), jnp.float32)
    if attention_mask is not None:
        am = jnp.asarray(attention_mask, bool)
        out = jnp.where(am[..., None] if k else am, out, 0.0)
    return LogprobOutput(logp=out[..., 0] if return_entropy else out,
                         entropy=out[..., 1] if return_entropy else None,
                         expert_ids=trunk.expert_ids if return_expert_ids else None, moe_drops=trunk.moe_drops)
