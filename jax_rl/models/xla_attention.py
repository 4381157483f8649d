"""The XLA attention path (HF eager numerics: scores scaled after the dot, fp32 softmax): GQA softmax
attention over [B,T,N,H] queries and [B,S,K,H] keys/values (:func:`attend`), its decode forms over the KV
cache's layouts (:func:`attend_cached`, :func:`attend_cached_t`) and the causal block split
(:func:`attend_causal`), with a hand-written backward (:func:`_attn_core`), and the causal attention of
rows at traced offsets that skips the key blocks above the diagonal (:func:`attend_offsets`, the paged
append-prefill on XLA:CPU; inference only). The Qwen3 model
(:mod:`jax_rl.models.qwen3`) and the paged attention's reference path (:mod:`jax_rl.models.paged_attention`)
both read it; the fused kernels (splash, cuDNN) are :mod:`jax_rl.models.attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["attend", "attend_cached", "attend_cached_t", "attend_causal", "attend_offsets"]

_NEG_INF = -1e30  # finite "minus infinity" for masked attention scores (no NaN on empty rows)


def _to_heads(x: Array, K: int) -> Array:
    """[B,T,N,H] -> [B,K,G*T,H] (kv-head major; the G query heads of a kv head stacked on T)."""
    B, T, N, H = x.shape
    return x.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B, K, (N // K) * T, H)


def _from_heads(o: Array, T: int) -> Array:
    """[B,K,G*T,H] -> [B,T,N,H] (inverse of ``_to_heads``)."""
    B, K, M, H = o.shape
    G = M // T
    return o.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def _attn_probs(qh: Array, kh: Array, mask: Array, G: int) -> Array:
    """Softmax probabilities [B,K,G*T,S] float32 (HF eager: scale after the dot, fp32)."""
    B, K, M, H = qh.shape
    S = kh.shape[2]
    s = jnp.einsum("bkmh,bksh->bkms", qh, kh, preferred_element_type=jnp.float32) * (H ** -0.5)
    s = jnp.where(mask[:, None, None], s.reshape(B, K, G, M // G, S), _NEG_INF)
    return jax.nn.softmax(s, axis=-1).reshape(B, K, M, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attn_core(qh: Array, kh: Array, vh: Array, mask: Array, G: int) -> Array:
    """Grouped attention in head-major layout: qh [B,K,G*T,H], kh/vh [B,K,S,H], mask [B,T,S]
    -> [B,K,G*T,H] (vh.dtype). A hand-written backward (same maths as autodiff) whose dots all
    take their operands in row-major order, so XLA:CPU inserts no transposes of [T,S] arrays."""
    return jnp.einsum("bkms,bksh->bkmh", _attn_probs(qh, kh, mask, G).astype(vh.dtype), vh)


def _attn_core_fwd(qh, kh, vh, mask, G):
    p = _attn_probs(qh, kh, mask, G).astype(vh.dtype)
    return jnp.einsum("bkms,bksh->bkmh", p, vh), (qh, kh, vh, mask, p)


def _attn_core_bwd(G, res, do):
    qh, kh, vh, mask, p = res
    B, K, M, H = qh.shape
    S = kh.shape[2]
    do = do.astype(vh.dtype)
    dp = jnp.einsum("bkmh,bksh->bkms", do, vh, preferred_element_type=jnp.float32)
    dv = jnp.einsum("bkhm,bkms->bkhs", do.swapaxes(-1, -2), p).swapaxes(-1, -2)
    pf = p.astype(jnp.float32)
    ds = pf * (dp - jnp.sum(dp * pf, axis=-1, keepdims=True))  # softmax vjp
    ds = jnp.where(mask[:, None, None], ds.reshape(B, K, G, M // G, S), 0.0)  # where vjp
    ds = (ds.reshape(B, K, M, S) * (H ** -0.5)).astype(qh.dtype)
    dq = jnp.einsum("bkms,bksh->bkmh", ds, kh)
    dk = jnp.einsum("bkhm,bkms->bkhs", qh.swapaxes(-1, -2), ds).swapaxes(-1, -2)
    return dq, dk.astype(kh.dtype), dv.astype(vh.dtype), None


_attn_core.defvjp(_attn_core_fwd, _attn_core_bwd)


def attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """GQA softmax attention (HF eager numerics: scores scaled after the dot, fp32 softmax).

    q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] bool (True = may attend) -> [B,T,N,H] (q.dtype).
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    if T == 1:  # decode: no transpose of the cache
        qg = q.reshape(B, K, N // K, H)
        s = jnp.einsum("bkgh,bskh->bkgs", qg, k, preferred_element_type=jnp.float32)
        s = jnp.where(mask[:, :, None, :], s * (H ** -0.5), _NEG_INF)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgs,bskh->bkgh", p, v).reshape(B, 1, N, H).astype(q.dtype)
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)
    o = _attn_core(_to_heads(q, K), kh, vh, mask, N // K)
    return _from_heads(o, T).astype(q.dtype)


def attend_cached(q: Array, kh: Array, vh: Array, mask: Array) -> Array:
    """One-token (decode) GQA attention over a head-major cache (the ``KVCache`` layout).

    q [B,1,N,H], kh/vh [B,K,S,H], mask [B,1,S] bool -> [B,1,N,H] (q.dtype). The same numerics
    as ``attend`` with T == 1; the cache's batch and head dims lead, so the dots read it in
    place (no transpose of the cache).
    """
    # the same einsums as ``attend`` on a [B,S,K,H] view: XLA folds the swapaxes into the
    # dots' dimension numbers (no copy of the cache on TPU), and XLA:CPU gives the same bits
    # as ``attend`` on a [B,S,K,H] cache
    return attend(q, kh.swapaxes(1, 2), vh.swapaxes(1, 2), mask)


def attend_cached_t(q: Array, kt: Array, vh: Array, mask: Array) -> Array:
    """``attend_cached`` over a key-transposed cache (``KVCache.per_layer``'s layout).

    q [B,1,N,H], kt [B,K,H,S], vh [B,K,S,H], mask [B,1,S] bool -> [B,1,N,H] (q.dtype). The same
    einsums as ``attend`` on [B,S,K,H] views: XLA folds the transposes into the dots' dimension
    numbers, so the score dot reads the keys with the positions contiguous (the layout is what
    makes it fast on XLA:CPU), and the values equal ``attend``'s bit for bit.
    """
    return attend(q, kt.transpose(0, 3, 1, 2), vh.swapaxes(1, 2), mask)


_CAUSAL_BLOCK = 80  # query rows per block of the causal attention (see attend_causal)


def attend_causal(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """``attend`` for a mask that is causal (``mask[b,t,s]`` False for ``s > t``) with S == T:
    the queries are split into blocks and block i only scores keys ``< end_i``, skipping the
    upper triangle (~40% of the work at 4 blocks). Same values as ``attend``."""
    B, T, N, H = q.shape
    nb = max(1, min(8, T // _CAUSAL_BLOCK))
    if nb == 1:
        return attend(q, k, v, mask)
    K = k.shape[2]
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)
    bounds = [round(i * T / nb) for i in range(nb + 1)]
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o = _attn_core(_to_heads(q[:, a:b], K), kh[:, :, :b], vh[:, :, :b], mask[:, a:b, :b],
                       N // K)
        outs.append(_from_heads(o, b - a))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)


Q_BLOCK = 256  # query rows per block of attend_offsets (see there; timed by bench/paged_prefill_skip.py)
K_BLOCK = 256  # key positions per block of attend_offsets


def _frontier(starts: Array, lengths: Array, a: int, b: int) -> Array:
    """Keys the query rows ``[a, b)`` need: max over rows of ``starts + min(b, lengths)`` (0 for a row
    with no valid query there), an int32 scalar."""
    last = jnp.minimum(lengths, b)
    return jnp.max(jnp.where(lengths > a, starts + last, 0)).astype(jnp.int32)


def _offset_block(qh: Array, kh: Array, vh: Array, qpos: Array, n: Array, bk: int, G: int) -> Array:
    """Online-softmax attention of one query block over key blocks ``0 .. n-1`` (traced ``n``) of
    ``bk`` keys: qh [B,K,G*tq,H], kh/vh [B,K,S,H], qpos [B,tq] int32 -> [B,K,G*tq,H] float32.
    A key block fully above a query's causal frontier adds exactly nothing to its sums (scores -1e30,
    exp 0, rescale exp(0) = 1), so the values do not depend on ``n`` past each query's own blocks.
    The last block is clamped to end at S (its keys below ``j * bk``, already counted, masked)."""
    B, K, M, H = qh.shape
    S, tq = kh.shape[2], qpos.shape[1]

    def body(j, carry):
        m, l, acc = carry
        s0 = jnp.minimum(j * bk, S - bk)
        spos = s0 + jnp.arange(bk, dtype=jnp.int32)
        kj = jax.lax.dynamic_slice_in_dim(kh, s0, bk, axis=2)
        vj = jax.lax.dynamic_slice_in_dim(vh, s0, bk, axis=2)
        ok = (spos[None, None, :] <= qpos[:, :, None]) & (spos >= j * bk)[None, None, :]  # [B, tq, bk]
        s = jnp.einsum("bkmh,bksh->bkms", qh, kj, preferred_element_type=jnp.float32) * (H ** -0.5)
        s = jnp.where(ok[:, None, None], s.reshape(B, K, G, tq, bk), _NEG_INF).reshape(B, K, M, bk)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkms,bksh->bkmh", p.astype(vh.dtype), vj, preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[..., None] + pv

    init = (jnp.full((B, K, M), -jnp.inf, jnp.float32), jnp.zeros((B, K, M), jnp.float32),
            jnp.zeros((B, K, M, H), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n, body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def attend_offsets(q: Array, k: Array, v: Array, starts: Array, lengths: Array, *,
                   q_block: int = Q_BLOCK, k_block: int = K_BLOCK, skip: bool = True) -> Array:
    """Causal GQA attention of rows that start at traced offsets (the paged append-prefill on XLA:CPU),
    skipping the key blocks above the causal frontier.

    q [B,T,N,H]: row b's query t sits at position ``starts[b] + t`` and is valid for ``t < lengths[b]``;
    k/v [B,S,K,H] keys at positions ``0 .. S-1``; query t attends to keys ``<= starts[b] + t`` (the caller
    makes S cover ``starts + lengths``). starts, lengths [B] int32. Returns [B,T,N,H] (q.dtype).

    The queries are split into static blocks of ``q_block`` rows; block ``[a, b)`` runs an online softmax
    (fp32 max / sum / accumulator, scores scaled after the dot as ``attend``) over key blocks of
    ``k_block`` positions, ``0 .. ceil(f / k_block) - 1`` where f = max over rows of
    ``starts + min(b, lengths)`` (a traced trip count, :func:`jax.lax.fori_loop`): the blocks fully
    above every valid query's frontier, and query blocks past every row's length, are not computed.
    ``skip=False`` runs every key block of every query block (the same values bit for bit: a skipped
    block adds exact zeros; the reference the tests compare against). Padded queries (``t >= lengths``)
    get finite values the caller ignores (0 where their block is skipped). Not reverse-differentiable
    with ``skip`` (a dynamic trip count): inference only. Equals ``attend`` up to fp32 summation order
    (the blocked sum, and the probabilities normalised after the value dot, not before).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    bk = min(int(k_block), S)
    nk = -(-S // bk)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    starts = jnp.asarray(starts, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    outs = []
    for a in range(0, T, int(q_block)):
        b = min(T, a + int(q_block))
        qpos = starts[:, None] + jnp.arange(a, b, dtype=jnp.int32)[None]
        n = jnp.minimum((_frontier(starts, lengths, a, b) + bk - 1) // bk, nk) if skip else nk
        o = _offset_block(_to_heads(q[:, a:b], K), kh, vh, qpos, n, bk, N // K)
        outs.append(_from_heads(o, b - a))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)
