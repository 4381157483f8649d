"""Qwen3 decode and append-prefill over a paged K/V pool (:mod:`jax_rl.models.paged_attention`).

:class:`PagedKVCache` holds the pool, the page table and the live lengths;
:func:`paged_decode_step` and :func:`paged_extend` are ``Qwen3ForCausalLM.decode_step`` /
``extend`` on it: the new tokens' K/V are written through the page table, and the attention reads
only the pages a row holds (``num_pages``, a static bucket of them, on the XLA path; the TPU
kernel reads the table itself). Same numerics as the contiguous cache (HF eager: fp32 softmax,
scale after the dot): equal to ``decode_step`` / ``extend`` up to fp32 summation order.
A prefill from position 0 is :func:`paged_extend` with ``starts = 0``.

Which rows own which pages is the host's business (``rollout.engine.paged.pool.PagePool``); the device side
only follows the table. A table entry of -1 is "no page": writes there are dropped, reads are
masked (a row never attends past its length).

Split over pages (``PagedKVCache.pool_spec`` names mesh axes on the page axis: a sharded rollout
engine whose slots are split over ``data`` / ``expert``): the pool of P pages is D sub-pools of P / D
(shard d's pages ``[d P/D, (d+1) P/D)``), the rows are split over the same axes (B / D a shard), and a
row's table entries are page ids *within its shard's sub-pool*. The write, the attention and
:func:`copy_pages` run per shard in ``jax.shard_map``, so no shard reads or writes another's pages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jax_rl.models.paged_attention import (gather_contiguous, paged_attention, paged_attention_local, pool_storage_dtype,
                                          write_kv)
from jax_rl.models.qwen3.cache import KVCache, LayerKVCache, StackedKVCache
from jax_rl.models.qwen3.outputs import ModelOutput

Array = jax.Array

__all__ = ["PagedKVCache", "init_paged_cache", "paged_decode_step", "paged_extend", "copy_pages", "gather_window",
           "write_window", "write_prefix"]


@flax.struct.dataclass
class PagedKVCache:
    """A paged K/V pool with its page table.

    kv: the pool, either one array [L, P, page_size, 2K, H] (stacked; what ``scan_layers``
        needs) or a tuple of L arrays [P, page_size, 2K, H] (per layer; unrolled layers read each
        layer's pool in place, the TPU kernel included), cache dtype; keys of kv head k at
        combined head 2k, values at 2k+1 (the TPU ragged paged attention layout).
    page_table: [B, M] int32, row b's j-th page (positions [j*ps, (j+1)*ps)); -1 = none.
    lengths: [B] int32, positions held per row (the next token of row b goes to ``lengths[b]``).
    pool_spec: static, one layer's pool [P, page_size, 2K, H] as a ``PartitionSpec`` on the ambient mesh
        (a sharded engine's; None: no mesh). A page axis split over mesh axes (D shards) makes the pool D
        sub-pools of P / D pages, the rows split alike, table entries numbered within the row's sub-pool
        (module doc); a page axis of None: one pool, global page ids.
    dtype: the K/V values' dtype when ``kv`` holds their uint16 bits (a bf16 pool on XLA:CPU,
        ``jax_rl.models.paged_attention.pool_storage_dtype``); None: ``kv``'s own dtype. Static.
    """

    kv: Any
    page_table: Array
    lengths: Array
    pool_spec: Any = flax.struct.field(pytree_node=False, default=None)
    dtype: Any = flax.struct.field(pytree_node=False, default=None)

    @property
    def page_axes(self) -> Any:
        """The mesh axes the pool's pages (and the rows) are split over; None: not split."""
        return None if self.pool_spec is None else self.pool_spec[0]

    @property
    def kv_dtype(self) -> Any:
        """The K/V values' dtype (``dtype``, else the pool's)."""
        return self._layer0().dtype if self.dtype is None else jnp.dtype(self.dtype)

    @property
    def page_size(self) -> int:
        return self._layer0().shape[-3]

    @property
    def num_pages(self) -> int:
        """P, the pool's pages."""
        return self._layer0().shape[-4]

    def _layer0(self) -> Array:
        return self.kv[0] if isinstance(self.kv, tuple) else self.kv

    def attend_view(self, kv: Any, i: int | Array) -> tuple[Array, Array]:
        """Layer i's pages of ``kv`` as the attention reads them: ``(pool, page_table)``. Per layer:
        that layer's pool and the table. Stacked [L, P, ...]: the whole pool seen as one of L*P pages
        (a reshape of its leading axes: no copy) and the table offset by ``i * P`` (-1 kept), so the
        TPU kernel, whose operand is a whole buffer, reads the layer's pages where they are; given
        the layer's slice instead, XLA copied every layer's whole pool out of the stack each step."""
        if isinstance(kv, tuple):
            return kv[int(i)], self.page_table
        return _stacked_view(kv, self.page_table, i)


def _stacked_view(kv: Array, table: Array, i) -> tuple[Array, Array]:
    """A stacked pool [L, P, ...] as one of L*P pages and ``table`` offset to layer i's (-1 kept)."""
    L, n = kv.shape[:2]
    return kv.reshape(L * n, *kv.shape[2:]), jnp.where(table >= 0, table + jnp.asarray(i, jnp.int32) * n, -1)


def init_paged_cache(model, batch_size: int, num_pages: int, page_size: int, max_pages: int,
                     dtype=None, per_layer: bool | None = None, pool_spec: Any = None) -> PagedKVCache:
    """An empty pool of ``num_pages`` pages of ``page_size`` positions (zeros, ``dtype``, default
    the model's compute dtype), a page table [batch_size, max_pages] of -1, lengths 0.
    ``per_layer`` (default: not ``model.scan_layers``) picks the tuple form; ``pool_spec``: the
    :class:`PagedKVCache` field (split over pages: ``num_pages`` and ``batch_size`` divide by the shards).
    Stored as ``pool_storage_dtype(dtype)`` (a bf16 pool traced for XLA:CPU: its uint16 bits, ``dtype`` set)."""
    c = model.config
    dt = model.dtype if dtype is None else jnp.dtype(dtype)
    store = pool_storage_dtype(dt)
    shape = (num_pages, page_size, 2 * c.num_key_value_heads, c.head_dim)
    per_layer = (not model.scan_layers) if per_layer is None else per_layer
    if per_layer and model.scan_layers:
        raise ValueError("a per-layer paged pool needs unrolled layers (model.scan_layers is set)")
    L = c.num_hidden_layers
    kv = tuple(jnp.zeros(shape, store) for _ in range(L)) if per_layer else jnp.zeros((L, *shape), store)
    return PagedKVCache(kv=kv, page_table=jnp.full((batch_size, max_pages), -1, jnp.int32),
                        lengths=jnp.zeros((batch_size,), jnp.int32), pool_spec=pool_spec,
                        dtype=None if store == dt else dt)


def _pool_specs(cache: PagedKVCache, stacked: bool) -> tuple:
    """(page axes, head axes, the pool's spec: stacked [L, P, ...] or one layer's [P, ...])."""
    b, h = cache.pool_spec[0], cache.pool_spec[2]
    return b, h, P(*((None,) if stacked else ()), b, None, h, None)


class _Rows(NamedTuple):
    """Where a call's rows write and what they attend to: ``positions`` [B, T] int32 of the new tokens,
    ``valid`` [B, T] bool (a padded token writes nothing), ``starts`` / ``lengths`` [B] int32 (positions held
    before the call, new positions)."""

    positions: Array
    valid: Array
    starts: Array
    lengths: Array


def _layer_pool_step(cache: PagedKVCache, kv: Any, i, q, k, v, rows: _Rows, num_pages, backend) -> tuple[Array, Any]:
    """Layer i: the new K/V written through the table, then attention over the rows' pages: (o, kv).
    Split over pages (module doc): per shard in ``jax.shard_map`` (rows, the layer's sub-pool, q and kv
    heads as the pool's head axis), so each shard writes and reads only its own sub-pool."""
    positions, valid, starts, lengths = rows
    if cache.page_axes is None:
        kv = _write(cache, kv, i, positions, k, v, valid)
        o = paged_attention(q, *cache.attend_view(kv, i), starts, lengths, num_pages, backend=backend,
                            kv_dtype=cache.kv_dtype)
        return o, kv
    stacked = not isinstance(kv, tuple)
    b, h, pspec = _pool_specs(cache, stacked)

    def local(q, k, v, pool, table, positions, valid, starts, lengths, li):
        pool = write_kv(pool, table, positions, k, v, valid, layer=li if stacked else None, dtype=cache.dtype)
        view, t = _stacked_view(pool, table, li) if stacked else (pool, table)
        return paged_attention_local(q, view, t, starts, lengths, num_pages, backend=backend,
                                     kv_dtype=cache.kv_dtype), pool

    heads, rows = P(b, None, h, None), P(b, None)
    body = jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), check_vma=False,
                         in_specs=(heads, heads, heads, pspec, rows, rows, rows, P(b), P(b), P()),
                         out_specs=(heads, pspec))
    o, pool = body(q, k, v, kv if stacked else kv[int(i)], cache.page_table, positions, valid, starts, lengths,
                   jnp.asarray(i if stacked else 0, jnp.int32))
    return o, pool if stacked else tuple(pool if j == int(i) else x for j, x in enumerate(kv))


