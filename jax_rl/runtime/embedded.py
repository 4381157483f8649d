"""Embedded runtime: one process, rollout threads + the learner loop, weights handed over by version.

Threads:

* ``rollout`` producer threads (``rollout.threads`` generators; each keeps up to
  ``ceil(slots / group_size) + 1`` GRPO groups in flight through one :class:`AgentLoop`).
  A group starts only when the buffer admits it (AReaL-style admission for
  ``async.max_staleness`` = K), so rollouts never run further ahead than K versions.
* the learner loop (the caller's thread): take ``optim.batch_size / group_size`` groups from the
  buffer, compute group advantages, train one step, publish the new params to every generator
  (``update_params(params, version)``) and only then tell the buffer the new version.

Bad episodes never end the run: an episode whose env or tool raises is failed and counted
(``episode_errors``; the buffer's ``failed``), one whose prompt does not fit ``rollout.max_cache_len``
is dropped and counted (``dropped_overlong``), and a group whose loop or put raises gives its slot
back. Only ``rollout.max_consecutive_episode_errors`` unusable episodes in a row (no usable one in
between: the env or the config is broken) stop the run, with the last reason (:attr:`RolloutManager.fatal`).

Task seeds are assigned by group index (``env.train_seed_offset + group_id``), and every sampling
seed derives from (task seed, sample, turn), so with K = 0 a run is reproducible and a resumed run
re-issues the in-flight groups identically.

Multi-process (``jax.distributed``, one process per host): every process runs its own producer on its
local rollout devices (``placement.rollout`` / ``Roles.local_engines``, or its first local device when
colocated). Process p of n starts groups ``p, p + n, p + 2n, ...``, contributes
``optim.batch_size / group_size / n`` groups to each step, and the learner trains on the union
(``train_step(..., process_local=True)``): each process's trajectories reach the learner once, none twice.
Checkpoints record every process's producer state and buffer (``processes``, gathered through the
``jax.distributed`` key-value store); on resume each process takes its own: its next group, its
in-flight groups re-issued, its pending groups back in its buffer, so no group is lost or trained twice.
Weights reach every process's engines shard by shard (:mod:`jax_rl.weight_sync`), never as a full copy.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional

import jax

from jax_rl.config import Config
from jax_rl.learner.correction.old_logits import ScoringQueue
from jax_rl.placement import resolve_roles
from jax_rl.runtime import engines
from jax_rl.runtime.loop import EpisodeGuard, WeightSyncClock, buffer_columns
from jax_rl.collectives import allgather_json
from rollout.agent import AgentLoop
from rollout.buffer import TrajectoryBuffer

log = logging.getLogger("jax_rl.runtime")

__all__ = ["RolloutManager", "EmbeddedProducer"]


class RolloutManager:
    """Producer side of the embedded runtime.

    Args:
        cfg: the run config.
        generators: started generators (one per rollout thread).
        agents: one :class:`rollout.agent.AgentLoop` per generator.
        buffer: the shared :class:`rollout.buffer.TrajectoryBuffer`.
        version_fn: returns the version the generators currently run (the buffer's notion of "now").
        next_group: first group index to start (from a checkpoint when resuming).
        reissue: groups to re-issue first (in-flight at the checkpoint), as ``[(group_id, task_seed)]``.
    """

    def __init__(self, cfg: Config, generators: list, agents: list, buffer, version_fn: Callable[[], int],
                 next_group: int = 0, reissue: Optional[list] = None, episode_errors: int = 0, scoring=None,
                 failures_by_reason: Optional[dict] = None):
        self.cfg = cfg
        self.scoring = scoring  # a route scoring before the buffer: a jax_rl.learner.correction.old_logits.ScoringQueue (set by the producer)
        self.generators = generators
        self.agents = agents
        self.buffer = buffer
        self.version_fn = version_fn
        # re-entrant: _put holds it across the in-flight pop and the buffer put (and may log an error under it)
        self._lock = threading.RLock()
        # multi-process (jax.distributed): process p of n starts groups p, p + n, p + 2n, ... (its share of the
        # task stream), so no two processes ever generate the same task; _next_group counts this process's groups
        # (disaggregated: over the processes that run engines, engines.rollout_rank; a learner-only process starts none)
        rank, n = engines.rollout_rank(cfg)
        self._nproc, self._pid = n, (-1 if rank is None else rank)
        self._next_group = int(next_group)
        self._reissue = [tuple(r) for r in (reissue or []) if int(r[0]) % self._nproc == self._pid]
        self._in_flight: dict[int, int] = {}  # group_id -> task seed
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.generated_tokens = 0
        self.t_start = time.perf_counter()
        self.errors: list[str] = []  # the last few errors (messages), for logs
        self.groups_done = 0
        self.admit_wait_s = 0.0  # seconds, summed over producer threads, blocked in buffer.admit
        self.guard = EpisodeGuard(cfg.rollout.max_consecutive_episode_errors, episode_errors,
                                  by_reason=failures_by_reason, max_seq_len=cfg.optim.max_seq_len)
        self._fatal: Optional[str] = None

    @property
    def fatal(self) -> Optional[str]:
        """Why the run must stop (a systematically failing rollout, or no more training seeds), else None."""
        return self._fatal or self.guard.fatal

    @property
    def episode_errors(self) -> int:
        """Failed episodes so far (env/tool exceptions; a group whose loop raised counts group_size)."""
        return self.guard.episode_errors

    def _error(self, msg: str) -> None:
        with self._lock:
            self.errors = (self.errors + [msg])[-20:]

    # --------------------------------------------------------------- group ids
    def _take_group(self) -> tuple[int, int]:
        with self._lock:
            if self._reissue:
                gid, seed = self._reissue.pop(0)
            else:
                gid = self._next_group * self._nproc + self._pid
                self._next_group += 1
                seed = self.cfg.env.train_seed_offset + gid
            if seed >= self.cfg.eval.seed_offset:
                raise RuntimeError(
                    f"training task seed {seed} reached eval.seed_offset={self.cfg.eval.seed_offset}: "
                    "raise eval.seed_offset so held-out tasks stay disjoint"
                )
            self._in_flight[gid] = seed
            return gid, seed

    def snapshot(self) -> tuple[dict, dict]:
        """``(buffer export_state, producer state)`` taken together: a finished group is either still in
        flight (re-issued after a resume) or in the buffer (restored), never in neither (lost) nor both
        (trained twice): read apart, a group put between the two reads was in neither."""
        with self._lock:
            return self.buffer.export_state(), self.state()

    def state(self) -> dict:
        """JSON-safe producer state for checkpoints: next group id and the in-flight groups."""
        with self._lock:
            pending = sorted(self._in_flight.items()) + list(self._reissue)
            return {"next_group": self._next_group, "reissue": [[int(g), int(s)] for g, s in sorted(pending)],
                    "episode_errors": self.guard.episode_errors,
                    "episode_failures_by_reason": dict(self.guard.by_reason)}

    # --------------------------------------------------------------- threads
    def start(self) -> None:
        per_gen = math.ceil(self.cfg.rollout.slots / self.cfg.algo.group_size) + 1
        self.t_start = time.perf_counter()  # rollout_tokens_per_s / rollout_idle_frac count from here
        for gi, agent in enumerate(self.agents):
            for j in range(per_gen):
                t = threading.Thread(target=self._producer, args=(agent,), name=f"rollout-{gi}-{j}", daemon=True)
                t.start()
                self._threads.append(t)

    def _producer(self, agent) -> None:
        """One rollout thread: admit, run a group, put it. No exception ends it silently: a group
        whose loop or put raises is counted (``episode_errors``) and its slot given back; only a
        broken buffer or running out of training seeds stops the run (:attr:`fatal`)."""
        while not self._stop.is_set():
            t_admit = time.perf_counter()
            try:
                admitted = self.buffer.admit(self.version_fn, block=True, timeout=0.2)
            except Exception as e:  # buffer closed or broken
                if not self._stop.is_set():
                    self._error(f"admit: {e!r}")
                    self._fatal = self._fatal or f"rollout failed: buffer admission raised {e!r}"
                return
            finally:
                with self._lock:
                    self.admit_wait_s += time.perf_counter() - t_admit
            if not admitted:
                continue
            if self._stop.is_set():
                self.buffer.cancel(1)
                return
            try:
                gid, seed = self._take_group()
            except Exception as e:
                self.buffer.cancel(1)
                self._error(repr(e))
                self._fatal = self._fatal or f"rollout failed: {e}"
                self._stop.set()
                return
            try:
                trajs = agent.submit_group(seed, gid).result()
            except Exception as e:  # never lose the slot: a failed group gives it back
                log.exception("group %d failed", gid)
                self._error(f"group {gid}: {e!r}")
                with self._lock:
                    self._in_flight.pop(gid, None)
                self.buffer.cancel(1)
                self.guard.record_error(self.cfg.algo.group_size, f"group {gid}: {e!r}")
                continue
            if self._stop.is_set():
                # stopping: keep the group for re-issue after resume instead of a half-consumed state
                self.buffer.cancel(1)
                return
            if self.scoring is not None:  # a route scoring before the buffer: scored first, then put (on_scored)
                if not self.scoring.submit(gid, trajs):
                    self.buffer.cancel(1)  # stopped while the queue was full: re-issued after resume
                    return
                continue
            self._put(gid, trajs)

    def _put(self, gid: int, trajs: list, dropped: tuple = ()) -> None:
        """Put a finished group into the buffer (its trajectories ``dropped`` by the scorer left out)."""
        with self._lock:  # the pop and the put are one step for snapshot(): in flight or in the buffer, never neither
            self._in_flight.pop(gid, None)
            self.generated_tokens += int(sum(t.num_generated for t in list(trajs) + list(dropped)))
            self.groups_done += 1
            if not trajs:  # every member dropped by the scorer (counted there): the slot goes back
                self.buffer.cancel(1)
                return
            try:
                self.buffer.put_group(trajs)
                failed = None
            except Exception as e:  # a malformed group: drop it, give its slot back, go on
                failed = e
                self.buffer.cancel(1)
        if failed is not None:
            log.error("group %d could not be put into the buffer", gid, exc_info=failed)
            self._error(f"put group {gid}: {failed!r}")
            self.guard.record_error(len(trajs), f"put group {gid}: {failed!r}", kind="put_error")
            return
        self.guard.record(trajs)

    def on_scored(self, gid: int, kept: list, dropped: list, error: Optional[BaseException]) -> None:
        """The scoring thread's callback (a route that scores before the buffer)."""
        if self._stop.is_set():  # stopping: the group stays in flight and is re-issued after resume
            self.buffer.cancel(1)
            return
        if error is not None:
            self._error(f"old logits of group {gid}: {error!r}")
            with self._lock:
                self._in_flight.pop(gid, None)
            self.buffer.cancel(1)
            self.guard.record_error(len(dropped), f"old logits of group {gid}: {error!r}", kind="old_logits_error")
            return
        self._put(gid, kept, tuple(dropped))

    def rollout_idle_frac(self) -> float:
        """Fraction of the producer threads' time since :meth:`start` spent
        blocked in :meth:`rollout.buffer.TrajectoryBuffer.admit`, i.e. held back by the staleness
        bound K (back-pressure: the learner has not consumed or published enough). Busy time is
        everything else: prefill/decode, queueing for a decode slot, simulated tool latency
        (``rollout.tool_latency_s``) and env work. ``admit_wait_s / (n_threads * elapsed_s)`` in
        [0, 1]; the embedded generators never wait for params (``update_params`` is non-blocking)."""
        n = len(self._threads)
        dt = time.perf_counter() - self.t_start
        if n == 0 or dt <= 0:
            return 0.0
        with self._lock:
            return min(1.0, self.admit_wait_s / (n * dt))

    def rollout_tokens_per_s(self) -> float:
        dt = time.perf_counter() - self.t_start
        return self.generated_tokens / dt if dt > 0 else 0.0

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        try:
            self.buffer.notify()
        except Exception:
            pass
        for g in self.generators:
            try:
                g.stop()
            except Exception:  # pragma: no cover
                log.exception("generator stop failed")
        for t in self._threads:
            t.join(timeout=timeout)
        if self.scoring is not None:  # groups still waiting to be scored stay in flight: re-issued on resume
            for _ in self.scoring.stop(timeout=timeout):
                self.buffer.cancel(1)
        for a in self.agents:
            try:
                a.close(wait=False)
            except Exception:  # pragma: no cover
                pass


def _own_state(meta: dict) -> dict:
    """This process's ``buffer`` / ``producer`` from checkpoint metadata: its entry of ``processes`` when the
    checkpoint has one per process for this process count (:meth:`EmbeddedProducer.state`), else the top
    level (process 0's; a checkpoint written before every process's state was saved)."""
    procs = meta.get("processes")
    if isinstance(procs, list) and len(procs) == jax.process_count() and jax.process_count() > 1:
        return {**meta, **procs[jax.process_index()]}
    return meta


class EmbeddedProducer:
    """The embedded runtime's :class:`~jax_rl.runtime.loop.Producer`: ``rollout.threads``
    generators with their agent loops, one :class:`~rollout.buffer.TrajectoryBuffer` and the
    :class:`RolloutManager` threads, all in this process.

    Args:
        ctx: the :class:`~jax_rl.runtime.context.RunContext` (config, model config, tokenizer, env
            factory, and the learner whose params are published).
        meta: the run metadata restored on resume (``buffer``, ``producer``); empty for a new run.
    """

    def __init__(self, ctx, meta: Optional[dict] = None):
        cfg = ctx.cfg
        meta = _own_state(meta or {})
        self._learner = ctx.learner
        self.publisher = ctx.publisher
        self.cfg = cfg
        strategy = ctx.learner.strategy
        self.route = strategy.route  # loss.correction=exact: the old_logits.route asked below, else None
        self.buffer = TrajectoryBuffer(cfg.algo.group_size, cfg.async_.max_staleness,
                                       groups_per_step=max(1, engines.local_groups_per_step(cfg)),
                                       max_seq_len=cfg.optim.max_seq_len,
                                       require_old_logp=strategy.scores_before_buffer)
        self.sync = None  # multi-process: the shard-by-shard weight sync (jax_rl.weight_sync)
        multi = jax.process_count() > 1
        params = None if multi else ctx.publisher.params()
        self.scorer = None
        self.retirer = None  # a route that retires versions (jax_rl.learner.correction.old_logits.RetiringScorer)
        self._scorer_s_reported = 0.0
        self._stall_reported = (0.0, 0.0)
        keep = self.route.scorer_keep() if self.route is not None else None
        if keep is not None:  # the route scores on the rollout side, before the buffer
            self.scorer = ctx.learner.old_logits.make_scorer(keep=keep, pad_id=ctx.tokenizer.pad_id)
            self.scorer.put(ctx.learner.version, params, copy=False)  # Publisher.params() is already a copy
        if meta.get("buffer"):
            self.buffer.import_state(meta["buffer"])
            if self.scorer is not None:
                self._score_restored()
        # engine i on its own mesh (placement.rollout / rollout.mesh; colocated: all on device 0); with
        # placement a process builds the engines whose devices it owns (all of them in one process)

        roles = resolve_roles(cfg)
        mine = range(cfg.rollout.threads) if roles.engines is None else [i for i, _ in roles.local_engines()]
        if multi:  # every engine of every process filled shard by shard, no full gather (a collective)
            if not mine and not roles.split_processes:
                raise ValueError(f"placement.rollout={cfg.placement.rollout} gives process {jax.process_index()} no "
                                 "rollout engine: every process generates its share of each step; give every host "
                                 "whole engines")
            self.generators, self.sync, self._sync_keys = engines.synced_generators(
                cfg, ctx.model_config, ctx.learner, list(mine), ctx.learner.version, roles=roles)
        else:
            self.generators = [engines.build_generator(cfg, ctx.model_config, params, ctx.learner.version, engine=i,
                                                 roles=roles) for i in mine]
        # a retiring route: the agents keep every unscored episode (finished or partial) for the retires
        track = self.route is not None and self.route.track_unscored
        agents = [AgentLoop(g, ctx.tokenizer, ctx.env_factory, cfg.rollout, group_size=cfg.algo.group_size, track=track)
                  for g in self.generators]
        if self.scorer is not None:
            def release(keys):
                for a in agents:
                    a.release(keys)

            self.retirer = self.route.make_retirer(self.scorer, lambda: [p for a in agents for p in a.unscored_prefixes()],
                                                   release, rows_per_forward=cfg.algo.group_size)
        self._published = int(ctx.learner.version)
        self.weight_sync = WeightSyncClock()  # publish timings (weight_sync_s columns)
        prod = meta.get("producer", {})
        self.manager = RolloutManager(cfg, self.generators, agents, self.buffer, lambda: self._published,
                                      next_group=prod.get("next_group", 0), reissue=prod.get("reissue"),
                                      episode_errors=prod.get("episode_errors", 0),
                                      failures_by_reason=prod.get("episode_failures_by_reason"))
        self.scoring = None
        if self.scorer is not None:
            self.scoring = ScoringQueue(self.retirer or self.scorer, self.manager.on_scored,
                                        cfg.old_logits.max_queued_groups)
            self.manager.scoring = self.scoring
        self._started = False
        self._nbytes: Optional[float] = None  # _engine_bytes, counted once

    def _score_restored(self) -> None:
        """Restored pending trajectories without ``old_logp`` (a checkpoint written under another
        route): scored now when their versions are held (only the restored version is), else left
        unscored, which the buffer drops and counts (``dropped_unscored``) instead of handing out."""
        todo: list = []
        self.buffer.map_pending(lambda g: todo.append(g) if any(t.old_logp is None for t in g) else None)
        n_left = 0
        for g in todo:
            self.scorer.score_group([t for t in g if t.old_logp is None])
            n_left += sum(t.old_logp is None for t in g)
        if todo:
            log.warning("old_logits.route=%s: %d restored group(s) had no exact old log-probs; %d trajectory(ies) "
                        "could not be scored (their versions are gone) and are dropped (buffer/dropped_unscored)",
                        self.cfg.old_logits.route, len(todo), n_left)

    @property
    def fatal(self) -> Optional[str]:
        return self.manager.fatal

    def start(self) -> None:
        if not self._started:
            self._started = True
            if self.scoring is not None:
                self.scoring.start()
            self.manager.start()

    def poll(self, n_groups: int, version: int) -> Optional[list]:
        return self.buffer.get_batch(n_groups, version, timeout=1.0)

    def publish(self, version: int) -> None:
        """Hand the learner's params of ``version`` to the route's scorer and every generator
        (:meth:`jax_rl.publish.Publisher.publish`: cast + reshard in this thread; several processes:
        shard by shard), then tell the buffer. Timed into :attr:`weight_sync` (``weight_sync_s``: all
        of it up to the hand-over, a retiring route's stall and wait included; ``weight_sync_cast_s``:
        the generators' ``load_params``)."""
        t0 = time.perf_counter()
        cast_s, moved = self.publisher.publish(version, self.generators, sync=self.sync,
                                               sync_keys=self._sync_keys if self.sync is not None else (),
                                               route=self.route, scorer=self.scorer, retirer=self.retirer)
        self.weight_sync.add(time.perf_counter() - t0, cast_s, self._engine_bytes() if moved is None else moved)
        self._published = int(version)
        self.buffer.notify()

    def _engine_bytes(self) -> float:
        """Bytes of every local engine's params (``rollout.dtype``, as loaded): what one publish hands them."""
        if self._nbytes is None:
            self._nbytes = float(sum(getattr(x, "nbytes", 0) for g in self.generators
                                     for x in jax.tree.leaves(getattr(g.engine, "params", None))))
        return self._nbytes

    def _scorer_columns(self) -> dict:
        if self.scorer is None:
            return {}
        st = self.scorer.stats()
        total = st["old_logits_scorer_s_total"]
        st["old_logits_s"] = total - self._scorer_s_reported  # scorer seconds since the previous row
        self._scorer_s_reported = total
        st["old_logits_queue"] = float(len(self.scoring)) if self.scoring is not None else 0.0
        if self.retirer is not None:  # per-row seconds since the previous row, as old_logits_s
            st.update(self.retirer.stats())
            stall, wait = st.pop("old_logits_stall_s_total"), st.pop("old_logits_publish_wait_s_total")
            st["old_logits_stall_s"] = stall - self._stall_reported[0]
            st["old_logits_publish_wait_s"] = wait - self._stall_reported[1]
            self._stall_reported = (stall, wait)
        return st

    def _kv_columns(self) -> dict:
        """The paged engines' K/V pool counters summed (``kv_pages_in_use``, ``kv_prefix_page_hits``,
        ``kv_preemptions``, ``kv_admission_waits``, ``kv_preempted_requests``, ...: the generators'
        :meth:`rollout.kv_pressure.KVPressure.kv_stats`; rollout.kv_layout=paged only: none for
        contiguous engines)."""
        out: dict = {}
        for g in self.generators:
            for k, v in g.kv_stats().items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def row(self) -> dict:
        return {**buffer_columns(self.buffer.stats(), self.manager.episode_errors, row=True,
                                 by_reason=self.manager.guard.by_reason),
                "rollout_tokens_per_s": self.manager.rollout_tokens_per_s(),
                "rollout_idle_frac": self.manager.rollout_idle_frac(), **self._scorer_columns(),
                **self.weight_sync.row(), **self._kv_columns()}

    def summary(self) -> dict:
        out = {**buffer_columns(self.buffer.stats(), self.manager.episode_errors, row=False,
                                by_reason=self.manager.guard.by_reason),
               "rollout_tokens_per_s": self.manager.rollout_tokens_per_s(),
               "rollout_idle_frac": self.manager.rollout_idle_frac(), **self.weight_sync.summary(),
               **self._kv_columns()}
        if self.scorer is not None:
            st = self.scorer.stats()
            out.update(old_logits_scorer_s_total=st["old_logits_scorer_s_total"],
                       old_logits_scored=st["old_logits_scored"], old_logits_dropped=st["old_logits_dropped"])
        if self.retirer is not None:
            st = self.retirer.stats()
            out.update({k: st[k] for k in ("old_logits_stall_s_total", "old_logits_publish_wait_s_total",
                                           "old_logits_retired", "old_logits_max_held", "old_logits_stash_mismatch",
                                           "old_logits_retire_errors", "old_logits_retire_partial")})
        return out

    def state(self) -> dict:
        """Checkpoint metadata: the buffer (pending groups) and the producer state (next group, in-flight and
        re-issue groups, counters). Multi-process: every process's, in ``processes`` (process order; gathered
        through the ``jax.distributed`` key-value store, a collective), beside process 0's at the top level
        (Orbax writes the metadata from process 0)."""
        buf, prod = self.manager.snapshot()
        own = {"buffer": buf, "buffer_stats": self.buffer.stats(), "producer": prod}
        if jax.process_count() == 1:
            return own

        every = allgather_json({k: own[k] for k in ("buffer", "producer")}, timeout_s=self.cfg.runtime.peer_timeout_s,
                               what="producer state")
        return {**own, **every[0], "processes": every}

    def stop(self) -> None:
        self.manager.stop(timeout=5.0)
        if self.retirer is not None:
            self.retirer.stop(timeout=5.0)
