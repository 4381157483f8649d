"""Paged K/V: the pool layout, the write of new entries through a page table, and attention over
the pages a sequence holds (the XLA reference, and the TPU ragged paged attention kernel wrapped
to the same interface).

Layout (the one ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` reads, so the kernel
reads the pool in place): one layer's pool is ``kv_pages [P, page_size, 2K, H]`` with the keys of
kv head k at combined head ``2k`` and its values at ``2k + 1``; a model's pool stacks the layers,
``[L, P, page_size, 2K, H]``. A sequence's positions ``[j * page_size, (j + 1) * page_size)`` live
in page ``page_table[b, j]``; ``page_table [B, M]`` int32 (M = pages a sequence may hold); entries
past a sequence's held pages are never read unmasked; -1 there means "no page" (a write to it
is dropped). On XLA:CPU a bf16 / f16 pool is stored as its uint16 bits (:func:`pool_storage_dtype`,
:mod:`jax_rl.models.kv_storage`): the write scatters the bits and the gathered pages are bitcast back
(the values bit for bit the same). Other backends store the float dtype itself.

Query convention (both paths): row b's new tokens ``t < lengths[b]`` sit at positions
``starts[b] + t``; their K/V are already in the pool (``write_kv`` before the attention, as the
kernel expects); token t attends to positions ``<= starts[b] + t``. Decode is ``T == 1``,
``lengths == 1``; append-prefill is ``T > 1`` with ``starts`` the cached length.

Which path runs where (``paged_attention``): TPU: the ragged paged attention kernel; CPU and GPU:
the XLA gather path (the rollout engine's multi-step decode on CPU gathers once a call instead:
``jax_rl.models.qwen3.paged.gather_window``; the CPU's append-prefill skips the key blocks above the
causal frontier: ``jax_rl.models.xla_attention.attend_offsets``). The Pallas GPU ``paged_attention``
(``jax.experimental.pallas.ops.gpu``) is decode-only (one query per sequence) and wants separate
``[K, P, page_size, H]`` key and value pools; in this layout it would need a transpose of the pool per
step, so the GPU runs the XLA path.

On a mesh (a sharded rollout engine, ``jax.set_mesh``): the pool's combined head axis is split over
the axis that splits the kv heads (``tensor``), in whole kv heads, so each shard's slice keeps the
key/value interleave; the XLA path is partitioned by XLA, the kernel runs per shard in
``jax.shard_map`` (:func:`paged_attention_kernel_sharded`). Where the slots are split too (over
``data`` / ``expert``: :func:`pool_page_axes`), the pool's page axis is split over the same axes, one
sub-pool per shard of slots, and the write and the attention run per shard in ``jax.shard_map``
(``jax_rl.models.qwen3.paged``; :func:`paged_attention_local` inside).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_rl.models.backend_target import current_target_backend
from jax_rl.models.bitwise import chunked_attend
from jax_rl.models.kv_storage import from_storage, to_storage
from jax_rl.models.kv_storage import storage_dtype as pool_storage_dtype
from jax_rl.models.xla_attention import attend, attend_cached_t, attend_offsets
from jax_rl.sharding import logical_to_pspec

Array = jax.Array

__all__ = ["pages_for", "page_bucket", "combine_kv", "write_kv", "paged_attention_xla",
           "paged_attention_kernel", "paged_attention_kernel_ref", "paged_attention_kernel_sharded",
           "paged_attention", "paged_attention_local", "gather_contiguous", "pool_head_spec", "pool_page_axes",
           "pool_storage_dtype"]


def pages_for(length: int, page_size: int) -> int:
    """Pages holding ``length`` positions (ceil division; 0 for 0)."""
    return -(-int(length) // int(page_size))


def page_bucket(live_pages: int, max_pages: int) -> int:
    """The static page count an attention call gathers: the next power of two >= ``live_pages``
    (at least 1), capped at ``max_pages`` (so at most log2(M) + 1 programs compile)."""
    n = 1
    while n < live_pages:
        n *= 2
    return min(n, int(max_pages))


def combine_kv(k: Array, v: Array) -> Array:
    """k, v [..., K, H] -> [..., 2K, H] with k at even and v at odd combined heads (the pool's)."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def write_kv(kv_pages: Array, page_table: Array, positions: Array, k: Array, v: Array,
             valid: Array, layer: int | Array | None = None, dtype=None) -> Array:
    """Scatter new K/V into the pool through the page table.

    kv_pages [P, ps, 2K, H] (or [L, P, ps, 2K, H] with ``layer``, a static or traced index);
    page_table [B, M] int32; positions [B, T] int32 (absolute positions); k, v [B, T, K, H];
    valid [B, T] bool: only valid tokens are written (the others, and positions past the table,
    are dropped). ``dtype``: the values' dtype when ``kv_pages`` holds their uint16 bits
    (:func:`pool_storage_dtype`; None: the pool's dtype). Returns the updated pool (same shape and
    dtype; in place under jit with the pool donated).
    """
    ps = kv_pages.shape[-3]
    P = kv_pages.shape[-4]
    M = page_table.shape[1]
    j = positions // ps
    page = jnp.take_along_axis(page_table, jnp.clip(j, 0, M - 1), axis=1)
    page = jnp.where(valid & (j < M) & (positions >= 0) & (page >= 0), page, P)  # P: out of bounds, dropped
    new = to_storage(combine_kv(k, v), kv_pages.dtype, dtype)  # [B, T, 2K, H], the pool's bits where it holds them
    idx = (page, positions % ps) if layer is None else (layer, page, positions % ps)
    return kv_pages.at[idx].set(new, mode="drop")


