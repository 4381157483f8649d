"""The dedicated route's scorer and queue (``old_logits.route=dedicated``, the paper's second route,
"a dedicated old-logit model", docs/design.md §2.2 Correction modes); the interrupt and retire
routes hold their params in the same scorer.

- :class:`OldLogitScorer` holds ``{version: params}`` for the versions the rollout fleet may still
  have tokens of ([g-K, g], at most K+1; on the learner's devices, or on ``placement.scorer``,
  :func:`jax_rl.placement.resolve_roles`) and scores a group's tokens with the learner's own jitted
  forward (:meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.logprob_fn`) through
  :func:`jax_rl.learner.correction.old_logits.store.logprobs_by_version`, the computation the snapshot route runs, so
  the routes agree token for token (bitwise for the same input shape).
- :class:`ScoringQueue` is the bounded queue and the thread between the rollout threads and the
  buffer (:class:`jax_rl.runtime.embedded.EmbeddedProducer` wires them): a group enters the
  buffer only once scored, and the learner runs no old-logit forward.
- A trajectory with a token of a version no longer held is dropped and counted, never approximated.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from jax_rl.learner.batch import collate, seq_buckets
from jax_rl.learner.correction.old_logits.store import StaleVersionError, logprobs_by_version, versions_needed
from jax_rl.placement import BatchPlacement

log = logging.getLogger(__name__)

__all__ = ["OldLogitScorer", "ScoringQueue"]


def _tree_nbytes(tree: Any) -> int:
    """Bytes of a tree of jax arrays on this process's devices (replicas counted once per device)."""
    return int(sum(sh.data.nbytes for x in jax.tree.leaves(tree) for sh in x.addressable_shards))