def _write(cache: PagedKVCache, kv: Any, i, positions, k, v, valid) -> Any:
    if isinstance(kv, tuple):
        out = list(kv)
        out[int(i)] = write_kv(kv[int(i)], cache.page_table, positions, k, v, valid, dtype=cache.dtype)
        return tuple(out)
    return write_kv(kv, cache.page_table, positions, k, v, valid, layer=i, dtype=cache.dtype)


def _layer_ids(model) -> Any:
    L = model.config.num_hidden_layers
    return jnp.arange(L, dtype=jnp.int32) if model.scan_layers else tuple(range(L))


def paged_decode_step(model, tokens: Array, cache: PagedKVCache, *, num_pages: int | None = None,
                      forced_expert_ids=None, return_expert_ids: bool = False,
                      valid: Array | None = None, return_moe_drops: bool = False,
                      write: Array | None = None, backend: str | None = None) -> ModelOutput:
    """One decode token per row: ``Qwen3ForCausalLM.decode_step`` on a :class:`PagedKVCache`.

    tokens [B] int32 goes to position ``cache.lengths[b]`` (its K/V written into the page the
    table names; a row without that page writes nothing) and attends to positions
    ``<= lengths[b]``; lengths += 1. ``num_pages`` (static): pages gathered per row on the XLA
    path, >= every row's ``ceil((lengths + 1) / page_size)`` (``page_bucket``; default all M).
    ``valid`` [B] bool: the rows whose token takes MoE capacity (None: all). ``write`` [B] bool: the
    rows whose K/V are written (None: all; an engine's inactive slots write nothing).
    ``backend``: the attention path (``paged_attention``). Returns :class:`ModelOutput` (logits
    [B,V] f32, ``cache`` a :class:`PagedKVCache`; ``expert_ids`` / ``moe_drops`` as decode_step).
    """
    tokens = jnp.asarray(tokens)
    backend = "bitwise" if model.bitwise else backend
    B = tokens.shape[0]
    pos = cache.lengths.astype(jnp.int32)
    write_ok = jnp.ones((B, 1), bool) if write is None else jnp.asarray(write, bool)[:, None]
    ones = jnp.ones((B,), jnp.int32)

    def layer_attend(q, k, v, i, kv):
        o, kv = _layer_pool_step(cache, kv, i, q, k, v, _Rows(pos[:, None], write_ok, pos, ones), num_pages, backend)
        return o.astype(q.dtype), None, kv

    forced = None if forced_expert_ids is None else [jnp.asarray(f)[:, None] for f in forced_expert_ids]
    mvalid = None if valid is None else jnp.asarray(valid, bool)[:, None]
    t = model._trunk(model.embed(tokens[:, None]), pos[:, None], layer_attend, _layer_ids(model), forced,
                     carry=cache.kv, valid=mvalid, row_drops=return_moe_drops)
    return ModelOutput(logits=model.lm_logits(t.h)[:, 0], cache=cache.replace(kv=t.carry, lengths=pos + 1),
                       expert_ids=tuple(i[:, 0] for i in t.expert_ids) if return_expert_ids else None,
                       moe_drops=model._moe_drops(t, mvalid, (B, 1), True) if return_moe_drops else None)


