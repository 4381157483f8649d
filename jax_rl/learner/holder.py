"""The learner's two small shared pieces: its mutable state (:class:`StateHolder`) and which processes hold it
(:class:`LearnerProcesses`).

The :class:`~jax_rl.learner.learner.Learner` composes its stages (:class:`~jax_rl.learner.checkpoints.LearnerCheckpoints`,
:class:`~jax_rl.learner.correction.old_logits.stage.OldLogitStage`, :class:`~jax_rl.learner.sft.SftRunner`,
:class:`~jax_rl.publish.Publisher`) from explicit pieces; none holds the learner. A stage that changes the learner's
state (a restore, an SFT step) writes it here, the one mutable object they share, so what a stage may change is
what this holds: the train state, the count of skipped batches and the host's copy of (version, optimizer step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from jax_rl.collectives import allgather_json

__all__ = ["LearnerProcesses", "StateHolder", "copy_params"]


@dataclasses.dataclass(frozen=True)
class LearnerProcesses:
    """The processes holding learner devices, and the metrics hand-over to those that hold none.

    Attributes:
        holders: the process indices holding a device of the learner's mesh (sorted).
        peer_timeout_s: how long a process waits for a holder's answer (``runtime.peer_timeout_s``, seconds).
    """

    holders: tuple[int, ...]
    peer_timeout_s: float

    @classmethod
    def of(cls, mesh: jax.sharding.Mesh, peer_timeout_s: float) -> "LearnerProcesses":
        """The processes holding ``mesh``'s devices."""
        return cls(tuple(sorted({d.process_index for d in mesh.devices.flat})), float(peer_timeout_s))

    @property
    def on_some_processes(self) -> bool:
        """Multi-process with the learner on some processes only (disaggregated: the engines' hosts hold no
        learner device): the others run its programs as no-ops and read its results from a holder."""
        return jax.process_count() > 1 and len(self.holders) < jax.process_count()

    @property
    def holds_learner(self) -> bool:
        """This process holds a learner device."""
        return jax.process_index() in self.holders

    @property
    def primary(self) -> int:
        """The process that speaks for the learner (writes, deletes): the first holder, or 0."""
        return self.holders[0] if self.on_some_processes else 0

    def host_values(self, get: Callable[[], dict]) -> dict[str, float]:
        """``get()`` (a step's metrics fetched to the host: ``{name: float}``); a process holding no learner
        device receives them from the first holder through the ``jax.distributed`` key-value store
        (:func:`jax_rl.collectives.allgather_json`; then a collective every process calls).

        Raises:
            jax_rl.collectives.PeerLostError: the holder did not answer within ``peer_timeout_s``.
        """
        if not self.on_some_processes:
            return get()
        mine = get() if jax.process_index() == self.holders[0] else None
        every = allgather_json(mine, timeout_s=self.peer_timeout_s, what="learner metrics")
        return {k: float(v) for k, v in every[self.holders[0]].items()}


class StateHolder:
    """The learner's mutable state, shared by the learner and the stages that change it.

    Args:
        state: the initial :class:`~jax_rl.learner.train_step.TrainState` (params, opt_state, version, step,
            rng, correction).
        holds_learner: this process holds learner devices (else the state's arrays are not readable here and
            (version, step) are only what :meth:`track_counters` recorded).

    Attributes:
        state: the current train state (replaced whole by a step, a restore or an SFT step; never changed in place).
        skipped_steps: batches without a loss token skipped so far (int; checkpointed).
    """

    def __init__(self, state: Any, holds_learner: bool):
        self.state = state
        self.skipped_steps = 0
        self._holds = bool(holds_learner)
        self._counters: tuple = (None, 0, 0)  # ((the state's version, step arrays), version, step) on the host

    def counters(self) -> tuple[int, int]:
        """(version, step) of the current state: from the last :meth:`track_counters` while the state is the
        one recorded then (no device -> host transfer), else read from the state."""
        arrs, v, st = self._counters
        if arrs is None or arrs[0] is not self.state.version or arrs[1] is not self.state.step:
            if not self._holds:  # nothing to read here: the counters train_step / restore tracked
                self.track_counters(v, st)
                return v, st
            v, st = int(self.state.version), int(self.state.step)
            self.track_counters(v, st)
        return v, st

    def track_counters(self, version: int, step: int) -> None:
        """Record (version, optimizer step) on the host as those of the current state (no device -> host
        transfer until the state changes): after a train step, or a restore on a process that holds no
        learner device."""
        self._counters = ((self.state.version, self.state.step), int(version), int(step))

    @property
    def version(self) -> int:
        """Published versions so far (params after n published updates are version n)."""
        return self.counters()[0]

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return self.counters()[1]

    def params(self) -> Any:
        """The live params (``nnx.State``; donated by the next train step: copy before keeping). The params
        getter the stages are given."""
        return self.state.params


def copy_params(params: Any, host: bool = False) -> Any:
    """A copy of ``params`` (an ``nnx.State``) the caller may keep while the learner donates its own buffers:
    device arrays with the same shardings, or with ``host`` numpy arrays (single-process only).

    Raises:
        ValueError: ``host`` in a multi-process run.
    """
    if host:
        if jax.process_count() > 1:
            raise ValueError("get_params(host=True) needs a single process; use device arrays")
        return jax.tree.map(lambda x: np.asarray(x), params)
    return jax.tree.map(lambda x: x.copy(), params)
