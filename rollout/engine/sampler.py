"""The rollout sampler: one token per slot from a decode step's logits, with its behaviour log-prob,
and the step's typed output.

Sampling (:func:`sample_tokens`): logits are fp32; ``logits / temperature``; optional top-k then
top-p (HF warper order) truncation; one uniform per token drawn from its key, inverted through
the running sum of the probabilities (:func:`inverse_cdf_index`). The reported ``behav_logp`` is the
log-prob of the sampled token under the distribution actually sampled from (renormalised over
the kept set); the learner reproduces the truncation from its own logits (``jax_rl.sampling``:
``logp = log_softmax(logits/T)[tok] - log(kept_mass)``), so no kept mass leaves the engine.
Greedy slots (temperature <= 0) report the log-prob of the argmax under T = 1. The key of the
token sampled at absolute position ``p`` is ``fold_in(PRNGKey(seed), p)``: reproducible from the
seed regardless of slot, batch composition, or whether the KV cache was recomputed.

JetStream's ``ResultTokens.data`` (the adapter only, :func:`pack_result`) is int32 [B, 4]: columns
token | valid | n_generated | behav_logp bits (float32 bit-cast to int32; JetStream's Driver reads
only the first three), then the route columns; :func:`unpack_result` reads it back in one host
transfer.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_rl.models.backend_target import current_target_backend
from jax_rl.sampling import TOP_P_CANDIDATES, log_kept_mass, threshold_by_search, threshold_from_sorted, truncates
from rollout.engine.sampler_kernel import kernel_fits, sample_untruncated

SAMPLER_IMPLS = ("auto", "xla", "kernel", "kernel_interpret")

__all__ = ["sample_tokens", "inverse_cdf_index", "StepOutput", "pack_result", "unpack_result"]


def _cdf_block(V: int, block: int) -> int:
    """Largest power of two <= ``block`` dividing ``V`` (no padding copy of the row), or
    ``block`` when that is below 8 (the row is padded with zeros then)."""
    b = block
    while b >= 8 and V % b:
        b //= 2
    return b if b >= 8 else block


def inverse_cdf_index(p: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
    """Inverse-CDF draw: for each row the first index whose running mass exceeds ``u`` times
    the row's total mass.

    Two levels, so the row is read about once (a full-length ``cumsum`` costs ~log2(V) passes over
    [B, V] on a TPU, where libtpu counted +8% bytes per Qwen3-4B decode step for it): the sums of
    ``block``-wide blocks, their running sum, the block holding the draw, then the running sum
    inside that one block.

    Args:
      p: [B, V] float32 non-negative (unnormalised) probabilities; each row has a positive entry.
      u: [B] float32 in [0, 1).
      block: block width (a power of two; 128 = a TPU lane row).

    Returns:
      [B] int32 indices, always of a positive entry of ``p``: zero-mass entries (truncated
      tokens) are never returned, also when fp32 rounding puts ``u * total`` at or past a
      block's or the row's total (the draw is then clamped to the last positive entry of the
      block / row). With ``u`` uniform this is an exact categorical draw up to the fp32 rounding
      of the sums.
    """
    B, V = p.shape
    b = _cdf_block(V, block)
    pad = (-V) % b
    if pad:
        p = jnp.pad(p, ((0, 0), (0, pad)))
    pb = p.reshape(B, p.shape[1] // b, b)
    return _draw(jnp.sum(pb, axis=-1), lambda blk: jnp.take_along_axis(pb, blk[:, None, None], axis=1)[:, 0], u, b)


def _draw(s: jax.Array, block_row: Callable[[jax.Array], jax.Array], u: jax.Array, b: int) -> jax.Array:
    """The two-level inverse-CDF draw of :func:`inverse_cdf_index` from the block masses ``s`` [B, n]
    and ``block_row(blk [B] int) -> [B, b]``, the masses inside each row's block ``blk``."""
    blk, prev, x = _draw_block(s, u)
    return blk * b + _draw_in_block(block_row(blk), prev, x)


