"""The K/V a :class:`rollout.generator.Generator` keeps and prefills: free and held slots, the batched
prefill of a step's admissions, a weight swap's treatment of the sequences in slots (``partial``), and the
prefix cache. A collaborator of the Generator, handed the state it reads and writes
(:mod:`rollout.generator_state`: the slot table, the request queue, the held episodes, the current weights, the
options).

Kept K/V (``keep_kv``, ``rollout.keep_kv``; sessions). A request submitted with ``session=key`` (the
agent passes one per episode) that finishes (stop id or budget) leaves its slot *held*: the slot's
cache holds ``prompt + tokens[:-1]`` (the last sampled token was never fed). The session's next
request whose prompt starts with that context takes the held slot and runs only its new tokens
(the last sampled token, the tool output and the generation prompt) through an append-prefill at
the cache's current length (``SlotPrefill.start``); its ``Completion.routes`` keep, at every held
position, the route that position's K/V was computed with. Holding policy: a held slot is not
decoding a request and not free; it is given up (its session's next turn then re-prefills the
whole conversation; each counted in ``stats``) when

* a queued request finds no free slot: the least recently held slot is evicted (``kv_evictions``),
  so slow tools never starve the fleet of slots;
* (no bound in decode steps: a held slot is deactivated in the engine, ``Qwen3Engine.free_slots``,
  so it neither decodes nor writes its cache while the tool runs; its K/V stay as they were);
* its session's next prompt does not extend the held context (``kv_mismatch``), or the session is
  released (:meth:`Generator.release_session`, at the end of the episode);
* a weight swap under ``partial=recompute_kv`` or ``abort`` (``kv_dropped_swap``): the next turn
  re-prefills the conversation under the new params, as the re-prefill path does. Under
  ``continue`` the held K/V stay (computed by older weights, as a ``continue`` slot's within a turn)
  and the new turn's tokens carry the new version.

Prefix cache (``prefix_cache`` entries, ``rollout.prefix_cache``). A request submitted with
``prefix_len=p`` (the agent passes the length of the env's rendered system prompt + tool schemas,
shared by every episode) starts from the K/V of ``prompt[:p]`` kept in an LRU cache keyed by those
tokens and the weight version: a miss prefills them once (``prefix_misses``; counted in that
request's ``prefill_tokens``), a hit (``prefix_hits``) copies them into the slot (one ``insert``),
and the request's row appends only ``prompt[p:]``; the other requests of the step with the same
whole prompt (a GRPO group's samples) copy that slot's row after the prefill
(``engine.copy_slot``, each armed with its own seed). A weight swap changes the key, so no request
ever starts from another version's prefix. Entries are K/V rows of the prefix's length bucket on
the engine's device(s).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Optional

import numpy as np

from rollout.engine import SlotPrefill
from rollout.engine.paged.pool import PoolExhausted
from rollout.generator_state import GeneratorOptions, HeldEpisodes, RequestQueue, SlotTable, Weights

__all__ = ["KVHolds", "HeldSlot"]

log = logging.getLogger("rollout.generator")


@dataclasses.dataclass
class HeldSlot:
    """A finished turn's slot kept for its session's next turn (module docstring, "Kept K/V")."""
    slot: int
    context: list  # the tokens whose K/V the slot holds, at positions 0..len-1
    routes: list  # their routes (record_routes), one [n_moe_layers, k] per position
    t: float  # when it was held (the least recently held one is evicted first)


class KVHolds:
    """The generator's slots, prefills, held slots and prefix cache (module doc).

    Args:
      engine: the generator's engine (:class:`rollout.types.DecodeEngine`).
      table: its :class:`rollout.generator_state.SlotTable` (a prefill arms slots and replaces the decode state).
      requests: its :class:`rollout.generator_state.RequestQueue` (a request short of pages goes back to its head).
      holds: its :class:`rollout.generator_state.HeldEpisodes`.
      weights: its :class:`rollout.generator_state.Weights` (the params a prefill runs, the prefix cache's key).
      opts: its :class:`rollout.generator_state.GeneratorOptions`.
      stats: its counters (prefill, hold and prefix-cache ones: :mod:`rollout.generator`'s module doc).
      completions: its :class:`rollout.decode_loop.Completions` (a request a swap ends, or whose prefill fails).
    """

    def __init__(self, engine: Any, table: SlotTable, requests: RequestQueue, holds: HeldEpisodes, weights: Weights,
                 opts: GeneratorOptions, stats: collections.Counter, completions: Any) -> None:
        self.engine, self.table, self.requests, self.holds = engine, table, requests, holds
        self.weights, self.opts, self.stats, self.completions = weights, opts, stats, completions
        self.prefixes: collections.OrderedDict = collections.OrderedDict()
        """The prefix cache: (prefix tokens, version) -> the engine's prefix K/V (LRU, ``opts.prefix_cache``)."""

    def free_slots(self) -> list[int]:
        return [s for s in range(self.table.size) if self.table.reqs[s] is None and s not in self.holds.by_slot]

    def held_slot_for(self, req: Any, free: list) -> tuple[Optional[int], int, Optional[HeldSlot]]:
        """``(slot, start, hold)``: the held slot of ``req``'s session whose context its prompt extends
        (it runs from ``start``), else ``(None, 0, None)``; a hold it does not extend is dropped
        (``kv_mismatch``) and its slot goes to ``free``."""
        held = self.holds.by_session.get(req.session) if req.session is not None else None
        if held is None:
            return None, 0, None
        c = len(held.context)
        if self.opts.keep_kv and c < len(req.prompt) and req.prompt[:c] == held.context:
            return held.slot, c, held
        free.append(self.drop_hold(req.session, "kv_mismatch"))  # nothing to reuse
        return None, 0, None

    def take_slot(self, free: list) -> Optional[int]:
        """A free slot, else the least recently held one (evicted: ``kv_evictions``); None: neither."""
        if not free:
            if not self.holds.by_session:
                return None
            victim = min(self.holds.by_session.values(), key=lambda h: h.t)
            free.append(self.drop_hold(self.holds.by_slot[victim.slot], "kv_evictions"))
        return free.pop(0)

    def take_held(self, req: Any, held: HeldSlot, start: int) -> None:
        """``req`` takes its session's held slot: the kept positions keep the routes their K/V came from."""
        self.drop_hold(req.session)
        req.routes = list(held.routes)
        req.kv_reused += start
        self.stats["kv_reused_tokens"] += start

    def drop_hold(self, session: Any, reason: str = "") -> Optional[int]:
        """Forget ``session``'s held slot (counted under ``reason``); returns the freed slot."""
        h = self.holds.by_session.pop(session, None)
        if h is None:
            return None
        self.holds.by_slot.pop(h.slot, None)
        if reason:
            self.stats[reason] += 1
        return h.slot

    def hold(self, req: Any, slot: int) -> None:
        """A finished turn of a session: keep its slot, whose cache holds ``prompt + tokens[:-1]``
        (the last sampled token was never fed), for the session's next turn."""
        ctx = req.prompt + req.tokens[:-1]
        if not req.tokens or len(ctx) >= self.opts.max_cache_len - 1:
            return
        self.drop_hold(req.session)
        self.holds.by_session[req.session] = HeldSlot(slot, ctx, list(req.routes[: len(ctx)]), time.monotonic())
        self.holds.by_slot[slot] = req.session
        self.stats["kv_holds"] += 1

    def apply_releases(self) -> None:
        with self.requests.lock:
            rel, self.holds.releases = self.holds.releases, []
        for session in rel:
            self.drop_hold(session)

    def prefill_batch(self, items: list) -> None:
        """Prefill ``items`` = [(slot, req, context tokens, start)] into their slots: one
        ``engine.prefill_slots`` call (one program per length bucket; a GRPO group's identical
        prompts once).
        Each request is in its slot afterwards; a failing row fails its own request only (the
        batch is retried row by row when a batched call raises)."""
        if not items:
            return

        rows = [SlotPrefill(toks, slot, req.seed, req.temperature, start) for slot, req, toks, start in items]
        try:
            self.table.state, res = self.engine.prefill_slots(self.weights.params, self.table.state, rows)
            self.stats["prefill_calls"] += 1
        except PoolExhausted:  # a paged pool short of pages (the engine took them back): wait in the queue
            for _, req, _, _ in items:
                self.stats["kv_admission_waits"] += 1
                with self.requests.lock:
                    self.requests.queue.appendleft(req)
            return
        except Exception as e:  # noqa: BLE001 - find the culprit: row by row
            if len(items) == 1:
                self.prefill_failed(items[0][0], items[0][1], e)
                return
            log.warning("batched prefill of %d requests failed (%r): retrying one by one", len(items), e)
            for it in items:
                self.prefill_batch([it])
            return
        for (slot, req, toks, start), r in zip(items, res):  # r: a rollout.engine.PrefillResult
            n = int(r.prefill_tokens)
            req.prefill_tokens += n
            req.shared_prefill = req.shared_prefill or bool(r.shared)
            if self.opts.moe_drops:
                req.moe_dropped += int(r.moe_dropped or 0)
                req.moe_copies += n * self.opts.moe_copies_per_token
            self.stats["prefill_tokens"] += n
            self.stats["prefills"] += 1
            self.stats["shared_prefills"] += int(bool(r.shared))
            routes = r.routes
            if routes is not None:  # the positions it ran take their new routes (module docstring)
                del req.routes[start:]
                req.routes.extend(np.asarray(routes))
            self.table.reqs[slot] = req

    def prefill_failed(self, slot: int, req: Any, e: BaseException) -> None:
        log.warning("prefill of request %d (%d tokens) failed: %r", req.request_id, len(req.prompt), e)
        self.stats["prefill_errors"] += 1
        if self.table.reqs[slot] is req:
            self.table.reqs[slot] = None
        self.table.finished.append(slot)
        if not req.future.done():
            req.future.set_exception(e)

    def after_swap(self) -> None:
        """The weights were swapped (``weights`` holds the new ones): the sequences in slots, held or waiting
        after a preemption are treated by ``partial`` (:mod:`rollout.generator`'s module doc)."""
        self.swap_preempted()
        if self.opts.partial == "continue":
            return  # held slots keep their K/V too: the next turn's new tokens carry the new version
        for session in list(self.holds.by_session):  # K/V of older weights: the next turn re-prefills (module doc)
            self.drop_hold(session, "kv_dropped_swap")
        items = []
        for slot, req in enumerate(self.table.reqs):
            if req is None:
                continue
            if self.opts.partial == "recompute_kv":
                req.recomputes += 1
                self.stats["recomputes"] += 1
                items.append((slot, req, req.prompt + req.tokens, 0))
            else:  # abort: drop the partial turn, re-issue with the remaining budget
                n = len(req.tokens)
                req.dropped += n
                req.budget -= n
                req.reissues += 1
                req.tokens = []  # its behav_logp / versions buffers are overwritten from index 0
                del req.routes[max(0, len(req.prompt) - 1):]  # the dropped turn's routes go with it
                self.stats["reissues"] += 1
                if req.budget <= 0:
                    self.completions.end(self.table, slot, req, "aborted")
                else:
                    items.append((slot, req, req.prompt, 0))
        for slot, *_ in items:
            self.table.reqs[slot] = None  # re-armed by the prefill (a failed one leaves the slot free)
            self.table.finished.append(slot)
        self.prefill_batch(items)

    def swap_preempted(self) -> None:
        """A swap reaches the preempted requests waiting with tokens (rollout.kv_pressure): their K/V will
        be recomputed by the new params (``recomputes``), or under ``abort`` their partial turn is dropped
        and re-issued with the remaining budget."""
        with self.requests.lock:
            waiting = [r for r in self.requests.queue if r.tokens]
        for req in waiting:
            if self.opts.partial != "abort":
                req.recomputes += 1
                self.stats["recomputes"] += 1
                continue
            n = len(req.tokens)
            req.dropped, req.budget, req.reissues, req.tokens = req.dropped + n, req.budget - n, req.reissues + 1, []
            del req.routes[max(0, len(req.prompt) - 1):]
            self.stats["reissues"] += 1
            if req.budget <= 0:
                with self.requests.lock:
                    self.requests.queue.remove(req)
                self.completions.resolve(req, "aborted")

    def use_prefix(self, pre: tuple, req: Any, slot: int) -> bool:
        """Copy the cached K/V of the shared prefix ``pre`` = (tokens, version) into ``slot`` (prefilled
        now on a miss, ``prefix_misses``; else ``prefix_hits``); the request's rows then append the
        rest of its prompt. Returns False when the prefix's prefill failed (the request is failed)."""
        prefix = self.prefixes.get(pre)
        if prefix is None:
            toks = list(pre[0]) + [req.prompt[len(pre[0])]]
            try:
                prefix = self.engine.prefill_tokens(self.weights.params, toks, seed=req.seed, temperature=req.temperature)
            except Exception as e:  # noqa: BLE001 - this request's fault: fail it alone
                self.prefill_failed(slot, req, e)
                return False
            self.prefixes[pre] = prefix
            while len(self.prefixes) > self.opts.prefix_cache:
                self.prefixes.popitem(last=False)
            n = len(pre[0])
            req.prefill_tokens += n
            if self.opts.moe_drops:
                req.moe_dropped += int(prefix.get("moe_dropped", 0))
                req.moe_copies += n * self.opts.moe_copies_per_token
            self.stats["prefill_tokens"] += n
            self.stats["prefix_misses"] += 1
        else:
            self.prefixes.move_to_end(pre)
            req.prefix_hits += 1
            self.stats["prefix_hits"] += 1
        self.table.state = self.engine.insert(prefix, self.table.state, slot)  # positions [0, len(prefix)) of the slot
        routes = prefix.get("routes")
        req.routes = [] if routes is None else list(np.asarray(routes))
        return True

    def copy_firsts(self, copies: list, items: list) -> None:
        """The prefix-cache route's GRPO samples: copy their first sample's slot (prefilled in ``items``)."""
        for slot, req, i in copies:
            src, first = items[i][0], items[i][1]
            if self.table.reqs[src] is not first:  # its first sample's prefill failed: try again next step
                with self.requests.lock:
                    self.requests.queue.appendleft(req)
                continue
            self.table.state = self.engine.copy_slot(self.table.state, src, slot, token=req.prompt[-1], seed=req.seed,
                                                temperature=req.temperature)
            req.routes = list(first.routes)
            req.shared_prefill = True
            self.stats["prefills"] += 1
            self.stats["shared_prefills"] += 1
            self.table.reqs[slot] = req