def paged_extend(model, input_ids: Array, starts: Array, lengths: Array, cache: PagedKVCache, *,
                 num_pages: int | None = None, return_expert_ids: bool = False,
                 return_moe_drops: bool = False, backend: str | None = None) -> ModelOutput:
    """Append-prefill (``Qwen3ForCausalLM.extend``) on a :class:`PagedKVCache`; with
    ``starts == 0`` a prefill.

    input_ids [B,T] int32 right-padded, ``starts`` [B] int32 (positions already held), ``lengths``
    [B] int32 (valid new tokens): token t of row b goes to position ``starts[b] + t``, its K/V into
    the row's page there, and attends to positions ``<= starts[b] + t``. The table must already
    name pages for positions ``< starts + lengths``. ``num_pages`` as in
    :func:`paged_decode_step` (>= ``ceil((starts + lengths) / page_size)``). Padded tokens write
    nothing and take no MoE capacity. Returns :class:`ModelOutput` (logits [B,T,V] f32, ``cache``
    with ``lengths = starts + lengths``; ``expert_ids`` / ``moe_drops`` as ``extend``).
    """
    input_ids = jnp.asarray(input_ids)
    B, T = input_ids.shape
    starts = jnp.asarray(starts, jnp.int32)
    backend = "bitwise" if model.bitwise else backend
    lengths = jnp.asarray(lengths, jnp.int32)
    positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    valid = jnp.arange(T)[None, :] < lengths[:, None]

    def layer_attend(q, k, v, i, kv):
        o, kv = _layer_pool_step(cache, kv, i, q, k, v, _Rows(positions, valid, starts, lengths), num_pages, backend)
        return o.astype(q.dtype), None, kv

    t = model._trunk(model.embed(input_ids), positions, layer_attend, _layer_ids(model), carry=cache.kv,
                     valid=valid, row_drops=return_moe_drops)
    return ModelOutput(logits=model.lm_logits(t.h), cache=cache.replace(kv=t.carry, lengths=starts + lengths),
                       expert_ids=t.expert_ids if return_expert_ids else None,
                       moe_drops=model._moe_drops(t, valid, (B, T), True) if return_moe_drops else None)


