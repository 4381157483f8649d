"""Batch-invariant pieces of the bitwise mode (``model.bitwise: true``, issue 62): with them the rollout
engine's decode, its re-score by prefill and the learner's forward compute every token's log-prob with the same
bits, whatever other rows share the call.

What varies on XLA:CPU with the rows that share a call (``bench/bitwise_pieces.py``, jax 0.10.2): a matmul's
rows below 64 (a 1-row call takes the GEMV path; 2-32 rows of a 64 x 640 product differ too), a row
reduction's (the mean of RMSNorm, a log-softmax over the vocab) below 64 rows, and the attention's key
reduction (the bucket of keys a call gathers, 1 query against T). What holds: every tested per-row piece
gives the same bits for a row whatever its position among >= 64 rows. So the mode has two pieces:

- **one row tile** (:data:`ROW_TILE` = 64): every per-token op (projections, norms, RoPE, MLP / MoE, LM
  head, log-softmax) runs on the call's tokens flattened and padded to a multiple of 64 rows
  (:func:`to_rows` / :func:`from_rows`, an optimization barrier at each end so XLA cannot narrow the
  padded op back);
- **attention over fixed key chunks** (:func:`chunked_attend`): keys at absolute positions in chunks of
  :data:`KEY_CHUNK`, an online softmax combined chunk after chunk in position order, each chunk's scores
  and values computed for a query-row tile of 64 (the G query heads of a kv head, padded). A chunk past a
  query's position changes nothing (it is skipped with ``where``), so 1 query (decode) and T queries
  (prefill, the learner), any key bucket, any page layout give the same bits.

The engine and the learner call the same code (the model, :func:`token_logprobs_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["ROW_TILE", "KEY_CHUNK", "to_rows", "from_rows", "chunked_attend", "token_logprobs_rows",
           "row_tile_of"]

ROW_TILE = 64
"""Rows per tile of every per-token op in the mode: a call's tokens are padded to a multiple of it."""

KEY_CHUNK = 64
"""Keys per chunk of :func:`chunked_attend` (at absolute positions 0, 64, 128, ...)."""


def row_tile_of(n: int, tile: int = ROW_TILE) -> int:
    """``n`` rounded up to a multiple of ``tile`` (at least one tile)."""
    return max(1, -(-int(n) // tile)) * tile


def to_rows(x: Array, lead: int, tile: int = ROW_TILE) -> Array:
    """x [*lead_dims, ...] (``lead`` leading dims, e.g. 2 for [B, T, ...]) -> [1, R, ...] with R the
    product of the lead dims padded with zeros to a multiple of ``tile``, behind an optimization barrier."""
    n = 1
    for s in x.shape[:lead]:
        n *= s
    flat = x.reshape(n, *x.shape[lead:])
    R = row_tile_of(n, tile)
    if R != n:
        flat = jnp.pad(flat, ((0, R - n),) + ((0, 0),) * (flat.ndim - 1))
    return jax.lax.optimization_barrier(flat[None])


def from_rows(y: Array, lead_shape: tuple[int, ...]) -> Array:
    """Inverse of :func:`to_rows`: [1, R, ...] -> [*lead_shape, ...] (the padding rows dropped)."""
    n = 1
    for s in lead_shape:
        n *= s
    y = jax.lax.optimization_barrier(y)[0, :n]
    return y.reshape(*lead_shape, *y.shape[1:])


def _chunk_step(carry, xs, qh, qpos, scale, q_tile):
    m, l, o = carry
    kc, vc, kpos = xs  # [B,K,C,H] x2, [C]
    s = jnp.einsum("bkmh,bkch->bkmc", qh, kc, preferred_element_type=jnp.float32) * scale
    ok = kpos[None, None, :] <= qpos[:, :, None]  # [B,M,C]
    s = jnp.where(ok[:, None], s, -jnp.inf)
    any_ok = jnp.any(ok, axis=-1)[:, None]  # [B,1,M]
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(any_ok, m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    l_new = l * alpha + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkmc,bkch->bkmh", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    o_new = o * alpha[..., None] + pv
    # a chunk with no key a row may see leaves that row as it was (bit for bit)
    return (jnp.where(any_ok, m_new, m), jnp.where(any_ok, l_new, l),
            jnp.where(any_ok[..., None], o_new, o)), None


def chunked_attend(q: Array, k: Array, v: Array, q_pos: Array, *, chunk: int = KEY_CHUNK,
                   q_tile: int = ROW_TILE) -> Array:
    """Causal GQA attention, batch-invariant: keys in fixed chunks of ``chunk`` absolute positions,
    an online softmax combined in position order, scores and values per query-row tile of ``q_tile``.

    q [B,T,N,H]; k/v [B,S,K,H] with key s at absolute position s (a contiguous cache row, a gathered
    page window, or the learner's own T keys); q_pos [B,T] int: each query's position (it sees keys
    ``s <= q_pos``; a negative position sees none and gives zeros). Returns [B,T,N,H] in q.dtype. Scores are
    ``q.k * H**-0.5`` in fp32, the softmax fp32, values accumulated in fp32. Raises ValueError for
    N % K != 0.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"num heads {N} is not a multiple of kv heads {K}")
    G = N // K
    nc = max(1, -(-S // chunk))
    if nc * chunk != S:
        pad = ((0, 0), (0, nc * chunk - S), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    M = T * G
    Mp = row_tile_of(M, q_tile)
    qh = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, M, H)  # rows (t, g)
    qpos = jnp.repeat(jnp.asarray(q_pos, jnp.int32), G, axis=1)  # [B, M]
    if Mp != M:
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, Mp - M), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, Mp - M)), constant_values=-1)
    kc = k.astype(q.dtype).reshape(B, nc, chunk, K, H).transpose(1, 0, 3, 2, 4)  # [nc,B,K,C,H]
    vc = v.astype(q.dtype).reshape(B, nc, chunk, K, H).transpose(1, 0, 3, 2, 4)
    kpos = jnp.arange(nc * chunk, dtype=jnp.int32).reshape(nc, chunk)
    init = (jnp.full((B, K, Mp), -jnp.inf, jnp.float32), jnp.zeros((B, K, Mp), jnp.float32),
            jnp.zeros((B, K, Mp, H), jnp.float32))

    def step(c, xs):
        return _chunk_step(c, xs, qh, qpos, H ** -0.5, q_tile)

    (_, l, o), _ = jax.lax.scan(step, init, (kc, vc, kpos))
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    o = o[:, :, :M].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
    return o.astype(q.dtype)


def token_logprobs_rows(logits: Array, targets: Array, temperature=1.0) -> Array:
    """``log_softmax(logits / temperature)[targets]`` on the row tile: logits [..., V] (any float dtype),
    targets [...] int -> [...] float32, every row computed among a multiple of :data:`ROW_TILE` rows (the
    engine's behaviour log-prob and the learner's log-prob in the mode are this function)."""
    lead = logits.shape[:-1]
    lr = to_rows(logits.astype(jnp.float32), len(lead))
    tr = to_rows(jnp.asarray(targets, jnp.int32), len(lead))
    t = jnp.asarray(temperature, jnp.float32)
    if t.ndim:  # per-row temperatures; the padding rows get 1 (no division by zero)
        t = to_rows(jnp.broadcast_to(t, lead) - 1.0, len(lead)) + 1.0
    lg = lr / (t[..., None] if t.ndim else t)
    lp = jax.nn.log_softmax(lg, axis=-1)
    return from_rows(jnp.take_along_axis(lp, tr[..., None], axis=-1)[..., 0], lead)