def _draw_block(s: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first level of :func:`_draw`: ``(blk, prev, x)`` [B] each: the block holding the draw (never a
    block past the last one with mass), the running mass before it, and the draw's target ``u x total``."""
    n = s.shape[1]
    cdf = jnp.cumsum(s, axis=-1)
    x = u * cdf[:, -1]
    last_blk = n - 1 - jnp.argmax((s > 0)[:, ::-1], axis=-1)
    blk = jnp.minimum(jnp.sum(cdf <= x[:, None], axis=-1), last_blk)  # the first block with cdf > x
    prev = jnp.where(blk > 0, jnp.take_along_axis(cdf, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    return blk.astype(jnp.int32), prev, x


def _draw_in_block(row: jax.Array, prev: jax.Array, x: jax.Array) -> jax.Array:
    """The second level of :func:`_draw`: the index [B] int32 inside the block whose masses are ``row``
    [B, b] (never an entry without mass)."""
    b = row.shape[1]
    inner = prev[:, None] + jnp.cumsum(row, axis=-1)
    last_in = b - 1 - jnp.argmax((row > 0)[:, ::-1], axis=-1)
    return jnp.minimum(jnp.sum(inner <= x[:, None], axis=-1), last_in).astype(jnp.int32)


def _select_rows(xb: jax.Array, *blks: jax.Array) -> tuple[jax.Array, ...]:
    """Row ``blks[i][r]`` of ``xb[r]`` ([B, n, b] -> [B, b] per index array [B]), all in one read of ``xb``:
    a variadic max over the block axis of ``where(block == blk, xb, -inf)``, which selects the values
    exactly (one block matches). A gather would read less, but the TPU lays the block view out again for
    it (a copy of [B, V] written and read), where this read follows the layout the LM head wrote
    (docs/performance.md, "The sampler's passes")."""
    n = xb.shape[1]
    at = jnp.arange(n, dtype=jnp.int32)[None, :, None]
    ninf = jnp.float32(-jnp.inf)
    ops = tuple(jnp.where(at == k.astype(jnp.int32)[:, None, None], xb, ninf) for k in blks)
    return tuple(jax.lax.reduce(ops, (ninf,) * len(ops), lambda a, c: tuple(jnp.maximum(p, q) for p, q in zip(a, c)), (1,)))


def _draw_from_logp(logp: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
    """``inverse_cdf_index(exp(logp), u, block)`` bit for bit, with ``exp`` taken where each mass is read
    (the block sums, then the one block row gathered from ``logp``'s block view), so no [B, V] array
    of masses is written (docs/performance.md, "The sampler's passes"). ``logp`` [B, V] float32
    (``-inf``: zero mass)."""
    B, V = logp.shape
    b = _cdf_block(V, block)
    pad = (-V) % b
    lp = jnp.pad(logp, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else logp
    lb = lp.reshape(B, lp.shape[1] // b, b)
    return _draw(jnp.sum(jnp.exp(lb), axis=-1),
                 lambda blk: jnp.exp(jnp.take_along_axis(lb, blk[:, None, None], axis=1)[:, 0]), u, b)


def _block_stats(x: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """One pass over ``x`` [B, n, b]: per block its max ``m`` [B, n] and ``sum(exp(x - m))`` [B, n]
    (an online-softmax variadic reduce; an all ``-inf`` block gives ``(-inf, b)``, mass 0 once
    scaled by ``exp(m - M)``)."""

    def combine(a, c):
        (m1, s1), (m2, s2) = a, c
        m = jnp.maximum(m1, m2)
        w1 = jnp.where(m1 == m, 1.0, jnp.exp(m1 - m))
        w2 = jnp.where(m2 == m, 1.0, jnp.exp(m2 - m))
        return m, s1 * w1 + s2 * w2

    init = (jnp.float32(-jnp.inf), jnp.float32(0.0))
    return jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (2,))


def _sample_truncated(lp_full: jax.Array, u: jax.Array, greedy: jax.Array, top_k: int, top_p: float,
                      candidates: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`sample_tokens` under top-k / top-p from the tempered log-softmax ``lp_full`` [B, V]
    (an expression XLA fuses into the ``lax.top_k`` read), the uniforms ``u`` [B] and ``greedy`` [B]."""
    B, V = lp_full.shape
    C = min(V, int(top_k) + 1 if top_k > 0 else max(int(candidates), 1))
    srt, idx = jax.lax.top_k(lp_full, C)  # [B, C] decreasing, ties lowest index first
    thr, decided = threshold_from_sorted(srt, top_k, top_p, complete=C == V, lse_all=jnp.zeros((B,), jnp.float32))

    def from_candidates(_):
        kept = srt >= thr
        lkm = jnp.log(jnp.sum(jnp.where(kept, jnp.exp(srt), 0.0), axis=-1))
        order = jnp.argsort(idx, axis=-1)  # vocabulary order: the full draw's running sum
        ci = jnp.take_along_axis(idx, order, axis=-1)
        w = jnp.take_along_axis(jnp.where(kept, jnp.exp(srt - lkm[:, None]), 0.0), order, axis=-1)
        cdf = jnp.cumsum(w, axis=-1)
        last = C - 1 - jnp.argmax((w > 0)[:, ::-1], axis=-1)
        j = jnp.minimum(jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1), last)
        tok = jnp.where(greedy, idx[:, 0], jnp.take_along_axis(ci, j[:, None], axis=-1)[:, 0])
        lp_tok = jnp.where(greedy, srt[:, 0], jnp.take_along_axis(srt, jnp.take_along_axis(order, j[:, None], axis=-1), axis=-1)[:, 0])
        return tok.astype(jnp.int32), lp_tok - lkm, jnp.exp(lkm)

    def full_vocab(_):  # the candidates do not decide every row: the same kept set over V, by bisection
        kept = lp_full >= threshold_by_search(lp_full, top_k, top_p, lse_all=jnp.zeros((B,), jnp.float32))
        lkm = log_kept_mass(lp_full, kept)
        logp_s = jnp.where(kept, lp_full - lkm[:, None], -jnp.inf)
        tok = jnp.where(greedy, jnp.argmax(logp_s, axis=-1), _draw_from_logp(logp_s, u)).astype(jnp.int32)
        return tok, jnp.take_along_axis(logp_s, tok[:, None], axis=-1)[:, 0], jnp.exp(lkm)

    if C == V:
        return from_candidates(None)
    return jax.lax.cond(jnp.all(decided), from_candidates, full_vocab, None)


def _sample_untruncated_xla(lb: jax.Array, m_blk: jax.Array, s_blk: jax.Array, M: jax.Array, log_s: jax.Array,
                            u: jax.Array, greedy: jax.Array, inv_t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`sample_tokens`' untruncated XLA path from the raw block view ``lb`` [B, n, b], the block
    statistics ``m_blk``, ``s_blk`` [B, n], the row's max ``M`` and ``log_s`` [B], the uniforms ``u``, the
    greedy rows and ``inv_t`` [B]: the draw's and the greedy block rows selected in one more read."""
    B, _, b = lb.shape

    def lp(row):  # [B, b] raw logits of a block -> the tempered log-softmax, as jax.nn.log_softmax
        # the product rounded on its own ([B, b]: the barrier keeps a fused multiply-subtract from skipping the
        # rounding the statistics' x / T had, which would put the argmax's log-prob an ulp of x / T off)
        return jax.lax.optimization_barrier(row * inv_t[:, None]) - M[:, None] - log_s[:, None]

    blk, prev, x = _draw_block(s_blk * jnp.exp(m_blk - M[:, None]) / jnp.exp(log_s)[:, None], u)
    g_blk = jnp.argmax(m_blk, axis=-1).astype(jnp.int32)
    row, g_row = (lp(r) for r in _select_rows(lb, blk, g_blk))  # both block rows in one more read
    i = _draw_in_block(jnp.exp(row), prev, x)
    g_i = jnp.argmax(g_row, axis=-1).astype(jnp.int32)
    tokens = jnp.where(greedy, g_blk * b + g_i, blk * b + i).astype(jnp.int32)
    logp = jnp.where(greedy, jnp.take_along_axis(g_row, g_i[:, None], axis=-1)[:, 0],
                     jnp.take_along_axis(row, i[:, None], axis=-1)[:, 0])
    return tokens, logp, jnp.ones((B,), jnp.float32)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    candidates: int = TOP_P_CANDIDATES,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample one token per row and return its log-prob under the sampling distribution.

    Two reads of the ``[B, V]`` logits when untruncated, none written: per 128-wide block its max and
    sum of ``exp`` of ``logits / T`` (:func:`_block_stats`), from which the row's logsumexp, the block
    of the inverse-CDF draw and the greedy argmax's block follow; then the two block rows (the draw's
    and the greedy one, B x 128 values each) selected in one more read (:func:`_select_rows`), which
    give the token and its log-prob. On a TPU, one Pallas kernel that reads them once, same stream
    (:func:`rollout.engine.sampler_kernel.sample_untruncated`). Truncated: the statistics' pass, then one
    ``lax.top_k`` of a bounded candidate set (``top_k + 1``, or ``candidates`` for top-p alone:
    :func:`jax_rl.sampling.kept_threshold`), drawn from in vocabulary order; when the candidates do
    not decide the kept set (a tie at the k-th value past them, a nucleus wider than them) the
    batch takes the full-vocabulary path (``lax.cond``; the threshold by bisection,
    :func:`jax_rl.sampling.threshold_by_search`, never a sort), with the same kept set and draw.

    The draw is the inverse CDF of one uniform per row over the vocabulary in index order, the
    same stream as the full-vocabulary draw (:func:`inverse_cdf_index`): the same token for the
    same key up to the fp32 rounding of the running sums (a draw within ~1e-7 of a token's CDF
    boundary can land on its neighbour), and the same log-prob to fp32 rounding.

    Args:
      logits: [B, V] (any float dtype; computed in float32).
      keys: [B, 2] uint32 raw PRNG keys, one per row.
      temperature: [B] float32; rows with ``temperature <= 0`` take the argmax (greedy) and
        report the log-prob under temperature 1.
      top_k: static; 0 = off. Applied first (HF order).
      top_p: static; 1.0 = off. Nucleus over the (top-k renormalised) distribution; the token
        that crosses ``top_p`` is kept. The kept set is :func:`jax_rl.sampling.kept_set`, the
        rule the learner's log-prob forward reproduces (``rollout.top_k`` / ``rollout.top_p``).
      candidates: static; top-p alone draws from this many largest values when the nucleus fits.
      impl: static; the untruncated path: ``"auto"`` (the kernel for a TPU target,
        :func:`jax_rl.models.backend_target.current_target_backend`, on one device, where
        :func:`~rollout.engine.sampler_kernel.kernel_fits` ``V``; else XLA), ``"xla"``, ``"kernel"``
        or ``"kernel_interpret"`` (Pallas interpret mode: CPU tests). Truncated: always XLA.

    Returns:
      ``(tokens [B] int32, logp [B] float32, kept_mass [B] float32)``. ``logp`` is the log-prob
      of the sampled token under the truncated, renormalised, tempered distribution;
      ``kept_mass`` is the tempered full-softmax mass of the kept set (1.0 when no truncation).

    Raises:
      ValueError: an ``impl`` not in :data:`SAMPLER_IMPLS`, or the kernel for ``V % 128 != 0``.
    """
    if impl not in SAMPLER_IMPLS:
        raise ValueError(f"sample_tokens: impl={impl!r} is not one of {SAMPLER_IMPLS}")
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    # one uniform per row and an inverse-CDF lookup, not jax.random.categorical's V Gumbel draws
    # per row (threefry over [B, V] bits was ~1 ms of a ~13 ms 32-slot decode step on the CPU)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    b = _cdf_block(V, 128)
    pad = (-V) % b
    lb = jnp.pad(logits, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else logits
    lb = lb.reshape(B, lb.shape[1] // b, b)  # the raw logits' block view: x / T is taken where it is read
    # x / T as XLA computes a division by a broadcast row (x times the reciprocal), written out so that the
    # statistics and the selected rows below agree bit for bit whichever fusion each lands in
    inv_t = 1.0 / t
    if not truncates(top_k, top_p) and _kernel_path(impl, V):
        tokens, logp = sample_untruncated(logits, u, inv_t, greedy, interpret=impl == "kernel_interpret")
        return tokens, logp, jnp.ones((B,), jnp.float32)
    m_blk, s_blk = _block_stats(lb * inv_t[:, None, None], b)  # the one pass for the statistics
    M = jnp.max(m_blk, axis=-1)
    log_s = jnp.log(jnp.sum(s_blk * jnp.exp(m_blk - M[:, None]), axis=-1))

    if not truncates(top_k, top_p):
        return _sample_untruncated_xla(lb, m_blk, s_blk, M, log_s, u, greedy, inv_t)

    lp_full = logits / t[:, None] - M[:, None] - log_s[:, None]  # fused into top_k's read
    return _sample_truncated(lp_full, u, greedy, top_k, top_p, candidates)


def _kernel_path(impl: str, V: int) -> bool:
    """Whether :func:`sample_tokens`' untruncated draw takes the Pallas kernel (``impl`` resolved). ``auto``
    keeps XLA under an ambient mesh of several devices: a Mosaic call is not partitioned, so its
    operand would be gathered whole (vocabulary-sharded logits included) where XLA reduces shards."""
    if impl == "auto":
        mesh = jax.sharding.get_abstract_mesh()
        one_device = mesh is None or mesh.empty or mesh.size == 1
        return current_target_backend() == "tpu" and kernel_fits(V) and one_device
    return impl != "xla"


class StepOutput(NamedTuple):
    """What one decode step gives the RL path, per slot: the engine's typed output.

    :meth:`Qwen3Engine.decode` returns one ([B] leaves), :meth:`Qwen3Engine.generate_steps` one
    per step stacked on a leading axis ([n, B] leaves). Device arrays as the engine returns them;
    ``jax.device_get(out)`` brings the whole record to the host in one transfer (the generator does
    so once per engine call) and :meth:`at` picks one step of a stacked record. The names are the
    ones the :class:`rollout.types.Completion` and the Trajectory carry on (``behav_logp``,
    ``versions``, ``routes``), so the behaviour log-prob has one name from engine to loss.

    Attributes:
      token: int32 [B]: the token sampled this step (the slot's new pending token).
      valid: bool [B]: the slot was active and had room in its cache, i.e. ``token`` is real; an
        inactive slot (free, finished, held for its session's next turn) or a full one is False and
        its other fields are meaningless.
      generated: int32 [B]: tokens the slot has emitted since it was armed (this one included).
      behav_logp: float32 [B]: log mu of ``token`` under the distribution it was sampled from
        (temperature, then top-k / top-p truncation renormalised: :func:`sample_tokens`); the
        learner reproduces a truncation itself (:mod:`jax_rl.sampling`), so no kept mass travels.
      version: int32 [B]: the policy version of the params that produced ``token`` (the
        ``version`` the caller passed with those params), -1 where not ``valid``.
      route: None, or int32 [B, n_moe_layers, k] (``record_routes``): the experts each MoE layer
        chose for the token this step FED (the slot's previous pending token, at position
        ``length`` before the step), not for ``token``.
      moe_dropped: None, or int32 [B] (``counts_moe_drops``): the MoE token copies dropped for
        capacity on the token this step FED (summed over the MoE layers; 0 where not ``valid``).
    """

    token: Any
    valid: Any
    generated: Any
    behav_logp: Any
    version: Any
    route: Any = None
    moe_dropped: Any = None

    def at(self, i: int) -> "StepOutput":
        """Step ``i`` of a record stacked over steps (``generate_steps``): every leaf ``x[i]``."""
        return StepOutput(*(None if x is None else x[i] for x in self))


_RESULT_COLS = 4  # token | valid | n_generated | behav_logp bits (then the route columns)


def pack_result(out: StepOutput) -> jax.Array:
    """JetStream's ``ResultTokens.data`` of one step (traceable; :meth:`Qwen3Engine.generate`):
    int32 [B, 4 (+ n_moe_layers * k)]: token | valid | n_generated | behav_logp (float32 bit-cast
    to int32) | the fed token's route ids. JetStream's Driver reads the first three columns."""
    cols = [out.token.astype(jnp.int32), out.valid.astype(jnp.int32), out.generated.astype(jnp.int32),
            jax.lax.bitcast_convert_type(out.behav_logp.astype(jnp.float32), jnp.int32)]
    data = jnp.stack(cols, axis=1)
    if out.route is not None:
        data = jnp.concatenate([data, out.route.reshape(out.route.shape[0], -1).astype(jnp.int32)], axis=1)
    return data


def unpack_result(result: Any) -> dict[str, np.ndarray]:
    """One host transfer of a JetStream-adapter result (:meth:`Qwen3Engine.generate`'s
    ``ResultTokens`` or its ``data`` array) for ``jax-rl serve`` and tests of the adapter; the RL
    path reads :class:`StepOutput` instead.

    Returns a dict of numpy arrays [B]: ``tokens`` int32, ``valid`` bool, ``lengths`` int32
    (tokens generated so far in the slot), ``behav_logp`` float32; and ``routes`` int32
    [B, n_moe_layers * k] when the engine records routes (``record_routes``).
    """
    data = np.asarray(getattr(result, "data", result))  # a ResultTokens or its data array
    out = {
        "tokens": data[:, 0].astype(np.int32),
        "valid": data[:, 1].astype(bool),
        "lengths": data[:, 2].astype(np.int32),
        "behav_logp": np.ascontiguousarray(data[:, 3]).view(np.float32),
    }
    if data.shape[1] > _RESULT_COLS:
        out["routes"] = data[:, _RESULT_COLS:].astype(np.int32)
    return out