def _copy_pages(kv: Any, src: Array, dst: Array) -> Any:
    src = jnp.maximum(jnp.asarray(src, jnp.int32), 0)
    dst = jnp.asarray(dst, jnp.int32)
    if isinstance(kv, tuple):
        return tuple(p.at[jnp.where(dst < 0, p.shape[0], dst)].set(p[src], mode="drop") for p in kv)
    return kv.at[:, jnp.where(dst < 0, kv.shape[1], dst)].set(kv[:, src], mode="drop")


def copy_pages(cache: PagedKVCache, src: Array, dst: Array) -> PagedKVCache:
    """Copy pages ``src`` [n] int32 to ``dst`` [n] int32 in every layer's pool (the device half of a
    copy-on-write, ``rollout.engine.paged.pool.PagePool.ensure``); a ``dst`` of -1 copies nothing (padding). Split
    over D shards of pages (module doc): n = D x m, shard d's m copies at ``[d m, (d+1) m)``, page ids
    within its sub-pool, done per shard in ``jax.shard_map`` (no page crosses shards)."""
    if cache.page_axes is None:
        return cache.replace(kv=_copy_pages(cache.kv, src, dst))
    stacked = not isinstance(cache.kv, tuple)
    b, _, pspec = _pool_specs(cache, stacked)
    specs = pspec if stacked else tuple(pspec for _ in cache.kv)
    body = jax.shard_map(_copy_pages, mesh=jax.sharding.get_abstract_mesh(), in_specs=(specs, P(b), P(b)),
                         out_specs=specs, check_vma=False)
    return cache.replace(kv=body(cache.kv, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)))


def _write_prefix_rows(kv: Any, table: Array, k: Array, v: Array, valid: Array, dtype: Any) -> Any:
    """Every layer's prefix entries k / v [L, 1, K, P, H] at positions ``[0, P)`` where ``valid`` [1, P], through
    ``table`` [1, M] (one row's page-table row), into ``kv`` (a stacked pool or a tuple of per-layer pools)."""
    pos = jnp.broadcast_to(jnp.arange(k.shape[3], dtype=jnp.int32)[None], valid.shape)
    for i in range(k.shape[0]):
        ki, vi = k[i].swapaxes(1, 2), v[i].swapaxes(1, 2)  # [1, P, K, H]
        if isinstance(kv, tuple):
            kv = tuple(write_kv(p, table, pos, ki, vi, valid, dtype=dtype) if j == i else p for j, p in enumerate(kv))
        else:
            kv = write_kv(kv, table, pos, ki, vi, valid, layer=i, dtype=dtype)
    return kv


def write_prefix(cache: PagedKVCache, k: Array, v: Array, n: Array, row: Array) -> PagedKVCache:
    """A batch-1 prefix's K/V (JetStream's ``insert``) into row ``row``'s pages: positions ``[0, n)`` of
    k / v [L, 1, K, P, H] (the compute dtype's values; positions ``>= n`` are not written) through the row's
    page-table row, which must name pages for them (a -1 entry drops the write); ``n`` and ``row`` int32
    scalars. Lengths unchanged (the caller sets the row's). Split over pages (module doc): per shard in
    ``jax.shard_map``, the shard whose rows hold ``row`` writing into its own sub-pool (its table entries are
    its page ids), the others nothing; k / v split on their kv-head axis as the pool's head axis."""
    n, row = jnp.asarray(n, jnp.int32), jnp.asarray(row, jnp.int32)
    valid = jnp.arange(k.shape[3], dtype=jnp.int32)[None] < n  # [1, P]
    if cache.page_axes is None:
        table = jax.lax.dynamic_slice_in_dim(cache.page_table, row, 1, axis=0)
        return cache.replace(kv=_write_prefix_rows(cache.kv, table, k, v, valid, cache.dtype))
    stacked = not isinstance(cache.kv, tuple)
    b, h, pspec = _pool_specs(cache, stacked)

    def local(kv, table, k, v, valid, row):
        rows = table.shape[0]
        r = row - jax.lax.axis_index(b) * rows  # the row within this shard's rows
        mine = (r >= 0) & (r < rows)
        t = jax.lax.dynamic_slice_in_dim(table, jnp.clip(r, 0, rows - 1), 1, axis=0)
        return _write_prefix_rows(kv, t, k, v, valid & mine, cache.dtype)

    specs = pspec if stacked else tuple(pspec for _ in cache.kv)
    heads = P(None, None, h, None, None)
    body = jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), check_vma=False,
                         in_specs=(specs, P(b, None), heads, heads, P(), P()), out_specs=specs)
    return cache.replace(kv=body(cache.kv, cache.page_table, k, v, valid, row))


