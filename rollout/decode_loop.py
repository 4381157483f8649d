"""The decode side of a :class:`rollout.generator.Generator`: how many steps an engine call runs, one call
for all slots brought to the host in one transfer, each step's tokens recorded per request, and the requests
that end resolved into :class:`rollout.types.Completion` records. A base class of the Generator (its state:
``_slots``, ``_finished``, ``_state``, ``_params``, ``_version``, ``stats``, ``engine``...).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax
import numpy as np

from rollout.types import ROUTE_MISSING, Completion

__all__ = ["DecodeLoop"]


class DecodeLoop:
    """The decode and completion methods of :class:`rollout.generator.Generator`."""

    def _routes_array(self, req: Any) -> Optional[np.ndarray]:
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

    def _call_steps(self) -> int:
        """Decode steps of the next engine call: the fewest of :attr:`step_counts` that cover the
        largest number of tokens any live slot can still emit (its remaining budget, capped by its
        cache room), so a call never runs steps no slot can use (a 1-token request runs a 1-step
        program, not a ``decode_steps`` scan whose later tokens would all be discarded)."""
        need = 1
        for req in self._slots:
            if req is not None:
                left = min(req.budget - len(req.tokens), self._S - len(req.prompt) - len(req.tokens))
                need = max(need, left)
        return next(n for n in self.step_counts if n >= need) if need < self.decode_steps else self.decode_steps

    def _decode(self) -> None:
        """One engine call (``decode``, or ``decode_steps`` of n <= ``decode_steps`` steps:
        :meth:`_call_steps`) for all slots, its :class:`rollout.engine.StepOutput` brought to the
        host in ONE transfer, then consumed step by step; the slots that finished are deactivated
        before the next call."""
        self._free_finished()
        v = self._version  # every token of the call is produced by self._params
        self._make_room(self._call_steps())  # a paged pool short of pages: preempt (rollout.kv_pressure)
        if not self.num_active:
            return
        n = self._call_steps()
        if n == 1:
            self._state, out = self.engine.decode(self._params, self._state, version=v)
            steps = [jax.device_get(out)]  # the one host sync of the step
        else:  # n steps in one call: [n, B] leaves, one host sync for all of them
            self._state, out = self.engine.decode_steps(self._params, self._state, n, version=v)
            out = jax.device_get(out)
            steps = [out.at(i) for i in range(n)]
        self.stats["calls"] += 1
        live = [req is not None for req in self._slots]  # slots with a request when the call began
        for r in steps:
            self._consume_step(r, live)

    def _free_finished(self) -> None:
        """Deactivate the slots whose request ended since the last call and that no request took
        since (one ``engine.free_slots``):
        a finished or held slot does not decode, and its cached K/V (a held context) stay intact."""
        done = [s for s in self._finished if self._slots[s] is None]
        self._finished = []
        if done:
            self._state = self.engine.free_slots(self._state, sorted(set(done)))

    def _consume_step(self, r: Any, live: list) -> None:
        """Append one decode step's outputs (a host :class:`rollout.engine.StepOutput` of [B]
        arrays) to the live requests in slots, finishing those that stop. ``live`` [B] bool: the
        slot held a request when the call began (a valid token of such a slot whose request
        finished earlier in the call is discarded and counted)."""
        toks, valid, behav_logp, versions = r.token, r.valid, r.behav_logp, r.version
        routes = r.route
        drops = r.moe_dropped  # None unless the engine counts MoE capacity drops
        self.stats["steps"] += 1
        for slot, req in enumerate(self._slots):
            if req is None:
                if live[slot] and valid[slot]:
                    self.stats["discarded_tokens"] += 1
                continue
            if not valid[slot]:  # cache full before this token (should not happen: see below)
                self._end(slot, req, "length")
                continue
            tok = int(toks[slot])
            if drops is not None:  # the fed token's copies (engine docstring, "MoE capacity drops")
                req.moe_dropped += int(drops[slot])
                req.moe_copies += self._moe_cpt
            i = len(req.tokens)
            req.tokens.append(tok)
            req.behav_logp[i] = behav_logp[slot]  # float32 -> float32 in place: no Python float
            req.versions[i] = versions[slot]
            if routes is not None:  # the route of the token this step fed (position len(context) - 2)
                req.routes.append(np.asarray(routes[slot]))
            self.stats["tokens"] += 1
            if tok in req.stop_ids:
                reason = "stop"
            elif len(req.tokens) >= req.budget or len(req.prompt) + len(req.tokens) >= self._S:
                reason = "length"  # budget, or the sequence fills the cache
            else:
                continue
            if self.keep_kv and req.session is not None:
                self._slots[slot] = None
                self._hold(req, slot)
            self._end(slot, req, reason)

    def _end(self, slot: int, req: Any, reason: str) -> None:
        """``req`` leaves ``slot`` (deactivated before the next decode call) and resolves."""
        self._slots[slot] = None
        self._finished.append(slot)
        self._resolve(req, reason)

    def _resolve(self, req: Any, reason: str) -> None:
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
        if self._moe_drops:
            info["moe_dropped_copies"] = req.moe_dropped
            info["moe_copies"] = req.moe_copies
        # the record's behav_logp / versions are views of the request's buffers (no copy); a request
        # resolved before admission (max_new_tokens=0) has none
        n = len(req.tokens)
        behav_logp = req.behav_logp[:n] if req.behav_logp is not None else np.zeros(0, np.float32)
        versions = req.versions[:n] if req.versions is not None else np.zeros(0, np.int32)
        comp = Completion(req.request_id, req.tokens, behav_logp, versions, reason, info,
                          routes=self._routes_array(req))
        if not req.future.done():
            req.future.set_result(comp)