def gather_contiguous(kv_pages: Array, page_table: Array, num_pages: int, dtype=None) -> tuple[Array, Array]:
    """The first ``num_pages`` pages of every row as contiguous keys and values [B, S, K, H]
    (S = num_pages * page_size; the cache's value dtype: ``dtype`` for a pool of uint16 bits, see
    :func:`write_kv`; None: as stored). ``kv_pages`` [P, ps, 2K, H], or with leading axes (a stacked
    pool [L, P, ps, 2K, H] gives [L, B, S, K, H]). Keys and values are gathered apart: each gather then
    has one consumer, into which XLA fuses it (one pass over the pages to the layout the attention's dot
    reads)."""
    B = page_table.shape[0]
    *lead, _, ps, K2, H = kv_pages.shape
    idx = (slice(None),) * len(lead) + (jnp.maximum(page_table[:, :num_pages], 0),)

    def one(x):
        return from_storage(x[idx], dtype).reshape(*lead, B, num_pages * ps, K2 // 2, H)

    return one(kv_pages[..., 0::2, :]), one(kv_pages[..., 1::2, :])


def paged_attention_xla(q: Array, kv_pages: Array, page_table: Array, starts: Array,
                        lengths: Array, num_pages: int | None = None, *, kv_dtype=None,
                        skip_masked: bool = False) -> Array:
    """GQA attention over the pages a row holds (the XLA reference; HF eager numerics, as
    ``xla_attention.attend``).

    q [B, T, N, H]; kv_pages [P, ps, 2K, H]; page_table [B, M] int32; starts, lengths [B] int32
    (module doc); ``num_pages`` (static, default M): the pages gathered per row, at least
    ``ceil((starts + lengths) / ps)`` of every row (``page_bucket``); ``kv_dtype``: the values'
    dtype of a pool of uint16 bits (:func:`pool_storage_dtype`; default q.dtype). Returns [B, T, N, H]
    (q.dtype); rows' padded tokens (``t >= lengths``) get finite values the caller ignores. Decode
    (T == 1) runs the contiguous per-layer cache's einsums (``attend_cached_t``: the keys read with the
    positions minor, the same values as ``attend``). ``skip_masked`` (XLA:CPU's prefill, T > 1):
    :func:`jax_rl.models.xla_attention.attend_offsets`, which skips the key blocks above every valid
    query's causal frontier (traced: the rows start at ``starts``) instead of ``attend``'s full [T, S]
    scores; equal up to fp32 summation order, inference only.
    """
    B, T = q.shape[:2]
    n = page_table.shape[1] if num_pages is None else int(num_pages)
    if kv_dtype is None and kv_pages.dtype == jnp.uint16:
        kv_dtype = q.dtype
    k, v = gather_contiguous(kv_pages, page_table, n, kv_dtype)
    pos = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
    mask = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :] <= pos[:, :, None]  # [B, T, S]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if T == 1:
        return attend_cached_t(q, k.transpose(0, 2, 3, 1), v.swapaxes(1, 2), mask)
    if skip_masked:
        return attend_offsets(q, k, v, starts, lengths)
    return attend(q, k, v, mask)


