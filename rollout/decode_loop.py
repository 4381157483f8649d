"""The decode side of a :class:`rollout.generator.Generator`: how many steps an engine call runs, one call
for all slots brought to the host in one transfer, each step's tokens recorded per request, and the requests
that end resolved into :class:`rollout.types.Completion` records (:class:`Completions`). Collaborators of the
Generator, handed the state they read and write (:mod:`rollout.generator_state`: the slot table and decode state,
the current weights, the options; :class:`rollout.kv_pressure.KVPressure`, :class:`rollout.kv_holds.KVHolds`).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax
import numpy as np

from rollout.generator_state import GeneratorOptions, SlotTable, Weights
from rollout.types import ROUTE_MISSING, Completion

__all__ = ["Completions", "DecodeLoop"]


class Completions:
    """A request's :class:`rollout.types.Completion` record and its future's result.

    Args:
      engine: the generator's engine (``route_shape``, ``route_dtype``).
      opts: the generator's :class:`rollout.generator_state.GeneratorOptions` (``moe_drops``).
    """

    def __init__(self, engine: Any, opts: GeneratorOptions) -> None:
        self.engine, self.opts = engine, opts

    def routes_array(self, req: Any) -> Optional[np.ndarray]:
        """[len(prompt) + len(tokens), n_moe_layers, k] compact ids (ROUTE_MISSING where none)."""
        shape = self.engine.route_shape
        if shape is None:
            return None
        n = len(req.prompt) + len(req.tokens)
        out = np.full((n, *shape), ROUTE_MISSING, self.engine.route_dtype)
        m = min(n, len(req.routes))
        if m:
            out[:m] = np.stack(req.routes[:m])
        return out

    def resolve(self, req: Any, reason: str) -> None:
        """Resolve ``req``'s future with its :class:`rollout.types.Completion` (``finish_reason`` ``reason``)."""
        now = time.monotonic()
        info = {
            "reissues": req.reissues,
            "dropped_tokens": req.dropped,
            "recomputes": req.recomputes,
            "prompt_len": len(req.prompt),
            "budget": req.budget,
            "queue_s": (req.t_start or now) - req.t_submit,
            "gen_s": now - (req.t_start or now),
            "prefill_tokens": req.prefill_tokens,
            "kv_reused": req.kv_reused,
            "shared_prefill": req.shared_prefill,
            "prefix_hits": req.prefix_hits,
            "preemptions": req.preemptions,
        }
        if self.opts.moe_drops:
            info["moe_dropped_copies"] = req.moe_dropped
            info["moe_copies"] = req.moe_copies
        # the record's behav_logp / versions are views of the request's buffers (no copy); a request
        # resolved before admission (max_new_tokens=0) has none
        n = len(req.tokens)
        behav_logp = req.behav_logp[:n] if req.behav_logp is not None else np.zeros(0, np.float32)
        versions = req.versions[:n] if req.versions is not None else np.zeros(0, np.int32)
        comp = Completion(req.request_id, req.tokens, behav_logp, versions, reason, info,
                          routes=self.routes_array(req))
        if not req.future.done():
            req.future.set_result(comp)

    def end(self, table: SlotTable, slot: int, req: Any, reason: str) -> None:
        """``req`` leaves ``slot`` of ``table`` (deactivated before the next decode call) and resolves."""
        table.release(slot)
        self.resolve(req, reason)


