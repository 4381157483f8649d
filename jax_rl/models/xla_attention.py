"""The XLA attention path (HF eager numerics: scores scaled after the dot, fp32 softmax): GQA softmax
attention over [B,T,N,H] queries and [B,S,K,H] keys/values (:func:`attend`), its decode forms over the KV
cache's layouts (:func:`attend_cached`, :func:`attend_cached_t`) and the causal block split
(:func:`attend_causal`), with a hand-written backward (:func:`_attn_core`). The Qwen3 model
(:mod:`jax_rl.models.qwen3`) and the paged attention's reference path (:mod:`jax_rl.models.paged_attention`)
both read it; the fused kernels (splash, cuDNN) are :mod:`jax_rl.models.attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["attend", "attend_cached", "attend_cached_t", "attend_causal"]

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