class OldLogitScorer:
    """Exact old log-probs with the learner's training numerics, from params it holds by version.

    The scorer of ``old_logits.route=dedicated`` (and the piece the retiring routes reuse; built
    for a run by :meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.make_scorer`): it
    holds ``{version: params}`` on its devices (:meth:`put` / :meth:`drop`, at most ``keep``, the
    oldest evicted first) and scores tokens exactly as :func:`snapshot_logprobs` does: the same
    jitted forward (:func:`jax_rl.learner.train_step.make_logprob_step`: fp32 master params, the model's
    compute dtype, ``algo.temperature``, the sampler's ``rollout.top_k`` / ``top_p``
    truncation reproduced), one forward per version present (:func:`logprobs_by_version`), each
    token keeping its own version's log-prob.

    Args:
        logprob_fn: jitted ``(params, tokens [1,1,B,T], attention_mask) -> logp`` float32
            (:meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.logprob_fn`).
        param_shardings: where held params live (a tree like the params).
        mesh: the mesh of ``param_shardings`` (rows of a scored batch are sharded over it).
        keep: versions held at most (``async.max_staleness + 1``), >= 1.
        max_seq_len: longest trajectory scored (``optim.max_seq_len``).
        pad_id: token written in padding (masked; causal attention never reads it).
        buckets: ``optim.seq_len_buckets``: T of a scored group is the smallest of
            :func:`jax_rl.learner.batch.seq_buckets` that holds its longest trajectory
            (:func:`jax_rl.learner.batch.bucket_len`, the learner's rule), so few shapes are compiled.
        routes_fn: the same forward with recorded expert ids forced, ``(params, tokens,
            attention_mask, routes) -> logp`` (:meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.logprob_fn`
            ``routes=True``), when the routing-replay policy forces the rollout's routes (r3).

    Thread-safety: :meth:`put`, :meth:`drop` and the scoring methods may run on different threads
    (the held dict is locked; a forward keeps references to the params it reads, so a version
    dropped meanwhile stays alive until that forward ends).

    Counters (cumulative): ``seconds`` (wall seconds in scoring, placement + forwards),
    ``forwards``, ``scored`` (trajectories), ``dropped`` (trajectories with a loss token whose
    version is not held).
    """

    def __init__(self, logprob_fn: Callable, param_shardings: Any, mesh: Any, *, keep: int, max_seq_len: int,
                 pad_id: int = 0, buckets: Optional[Sequence[int]] = None, routes_fn: Optional[Callable] = None):
        if keep < 1:
            raise ValueError(f"OldLogitScorer keep={keep} must be >= 1")
        self.logprob_fn = logprob_fn
        self.param_shardings = param_shardings
        self.mesh = mesh
        self.keep = int(keep)
        self.max_seq_len = int(max_seq_len)
        self.pad_id = int(pad_id)
        self.buckets = seq_buckets(self.max_seq_len, buckets)
        self.placement = BatchPlacement(mesh, 1, 1)
        self._params: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.forwards = 0
        self.scored = 0
        self.dropped = 0
        self.routes_fn: Optional[Callable] = routes_fn
        """``moe.routing_replay=r3``: ``(params, tokens, attention_mask, routes) -> logp``, the same
        forward with the batch's recorded expert ids forced (:meth:`score_arrays` ``routes``)."""

    # ---------------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        """Versions held, ascending."""
        with self._lock:
            return sorted(self._params)

    def __contains__(self, version: int) -> bool:
        with self._lock:
            return int(version) in self._params

    def __len__(self) -> int:
        with self._lock:
            return len(self._params)

    @property
    def nbytes(self) -> int:
        """Device bytes of the held params (a version shared with another holder counts fully)."""
        with self._lock:
            trees = list(self._params.values())
        return sum(_tree_nbytes(t) for t in trees)

    def put(self, version: int, params: Any, *, copy: bool = True) -> list[int]:
        """Hold ``params`` (tree of jax arrays) as ``version``; evict the oldest beyond ``keep``.

        The params are placed with the scorer's shardings: a device-to-device copy when the scorer
        has its own devices (``placement.scorer``), else, on the learner's devices, a copy only
        with ``copy=True`` (``copy=False`` keeps a reference: only for arrays nobody donates, e.g.
        ``Learner.get_params()``'s copy). Returns the evicted versions.
        """
        placed = jax.device_put(params, self.param_shardings, may_alias=False if copy else None)
        with self._lock:
            self._params[int(version)] = placed
            evicted = []
            while len(self._params) > self.keep:
                old = min(self._params)
                del self._params[old]
                evicted.append(old)
        return evicted

    def held(self) -> dict:
        """``{version: params}`` held now (a shallow copy: later puts and drops do not change it)."""
        with self._lock:
            return dict(self._params)

    def drop(self, version: int) -> None:
        """Stop holding ``version`` (no error if absent)."""
        with self._lock:
            self._params.pop(int(version), None)

    def drop_below(self, version: int) -> list[int]:
        """Drop every held version < ``version``; returns them."""
        with self._lock:
            old = [v for v in self._params if v < int(version)]
            for v in old:
                del self._params[v]
        return old

    # ---------------------------------------------------------------------------------
    def score_arrays(self, tokens: np.ndarray, attention_mask: np.ndarray, versions: np.ndarray,
                     loss_mask: np.ndarray, *, held: Optional[dict] = None,
                     routes: Optional[np.ndarray] = None) -> np.ndarray:
        """Exact old log-probs of a right-padded host batch.

        Args:
            tokens: int32 [B, T]; attention_mask, loss_mask: bool [B, T]; versions: int32 [B, T]
                (the behaviour version of each token, -1 where not generated).
            held: ``{version: params}`` to read (default: the versions held now).
            routes: int [B, T, n_moe_layers, k] recorded expert ids (``Trajectory.routes``), forced
                in every forward when :attr:`routes_fn` is set (``moe.routing_replay=r3``).

        Returns:
            float32 [B, T] (numpy): log pi_v (nats) of each loss token under its own version v,
            0 where ``versions`` names no loss-token version (prompt, tool output, padding).

        Raises:
            StaleVersionError: a loss token's version is not held.
        """
        t0 = time.perf_counter()
        if held is None:
            with self._lock:
                held = dict(self._params)
        needed = versions_needed(versions, loss_mask)
        missing = [v for v in needed if v not in held]
        if missing:
            raise StaleVersionError(f"old logits for version(s) {missing} requested but the scorer holds "
                                    f"{sorted(held)} (keep={self.keep} = async.max_staleness+1)")
        B, T = np.shape(tokens)
        host = {"tokens": np.asarray(tokens, np.int32), "attention_mask": np.asarray(attention_mask, bool),
                "versions": np.asarray(versions, np.int32)}
        forced = routes is not None and self.routes_fn is not None
        if forced:
            host["routes"] = np.asarray(routes)
        dev, _ = self.placement.device_batch(host, process_local=False)
        fn = (lambda p, t, a: self.routes_fn(p, t, a, dev["routes"])) if forced else self.logprob_fn
        # called like the learner's snapshot route calls it (outside any ``jax.set_mesh``): same program
        old = logprobs_by_version(held.__getitem__, fn, tokens=dev["tokens"],
                                  attention_mask=dev["attention_mask"], versions=dev["versions"], needed=needed)
        out = np.asarray(old).reshape(B, T)
        with self._lock:
            self.seconds += time.perf_counter() - t0
            self.forwards += len(needed)
        return out

    def score_group(self, trajectories: list) -> tuple[list, list]:
        """Fill ``old_logp`` of each trainable trajectory of one group (in place).

        Failed or over-long trajectories (``info["failed"]``, ``info["overlong"]``, longer than
        ``max_seq_len``) pass through unscored: the buffer drops and counts them. A trajectory with
        a loss token whose version is not held is not scored and is returned in ``dropped`` (and
        counted in :attr:`dropped`): never approximated.

        Returns:
            ``(kept, dropped)``: the group without the dropped trajectories (order kept), and them.
        """
        with self._lock:
            held = dict(self._params)
        kept, dropped, todo = [], [], []
        for t in trajectories:
            if t.failed or t.overlong or len(t) > self.max_seq_len:
                kept.append(t)
                continue
            need = {int(v) for v in np.unique(t.versions[t.loss_mask])}
            if need - set(held):
                dropped.append(t)
                continue
            kept.append(t)
            todo.append(t)
        if todo:
            b = collate(todo, [0.0] * len(todo), self.max_seq_len, self.buckets, pad_id=self.pad_id)
            old = self.score_arrays(b["tokens"], b["attention_mask"], b["versions"], b["loss_mask"], held=held,
                                    routes=b.get("routes"))
            for i, t in enumerate(todo):
                t.old_logp = old[i, : len(t)].copy()
        with self._lock:
            self.scored += len(todo)
            self.dropped += len(dropped)
        return kept, dropped

    def count(self, *, scored: int = 0, dropped: int = 0) -> None:
        """Add to the cumulative ``scored`` / ``dropped`` trajectory counters (thread-safe; for a
        caller that scores with this scorer's params by its own path, :mod:`jax_rl.learner.correction.old_logits.retire`)."""
        with self._lock:
            self.scored += int(scored)
            self.dropped += int(dropped)

    def stats(self) -> dict[str, float]:
        """``old_logits_versions``, ``old_logits_bytes`` (now) and the cumulative counters."""
        return {"old_logits_versions": float(len(self)), "old_logits_bytes": float(self.nbytes),
                "old_logits_scorer_s_total": float(self.seconds), "old_logits_scorer_forwards": float(self.forwards),
                "old_logits_scored": float(self.scored), "old_logits_dropped": float(self.dropped)}