class DecodeLoop:
    """The generator's engine calls and per-token records (module doc).

    Args:
      engine: the generator's engine (:class:`rollout.types.DecodeEngine`).
      table: its :class:`rollout.generator_state.SlotTable` (each call replaces the decode state).
      weights: its :class:`rollout.generator_state.Weights` (the params a call decodes with, their version).
      opts: its :class:`rollout.generator_state.GeneratorOptions`.
      stats: its counters (``calls``, ``steps``, ``tokens``, ``discarded_tokens``).
      pressure: its :class:`rollout.kv_pressure.KVPressure` (room in a paged pool before a call).
      kv: its :class:`rollout.kv_holds.KVHolds` (a finished session's slot is held).
      completions: its :class:`Completions`.
    """

    def __init__(self, engine: Any, table: SlotTable, weights: Weights, opts: GeneratorOptions, stats: Any,
                 pressure: Any, kv: Any, completions: Completions) -> None:
        self.engine, self.table, self.weights, self.opts, self.stats = engine, table, weights, opts, stats
        self.pressure, self.kv, self.completions = pressure, kv, completions

    @property
    def num_active(self) -> int:
        """Slots decoding a request."""
        return sum(r is not None for r in self.table.reqs)

    def call_steps(self) -> int:
        """Decode steps of the next engine call: the fewest of :attr:`step_counts` that cover the
        largest number of tokens any live slot can still emit (its remaining budget, capped by its
        cache room), so a call never runs steps no slot can use (a 1-token request runs a 1-step
        program, not a ``decode_steps`` scan whose later tokens would all be discarded)."""
        need = 1
        for req in self.table.reqs:
            if req is not None:
                left = min(req.budget - len(req.tokens), self.opts.max_cache_len - len(req.prompt) - len(req.tokens))
                need = max(need, left)
        top = self.opts.decode_steps
        return next(n for n in self.opts.step_counts if n >= need) if need < top else top

    def decode(self) -> None:
        """One engine call (``decode``, or ``decode_steps`` of n <= ``decode_steps`` steps:
        :meth:`call_steps`) for all slots, its :class:`rollout.engine.StepOutput` brought to the
        host in ONE transfer, then consumed step by step; the slots that finished are deactivated
        before the next call."""
        self.free_finished()
        v, params = self.weights.version, self.weights.params  # every token of the call is produced by params
        self.pressure.make_room(self.call_steps())  # a paged pool short of pages: preempt (rollout.kv_pressure)
        if not self.num_active:
            return
        n = self.call_steps()
        if n == 1:
            self.table.state, out = self.engine.decode(params, self.table.state, version=v)
            steps = [jax.device_get(out)]  # the one host sync of the step
        else:  # n steps in one call: [n, B] leaves, one host sync for all of them
            self.table.state, out = self.engine.decode_steps(params, self.table.state, n, version=v)
            out = jax.device_get(out)
            steps = [out.at(i) for i in range(n)]
        self.stats["calls"] += 1
        live = [req is not None for req in self.table.reqs]  # slots with a request when the call began
        for r in steps:
            self.consume_step(r, live)

    def free_finished(self) -> None:
        """Deactivate the slots whose request ended since the last call and that no request took
        since (one ``engine.free_slots``):
        a finished or held slot does not decode, and its cached K/V (a held context) stay intact."""
        done = [s for s in self.table.finished if self.table.reqs[s] is None]
        self.table.finished = []
        if done:
            self.table.state = self.engine.free_slots(self.table.state, sorted(set(done)))

    def consume_step(self, r: Any, live: list) -> None:
        """Append one decode step's outputs (a host :class:`rollout.engine.StepOutput` of [B]
        arrays) to the live requests in slots, finishing those that stop. ``live`` [B] bool: the
        slot held a request when the call began (a valid token of such a slot whose request
        finished earlier in the call is discarded and counted)."""
        toks, valid, behav_logp, versions = r.token, r.valid, r.behav_logp, r.version
        routes = r.route
        drops = r.moe_dropped  # None unless the engine counts MoE capacity drops
        self.stats["steps"] += 1
        for slot, req in enumerate(self.table.reqs):
            if req is None:
                if live[slot] and valid[slot]:
                    self.stats["discarded_tokens"] += 1
                continue
            if not valid[slot]:  # cache full before this token (should not happen: see below)
                self.completions.end(self.table, slot, req, "length")
                continue
            tok = int(toks[slot])
            if drops is not None:  # the fed token's copies (engine docstring, "MoE capacity drops")
                req.moe_dropped += int(drops[slot])
                req.moe_copies += self.opts.moe_copies_per_token
            i = len(req.tokens)
            req.tokens.append(tok)
            req.behav_logp[i] = behav_logp[slot]  # float32 -> float32 in place: no Python float
            req.versions[i] = versions[slot]
            if routes is not None:  # the route of the token this step fed (position len(context) - 2)
                req.routes.append(np.asarray(routes[slot]))
            self.stats["tokens"] += 1
            if tok in req.stop_ids:
                reason = "stop"
            elif len(req.tokens) >= req.budget or len(req.prompt) + len(req.tokens) >= self.opts.max_cache_len:
                reason = "length"  # budget, or the sequence fills the cache
            else:
                continue
            if self.opts.keep_kv and req.session is not None:
                self.table.reqs[slot] = None
                self.kv.hold(req, slot)
            self.completions.end(self.table, slot, req, reason)
