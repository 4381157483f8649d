"""The decode KV cache, one type per layout: :class:`StackedKVCache` (k/v [L,B,K,S,H]) and
:class:`LayerKVCache` (L per-layer buffers, keys transposed); :class:`KVCache` is their common base.

Why two types and not one class whose ``k`` is an array or a tuple: the two layouts are different
programs (a scanned stack needs the stacked form, an unrolled one decodes faster on XLA:CPU over its
own buffers), so code that reads a cache must know which it holds. The type says it, each type's
``k`` has one shape, and each type owns its layout's indexing (:meth:`KVCache.insert`,
:meth:`KVCache.write_decode`), so no reader inspects ``k`` to tell the two apart.
``stacked()`` / ``per_layer()`` convert either way (same values).

Storage: on XLA:CPU a 16-bit float cache is kept as its uint16 bits (:mod:`jax_rl.models.kv_storage`:
XLA:CPU runs bf16 scatters and dynamic-update-slices in f32, so each one-token write converted the
whole cache to f32 and back). ``k`` / ``v`` then hold the bits and ``dtype`` names the values' dtype;
every write goes through :meth:`KVCache.store` and every read through :meth:`KVCache.load` (a
bitcast of what is read: one layer, a window), so the values are bit for bit those of a float cache.
Other backends (and fp32 caches) store the values themselves (``dtype`` None).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jax_rl.models.kv_storage import from_storage, to_storage

Array = jax.Array

__all__ = ["KVCache", "StackedKVCache", "LayerKVCache"]


class KVCache:
    """Base of the two KV cache layouts (a pytree of either subclass; never built itself).

    Every cache has ``k``, ``v`` (stored dtype), ``lengths`` [B] int32 = the number of valid
    positions per slot (the next token of slot b goes to position ``lengths[b]``) and ``dtype``
    (static): the values' dtype when ``k`` / ``v`` hold their uint16 bits (module doc), else None;
    ``is_per_layer`` (a class constant) says which layout it is.
    """

    is_per_layer = False

    @property
    def kv_dtype(self) -> Any:
        """The K/V values' dtype (``dtype``, else the buffers' own)."""
        return self._buf0().dtype if self.dtype is None else jnp.dtype(self.dtype)

    def _buf0(self) -> Array:
        return self.v[0] if isinstance(self.v, tuple) else self.v

    def store(self, x: Array) -> Array:
        """Values ``x`` (any float dtype) as this cache's buffers hold them: cast to :attr:`kv_dtype`,
        as uint16 bits where the cache keeps bits."""
        return to_storage(x, self._buf0().dtype, self.dtype)

    def load(self, x: Array) -> Array:
        """Entries read from this cache's buffers (any slice of ``k`` / ``v``) as values (:attr:`kv_dtype`)."""
        return from_storage(x, self.dtype)

    def adopt(self, other: "KVCache", x: Array) -> Array:
        """Entries ``x`` read from ``other``'s buffers as this cache stores them (as they are when both
        store alike)."""
        if other.dtype == self.dtype and x.dtype == self._buf0().dtype:
            return x
        return self.store(other.load(x))

    @property
    def max_len(self) -> int:
        """S, the positions per slot."""
        raise NotImplementedError

    def stacked(self) -> "StackedKVCache":
        """This cache as a :class:`StackedKVCache` (itself when it is one)."""
        raise NotImplementedError

    def per_layer(self) -> "LayerKVCache":
        """This cache as a :class:`LayerKVCache` (itself when it is one)."""
        raise NotImplementedError

    def insert(self, other: "StackedKVCache", slot: int | Array, row: int = 0) -> "KVCache":
        """Copy row ``row`` of a stacked cache (e.g. a batch-1 prefill; stored as bits or not) into slot
        ``slot``; the result has this cache's type and storage."""
        raise NotImplementedError

    def write_decode(self, kv: tuple[Any, Any], i: int | Array, new_k: Array, new_v: Array,
                     idx: tuple[Array, Array, Array]) -> tuple[tuple[Any, Any], Array, Array]:
        """One decode step's write into layer ``i`` of this layout's ``(k, v)`` buffers (stored as this
        cache stores them) and the read back of that layer as values (``Qwen3ForCausalLM.decode_step``;
        the buffers are the layer carry).

        new_k, new_v [B,K,H]: slot b's new entry goes to position ``pos[b]`` (dropped when
        ``pos[b] >= S``); ``idx = (b [B,1], kv head [1,K], pos [B,1])`` int32 index arrays.
        ``i``: a static layer index (unrolled layers) or a traced one (scanned). Returns the new
        buffers and layer i's keys and values in this layout's per-layer form (stacked:
        [B,K,S,H] each; per-layer: keys [B,K,H,S], values [B,K,S,H]).
        """
        raise NotImplementedError


