"""What a :class:`rollout.generator.Generator` does when a paged engine's K/V pool runs short
(``rollout.kv_layout=paged``; a collaborator of the Generator, handed its slot table, request queue, held
episodes and counters: :mod:`rollout.generator_state`). It asks the engine's K/V layout (``engine.kv``, :class:`rollout.engine.layout.KVLayout`);
a layout that is not ``pooled`` (the contiguous one) never gets here.

Two rules, vLLM's (its scheduler's ``can_allocate`` / ``_preempt`` by recompute):

* **Admission by free pages.** A queued request is admitted only when the pool can hold it: its
  context (prompt, plus what it generated before a preemption) and its first ``decode_steps``
  positions, past any prefix pages it shares (``engine.kv.request_pages``), within what is left of
  the step's page budget (``engine.kv.admission_budget``: free + cached pages + what held slots alone
  hold, less what the decoding slots need for their next call). A request that does not fit waits in
  the queue, in its place (the admission order of :mod:`rollout.admission` is kept: the requests behind
  it wait too), counted in ``kv_admission_waits`` (once per step its head waits, and once per request a
  prefill that found the pool exhausted queued again). With no slot decoding and nothing
  admitted yet in the step the head is admitted whatever the budget says (the pool holds one
  ``max_cache_len`` sequence, the engine's construction checks it; held slots are preempted for it).
* **Preemption of an active slot.** Before each decode call the generator asks the engine how many
  pages the active slots lack for the call (``engine.kv.decode_shortfall``: held slots and cached
  pages count as room, the engine frees them first). While some are lacking it preempts the active
  request admitted most recently (vLLM's victim: the end of its running queue): the engine frees its
  pages (``engine.kv.preempt_slots``, ``kv_preemptions``), and the request goes back to the head of the
  queue with everything it generated (``kv_preempted_requests``; ``Completion.info["preemptions"]``).
  When it is admitted again its prompt + generated tokens are re-prefilled (preemption by recompute;
  ``kv_reprefill_tokens`` counts those positions) and decoding resumes at the next position. A lone
  active slot is never preempted (it could not resume either). A prefill that still finds the pool
  exhausted (an estimate off by a page) queues its requests again the same way.

What a preempted request keeps: its tokens, their ``behav_logp`` and per-token ``version`` (the values
they were sampled with; nothing is re-sampled: a token's key is its seed and position, so the tokens
after the resume are the ones an unpreempted run would sample from the same logits). Its K/V are
recomputed by the params current *when it is re-admitted*: the same weights when no swap happened
in between (then only the prefill/decode rounding differs, below 1e-5 in fp32), else the new ones. So a
swap while it waits acts as ``rollout.partial=recompute_kv`` on it whatever the policy (the old
weights' K/V are gone; ``continue`` cannot keep them): ``recompute_kv`` and ``continue`` count it in
``recomputes``, and ``abort`` drops its partial turn and re-issues it with the remaining budget, as it
does to a request in a slot (:meth:`rollout.kv_holds.KVHolds.after_swap`).

Per shard: an engine whose pool is split over shards of slots (``engine.kv.shards`` > 1: a rollout mesh
that splits the slots over ``data`` / ``expert``, :mod:`rollout.engine.paged`) has a page budget per
shard, and a slot takes only its shard's pages. A request without a slot of its own goes to the free
slot whose shard has the most budget left after it (a GRPO sample to its group's shard, where it forks
the group's pages, unless another shard has more room), and waits when that does not fit; before a
decode call only the shards short of pages preempt, each its most recently admitted request (never a
shard's last active one: each shard's pages hold one sequence). With one shard all of this is the rules
above. Routes (routing replay): the re-prefill
reports the route of every position it ran, and, as for ``recompute_kv``, each position keeps the route
it was run with most recently (the one of the K/V every later token attends to); under the same
weights those are the routes it had, up to ties the rounding breaks.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

from rollout.generator_state import HeldEpisodes, RequestQueue, SlotTable

__all__ = ["KVPressure"]


class KVPressure:
    """Admission by free pages and preemption by recompute (module doc): a collaborator of the generator,
    given the state it reads and writes.

    Args:
      engine: the generator's engine (:class:`rollout.types.DecodeEngine`; its K/V layout ``engine.kv``).
      table: the generator's :class:`rollout.generator_state.SlotTable` (a preemption frees a slot and
        replaces the decode state).
      requests: its :class:`rollout.generator_state.RequestQueue` (a preempted request goes to its head).
      holds: its :class:`rollout.generator_state.HeldEpisodes` (read: which slots are held).
      stats: its counters (``kv_admission_waits``, ``kv_preempted_requests``; ``kv_reprefill_tokens`` is the
        generator's own).
      decode_steps: the most decode steps per engine call (``rollout.decode_steps``).
    """

    def __init__(self, engine: Any, table: SlotTable, requests: RequestQueue, holds: HeldEpisodes,
                 stats: collections.Counter, decode_steps: int) -> None:
        self.engine, self.table, self.requests, self.holds = engine, table, requests, holds
        self.stats, self.decode_steps = stats, int(decode_steps)

    def _budgeted(self) -> bool:
        """The engine's K/V layout budgets admissions (a pool of pages), else every slot's positions are reserved."""
        return self.engine.kv.pooled

    def _shard(self, slot: int) -> int:
        return self.engine.kv.shard_of(slot) if self.engine.kv.shards > 1 else 0

    def page_budget(self, free_finished: Callable[[], None]) -> Optional[list]:
        """Pages this step's admissions may take, per shard (None: the engine has no pages). The slots whose request
        ended are deactivated first, and the pages of every slot held for no session are given back (a
        finished request's K/V serve nothing but its published prefix pages, which stay cached), so the
        pool's state does not depend on what earlier steps left in it. ``free_finished``: the generator's
        deactivation of those slots."""
        if not self._budgeted():
            return None
        free_finished()
        self.engine.kv.release([s for s in range(self.table.size) if self.table.reqs[s] is None and s not in self.holds.by_slot])
        n = self.engine.kv.shards
        if n == 1:
            return [self.engine.kv.admission_budget(self.decode_steps)]
        return [self.engine.kv.admission_budget(self.decode_steps, shard=d) for d in range(n)]

    def page_cost(self, pages: Optional[list], ctx: list, slot: Optional[int], start: int, shared: Optional[int],
                   free: list) -> tuple[int, int]:
        """``(pages, shard)`` admitting the row ``ctx`` into ``slot`` at ``start`` takes; ``shared``: the slot
        of an identical row admitted before it in this step (its pages are forked within a shard). ``slot``
        None (a free slot): with several shards the free slot whose shard keeps the most budget is moved to
        the head of ``free`` (what the generator takes next); with none free, the held slot it would evict."""
        if pages is None:
            return 0, 0

        def cost(s: int) -> int:
            same = shared is not None and self._shard(shared) == self._shard(s)
            return self.engine.kv.request_pages(ctx, s, start, self.decode_steps, same)

        if slot is None and len(pages) > 1 and free:
            firsts: dict = {}
            for s in free:
                firsts.setdefault(self._shard(s), s)
            left = {s: pages[d] - cost(s) for d, s in firsts.items()}
            slot = max(left, key=lambda s: (left[s], -s))
            free.remove(slot)
            free.insert(0, slot)
            return pages[self._shard(slot)] - left[slot], self._shard(slot)
        if slot is None:  # one shard: any slot's cost; several, none free: the held slot _take_slot evicts
            slot = -1 if len(pages) == 1 or not self.holds.by_session else min(self.holds.by_session.values(), key=lambda h: h.t).slot
        return cost(slot), self._shard(slot)

    def pages_wait(self, pages: Optional[list], need: int, shard: int, first: bool) -> bool:
        """Whether the request must wait for pages of ``shard`` (counted in ``kv_admission_waits``); ``first``:
        no slot decodes and nothing was admitted in this step (the head is admitted whatever)."""
        if pages is None or need <= pages[shard] or first:
            return False
        self.stats["kv_admission_waits"] += 1
        return True

    def make_room(self, n: int) -> None:
        """Preempt active requests, most recently admitted first, until the next ``n``-step decode call
        fits the pool (module doc); never the last active one (of its shard)."""
        if not self._budgeted():
            return
        shards = self.engine.kv.shards
        while self.engine.kv.decode_shortfall(n) > 0:
            short = {0} if shards == 1 else {d for d in range(shards) if self.engine.kv.decode_shortfall(n, shard=d)}
            live = [(req.admit_seq, slot) for slot, req in enumerate(self.table.reqs)
                    if req is not None and self._shard(slot) in short]
            count = collections.Counter(self._shard(s) for _, s in live)
            live = [x for x in live if count[self._shard(x[1])] > 1]
            if not live:
                return  # the engine preempts held slots itself; one sequence always fits a shard's pool
            _, slot = max(live)
            req = self.table.reqs[slot]
            self.table.state = self.engine.kv.preempt_slots(self.table.state, [slot])
            self.table.reqs[slot] = None
            self.requeue(req)

    def requeue(self, req: Any) -> None:
        """``req`` lost its slot's K/V: back to the head of the queue, to be re-prefilled with what it
        generated (``kv_preempted_requests``)."""
        req.preemptions += 1
        self.stats["kv_preempted_requests"] += 1
        self.requests.push_front(req)

    def kv_stats(self) -> dict[str, int]:
        """The engine's pool counters (``kv_pages_in_use``, ``kv_preemptions``, ...) and the generator's
        (``kv_admission_waits``, ``kv_preempted_requests``, ``kv_reprefill_tokens``); {} without pages."""
        if not self._budgeted():
            return {}
        own = {k: int(self.stats[k]) for k in ("kv_admission_waits", "kv_preempted_requests", "kv_reprefill_tokens")}
        return {**self.engine.kv.stats(), **own}
