"""``runtime=ray``'s side of the one RL loop (:func:`jax_rl.runtime.loop.run_rl`): the
:class:`RayProducer` (groups dispatched to the rollout-worker actors, collected into the buffer
actor, workers replaced when they die) and the :class:`RemoteLearner` handle over the learner actor.

Trajectories stay :class:`rollout.types.Trajectory` objects on the way (numpy arrays through Ray's
object store), put into the store once, as the rollout worker's result: the group goes to the buffer
actor, back to the driver and on to the learner actor by that object reference (:func:`group_source`,
:func:`read_groups`; each reads the arrays in place), and the learner actor builds the batch, so no
process serialises a trajectory or the batch again.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from jax_rl.config import Config
from jax_rl.runtime.loop import EpisodeGuard, WeightSyncClock, buffer_columns
from jax_rl.runtime.ray_cluster import ray_get
from rollout.envs import env_spec
from rollout.types import Trajectory, json_safe

log = logging.getLogger("jax_rl.runtime")

__all__ = ["RayProducer", "RemoteLearner", "RayGroups", "group_source", "read_groups"]


def group_source(group: list, src: Optional[tuple]) -> tuple:
    """How a batch's group crosses processes: ``(ref, member indices, None)`` when ``src`` is
    ``(ref, the group as its worker returned it)`` (``group`` keeps some of those members, the same objects),
    else ``(None, None, group)`` (by value: a group restored from a checkpoint)."""
    if src is None:
        return None, None, group
    ref, whole = src
    return ref, [next(i for i, w in enumerate(whole) if w is t) for t in group], None


def read_groups(ray, sources: list) -> list[list[Trajectory]]:
    """The groups of :func:`group_source` entries: one ``ray.get`` of their references (on the node of the
    store's copy the arrays are read-only views of it, no copy), the kept members of each."""
    refs = list(dict.fromkeys(r for r, _, _ in sources if r is not None))
    got = dict(zip(refs, ray.get(refs))) if refs else {}
    return [g if r is None else [got[r][i] for i in idx] for r, idx, g in sources]


class RayGroups(list):
    """A batch's groups (:meth:`RayProducer.poll`) with their :attr:`sources` (:func:`group_source`), which
    :meth:`RemoteLearner.train_groups` hands the learner actor instead of the arrays."""

    sources: list = []


class RemoteLearner:
    """The driver's :class:`~jax_rl.runtime.loop.LearnerHandle` over the learner actor."""

    def __init__(self, actor):
        self.actor = actor

    @property
    def version(self) -> int:
        return int(ray_get(self.actor.version.remote()))

    @property
    def opt_step(self) -> int:
        return int(ray_get(self.actor.opt_step.remote()))

    def train_step(self, batch: dict, *, process_local: bool = False) -> dict:
        """One learner step on the actor. ``process_local`` must be False: the Ray driver is one
        process and sends the whole batch. Raises ValueError otherwise."""
        if process_local:
            raise ValueError("runtime=ray: the driver sends whole batches; process_local=True is a multi-process embedded option")
        return ray_get(self.actor.train_step.remote(batch))

    def train_groups(self, groups: list, pad_id: int, rows: int) -> tuple[dict, int]:
        """One learner step on ``groups``, collated by the learner actor
        (:meth:`~jax_rl.runtime.ray_actors.LearnerActor.train_groups`): a :class:`RayGroups` goes by its
        object references (no copy into the store), other groups by value. Returns ``(metrics, batch rows)``;
        the metrics carry ``ray/groups_by_value``, how many groups went by value (0 but on the steps that train
        groups restored from a checkpoint)."""
        sources = getattr(groups, "sources", None) or [(None, None, g) for g in groups]
        metrics, n = ray_get(self.actor.train_groups.remote(sources, pad_id, rows))
        # groups that crossed to the learner by value (a second store copy): those restored from a checkpoint
        return {**metrics, "ray/groups_by_value": sum(r is None for r, _, _ in sources)}, n

    def evaluate(self, step: int, label: str = "eval") -> dict:
        return ray_get(self.actor.evaluate.remote(step, label))

    def save(self, rl_step: int, meta: Optional[dict] = None, *, wait: bool = False) -> None:
        """Always committed before it returns (the actor waits)."""
        ray_get(self.actor.save.remote(int(rl_step), json_safe(meta or {}, default=str)))


class RayProducer:
    """The Ray runtime's :class:`~jax_rl.runtime.loop.Producer`: dispatches groups (after buffer
    admission) to ``runtime.ray_workers`` :class:`RolloutWorker` actors, collects them with
    ``ray.wait`` into the buffer actor, replaces a worker that died and re-issues its groups
    (``reissued_groups``), and drops a group that arrives twice (``duplicate_groups``).

    Args:
        cfg: the run config.
        learner_actor: the learner actor (its params are put in the object store once per version).
        model_config_hf: the model config as an HF dict (the workers rebuild it).
        meta: the run metadata restored on resume (``buffer``, ``producer``, ``ray_counters``).
        actor_classes: ``(RolloutWorker, BufferActor)`` as returned by
            :func:`jax_rl.runtime.ray_actors.actor_classes`.
    """

    def __init__(self, cfg: Config, learner_actor, model_config_hf: dict, meta: Optional[dict] = None, *,
                 actor_classes: tuple):
        import ray  # optional dependency (the [ray] extra): imported when runtime=ray runs

        self._ray = ray
        meta = meta or {}
        self.cfg = cfg
        self._cfg_dict = cfg.to_dict()
        self._hf = model_config_hf
        self._learner = learner_actor
        self._worker_cls, buffer_cls = actor_classes
        self.counters = {"reissued_groups": 0, "worker_restarts": 0, "duplicate_groups": 0}
        self.counters.update({k: int(v) for k, v in (meta.get("ray_counters") or {}).items() if k in self.counters})
        n_groups = cfg.optim.batch_size // cfg.algo.group_size
        self.buffer = buffer_cls.remote(cfg.algo.group_size, cfg.async_.max_staleness, n_groups,
                                        meta.get("buffer"), cfg.optim.max_seq_len)
        prod = meta.get("producer") or {}
        self.next_gid = int(prod.get("next_group", 0))
        self.guard = EpisodeGuard(cfg.rollout.max_consecutive_episode_errors, int(prod.get("episode_errors", 0)),
                                  by_reason=prod.get("episode_failures_by_reason"), max_seq_len=cfg.optim.max_seq_len)
        # groups in flight at the checkpoint are re-issued first (their admission is in the buffer's state)
        self.reissue: list[tuple[int, int]] = [(int(g), int(sd)) for g, sd in prod.get("reissue", [])]
        self.in_flight: dict = {}  # ref -> (worker index, gid, seed)
        self.done_gids: set[int] = set()
        # groups a worker holds at once: its slots' worth plus one step's batch, so that it keeps
        # decoding while the driver is blocked in a learner step (groups are dispatched only between
        # steps); admission (async.max_staleness) bounds them all the same
        self.per_worker = max(1, cfg.rollout.slots // cfg.algo.group_size) + n_groups
        self.workers: list = []
        self.version = 0
        self.params_ref = None
        self.user_ref = None  # env.tau2.user=model: the learner actor's user model, in the object store
        self.weight_sync = WeightSyncClock()  # publish timings (weight_sync_s columns)
        self._fatal: Optional[str] = None
        self._syncs: list = []  # set_params refs of publishes whose worker seconds are not collected yet
        self.stop_event = None
        """A ``threading.Event`` (the run's :class:`~jax_rl.runtime.context.StopFlag` event) that ends
        :meth:`start`'s wait for the workers' first weights early: a SIGTERM while the workers build
        their engines stops the run at once instead of after every engine has compiled."""

    @property
    def fatal(self) -> Optional[str]:
        """Why the run must stop (a systematically failing rollout, no training seed left below
        ``eval.seed_offset``, a dead Ray daemon), else None."""
        return self._fatal or self.guard.fatal

    def start(self) -> None:
        if self.workers:
            return
        ray = self._ray
        self.version = int(ray.get(self._learner.version.remote()))
        self.params_ref = self._learner.get_params.remote()  # lives in the object store; every worker reads it
        if env_spec(self.cfg.env.name).user_model(self.cfg.env):  # a served user model: one copy for every worker
            self.user_ref = self._learner.user_model.remote()
        self.workers = [self._new_worker(i) for i in range(self.cfg.runtime.ray_workers)]
        pending = [w.set_params.remote(self.params_ref, self.version) for w in self.workers]
        while pending:  # each worker builds its engine (compiles) here: minutes on a loaded host
            if self.stop_event is not None and self.stop_event.is_set():
                return  # stopped: the loop sees the flag before its first step; stop() ends the workers
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            ray.get(ready)  # a worker that failed to build raises here

    def _new_worker(self, i: int):
        # its per_worker groups run at once (one thread each, blocked on the group's future) and a
        # set_params and the cpu_s / affinity probes beside them
        return self._worker_cls.options(max_concurrency=self.per_worker + 2).remote(self._cfg_dict, self._hf, i,
                                                                                   self.user_ref)

    def poll(self, n_groups: int, version: int) -> Optional[RayGroups]:
        """``n_groups`` groups from the buffer actor for the learner at ``version`` (the trajectories'
        arrays are read-only views of the worker's object-store copy, read by reference), or None when it
        has too few yet."""
        ray = self._ray
        self._collect(0.0)
        self._dispatch()
        sources = ray.get(self.buffer.get_batch.remote(n_groups, version))
        if sources is None:
            self._collect(0.2)
            return None
        groups = RayGroups(read_groups(ray, sources))
        groups.sources = sources
        return groups

    def publish(self, version: int) -> None:
        """Put the learner's params of ``version`` in the object store (one copy per version) and
        send them to every worker. Timed on the driver into :attr:`weight_sync` (``weight_sync_s``):
        the learner's device-to-host copy and put, waited for (``ray.wait``), and the sends. The
        workers' own cast/reshard seconds (``set_params``' return, ``weight_sync_cast_s``) are
        collected when they are done, possibly a row later: a worker runs ``set_params`` after the
        groups already queued on it, so the driver does not wait for it."""
        ray = self._ray
        t0 = time.perf_counter()
        self.version = int(version)
        self.params_ref = self._learner.get_params.remote()  # one object-store copy per version
        ray.wait([self.params_ref], fetch_local=False)  # the copy is in the store: its seconds are timed here
        self._syncs += [w.set_params.remote(self.params_ref, self.version) for w in self.workers]
        self.weight_sync.add(time.perf_counter() - t0)

    def _collect_syncs(self) -> None:
        """Add the cast/reshard seconds of the workers' finished ``set_params`` (a dead worker's
        is dropped: :meth:`_restart` gives its replacement the params again)."""
        if not self._syncs:
            return
        ready, self._syncs = self._ray.wait(self._syncs, num_returns=len(self._syncs), timeout=0)
        for ref in ready:
            try:
                self.weight_sync.add_cast(self._ray.get(ref))
            except Exception:  # noqa: BLE001 - the worker died; counted by the restart
                pass

    def cpu_columns(self) -> dict:
        """``learner_cpu_s`` / ``rollout_cpu_s``: CPU seconds so far of the learner actor's process and
        of the rollout workers' processes (summed; a replaced worker's count restarts), so that per
        role busy cores = CPU seconds / wall seconds (``bench/async_speedup.py`` reads them)."""
        ray = self._ray
        try:
            out = {"learner_cpu_s": float(ray.get(self._learner.cpu_s.remote(), timeout=30))}
            out["rollout_cpu_s"] = float(sum(ray.get([w.cpu_s.remote() for w in self.workers], timeout=30)))
        except Exception:  # noqa: BLE001 - a dead worker: no figure this row (the restart is counted)
            return {}
        return out

    def row(self) -> dict:
        self._collect_syncs()
        return {**buffer_columns(self._ray.get(self.buffer.stats.remote()), self.guard.episode_errors, row=True,
                                 by_reason=self.guard.by_reason),
                **{f"ray/{k}": v for k, v in self.counters.items()}, **self.weight_sync.row(), **self.cpu_columns()}

    def summary(self) -> dict:
        self._collect_syncs()
        return {**buffer_columns(self._ray.get(self.buffer.stats.remote()), self.guard.episode_errors, row=False,
                                 by_reason=self.guard.by_reason),
                **self.counters, **self.weight_sync.summary()}

    def state(self) -> dict:
        ray = self._ray
        pending = sorted([(g, sd) for (_, g, sd) in self.in_flight.values()] + self.reissue)
        return {"buffer": ray.get(self.buffer.export_state.remote()), "buffer_stats": ray.get(self.buffer.stats.remote()),
                "ray_counters": dict(self.counters),
                "producer": {"next_group": self.next_gid, "reissue": [[int(g), int(sd)] for g, sd in pending],
                             "episode_errors": self.guard.episode_errors,
                             "episode_failures_by_reason": dict(self.guard.by_reason)}}

    def stop(self) -> None:
        for w in self.workers:
            try:
                self._ray.get(w.stop.remote(), timeout=10)
            except Exception:
                pass

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self) -> None:
        """Admitted groups to the least busy worker, one at a time, until every worker holds
        :attr:`per_worker` groups or admission refuses."""
        ray = self._ray
        busy = [0] * len(self.workers)
        for wi, _, _ in self.in_flight.values():
            busy[wi] += 1
        while busy and min(busy) < self.per_worker:
            wi = busy.index(min(busy))
            if self.reissue:
                gid, seed = self.reissue.pop(0)
            else:
                gid, seed = self.next_gid, self.cfg.env.train_seed_offset + self.next_gid
                if seed >= self.cfg.eval.seed_offset:  # the held-out guard (the config's check is a lower bound)
                    self._fatal = (f"training task seed {seed} reached eval.seed_offset={self.cfg.eval.seed_offset}: "
                                   "raise eval.seed_offset so held-out tasks stay disjoint")
                    return
                if not ray.get(self.buffer.admit.remote(self.version)):
                    return
                self.next_gid += 1
            self.in_flight[self.workers[wi].run_group.remote(gid, seed)] = (wi, gid, seed)
            busy[wi] += 1

    def _restart(self, wi: int) -> None:
        for ref, (w2, gid, seed) in list(self.in_flight.items()):
            if w2 == wi:
                self.in_flight.pop(ref)
                self.reissue.append((gid, seed))
                self.counters["reissued_groups"] += 1
        self.workers[wi] = self._new_worker(wi)
        self._ray.get(self.workers[wi].set_params.remote(self.params_ref, self.version))
        self.counters["worker_restarts"] += 1

    def _collect(self, timeout: float) -> None:
        ray = self._ray
        refs = list(self.in_flight)
        if not refs:
            time.sleep(timeout)
            return
        # back as soon as one group is done (not after all of them or the timeout), with every done one
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            if ref not in self.in_flight:  # already re-issued after its worker died
                continue
            wi, gid, seed = self.in_flight[ref]
            try:
                group = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                log.warning("rollout worker %d died (%s): restarting it, re-issuing its groups", wi, type(e).__name__)
                self._restart(wi)
                continue
            except Exception as e:  # the group's loop raised: drop it, give its slot back, count it
                log.warning("group %d failed on rollout worker %d: %r", gid, wi, e)
                self.in_flight.pop(ref)
                ray.get(self.buffer.cancel.remote(1))
                self.guard.record_error(self.cfg.algo.group_size, f"group {gid}: {type(e).__name__}")
                continue
            self.in_flight.pop(ref)
            if gid in self.done_gids:
                self.counters["duplicate_groups"] += 1
                continue
            self.done_gids.add(gid)
            try:  # by reference (in a list, so Ray passes the ref): the buffer actor reads the worker's copy
                ray.get(self.buffer.put_group.remote([ref]))
            except Exception as e:  # a malformed group: drop it, give its slot back, count it
                log.warning("group %d could not be put into the buffer: %r", gid, e)
                ray.get(self.buffer.cancel.remote(1))
                self.guard.record_error(len(group), f"put group {gid}: {type(e).__name__}", kind="put_error")
                continue
            self.guard.record(group)
