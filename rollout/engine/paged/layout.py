"""The paged K/V layout of :class:`rollout.engine.Qwen3Engine` (``kv_layout="paged"``).

The decode state's cache is a :class:`jax_rl.models.qwen3.paged.PagedKVCache` (one pool of
``kv_pages`` pages of ``kv_page_size`` positions, a page table row per slot, the slots' lengths);
:class:`rollout.engine.paged.pool.PagePool` on the host decides which slot holds which pages. What changes
against the contiguous layout, with the engine's API and outputs unchanged:

- no reservation per slot: a slot holds the pages its positions need, allocated as prefill and
  decode reach them (``decode_steps(n)`` makes room for ``n`` more positions per active slot
  first; a call in which every active slot stays within pages only it holds, most calls, only moves
  the host's lengths: :meth:`PagePool.room`), and the page table goes to the device only when a row
  changed;
- a GRPO group's identical prompts are prefilled once and the other samples' slots reference the
  same pages (:meth:`PagePool.fork`: no K/V copied); the first decode write into the shared
  partial last page copies that page (copy on write);
- a fresh prompt whose leading full pages were computed before *by the same weights* (in an earlier
  call or by an earlier row of the same call: a call's rows are published as they are admitted, so
  what a row computes does not depend on how admissions were batched) references them
  (:meth:`PagePool.admit`; ``kv_prefix_page_hits``) and is prefilled from there: the env
  prefix cache by reference. Pages are keyed by the engine's weight epoch (+1 whenever a prefill
  runs other params than the last one), so after a weight swap no new request reads a page of the
  old weights; a held session keeps its own pages (its partial policy decides, as with the
  contiguous cache);
- decode and append-prefill attend over the pages a slot holds (TPU: the ragged paged attention
  kernel; CPU/GPU: an XLA gather of a power-of-two bucket of pages; on CPU a decode call of n steps
  gathers them once into a contiguous window and writes its new entries back after:
  :meth:`rollout.engine.paged.programs.PagedStepPrograms.decode_steps`);
- pool exhausted: the least recently released *held* slot (an episode between turns) is preempted
  (its pages freed, ``kv_preemptions``); its next append-prefill re-prefills its whole context
  (reported in ``PrefillResult.prefill_tokens``). With no held slot to preempt, ``PoolExhausted``
  is raised; a :meth:`PagedLayout.prefill_slots` that raises it takes back every page its rows got
  (their slots hold nothing after it), so the caller can queue them again. The generator never
  gets there in decode: it asks :meth:`PagedLayout.decode_shortfall` before each decode call and
  preempts *active* slots itself (:meth:`PagedLayout.preempt_slots`; the most recently admitted
  first, re-queued and re-prefilled later: :mod:`rollout.kv_pressure`), and it admits a request
  only when :meth:`PagedLayout.admission_budget` covers :meth:`PagedLayout.request_pages`.
- the pool holds at least one sequence of ``max_cache_len`` positions (else ``ValueError`` at
  construction, vLLM's rule): a lone active slot can always grow to the cache end once held slots
  are preempted and cached pages evicted.

On a mesh (``Qwen3Engine(..., mesh=)``, a sharded rollout engine): params as the contiguous sharded
engine places them; each layer's pool split on its combined head axis over the axis that splits the kv
heads (``tensor``), in whole kv heads so a shard keeps its heads' keys and values together (replicated
where the kv heads do not divide, as the contiguous cache); the page table, lengths and per-slot vectors
replicated (:func:`paged_state_shardings`). Where the mesh splits the slots (``data`` / ``expert``, as the
contiguous cache splits them: :func:`jax_rl.models.paged_attention.pool_page_axes`, D shards of B / D
slots), the pool's pages are split over the same axes: ``rollout.kv_pages // D`` pages a shard, numbered
from 0 within it; a slot's table holds its shard's page ids, and the host allocator
(:class:`rollout.engine.paged.shards.ShardedPagePool`) gives a slot only its shard's pages, so prefix pages and
forks are shared only within a shard, and free pages, admission budgets and decode shortfalls are per
shard (:attr:`PagedLayout.shards`, :meth:`PagedLayout.shard_of`). Each shard's sub-pool must hold one ``max_cache_len`` sequence.
Then the write, the attention and the copies on write run per shard in ``shard_map``
(``jax_rl.models.qwen3.paged``); with the slots not split, XLA partitions the gather path and the TPU
kernel runs per head shard (:func:`jax_rl.models.paged_attention.paged_attention_kernel_sharded`).

JetStream's adapter (``jax-rl serve``) on pages: ``insert`` of a batch-1 :class:`PrefixKV` frees the slot's
pages, takes ``ceil(length / page_size)`` and writes the prefix's K/V into them (:meth:`PagedLayout.insert`; no
prefix page shared: those K/V come from the batch-1 prefill program), and ``generate`` is the decode step with
its :meth:`PagedLayout.before_decode` (the next page taken as a slot crosses a page boundary). JetStream's
Driver never frees a slot, so a finished request's slot decodes on, taking pages, until its
``max_cache_len`` or its next insert: a pool of ``slots x ceil(max_cache_len / kv_page_size)`` pages (the
default, what ``jax-rl serve`` builds) never runs short; a smaller one raises ``PoolExhausted`` there.

Not in this layout: the generator's copying prefix cache (``rollout.prefix_cache`` must be 0: the pages are
the prefix cache).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_rl.models.paged_attention import page_bucket, pages_for
from jax_rl.sharding import axis_names
from rollout.engine.layout import KVLayout, LayoutFacts
from rollout.engine.paged.programs import PAGED_PROGRAMS, PagedStepPrograms, paged_pool_spec, paged_state_shardings
from rollout.engine.paged.prefill_plan import prefill_programs
from rollout.engine.programs import StepConfig
from rollout.engine.slots import PrefillResult, SlotPrefill
from rollout.engine.spec import EngineSpec
from rollout.engine.paged.shards import ShardedPagePool
from rollout.engine.paged.pool import PoolExhausted

__all__ = ["PagedLayout"]


class PagedLayout(KVLayout):
    """The paged K/V layout (module doc): its host side over :class:`rollout.engine.paged.shards.ShardedPagePool`
    and its programs (:class:`rollout.engine.paged.programs.PagedStepPrograms`).

    Raises:
      ValueError: the pool (each shard's sub-pool) holds fewer than ``max_cache_len`` positions.
    """

    name = "paged"
    table = PAGED_PROGRAMS
    pooled = True
    one_device_kernel = True
    keeps_prefix_pages = True

    def __init__(self, spec: EngineSpec, facts: LayoutFacts) -> None:
        super().__init__(spec, facts)
        page_size = int(spec.kv_page_size)
        num_pages = int(spec.kv_pages) if spec.kv_pages else self._slots * pages_for(self.max_cache_len, page_size)
        mc = facts.model_config
        pool_spec = (paged_pool_spec(self._slots, facts.mesh, num_q_heads=mc.num_attention_heads,
                                     num_kv_heads=mc.num_key_value_heads) if facts.mesh is not None else None)
        names = () if pool_spec is None else axis_names(pool_spec[0])
        shards = int(np.prod([self._mesh.shape[a] for a in names], dtype=np.int64))
        per = num_pages // shards
        if per * page_size < self.max_cache_len:
            split = f" split over {shards} shards of slots ({'x'.join(names)}: {per} a shard)" if shards > 1 else ""
            raise ValueError(f"rollout.kv_pages={num_pages} pages of {page_size} positions{split} hold {per * page_size} "
                             f"< rollout.max_cache_len={self.max_cache_len}: the K/V pool cannot hold one sequence "
                             f"(at least {pages_for(self.max_cache_len, page_size) * shards} pages)")
        self.pool = ShardedPagePool(shards, per, page_size, self._slots)
        """The host allocator: which slot holds which pages (:class:`rollout.engine.paged.shards.ShardedPagePool`)."""
        self._pool_spec = pool_spec
        self._max_pages = pages_for(self.max_cache_len, page_size)
        self._table = np.full((self._slots, self._max_pages), -1, np.int32)
        self._plen = np.zeros(self._slots, np.int64)  # positions each slot holds (host mirror)
        self._room = np.zeros(self._slots, np.int64)  # pool.room of the active slots, at changes _room_at
        self._room_at = -1
        self._table_gen = 0  # bumped by every change of the host table
        self._synced: tuple = (None, -1)  # (a device page table equal to the host's, the _table_gen it equals)
        self._pactive = np.zeros(self._slots, bool)
        self._held: collections.OrderedDict[int, None] = collections.OrderedDict()  # released slots, LRU
        self._preempted: set[int] = set()
        self._kv_epoch = 0
        self._epoch_leaf: Optional[weakref.ref] = None
        self._xla_pages = jax.default_backend() != "tpu"  # the XLA path gathers a static bucket

    def step_programs(self, cfg: StepConfig, model: Callable[[Any], Any], dequantized: Callable[[Any], Any]
                      ) -> PagedStepPrograms:
        return PagedStepPrograms(cfg, model, dequantized, page_size=self.pool.page_size,
                                 num_pages=self.pool.num_pages, pool_spec=self._pool_spec)

    state_shardings = staticmethod(paged_state_shardings)

    def reset(self) -> None:
        """The host side of a fresh decode state (:meth:`Qwen3Engine.init_decode_state`): its device pool
        holds no K/V, so no slot holds pages, no page is held for a session and no prefix page can be hit."""
        self.pool.clear()
        for slot in range(self._slots):
            self._set_row(slot, -1)
        self._plen[:], self._pactive[:] = 0, False
        self._held.clear()
        self._preempted.clear()

    def stats(self) -> dict[str, int]:
        """The pool's counters (``kv_pages_in_use``, ``kv_prefix_page_hits``, ``kv_preemptions``, ...)."""
        return self.pool.stats()

    @property
    def shards(self) -> int:
        """D, the shards of slots the pool is split into (1: one pool, any slot any page)."""
        return self.pool.num_shards

    def shard_of(self, slot: int) -> int:
        """The shard whose pages ``slot`` holds (-1: shard 0)."""
        return self.pool.shard_of(slot)

    def _check_epoch(self, params: Any) -> None:
        """New weights in a prefill (another params tree than the last one): a new page epoch, so pages
        computed before are never matched by a new request again. Keyed by the params the prefill
        runs (a weak reference to their first leaf), not by ``load_params``, which runs in the
        publisher's thread before the generator swaps."""
        leaf = jax.tree.leaves(params)[0]
        if self._epoch_leaf is None or self._epoch_leaf() is not leaf:
            if self._epoch_leaf is not None:
                self._kv_epoch += 1
                self.pool.drop_versions_below(self._kv_epoch)
            self._epoch_leaf = weakref.ref(leaf)

    # ---- pages -------------------------------------------------------------------------------
    def _retry(self, fn, slot: int):
        """``fn()``; while it finds ``slot``'s shard exhausted, preempt that shard's least recently
        released held slot first."""
        d = self.shard_of(slot)
        while True:
            try:
                return fn()
            except PoolExhausted:
                victim = next((h for h in self._held if self.shard_of(h) == d), None)
                if victim is None:
                    raise
                del self._held[victim]
                self.pool.preempt(victim)
                self._preempted.add(victim)
                self._plen[victim] = 0
                self._set_row(victim, -1)

    def _forget(self, slot: int, preempt: bool = False) -> None:
        """``slot`` holds no pages any more (``preempt``: counted in ``kv_preemptions``)."""
        if slot in self.pool.seqs:
            (self.pool.preempt if preempt else self.pool.free)(slot)
        self._held.pop(slot, None)
        self._preempted.discard(slot)
        self._plen[slot], self._pactive[slot] = 0, False
        self._set_row(slot, -1)

    # ---- what the generator asks before admitting and decoding (rollout.kv_pressure) ---------
    def _held_room(self, d: int) -> int:
        return sum(self.pool.sole_pages(h) for h in self._held if h in self.pool.seqs and self.shard_of(h) == d)

    def _decode_need(self, n: int, d: int) -> int:
        S, refs = self.max_cache_len, {}
        act = np.flatnonzero(self._pactive)
        need = np.minimum(self._plen[act] + n, S)
        slow = ~self._fits_room(act, need)  # a slot within its room needs nothing and touches no shared page
        return sum(self.pool.ensure_cost(s, m, refs)
                   for s, m in zip(act[slow].tolist(), need[slow].tolist()) if self.shard_of(s) == d)

    def _per_shard(self, fn, shard: Optional[int]) -> int:
        return fn(shard) if shard is not None else sum(fn(d) for d in range(self.shards))

    def decode_shortfall(self, n: int, shard: Optional[int] = None) -> int:
        """Pages the active slots of ``shard`` lack for ``n`` more positions each (copies on write
        included) beyond its free and cached pages and the pages its held slots alone hold (preempted by
        the next decode as it needs them); 0: the decode call fits there. None: summed over the shards
        (0: it fits everywhere)."""
        return self._per_shard(lambda d: max(0, self._decode_need(int(n), d) - self.pool.pages_available(d)
                                             - self._held_room(d)), shard)

    def admission_budget(self, n_decode: int, shard: Optional[int] = None) -> int:
        """Pages admissions into ``shard``'s slots may take now: its free + cached pages + what its held
        slots alone hold, less what its active slots need for their next ``n_decode`` positions (so an
        admission does not force the next decode call to preempt). None: summed over the shards."""
        return self._per_shard(lambda d: self.pool.pages_available(d) + self._held_room(d)
                               - self._decode_need(int(n_decode), d), shard)

    def request_pages(self, tokens: Sequence[int], slot: int, start: int, n_decode: int,
                         shared: bool = False) -> int:
        """Pages admitting row ``tokens`` (context ``tokens[:-1]`` + the pending last token) into ``slot``
        at ``start`` and decoding ``n_decode`` tokens takes from :meth:`admission_budget`: an append
        on a held slot that still has its pages, its extension plus those pages (counted as room in the
        budget); ``shared`` (the same context as a row admitted before it in the same call: a fork of its
        pages), the copy of the last partial page and the growth; else the pages past any prefix hit. Pages of ``slot``'s shard (-1: a slot not chosen yet, shard 0's).
        """
        ps, ctx = self.pool.page_size, len(tokens) - 1
        end = min(ctx + int(n_decode), self.max_cache_len)
        if start and slot in self.pool.seqs and slot not in self._preempted:
            own = self.pool.sole_pages(slot) if slot in self._held else 0
            return own + self.pool.ensure_cost(slot, end)
        if shared:
            return self.pool.pages_for(end) - ctx // ps
        hits = [] if self.record_routes else self.pool.lookup([int(t) for t in tokens[:-1]], self._kv_epoch, slot)
        return self.pool.pages_for(end) - len(hits) + sum(1 for p in hits if self.pool.refs(slot, p) == 0)

    def release(self, slots: Sequence[int]) -> None:
        """Give back the pages of inactive ``slots`` no request will append to (the caller holds them for no
        session: a finished request's; its published full pages stay cached for prefix hits until evicted).
        Host bookkeeping only, not a preemption. An active slot is left alone."""
        for s_ in slots:
            if int(s_) in self.pool.seqs and not self._pactive[int(s_)]:
                self._forget(int(s_))

    def preempt_slots(self, decode_state: dict, slots: Sequence[int]) -> dict:
        """Preempt active ``slots``: their pages freed (``kv_preemptions``), the slots deactivated; the
        caller re-prefills their requests later (preemption by recompute)."""
        for s_ in slots:
            self._forget(int(s_), preempt=True)
        mask = np.zeros((self._slots,), bool)
        mask[[int(s_) for s_ in slots]] = True
        state = self._push(decode_state, [])
        with self._in_mesh():
            return self._synced_state(self._jits["free_slots"](state, jnp.asarray(mask)))

    def _release(self, slot: int) -> None:
        if slot in self.pool.seqs:
            self.pool.free(slot)
        self._held.pop(slot, None)
        self._preempted.discard(slot)

    def _row(self, slot: int) -> None:
        self._set_row(slot, self.pool.table(slot, self._max_pages))

    def _set_row(self, slot: int, row: Any) -> None:
        if not np.array_equal(self._table[slot], row):
            self._table[slot] = row
            self._table_gen += 1

    def _synced_state(self, state: dict) -> dict:
        """Record that ``state``'s page table equals the host's (a program's output whose input table did:
        no program but ``set_table`` writes the device table), so :meth:`_push` need not send it again."""
        self._synced = (state["cache"].page_table, self._table_gen)
        return state

    def _is_synced(self, state: dict) -> bool:
        table, gen = self._synced
        return gen == self._table_gen and state["cache"].page_table is table

    def _push(self, state: dict, copies: Sequence[tuple[int, int, int]]) -> dict:
        """The copies on write ``(shard, src, dst)`` (a power-of-two bucket of them a shard, -1 padding;
        shard d's at ``[d n, (d+1) n)``), then the host's table."""
        with self._in_mesh():
            if copies:
                at = collections.Counter(d for d, _, _ in copies)
                n = 1 << (max(at.values()) - 1).bit_length()
                src, dst = np.full((2, self.shards, n), -1, np.int32)
                for d, s_, t_ in reversed(copies):
                    at[d] -= 1
                    src[d, at[d]], dst[d, at[d]] = s_, t_
                state = self._jits["copy_pages"](state, jnp.asarray(src.reshape(-1)), jnp.asarray(dst.reshape(-1)))
            elif self._is_synced(state):  # the table unchanged since it was sent to this state
                return state
            return self._synced_state(self._jits["set_table"](state, jnp.asarray(self._table)))

    def append_prefill_shape(self, positions: int) -> tuple[int, int]:
        """``(rows, T)`` of the largest append-prefill program rows of ``positions`` new positions run: the
        contiguous layout's ``(slots, positions)``; paged, the chunk's bucket T and its row count
        (:mod:`rollout.engine.paged.prefill_plan`; ``slots`` rows on a pool split over shards of slots)."""
        first = prefill_programs([(0, 0, int(positions), 0)], chunk=self.prefill_chunk_size, slots=self._slots,
                                 max_len=self.max_cache_len, rows_at_slots=self.shards > 1)[0]  # the largest chunk
        return first.rows, first.T

    def _bucket(self, positions: int) -> Optional[int]:
        """The XLA path's static page count for ``positions``: a power of two (None on the TPU kernel: it reads
        the table). A row's attention values depend on the count gathered (XLA:CPU's reduction order over it)
        and the count is the longest active row's, so which rows share a call can show in a row's log-probs
        where the bucket changes; with 4 buckets an octave it did (a killed and resumed run's log-probs
        differed from a straight run's in the 8th digit), with powers of two it has not (docs/performance.md)."""
        if not self._xla_pages:
            return None
        return page_bucket(pages_for(positions, self.pool.page_size), self._max_pages)

    # ---- the engine's host operations --------------------------------------------------------
    def prefill_slots(self, params: Any, decode_state: dict, rows: Sequence[SlotPrefill]
                      ) -> tuple[dict, list[PrefillResult]]:
        """:meth:`ContiguousLayout.prefill_slots` on pages (module doc): fresh rows reference any prefix
        pages of the current weights and prefill the rest; a group's identical rows share one
        prefill and its pages; append rows extend their slot's pages (a preempted slot re-prefills)."""
        rows = list(rows)
        self._check_rows(rows)
        self._check_epoch(params)
        published: list[int] = []
        try:
            return self._prefill_paged(params, decode_state, rows, published)
        except BaseException as e:
            self.pool.retract(published)  # pages whose K/V this call may not have written
            if isinstance(e, PoolExhausted):  # take back what the rows got: the caller may queue them again
                for r in rows:
                    self._forget(int(r.slot))
            raise

    def _prefill_paged(self, params: Any, decode_state: dict, rows: list, published: list
                       ) -> tuple[dict, list[PrefillResult]]:
        """The rows' pages, then their programs. A fresh row's full pages are published as it is admitted
        (``published``: what the caller retracts if the call fails), so a later row of the same call with
        the same leading full pages references them as it would after an earlier call: which pages a row
        computes does not depend on how the generator batched its admissions. Such a row runs in a later
        wave of programs than the rows whose pages it reads (``run``'s third field)."""
        res = [dict(prefill_tokens=0, shared=False) for _ in rows]
        owners: dict[tuple, int] = {}  # (shard, context) -> the row whose pages its shard's rows fork
        members: list[tuple[int, int]] = []  # (row index, owner row index)
        run: list[tuple[int, int, int]] = []  # (row index, start of the computed positions, wave)
        copies: list[tuple[int, int]] = []
        wave_of: dict[tuple, int] = {}  # (shard, page) written by this call -> the wave of programs writing it
        for i, r in enumerate(rows):
            slot, ctx = int(r.slot), [int(t) for t in r.tokens[:-1]]
            start = int(r.start)
            if start and slot not in self._preempted and slot in self.pool.seqs:
                self._held.pop(slot, None)  # never the victim of its own allocation
                copies += self._retry(lambda: self.pool.ensure(slot, len(ctx)), slot)
                run.append((i, start, 0))
                continue
            key = (self.shard_of(slot), tuple(ctx))
            self._release(slot)
            if not start and key in owners:
                members.append((i, owners[key]))
                continue
            owners.setdefault(key, i)
            # an engine recording MoE routes reports the routes of every prompt position: no prefix hits
            hit = self._retry(lambda: self.pool.admit(slot, ctx, self._kv_epoch, lookup=not self.record_routes), slot)
            copies += self._retry(lambda: self.pool.ensure(slot, len(ctx)), slot)
            pages = [(key[0], p) for p in self.pool.seqs[slot].pages]
            n_hit = hit // self.pool.page_size
            wave = 1 + max((wave_of.get(p, -1) for p in pages[:n_hit]), default=-1)
            wave_of.update((p, wave) for p in pages[n_hit:])
            run.append((i, hit, wave))
            if not start:
                published += self.pool.publish(slot, ctx)
        for i, o in members:
            self.pool.fork(int(rows[o].slot), int(rows[i].slot))
            res[i]["shared"] = True
        for i, r in enumerate(rows):
            self._row(int(r.slot))
        state = self._push(decode_state, copies)
        state = self._run_rows(params, state, rows, run, res)
        state = self._copy_slots(state, [(int(rows[o].slot), int(rows[i].slot), int(rows[i].tokens[-1]),
                                          int(rows[i].seed), rows[i].temperature) for i, o in members])
        for i, o in members:
            for k in ("routes", "moe_dropped"):
                if k in res[o]:
                    res[i][k] = res[o][k] if k == "routes" else 0
        for r in rows:
            self._plen[int(r.slot)], self._pactive[int(r.slot)] = len(r.tokens) - 1, True
        return self._synced_state(state), [PrefillResult(int(x["prefill_tokens"]), bool(x["shared"]), x.get("routes"),
                                                         x.get("moe_dropped"))
                       for x in res]

    def _run_rows(self, params, state, rows, run, res) -> dict:
        """The computed rows in chunked programs (:func:`rollout.engine.paged.prefill_plan.prefill_programs`): the
        waves in order (a row reading pages another row of the call writes runs after it), a row's chunks
        in order, each chunk an append-prefill onto the pages its earlier chunks wrote."""
        plan = prefill_programs([(i, st, len(rows[i].tokens) - 1, wave) for i, st, wave in run],
                                chunk=self.prefill_chunk_size, slots=self._slots, max_len=self.max_cache_len,
                                page_key=self._bucket, rows_at_slots=self.shards > 1)
        routes: dict[int, list] = {}
        for prog in plan:
            state = self._run_program(params, state, rows, prog, res, routes)
        for i, st, _ in run:  # a re-prefilled (preempted) row reports the positions asked for
            if self.record_routes:
                res[i]["routes"] = np.concatenate(routes[i])[max(0, int(rows[i].start) - st):]
            res[i]["prefill_tokens"] = len(rows[i].tokens) - 1 - st
        return state

    def _run_program(self, params, state, rows, prog, res, routes) -> dict:
        """One :class:`ChunkProgram`: its chunks' tokens at rows 0.. (at their slots' rows on a pool split over
        shards of slots, where the program writes and reads each shard's sub-pool); padding rows write nowhere."""
        B, nb, T = self._slots, prog.rows, prog.T
        at = [(int(rows[c.row].slot) if self.shards > 1 else j, c) for j, c in enumerate(prog.chunks)]
        buf = np.zeros((nb, T), np.int32)
        starts, lens, pending = (np.zeros(nb, np.int32) for _ in range(3))
        slots = np.full(nb, B, np.int32)
        seeds, temps = np.zeros(nb, np.uint32), np.ones(nb, np.float32)
        for j, c in at:
            r = rows[c.row]
            buf[j, :c.length] = np.asarray(r.tokens[c.start:c.end], np.int32)
            starts[j], lens[j], slots[j], pending[j] = c.start, c.length, int(r.slot), int(r.tokens[-1])
            seeds[j] = int(r.seed) & 0xFFFFFFFF
            temps[j] = self.temperature if r.temperature is None else float(r.temperature)
        with self._in_mesh():
            state, (rts, drops) = self._jits["append_prefill"](
                params, state, jnp.asarray(buf), jnp.asarray(starts), jnp.asarray(lens), jnp.asarray(slots),
                jnp.asarray(pending), jnp.asarray(seeds), jnp.asarray(temps), num_pages=prog.pages)
        for j, c in at:
            if self.counts_moe_drops:
                res[c.row]["moe_dropped"] = res[c.row].get("moe_dropped", 0) + int(np.asarray(drops)[j])
            if self.record_routes:
                routes.setdefault(c.row, []).append(np.asarray(rts)[j, :c.length])
        return state

    def copy_slot(self, decode_state: dict, src: int, dst: int, *, token: int, seed: int,
                  temperature: Optional[float] = None) -> dict:
        """:meth:`ContiguousLayout.copy_slot` by reference: ``dst`` shares ``src``'s pages."""
        src, dst = int(src), int(dst)
        if not (0 <= src < self._slots and 0 <= dst < self._slots) or src == dst:
            raise ValueError(f"copy_slot: slots {src} -> {dst} (range [0, {self._slots}), distinct)")
        if self.shard_of(src) != self.shard_of(dst):
            raise ValueError(f"copy_slot: slots {src} -> {dst} are in different shards of the paged pool "
                             f"({self.shards} shards of {self._slots // self.shards} slots): no page crosses shards")
        self._release(dst)
        self.pool.fork(src, dst)
        self._row(dst)
        self._plen[dst], self._pactive[dst] = self._plen[src], True
        state = self._push(decode_state, [])
        return self._synced_state(self._copy_slots(state, [(src, dst, int(token), int(seed), temperature)]))

    def insert(self, decode_state: dict, prefix: dict, slot: int) -> dict:
        """JetStream's ``insert`` on pages (``jax-rl serve``): ``slot``'s pages freed (the slot of a finished or
        unfinished request, active or held), ``ceil(length / page_size)`` pages taken from its shard's pool (none
        referenced or published for prefix hits: the K/V come from the batch-1 prefill program, not the paged
        one), the table pushed, the prefix K/V written into the pages and the slot armed (its next page is taken
        by :meth:`before_decode` when its decode crosses a page boundary). Donates the state.

        Raises:
          ValueError: a slot out of range, a prefix of ``max_cache_len`` or more positions.
          PoolExhausted: no pages for the prefix in the slot's shard even after preempting its held slots (a
            pool smaller than ``slots`` sequences of ``max_cache_len``); the slot then holds no pages and the
            state is not touched (its host row is empty: the next call pushes it, the old pages are not read).
        """
        slot, n = self._check_insert(prefix, slot)
        self._forget(slot)
        try:  # no lookup: only the context's length is read
            self._retry(lambda: self.pool.admit(slot, [0] * n, self._kv_epoch, lookup=False), slot)
        except PoolExhausted as e:
            raise PoolExhausted(f"insert: a prefix of {n} positions needs {self.pool.pages_for(n)} pages in slot "
                                f"{slot}'s shard of the paged pool, which has {self.pool.pages_available(self.shard_of(slot))} "
                                f"free or cached and no held slot to preempt ({e}); free slots or raise "
                                f"rollout.kv_pages") from None
        self.pool.ensure(slot, n)  # the sequence's length (its pages are all taken by admit)
        self._row(slot)
        state = self._push(decode_state, [])
        with self._in_mesh():
            state = self._jits["insert"](prefix["k"], prefix["v"], jnp.int32(n), jnp.int32(prefix["token"]),
                                         jnp.uint32(prefix["seed"]), jnp.float32(prefix["temperature"]), state,
                                         jnp.int32(slot))
        self._plen[slot], self._pactive[slot] = n, True
        return self._synced_state(state)

    def _copy_slots(self, state: dict, copies: Sequence[tuple]) -> dict:
        """The ``copy_slot`` program over ``(src, dst, pending token, seed, temperature or None)`` rows, in
        one call of a power-of-two bucket of them (padding rows at slot B change nothing)."""
        if not copies:
            return state
        n = 1 << (len(copies) - 1).bit_length()
        src, dst, pending = np.zeros(n, np.int32), np.full(n, self._slots, np.int32), np.zeros(n, np.int32)
        seeds, temps = np.zeros(n, np.uint32), np.ones(n, np.float32)
        for j, (s_, d_, tok, seed, t) in enumerate(copies):
            src[j], dst[j], pending[j], seeds[j] = s_, d_, tok, int(seed) & 0xFFFFFFFF
            temps[j] = self.temperature if t is None else float(t)
        with self._in_mesh():
            return self._jits["copy_slot"](state, *map(jnp.asarray, (src, dst, pending, seeds, temps)))

    def free_slots(self, decode_state: dict, slots: Sequence[int]) -> dict:
        """:meth:`KVLayout.free_slots`; the slots keep their pages (held) until reused or preempted."""
        for s_ in slots:
            if not 0 <= int(s_) < self._slots:
                raise ValueError(f"slot {s_} out of range [0, {self._slots})")
            self._pactive[int(s_)] = False
            if int(s_) in self.pool.seqs:
                self._held[int(s_)] = None
                self._held.move_to_end(int(s_))
        mask = np.zeros((self._slots,), bool)
        mask[[int(s_) for s_ in slots]] = True
        synced = self._is_synced(decode_state)
        with self._in_mesh():
            state = self._jits["free_slots"](decode_state, jnp.asarray(mask))
        return self._synced_state(state) if synced else state

    def _fits_room(self, slots: np.ndarray, need: np.ndarray) -> np.ndarray:
        """Which of ``slots`` reach ``need`` within their pages with no allocation or copy ([n] bool; all
        False when the pool changed since the rooms were taken)."""
        if self._room_at != self.pool.changes:
            return np.zeros(len(slots), bool)
        return need <= self._room[slots]

    def before_decode(self, state: dict, n: int) -> tuple[dict, dict[str, Any]]:
        """Pages for ``n`` more positions of every active slot (copy on write of a shared page), the
        table pushed where it changed; the XLA path's page bucket (the decode programs' ``num_pages``). A call in which every active slot stays
        within its own pages (most calls: a page holds ``page_size`` steps) only moves the lengths."""
        S = self.max_cache_len
        act = np.flatnonzero(self._pactive)
        need = np.minimum(self._plen[act] + int(n), S)
        copies: list[tuple[int, int]] = []
        if self._fits_room(act, need).all():
            for slot, m in zip(act.tolist(), need.tolist()):
                self.pool.grow(slot, m)
        else:
            for slot, m in zip(act.tolist(), need.tolist()):
                copies += self._retry(lambda: self.pool.ensure(slot, m), slot)
                self._row(slot)
            self._room[:] = 0
            self._room[act] = [self.pool.room(slot) for slot in act.tolist()]  # after every slot's copies
            self._room_at = self.pool.changes
        self._plen[act] = need
        self._pactive[act[need >= S]] = False
        return self._push(state, copies), {"num_pages": self._bucket(max(1, int(need.max(initial=1))))}

    def after_call(self, decode_state: dict) -> dict:
        return self._synced_state(decode_state)