def gather_window(cache: PagedKVCache, num_pages: int) -> KVCache:
    """The first ``num_pages`` pages of every row as a contiguous cache of ``W = num_pages * page_size``
    positions: a :class:`LayerKVCache` (keys [B,K,H,W], values [B,K,W,H] per layer) for a per-layer pool,
    a :class:`StackedKVCache` ([L,B,K,W,H]) for a stacked one; stored as the pool stores (its uint16 bits
    and ``dtype`` where it keeps bits), ``lengths`` the cache's. Table entries of -1 read page 0 (past a
    row's length, masked by the decode). What the XLA:CPU decode runs its steps on (gathered once a call,
    not once a step and layer: :func:`write_window` puts the new entries back). Unsplit pools only
    (``cache.page_axes`` None; raises ValueError otherwise: a split pool's table is shard-local)."""
    if cache.page_axes is not None:
        raise ValueError("gather_window needs a pool not split over pages (cache.page_axes is set)")
    n = int(num_pages)
    if isinstance(cache.kv, tuple):  # gather_contiguous's [B, W, K, H] keys / values, as stored
        kv = [gather_contiguous(p, cache.page_table, n) for p in cache.kv]
        return LayerKVCache(k=tuple(k.transpose(0, 2, 3, 1) for k, _ in kv), v=tuple(v.swapaxes(1, 2) for _, v in kv),
                            lengths=cache.lengths, dtype=cache.dtype)
    k, v = gather_contiguous(cache.kv, cache.page_table, n)  # [L, B, W, K, H]
    return StackedKVCache(k=k.swapaxes(2, 3), v=v.swapaxes(2, 3), lengths=cache.lengths, dtype=cache.dtype)


def write_window(cache: PagedKVCache, window: KVCache, starts: Array, n: int) -> PagedKVCache:
    """Back into the pages: positions ``[starts[b], window.lengths[b])`` of every row of ``window`` (at most
    ``n`` of them: a call's new entries; ``starts`` [B] int32, the lengths the window was gathered at),
    written through ``cache``'s page table (:func:`jax_rl.models.paged_attention.write_kv`: a row without
    a page there writes nothing); lengths become ``window.lengths``. ``window`` as :func:`gather_window`
    built it (same storage). Returns the :class:`PagedKVCache` (pool updated in place under a donated jit)."""
    n = int(n)
    starts = jnp.asarray(starts, jnp.int32)
    pos = starts[:, None] + jnp.arange(n, dtype=jnp.int32)[None]  # [B, n]
    valid = pos < window.lengths[:, None]
    rows = jnp.arange(pos.shape[0], dtype=jnp.int32)[:, None]
    at = jnp.clip(pos, 0, window.max_len - 1)
    L = len(window.v) if window.is_per_layer else window.v.shape[0]

    def entries(i: int) -> tuple[Array, Array]:  # layer i's [B, n, K, H] keys and values (values, not bits)
        if window.is_per_layer:
            return window.load(window.k[i][rows, :, :, at]), window.load(window.v[i][rows, :, at])
        return window.load(window.k[i][rows, :, at]), window.load(window.v[i][rows, :, at])

    kv = cache.kv
    for i in range(L):
        k, v = entries(i)
        if isinstance(kv, tuple):
            kv = tuple(write_kv(p, cache.page_table, pos, k, v, valid, dtype=cache.dtype) if j == i else p
                       for j, p in enumerate(kv))
        else:
            kv = write_kv(kv, cache.page_table, pos, k, v, valid, layer=i, dtype=cache.dtype)
    return cache.replace(kv=kv, lengths=window.lengths)