def _ragged_layout(lengths: Array, B: int, T: int) -> tuple[Array, Array, Array]:
    """(cu_q_lens [B+1], flat index [B, T] of each (row, token) in the packed queries, valid)."""
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])
    t = jnp.arange(T, dtype=jnp.int32)[None]
    valid = t < lengths[:, None]
    return cu, cu[:-1, None] + t, valid


def _packed_call(fn, q: Array, kv_pages: Array, page_table: Array, starts: Array, lengths: Array,
                 **kw) -> Array:
    """Run a ragged paged attention ``fn`` (the kernel's signature) on [B, T] queries: they are
    packed into the ragged [B*T, N, H] form (row b's valid tokens from ``cu_q_lens[b]``) with
    ``kv_lens = starts + lengths``, and unpacked after (padded tokens 0)."""
    B, T, N, H = q.shape
    starts = jnp.asarray(starts, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    cu, flat, valid = _ragged_layout(lengths, B, T)
    qf = jnp.zeros((B * T, N, H), q.dtype).at[jnp.where(valid, flat, B * T)].set(q, mode="drop")
    out = fn(qf, kv_pages, starts + lengths, jnp.maximum(jnp.asarray(page_table, jnp.int32), 0), cu,
             jnp.array([B], jnp.int32), sm_scale=float(H) ** -0.5, **kw)
    o = out[jnp.clip(flat, 0, B * T - 1)]  # [B, T, N, H]
    return jnp.where(valid[:, :, None, None], o, 0).astype(q.dtype)


def paged_attention_kernel_ref(q: Array, kv_pages: Array, page_table: Array, starts: Array,
                               lengths: Array) -> Array:
    """:func:`paged_attention_kernel`'s packing around the kernel's own pure-JAX reference
    (``ref_ragged_paged_attention``, which JAX tests the kernel against). Eager only (the
    reference loops over the concrete sequence count); a check of the packing alone, off a TPU
    (``tests/models/test_paged_attention.py``; the kernel itself runs there in interpret mode)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    return _packed_call(ref_ragged_paged_attention, q, kv_pages, page_table, starts, lengths)


@functools.partial(jax.jit, static_argnames=("interpret", "num_kv_pages_per_block",
                                             "num_queries_per_block", "vmem_limit_bytes"))
def paged_attention_kernel(q: Array, kv_pages: Array, page_table: Array, starts: Array,
                           lengths: Array, *, interpret: bool = False,
                           num_kv_pages_per_block: int | None = None,
                           num_queries_per_block: int | None = None,
                           vmem_limit_bytes: int | None = None) -> Array:
    """``paged_attention_xla``'s interface on the TPU ragged paged attention kernel
    (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, vLLM-TPU's / sglang-jax's).

    The [B, T] queries are packed into the kernel's ragged [sum(lengths), N, H] form
    (``_packed_call``); the kernel's causal mask (query i of a row at ``kv_len - q_len + i``) is
    the module's convention. Needs ``H % 128 == 0`` (the kernel's lane tiling). ``interpret``:
    Pallas TPU interpret mode (on CPU; jax 0.10.2's interpreter needs the test-only shim and the
    block sizes in ``tests/models/test_paged_attention.py`` to read this kernel). Block sizes:
    the kernel's tuned table reads the local TPU's version, so off a TPU (an AOT compile from a
    CPU host) both are needed; default here ``min(M, max(1, 128 // ps))``
    pages and ``min(B*T, 32)`` queries per block. Returns [B, T, N, H] (q.dtype; padded tokens 0).

    Raises ValueError (one line naming the keys) when ``H % 128 != 0``: the kernel's lanes, otherwise an
    opaque Pallas assertion deep in its lowering.
    """
    if q.shape[-1] % 128:
        raise ValueError(f"rollout.kv_layout=paged on a TPU: the ragged paged attention kernel needs head_dim a "
                         f"multiple of 128 (this model's head_dim is {q.shape[-1]}); set rollout.kv_layout=contiguous "
                         f"for this model")
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    B, T = q.shape[:2]
    M = page_table.shape[1]
    if num_kv_pages_per_block is None:
        num_kv_pages_per_block = max(1, min(M, 128 // kv_pages.shape[1]))
    if num_queries_per_block is None:
        num_queries_per_block = min(B * T, 32)
    kw = dict(num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block,
              vmem_limit_bytes=vmem_limit_bytes)
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            return _packed_call(ragged_paged_attention, q, kv_pages, page_table, starts, lengths, **kw)
    return _packed_call(ragged_paged_attention, q, kv_pages, page_table, starts, lengths, **kw)


def pool_head_spec(num_q_heads: int, num_kv_heads: int, mesh) -> tuple:
    """``(q_spec, kv_spec)``: the mesh axes (or None) the q heads and the pool's kv heads are split over
    on ``mesh`` (the learner's rules, ``q_heads`` / ``kv_heads``: ``tensor``), both None unless they are
    split alike (the divisibility is the kv heads', so a shard holds whole kv heads: key and value of
    kv head k at its combined heads ``2k`` and ``2k + 1``, as the kernel reads them; splitting the
    combined axis of 1 kv head over 2 shards would put the keys on one and the values on the other)."""
    hspec = logical_to_pspec(("q_heads",), shape=(num_q_heads,), mesh=mesh)[0]
    kspec = logical_to_pspec(("kv_heads",), shape=(num_kv_heads,), mesh=mesh)[0]
    return (hspec, kspec) if hspec == kspec else (None, None)


def pool_page_axes(num_slots: int, mesh):
    """The mesh axes (a name, a tuple of names, or None) a paged pool's page axis is split over on
    ``mesh``: the ones that split the slots (``cache_batch``: ``data`` / ``fsdp`` / ``expert``, those that
    divide ``num_slots``), as the contiguous cache splits them. With D shards of slots (slot b in shard
    ``b // (num_slots / D)``), the pool of P pages is D sub-pools of P / D, each numbered from 0: a slot's
    page-table entries index its own shard's sub-pool. None: no mesh, or no axis divides the slots."""
    if mesh is None or mesh.empty:
        return None
    return logical_to_pspec(("cache_batch",), shape=(int(num_slots),), mesh=mesh)[0]


def paged_attention_kernel_sharded(q: Array, kv_pages: Array, page_table: Array, starts: Array,
                                   lengths: Array, *, mesh=None, **kernel_kw) -> Array:
    """:func:`paged_attention_kernel` on a mesh (default: the ambient ``jax.set_mesh`` one; none: the
    kernel as is). A Mosaic kernel cannot be partitioned automatically, so it runs in ``jax.shard_map``:
    rows (q, page table, starts, lengths) over the ``activation_batch`` axes that divide B, q heads and
    the pool's combined head axis over the axis that splits the kv heads (:func:`pool_head_spec`); the
    pool is replicated over every other axis (the engine's layout where its mesh does not split the slots;
    where it does, the pool's pages are split with them and ``jax_rl.models.qwen3.paged`` runs the plain
    kernel per shard of slots in its own ``shard_map``, :func:`paged_attention_local`). Each shard
    runs the kernel on its rows and heads: its q heads ``[s N/T, (s+1) N/T)`` attend to its kv heads
    ``[s K/T, (s+1) K/T)`` (GQA groups never straddle shards). ``kernel_kw`` go to the kernel
    (``interpret``, block sizes). Same arguments and result as :func:`paged_attention_kernel`."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty:
        return paged_attention_kernel(q, kv_pages, page_table, starts, lengths, **kernel_kw)
    B, _, N, _ = q.shape
    bspec = logical_to_pspec(("activation_batch",), shape=(B,), mesh=mesh)[0]
    hspec, kspec = pool_head_spec(N, kv_pages.shape[-2] // 2, mesh)
    rows = P(bspec, None, hspec, None)
    body = jax.shard_map(functools.partial(paged_attention_kernel, **kernel_kw), mesh=mesh,
                         in_specs=(rows, P(None, None, kspec, None), P(bspec, None), P(bspec), P(bspec)),
                         out_specs=rows, check_vma=False)
    return body(q, kv_pages, jnp.asarray(page_table, jnp.int32), jnp.asarray(starts, jnp.int32),
                jnp.asarray(lengths, jnp.int32))


def paged_attention_local(q: Array, kv_pages: Array, page_table: Array, starts: Array, lengths: Array,
                          num_pages: int | None = None, *, backend: str | None = None, kv_dtype=None) -> Array:
    """:func:`paged_attention` on the arrays as they are, never a ``shard_map`` of its own: the body of a
    caller's ``shard_map`` (one shard of slots and its sub-pool: ``jax_rl.models.qwen3.paged``). Same
    arguments and result. ``backend="bitwise"``: the pages gathered as on the XLA path, then the bitwise
    mode's :func:`jax_rl.models.bitwise.chunked_attend` (any page bucket, the same bits). On ``"cpu"``
    the XLA path's append-prefill skips fully masked key blocks (``skip_masked``)."""
    if backend == "bitwise":
        n = page_table.shape[1] if num_pages is None else int(num_pages)
        dt = q.dtype if kv_dtype is None and kv_pages.dtype == jnp.uint16 else kv_dtype
        k, v = gather_contiguous(kv_pages, page_table, n, dt)
        return chunked_attend(q, k, v, starts[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None])
    backend = backend or current_target_backend()
    if backend == "tpu":
        return paged_attention_kernel(q, kv_pages, page_table, starts, lengths)
    return paged_attention_xla(q, kv_pages, page_table, starts, lengths, num_pages, kv_dtype=kv_dtype,
                               skip_masked=backend == "cpu")


def paged_attention(q: Array, kv_pages: Array, page_table: Array, starts: Array, lengths: Array,
                    num_pages: int | None = None, *, backend: str | None = None, kv_dtype=None) -> Array:
    """Attention over live pages on the path for ``backend`` (default: the :func:`jax_rl.models.backend_target.target_backend`
    in effect, else JAX's default backend): ``"tpu"``: :func:`paged_attention_kernel` (reads the
    page table itself; ``num_pages`` unused), per shard on an ambient mesh
    (:func:`paged_attention_kernel_sharded`); otherwise :func:`paged_attention_xla` (partitioned by
    XLA on a mesh; ``kv_dtype``: a pool of uint16 bits' value dtype). Same arguments and result as those."""
    backend = backend or current_target_backend()
    if backend == "tpu":
        return paged_attention_kernel_sharded(q, kv_pages, page_table, starts, lengths)
    return paged_attention_local(q, kv_pages, page_table, starts, lengths, num_pages, backend=backend,
                                 kv_dtype=kv_dtype)
