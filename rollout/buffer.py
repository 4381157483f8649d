"""Staleness-bounded, group-aware trajectory buffer (thread-safe).

Definitions (versions as in docs/design.md §3.1 Versions and staleness):

* ``v`` = the learner's current version (number of published updates). The batch handed out by
  ``get_batch(n, v)`` is trained at version ``v``.
* staleness of a trajectory at version ``v`` = ``v - min(versions[t] for generated tokens t)``;
  a group's staleness is its members' maximum. ``K = max_staleness``.
* ``B = groups_per_step``: groups the learner consumes per step.

**Hard bound (consumption).** ``get_batch`` never returns a group whose staleness exceeds K;
such groups are dropped whole (GRPO groups stay together) and counted in ``dropped_stale``.
This holds whatever the producers do, and after ``import_state`` (the check is made at
consumption time against the caller's version).

**Admission control (AReaL's rule).** A new group may start at learner version ``v`` only if

    started + 1 <= (v + K + 1) * B,      started = consumed_groups + pending_groups + in_flight_groups

i.e. the groups ever accepted (consumed, waiting in the buffer, or being generated; dropped and
failed ones give their slot back). If batches are consumed in start order, a group admitted at
version ``v0`` is among the first ``(v0 + K + 1) * B`` groups, hence in a batch trained at version
``<= v0 + K``: it is not stale if its tokens carry versions ``>= v0`` (the generator runs the
newest weights). Admission keeps drops rare; the hard bound makes them harmless.

Counters (``stats()``), in trajectories unless suffixed ``_groups``: ``produced`` (accepted by
``put_group``), ``consumed`` (returned by ``get_batch``), ``dropped_stale``, ``failed``
(``info["failed"]`` trajectories, never trained), ``dropped_overlong`` (over-long trajectories: a
prompt that filled the cache, or longer than ``max_seq_len``; never trained), ``in_flight`` (admitted, not yet put; in groups
via ``in_flight_groups``), ``pending``, ``admitted_groups`` and ``cancelled_groups`` (admitted slots
given back by :meth:`cancel`: a group whose episode loop failed, or one in flight when the run stopped,
which the runtime re-issues after ``--resume``), ``dropped_unscored`` (with ``require_old_logp``: a
group holding a trajectory without exact old log-probs, e.g. restored from a checkpoint written under
another route and not scorable any more; never handed out). Invariants: ``produced == consumed +
dropped_stale + dropped_unscored + pending``; every finished episode put is ``produced + failed + dropped_overlong``; within one session
``admitted_groups == produced_groups + failed_groups + dropped_overlong_groups + cancelled_groups +
in_flight_groups``.

State export/import is JSON-safe (lists, numbers, strings), for the learner's checkpoint. In-flight
groups are not exported (their partial work is lost on restart), so ``in_flight`` restarts at 0.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Optional, Sequence

from .types import Trajectory

__all__ = ["TrajectoryBuffer"]

_COUNTERS = ("produced", "consumed", "dropped_stale", "failed", "dropped_overlong", "produced_groups",
             "consumed_groups", "dropped_stale_groups", "failed_groups", "dropped_overlong_groups",
             "admitted_groups", "cancelled_groups", "dropped_unscored", "dropped_unscored_groups")


class TrajectoryBuffer:
    """Thread-safe GRPO-group buffer with AReaL-style admission and a hard staleness bound.

    Args:
        group_size: samples per group (a put group may be smaller only after failed members are
            removed).
        max_staleness: K >= 0.
        groups_per_step: B, groups the learner consumes per step (``optim.batch_size // group_size``).
        max_pending_groups: optional cap on groups waiting in the buffer (``admit`` refuses beyond).
        max_seq_len: optional longest trainable trajectory (``optim.max_seq_len``); longer ones are
            dropped by :meth:`put_group` and counted in ``dropped_overlong``.
        require_old_logp: every trainable trajectory must carry ``old_logp``
            (``old_logits.route=dedicated``): :meth:`put_group` refuses an unscored one and
            :meth:`get_batch` never hands one out (a restored unscored group is dropped and counted
            in ``dropped_unscored``).
    """

    STATE_VERSION = 1

    def __init__(self, group_size: int, max_staleness: int, groups_per_step: int = 1,
                 max_pending_groups: Optional[int] = None, max_seq_len: Optional[int] = None,
                 require_old_logp: bool = False):
        if group_size < 1 or max_staleness < 0 or groups_per_step < 1:
            raise ValueError(f"bad buffer config group_size={group_size} max_staleness={max_staleness} "
                             f"groups_per_step={groups_per_step}")
        self.group_size = int(group_size)
        self.max_staleness = int(max_staleness)
        self.groups_per_step = int(groups_per_step)
        self.max_pending_groups = max_pending_groups
        self.max_seq_len = None if max_seq_len is None else int(max_seq_len)
        self.require_old_logp = bool(require_old_logp)
        self._cv = threading.Condition()
        self._pending: collections.deque[list[Trajectory]] = collections.deque()
        self._in_flight_groups = 0
        self._closed = False
        self.counters: dict[str, int] = {k: 0 for k in _COUNTERS}
        self.max_consumed_staleness = -1

    # ------------------------------------------------------------------ admission
    def _started(self) -> int:
        return self.counters["consumed_groups"] + len(self._pending) + self._in_flight_groups

    def capacity(self, current_version: int) -> int:
        """Groups that may start now at learner version ``current_version`` (>= 0)."""
        with self._cv:
            return self._capacity(current_version)

    def _capacity(self, v: int) -> int:
        cap = (int(v) + self.max_staleness + 1) * self.groups_per_step - self._started()
        if self.max_pending_groups is not None:
            cap = min(cap, self.max_pending_groups - len(self._pending) - self._in_flight_groups)
        return max(0, cap)

    def admit(self, current_version: int | Any, *, block: bool = False, timeout: Optional[float] = None) -> bool:
        """Reserve one group slot (``in_flight_groups += 1``) if admission allows it.

        Args:
            current_version: the learner version, or a zero-argument callable returning it (re-read
                while blocking).
            block: wait until a slot frees (a consumption or a version bump via :meth:`notify`).
            timeout: seconds to wait when blocking (None = forever).

        Returns:
            True if admitted (the caller must later :meth:`put_group` or :meth:`cancel`), else False
            (also when the buffer is closed).
        """
        get_v = current_version if callable(current_version) else (lambda: current_version)
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._closed:
                    return False
                if self._capacity(get_v()) > 0:
                    self._in_flight_groups += 1
                    self.counters["admitted_groups"] += 1
                    return True
                if not block:
                    return False
                wait = None if end is None else end - time.monotonic()
                if wait is not None and wait <= 0:
                    return False
                self._cv.wait(timeout=wait if wait is not None else 0.5)

    def cancel(self, n_groups: int = 1) -> None:
        """Give back ``n_groups`` admitted slots that will not be produced."""
        with self._cv:
            n = min(int(n_groups), self._in_flight_groups)
            self._in_flight_groups -= n
            self.counters["cancelled_groups"] += n
            self._cv.notify_all()

    def notify(self) -> None:
        """Wake blocked :meth:`admit` / :meth:`get_batch` callers (e.g. after a version bump)."""
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ produce / consume
    def put_group(self, trajectories: Sequence[Trajectory], *, admitted: bool = True) -> int:
        """Add one finished group (all samples of one task).

        Failed members (``info["failed"]``) are removed and counted in ``failed``; over-long members
        (``info["overlong"]``: the prompt did not fit the cache, or longer than ``max_seq_len``) are
        removed and counted in ``dropped_overlong``. If none remains the group is discarded
        (``dropped_overlong_groups`` when a member was over-long, else ``failed_groups``) and its
        slot is free again. ``admitted=True`` releases one in-flight slot.

        Returns:
            The number of trajectories accepted.

        Raises:
            ValueError: more than ``group_size`` trajectories, mixed ``group_id``s, or (with
                ``require_old_logp``) a trainable trajectory without ``old_logp``.
        """
        trajs = list(trajectories)
        if len(trajs) > self.group_size:
            raise ValueError(f"group of {len(trajs)} > group_size={self.group_size}")
        if len({t.group_id for t in trajs}) > 1:
            raise ValueError(f"mixed group ids in one group: {sorted({t.group_id for t in trajs})}")
        failed = [t for t in trajs if t.failed]
        overlong = [t for t in trajs if not t.failed and self._overlong(t)]
        ok = [t for t in trajs if not t.failed and not self._overlong(t)]
        if self.require_old_logp and any(t.old_logp is None for t in ok):
            raise ValueError(f"group {trajs[0].group_id}: a trajectory without old_logp was put into a buffer that "
                             "requires exact old log-probs (the run's old_logits.route scores every trajectory before the buffer)")
        with self._cv:
            if admitted:
                self._in_flight_groups = max(0, self._in_flight_groups - 1)
            self.counters["failed"] += len(failed)
            self.counters["dropped_overlong"] += len(overlong)
            if ok:
                self._pending.append(ok)
                self.counters["produced"] += len(ok)
                self.counters["produced_groups"] += 1
            elif overlong:
                self.counters["dropped_overlong_groups"] += 1
            else:
                self.counters["failed_groups"] += 1
            self._cv.notify_all()
        return len(ok)

    def _overlong(self, t: Trajectory) -> bool:
        return t.overlong or (self.max_seq_len is not None and len(t) > self.max_seq_len)

    @staticmethod
    def _group_staleness(group: Sequence[Trajectory], v: int) -> int:
        return max(t.staleness(v) for t in group)

    def _drop_stale(self, v: int) -> None:
        keep: collections.deque[list[Trajectory]] = collections.deque()
        for g in self._pending:
            if self._group_staleness(g, v) > self.max_staleness:
                self.counters["dropped_stale"] += len(g)
                self.counters["dropped_stale_groups"] += 1
            elif self.require_old_logp and any(t.old_logp is None for t in g):
                self.counters["dropped_unscored"] += len(g)
                self.counters["dropped_unscored_groups"] += 1
            else:
                keep.append(g)
        self._pending = keep

    def get_batch(self, n_groups: int, current_version: int, timeout: Optional[float] = None
                  ) -> Optional[list[list[Trajectory]]]:
        """Take ``n_groups`` groups (oldest first) that are at most K versions stale at ``current_version``.

        Over-stale groups met on the way are dropped and counted (and, with ``require_old_logp``,
        unscored ones: ``dropped_unscored``). Blocks until enough groups are pending.

        Returns:
            A list of ``n_groups`` groups (each a list of Trajectory), or None on timeout / close
            (nothing is taken then).
        """
        end = None if timeout is None else time.monotonic() + timeout
        v = int(current_version)
        with self._cv:
            while True:
                self._drop_stale(v)
                if len(self._pending) >= n_groups:
                    out = [self._pending.popleft() for _ in range(n_groups)]
                    for g in out:
                        self.counters["consumed"] += len(g)
                        self.counters["consumed_groups"] += 1
                        self.max_consumed_staleness = max(self.max_consumed_staleness, self._group_staleness(g, v))
                    self._cv.notify_all()  # consumption frees admission capacity
                    return out
                if self._closed:
                    return None
                wait = None if end is None else end - time.monotonic()
                if wait is not None and wait <= 0:
                    return None
                self._cv.wait(timeout=wait if wait is not None else 0.5)

    def map_pending(self, fn) -> None:
        """Apply ``fn(group) -> None`` to every pending group under the lock (e.g. to score groups
        restored from a checkpoint: ``fn`` may set their trajectories' ``old_logp``)."""
        with self._cv:
            for g in self._pending:
                fn(g)

    def close(self) -> None:
        """Refuse new admissions and release blocked callers."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        with self._cv:
            return len(self._pending)

    @property
    def in_flight(self) -> int:
        """Trajectories being generated (admitted groups x group_size)."""
        with self._cv:
            return self._in_flight_groups * self.group_size

    def stats(self) -> dict[str, int]:
        """Counters (see module doc) plus ``in_flight``, ``in_flight_groups``, ``pending``, ``pending_groups``."""
        with self._cv:
            d = dict(self.counters)
            d["in_flight_groups"] = self._in_flight_groups
            d["in_flight"] = self._in_flight_groups * self.group_size
            d["pending_groups"] = len(self._pending)
            d["pending"] = sum(len(g) for g in self._pending)
            d["max_consumed_staleness"] = self.max_consumed_staleness
            return d

    def __getattr__(self, name: str) -> int:
        if name in _COUNTERS:
            return self.__dict__["counters"][name]
        raise AttributeError(name)

    # ------------------------------------------------------------------ state
    def export_state(self) -> dict:
        """JSON-safe state: config, counters and pending groups (Trajectory.to_dict). Thread-safe."""
        with self._cv:
            return {
                "state_version": self.STATE_VERSION,
                "group_size": self.group_size,
                "max_staleness": self.max_staleness,
                "groups_per_step": self.groups_per_step,
                "counters": dict(self.counters),
                "max_consumed_staleness": self.max_consumed_staleness,
                "pending": [[t.to_dict() for t in g] for g in self._pending],
            }

    def import_state(self, state: dict) -> None:
        """Replace counters and pending groups with ``state`` (from :meth:`export_state`).

        In-flight slots held before are kept (in-flight work of the exporting run is not restored).
        The hard staleness check applies to restored groups at the next ``get_batch``.

        Raises:
            ValueError: unknown state version or a different ``group_size``.
        """
        if state.get("state_version") != self.STATE_VERSION:
            raise ValueError(f"buffer state version {state.get('state_version')} != {self.STATE_VERSION}")
        if int(state["group_size"]) != self.group_size:
            raise ValueError(f"buffer state has group_size={state['group_size']}, this buffer {self.group_size}")
        pending = collections.deque([Trajectory.from_dict(d) for d in g] for g in state["pending"])
        with self._cv:
            self.counters = {k: int(state["counters"].get(k, 0)) for k in _COUNTERS}
            self.max_consumed_staleness = int(state.get("max_consumed_staleness", -1))
            self._pending = pending
            self._cv.notify_all()

    @classmethod
    def from_state(cls, state: dict, **kw: Any) -> "TrajectoryBuffer":
        """A new buffer built from exported state (config from the state unless given in ``kw``)."""
        buf = cls(group_size=kw.pop("group_size", state["group_size"]),
                  max_staleness=kw.pop("max_staleness", state["max_staleness"]),
                  groups_per_step=kw.pop("groups_per_step", state["groups_per_step"]), **kw)
        buf.import_state(state)
        return buf