class ScoringQueue:
    """A bounded queue of finished groups and the thread that scores them (``old_logits.route=dedicated``).

    :meth:`submit` blocks while ``maxsize`` groups wait (backpressure on the rollout thread that
    finished the next one); the ``old-logits`` thread takes them in order, calls
    :meth:`OldLogitScorer.score_group` and hands the result to ``done(key, kept, dropped, error)``
    (``error`` is the exception when scoring raised; then ``kept`` is empty and ``dropped`` the
    whole group). Nothing is scored twice or lost: on :meth:`stop` the groups still queued are
    returned to the caller.

    Args:
        scorer: the :class:`OldLogitScorer`.
        done: called on the scoring thread for every group taken.
        maxsize: groups waiting at most (``old_logits.max_queued_groups``).
    """

    def __init__(self, scorer: OldLogitScorer, done: Callable[[Any, list, list, Optional[BaseException]], None],
                 maxsize: int = 4):
        self.scorer = scorer
        self.done = done
        self.maxsize = int(maxsize)
        self._q: queue.Queue = queue.Queue(maxsize=self.maxsize)
        self._stop = threading.Event()
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._run, name="old-logits", daemon=True)
        self.max_depth = 0  # the deepest the queue got (<= maxsize)

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def __len__(self) -> int:
        return self._q.qsize()

    def submit(self, key: Any, trajectories: list, *, poll_s: float = 0.2) -> bool:
        """Queue one group (blocking while full). False when stopped (nothing queued)."""
        while not self._stop.is_set():
            try:
                self._q.put((key, trajectories), timeout=poll_s)
            except queue.Full:
                continue
            self.max_depth = max(self.max_depth, self._q.qsize())
            return True
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                key, trajs = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            self._busy.set()
            try:
                try:
                    kept, dropped = self.scorer.score_group(trajs)
                except Exception as e:  # a scoring failure loses this group only, and says why
                    log.exception("old-logit scoring of group %r failed", key)
                    self.done(key, [], list(trajs), e)
                else:
                    self.done(key, kept, dropped, None)
            except Exception:  # pragma: no cover - the callback must not kill the thread
                log.exception("old-logit done callback failed for group %r", key)
            finally:
                self._busy.clear()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until the queue is empty and no group is being scored (True), or ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._q.empty() and not self._busy.is_set():
                return True
            time.sleep(0.01)
        return False

    def stop(self, timeout: float = 30.0) -> list:
        """Stop the thread (the group being scored finishes first); returns ``[(key, group)]``
        still queued, unscored."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        left = []
        while True:
            try:
                left.append(self._q.get_nowait())
            except queue.Empty:
                return left
