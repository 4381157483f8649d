"""The decode KV cache (:class:`KVCache`), stacked or per-layer."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["KVCache"]


@flax.struct.dataclass
class KVCache:
    """Per-slot KV cache (a pytree).

    k, v: [L,B,K,S,H] (cache dtype; head-major, as JetStream/MaxText decode caches, so the
    decode attention reads each layer's [B,K,S,H] in place); lengths: [B] int32 = number of
    valid positions per slot (the next token of slot b goes to position ``lengths[b]``).

    Per-layer form (``per_layer()``; what the rollout engine keeps for unrolled layers, i.e. off
    a TPU): k is a tuple of L key-transposed arrays [B,K,H,S] and v a tuple of L arrays
    [B,K,S,H]. Same values; ``decode_step`` then writes and reads each layer's own buffer,
    where the stacked form makes XLA:CPU copy the layer's [B,K,S,H] out of the [L,...] buffer
    before the attention dots (two cache-layer copies per layer per token). Keys are stored
    transposed so the decode score dot ``q [G,H] @ k [H,S]`` has the positions as its
    contiguous output dim: XLA:CPU ran it 2.8x faster than over [B,K,S,H] (32 slots x 145
    positions, 4 kv heads of 32: 0.43 vs 1.2 ms, ``bench/rollout_decode.py``). Scanned layers
    need the stacked form.
    """

    k: Any
    v: Any
    lengths: Array

    @property
    def is_per_layer(self) -> bool:
        return isinstance(self.k, (tuple, list))

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2] if self.is_per_layer else self.k.shape[3]

    def per_layer(self) -> "KVCache":
        """This cache with k as a tuple of per-layer key-transposed [B,K,H,S] arrays and v as a
        tuple of per-layer [B,K,S,H] arrays."""
        if self.is_per_layer:
            return self
        L = self.k.shape[0]
        return KVCache(k=tuple(self.k[i].swapaxes(2, 3) for i in range(L)),
                       v=tuple(self.v[i] for i in range(L)),
                       lengths=self.lengths)

    def stacked(self) -> "KVCache":
        """This cache with k/v as [L,B,K,S,H] arrays."""
        if not self.is_per_layer:
            return self
        return KVCache(k=jnp.stack([k.swapaxes(2, 3) for k in self.k]), v=jnp.stack(self.v),
                       lengths=self.lengths)

    def insert(self, other: "KVCache", slot: int | Array, row: int = 0) -> "KVCache":
        """Copy row ``row`` of another (stacked) cache (e.g. a batch-1 prefill) into slot ``slot``."""
        s = other.k.shape[3]
        if self.is_per_layer:
            k = tuple(c.at[slot, :, :, :s].set(other.k[i, row].swapaxes(1, 2).astype(c.dtype))
                      for i, c in enumerate(self.k))
            v = tuple(c.at[slot, :, :s].set(other.v[i, row].astype(c.dtype)) for i, c in enumerate(self.v))
        else:
            k = self.k.at[:, slot, :, :s].set(other.k[:, row].astype(self.k.dtype))
            v = self.v.at[:, slot, :, :s].set(other.v[:, row].astype(self.v.dtype))
        return KVCache(k=k, v=v, lengths=self.lengths.at[slot].set(other.lengths[row]))
