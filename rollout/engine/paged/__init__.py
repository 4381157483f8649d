"""The paged K/V layout (``kv_layout="paged"``), in one folder: one pool of pages, a page table row per slot.

* :mod:`rollout.engine.paged.layout`: :class:`~rollout.engine.paged.layout.PagedLayout`, the layout object the
  engine holds (``Qwen3Engine.kv``): what the layout does (module doc) and its host operations (admit /
  prefill with prefix pages by reference, fork a group's pages, free and hold, pages before a decode call,
  preemption, admission budget, stats);
* :mod:`rollout.engine.paged.programs`: its step programs (:class:`~rollout.engine.paged.programs.PagedStepPrograms`:
  the one decode step of :class:`rollout.engine.programs.StepPrograms` with the paged model call, the
  chunked append-prefill, page copies on write, the page table) and their jit table, the pool's shardings;
* :mod:`rollout.engine.paged.prefill_plan`: which chunked-prefill programs a call's rows run;
* :mod:`rollout.engine.paged.pool`: :class:`~rollout.engine.paged.pool.PagePool`, the host allocator (pages,
  reference counts, prefix pages by content and weight epoch, copy on write, eviction);
* :mod:`rollout.engine.paged.shards`: :class:`~rollout.engine.paged.shards.ShardedPagePool`, one pool per
  shard of slots on a mesh that splits them.

The model side (the pool's array form, the paged decode / extend, the attention kernels) is
:mod:`jax_rl.models.qwen3.paged`, :mod:`jax_rl.models.paged_attention`, :mod:`jax_rl.models.kv_storage`. A K/V
page's life: :meth:`PagedLayout.prefill_slots` admits it (``PagePool.admit`` / ``ensure``, published for prefix
hits), the programs write it through the page table, :meth:`PagedLayout.before_decode` grows a slot into new
pages (copy on write of a shared one), :meth:`PagedLayout.free_slots` holds it for the session's next turn,
:meth:`PagedLayout.release` / preemption give it back to the pool (cached for prefix hits until evicted).

This package imports nothing at its top (its modules import the engine's base modules).
"""