@flax.struct.dataclass
class StackedKVCache(KVCache):
    """The stacked layout: k, v [L,B,K,S,H] (cache dtype; head-major, as JetStream/MaxText decode
    caches, so the decode attention reads each layer's [B,K,S,H] in place); lengths [B] int32.

    What :meth:`Qwen3ForCausalLM.init_cache` builds and ``prefill`` / ``extend`` write; the form a
    ``scan_layers`` model decodes with (the whole buffer is the scan carry, written at one
    position per layer and step).
    """

    k: Array
    v: Array
    lengths: Array
    dtype: Any = flax.struct.field(pytree_node=False, default=None)

    is_per_layer = False

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def stacked(self) -> "StackedKVCache":
        return self

    def per_layer(self) -> "LayerKVCache":
        L = self.k.shape[0]
        return LayerKVCache(k=tuple(self.k[i].swapaxes(2, 3) for i in range(L)),
                            v=tuple(self.v[i] for i in range(L)), lengths=self.lengths, dtype=self.dtype)

    def insert(self, other: "StackedKVCache", slot: int | Array, row: int = 0) -> "StackedKVCache":
        s = other.k.shape[3]
        k = self.k.at[:, slot, :, :s].set(self.adopt(other, other.k[:, row]))
        v = self.v.at[:, slot, :, :s].set(self.adopt(other, other.v[:, row]))
        return self.replace(k=k, v=v, lengths=self.lengths.at[slot].set(other.lengths[row]))

    def write_decode(self, kv, i, new_k, new_v, idx):
        # one scatter per buffer: c[i, b, k, pos[b]] = new[b, k] (the bits, on a cache of bits)
        ck, cv = (c.at[(i, *idx)].set(self.store(n), mode="drop") for c, n in zip(kv, (new_k, new_v)))
        if isinstance(i, jax.Array):  # scanned: traced layer index
            ki, vi = (jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False) for c in (ck, cv))
        else:  # unrolled: a static layer index
            ki, vi = ck[int(i)], cv[int(i)]
        return (ck, cv), self.load(ki), self.load(vi)  # one layer bitcast, fused into its reader


@flax.struct.dataclass
class LayerKVCache(KVCache):
    """The per-layer layout (what the rollout engine keeps for unrolled layers, i.e. off a TPU):
    k a tuple of L key-transposed arrays [B,K,H,S], v a tuple of L arrays [B,K,S,H]; lengths [B]
    int32.

    Same values as the stacked form; ``decode_step`` then writes and reads each layer's own
    buffer, where the stacked form makes XLA:CPU copy the layer's [B,K,S,H] out of the [L,...]
    buffer before the attention dots (two cache-layer copies per layer per token). Keys are stored
    transposed so the decode score dot ``q [G,H] @ k [H,S]`` has the positions as its contiguous
    output dim: XLA:CPU ran it 2.8x faster than over [B,K,S,H] (32 slots x 145 positions, 4 kv
    heads of 32: 0.43 vs 1.2 ms, ``bench/rollout_decode.py``). Scanned layers need the stacked form.
    """

    k: tuple[Array, ...]
    v: tuple[Array, ...]
    lengths: Array
    dtype: Any = flax.struct.field(pytree_node=False, default=None)

    is_per_layer = True

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]

    def stacked(self) -> StackedKVCache:
        return StackedKVCache(k=jnp.stack([k.swapaxes(2, 3) for k in self.k]), v=jnp.stack(self.v),
                              lengths=self.lengths, dtype=self.dtype)

    def per_layer(self) -> "LayerKVCache":
        return self

    def insert(self, other: StackedKVCache, slot: int | Array, row: int = 0) -> "LayerKVCache":
        s = other.k.shape[3]
        k = tuple(c.at[slot, :, :, :s].set(self.adopt(other, other.k[i, row].swapaxes(1, 2)))
                  for i, c in enumerate(self.k))
        v = tuple(c.at[slot, :, :s].set(self.adopt(other, other.v[i, row])) for i, c in enumerate(self.v))
        return self.replace(k=k, v=v, lengths=self.lengths.at[slot].set(other.lengths[row]))

    def write_decode(self, kv, i, new_k, new_v, idx):
        # layer i's own buffers: keys [B,K,H,S] c[b, k, :, pos[b]], values [B,K,S,H] c[b, k, pos[b]]
        i, (b, h, p) = int(i), idx
        ck, cv = list(kv[0]), list(kv[1])
        ck[i] = ck[i].at[b, h, :, p].set(self.store(new_k), mode="drop")
        cv[i] = cv[i].at[b, h, p].set(self.store(new_v), mode="drop")
        return (tuple(ck), tuple(cv)), self.load(ck[i]), self.load(cv[i])

