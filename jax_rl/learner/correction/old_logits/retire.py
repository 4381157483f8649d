"""The interrupt and retire routes (``old_logits.route=interrupt``, the paper's third route, docs/design.md §2.2 Correction modes, and
``old_logits.route=retire``, ours): :class:`RetiringScorer` scores version v's tokens, in finished
and in in-flight (partial) trajectories, with theta_v when the fleet leaves v, then drops theta_v:
the rollouts pause for it (interrupt, a measured stall per publish) or keep generating at v+1 while
a background thread does it (retire). The scorer holds the fleet's current version and at most one
retiring one.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from jax_rl.learner.batch import bucket_len, collate, inert
from jax_rl.learner.correction.old_logits.scorer import OldLogitScorer
from jax_rl.learner.correction.old_logits.store import StaleVersionError

log = logging.getLogger(__name__)

__all__ = ["RetiringScorer", "trajectory_key"]


def trajectory_key(t: Any) -> tuple[int, int]:
    """``(group_id, sample_idx)``: the id of an episode from its first token to its trajectory."""
    return int(t.group_id), int(t.info.get("sample_idx", 0))


class RetiringScorer:
    """Exact old log-probs scored per version at the moment the rollout fleet leaves it
    (``old_logits.route=interrupt`` and ``old_logits.route=retire``).

    When every generator has swapped from version v to v+1 (``Generator.apply_update_now``), no
    token of version v will ever be generated again: the set of v-tokens is final. Each of them
    sits in an episode the rollout side still holds (finished and waiting for its group or for
    scoring, or in flight: between turns, queued, or decoding in a slot), at the position it will
    keep, after a prefix that will not change (trajectories only grow; ``rollout.partial=abort``
    drops the current turn at the swap itself, before the capture). Causal attention makes the
    log-prob of a token a function of its prefix and the params only, so scoring the v-tokens of
    every episode's prefix with theta_v, at or after the swap, gives exactly the log-probs a
    forward over the finished trajectory with theta_v gives (the snapshot route's; equal up to the
    reduction order of another input shape, <= 1e-6 in fp32). theta_v is then dropped: at most
    the current version and one retiring version are held, whatever ``async.max_staleness`` is.

    What it needs from the rollout side (``sources``): at retire time, every episode not yet
    scored, as ``(key, tokens int32 [L], versions int32 [L], loss_mask bool [L][, routes])`` with
    its prefix so far (earlier turns, tool tokens, the current turn's tokens from the generator
    slot), the version of each generated token and (``moe.routing_replay=r3``) the recorded expert
    ids of its positions (int [L, n_moe_layers, k], ``ROUTE_MISSING`` where none), which the
    prefix's forward forces as the finished trajectory's forward does (``scorer.routes_fn``;
    without routes the prefix is scored by the router's own choice); the key (:func:`trajectory_key`) names the same
    episode's final :class:`rollout.types.Trajectory` when its group reaches :meth:`score_group`.
    ``rollout.agent.AgentLoop(track=True).unscored_prefixes`` ships exactly that; ``release(keys)``
    tells it a group is scored.

    A finished group's tokens are filled from what its versions' retires stashed, and the
    versions still held (the fleet's current one, or a retiring one whose job has not run) are
    scored by :meth:`OldLogitScorer.score_group`'s computation. A retire and a group's scoring
    never interleave (one lock), so each token is found either stashed or held. A trajectory
    whose stashed prefix does not match its final tokens, or with a version neither stashed nor
    held, is dropped and counted (``old_logits_dropped``, ``old_logits_stash_mismatch``).

    The two routes differ only in who waits (:meth:`publish`, ``pause``):

    - ``pause=True`` (``interrupt``): the publisher pauses every generator (their step locks), retires the
      outgoing version synchronously (score its unscored tokens, finished and partial, drop its
      params), swaps and resumes: the rollout stall is measured (``old_logits_stall_s``).
    - ``pause=False`` (``retire``): the generators swap at once and keep generating; the outgoing version is
      retired by a background thread while training goes on. A publish that finds the previous
      retire unfinished waits for it (``old_logits_publish_wait_s``: the learner waits, the
      rollouts never do), so at most 2 versions are held.

    Args:
        scorer: the :class:`OldLogitScorer` holding the params (``keep`` >= 2).
        sources: ``() -> list[(key, tokens, versions, loss_mask[, routes])]``, the unscored
            episodes now (``routes`` None or absent: not forced).
        release: ``(keys) -> None``, called with a group's keys once it is scored (or None).
        pause: the publisher pauses the generators while the outgoing version retires
            (``old_logits.route=interrupt``); False: a background thread retires it while the
            fleet generates at the new version (``old_logits.route=retire``).
        rows_per_forward: captured prefixes scored per forward at most.

    Thread-safety: :meth:`score_group` (the scoring-queue thread), :meth:`publish` (the learner
    thread) and the background retire thread may run concurrently.

    Counters (cumulative): ``retired`` (versions), ``retire_s`` (wall seconds in retires),
    ``retire_rows`` (prefixes scored), ``stall_s`` (rollout pause, interrupt), ``publish_wait_s``
    (retire), ``max_held`` (most versions held at once), ``stash_mismatch``, ``retire_errors``,
    ``retire_partial`` (stashes used by a trajectory with tokens newer than the stashed version:
    it was in flight when that version retired).
    """

    def __init__(self, scorer: OldLogitScorer, sources: Callable[[], list], release: Optional[Callable] = None, *,
                 pause: bool = False, rows_per_forward: int = 8):
        if scorer.keep < 2:
            raise ValueError(f"RetiringScorer needs a scorer that holds 2 versions (keep={scorer.keep})")
        self.scorer = scorer
        self.sources = sources
        self.release = release
        self.pause = bool(pause)
        self.rows_per_forward = max(1, int(rows_per_forward))
        self._lock = threading.Lock()  # a retire and a group's scoring never interleave
        self._stash: dict[tuple, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0  # retires queued or running (pause=False)
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self.retired = 0
        self.retire_s = 0.0
        self.retire_rows = 0
        self.stall_s = 0.0
        self.publish_wait_s = 0.0
        self.max_held = len(scorer)
        self.stash_mismatch = 0
        self.retire_partial = 0  # stashed prefixes used that were partial when retired (the episode went on)
        self.retire_errors = 0  # background retires that raised (their tokens' trajectories are dropped, counted)
        self.errors: list[str] = []

    # ---------------------------------------------------------------------------------
    def _note_held(self) -> None:
        self.max_held = max(self.max_held, len(self.scorer))

    def put(self, version: int, params: Any, *, copy: bool = True) -> None:
        """Hold ``params`` as ``version`` (the fleet's next version)."""
        self.scorer.put(int(version), params, copy=copy)
        self._note_held()

    def _pad(self, rows: list) -> tuple[np.ndarray, ...]:
        """Right-pad ``(key, tokens, versions, mask, routes)`` rows: tokens/versions int32 [B, T],
        attention/loss mask bool [B, T], routes [B, T, n_moe_layers, k] (-1 pad) or None when the
        scorer forces none (not r3) or no row carries routes.

        Raises:
            ValueError: under r3, some rows carry routes and others not, or a row's routes do not
                match its tokens (the forward would silently route those rows by the router)."""
        T = bucket_len(max(len(r[1]) for r in rows), self.scorer.buckets)
        B = len(rows)
        tok = np.full((B, T), inert("tokens", self.scorer.pad_id), np.int32)
        am = np.full((B, T), inert("attention_mask"), bool)
        ver = np.full((B, T), inert("versions"), np.int32)
        lm = np.full((B, T), inert("loss_mask"), bool)
        for i, (_, t, v, l, _) in enumerate(rows):
            n = len(t)
            tok[i, :n], am[i, :n], ver[i, :n], lm[i, :n] = t, True, v, l
        rts = [r[4] for r in rows]
        routes = None
        if self.scorer.routes_fn is not None and any(r is not None for r in rts):
            bad = [r[0] for r in rows if r[4] is None]
            if bad:
                raise ValueError(f"retire: {len(bad)} of {B} prefixes carry no routes under moe.routing_replay=r3 "
                                 f"while the others do (episodes {bad[:4]})")
            tails = {np.shape(r)[1:] for r in rts}
            if len(tails) != 1:
                raise ValueError(f"retire: prefix routes must all be [L, n_moe_layers, k] of one shape; got {sorted(tails)}")
            routes = np.full((B, T, *next(iter(tails))), inert("routes"), np.asarray(rts[0]).dtype)
            for i, (key, t, _, _, r) in enumerate(rows):
                if len(r) != len(t):
                    raise ValueError(f"retire: episode {key}'s prefix routes have {len(r)} positions, its tokens "
                                     f"{len(t)}")
                routes[i, : len(t)] = r
        return tok, am, ver, lm, routes

    def retire(self, version: int) -> int:
        """Score every unscored episode's ``version`` tokens (finished and partial prefixes) with
        theta_version, stash them, then drop theta_version. Call only once the fleet has left
        ``version``. Returns the prefixes scored.

        Raises:
            StaleVersionError: ``version`` has tokens to score but is not held.
            ValueError: under r3, prefixes with and without routes, or routes not aligned with
                their tokens (:meth:`_pad`).
        """
        version = int(version)
        t0 = time.perf_counter()
        with self._lock:
            held = self.scorer.held()
            rows = []
            for key, tok, ver, lm, *rt in self.sources():
                tok, ver, lm = np.asarray(tok, np.int32), np.asarray(ver, np.int32), np.asarray(lm, bool)
                mine = lm & (ver == version)
                if not mine.any() or version in self._stash.get(key, {}) or len(tok) > self.scorer.max_seq_len:
                    continue  # nothing of this version, already stashed, or too long to train (dropped later)
                rows.append((key, tok, ver, mine, rt[0] if rt else None))
            if rows and version not in held:
                raise StaleVersionError(f"retire of version {version}: {len(rows)} episode(s) hold its tokens but the "
                                        f"scorer holds {sorted(held)}")
            for i in range(0, len(rows), self.rows_per_forward):
                chunk = rows[i: i + self.rows_per_forward]
                tok, am, ver, lm, routes = self._pad(chunk)
                old = self.scorer.score_arrays(tok, am, ver, lm, held={version: held[version]}, routes=routes)
                for j, (key, t, _, mine, _) in enumerate(chunk):
                    pos = np.flatnonzero(mine)
                    self._stash.setdefault(key, {})[version] = (pos, t[: int(pos[-1]) + 1].copy(), old[j, pos].copy())
            self.scorer.drop(version)
            self.retired += 1
            self.retire_rows += len(rows)
            self.retire_s += time.perf_counter() - t0
        return len(rows)

    def score_group(self, trajectories: list) -> tuple[list, list]:
        """Fill ``old_logp`` of each trainable trajectory of one finished group (in place), from the
        stashes of its retired versions and the params of the versions still held; then release the
        group's keys. Same contract as :meth:`OldLogitScorer.score_group`: ``(kept, dropped)``."""
        sc = self.scorer
        with self._lock:
            held = sc.held()
            kept, dropped, todo = [], [], []
            for t in trajectories:
                key = trajectory_key(t)
                stash = self._stash.pop(key, {})
                if t.failed or t.overlong or len(t) > sc.max_seq_len:
                    kept.append(t)
                    continue
                old = np.zeros(len(t), np.float32)
                need = {int(v) for v in np.unique(t.versions[t.loss_mask])}
                ok = True
                for v in need & set(stash):
                    pos, prefix, lp = stash[v]
                    now = np.flatnonzero(t.loss_mask & (t.versions == v))
                    if not (np.array_equal(now, pos) and len(t) >= len(prefix)
                            and np.array_equal(t.tokens[: len(prefix)], prefix)):
                        ok = False
                        self.stash_mismatch += 1
                        log.warning("old logits: episode %s's version-%d tokens differ from its retired prefix; dropped",
                                    key, v)
                        break
                    old[pos] = lp
                    self.retire_partial += int(t.max_version() > v)  # generated on after v retired: was partial
                rest = need - set(stash)
                if not ok or rest - set(held):
                    dropped.append(t)
                    continue
                kept.append(t)
                todo.append((t, old, rest))
            live = [(t, old, rest) for t, old, rest in todo if rest]
            if live:
                b = collate([t for t, _, _ in live], [0.0] * len(live), sc.max_seq_len, sc.buckets, pad_id=sc.pad_id)
                vs = sorted(set().union(*(r for _, _, r in live)))
                lm = b["loss_mask"] & np.isin(b["versions"], vs)
                new = sc.score_arrays(b["tokens"], b["attention_mask"], b["versions"], lm, held=held,
                                      routes=b.get("routes"))
                for i, (t, old, rest) in enumerate(live):
                    sel = t.loss_mask & np.isin(t.versions, sorted(rest))
                    old[sel] = new[i, : len(t)][sel]
            for t, old, _ in todo:
                t.old_logp = old
            sc.count(scored=len(todo), dropped=len(dropped))
        if self.release is not None:
            self.release([trajectory_key(t) for t in trajectories])
        return kept, dropped

    # ---------------------------------------------------------------------------------
    def publish(self, version: int, params: Any, generators: list) -> float:
        """Move the fleet to ``version``: hold ``params``, hand them to every generator, make each
        swap before it returns (``pause``) or at once, and retire the outgoing versions.

        Args:
            version: the new version; params: its params (kept by reference: a copy nobody donates).
            generators: objects with ``update_params(params, version)`` (returns cast seconds or
                None), ``apply_update_now()`` and (``pause``) ``paused()``.

        Returns:
            the generators' cast seconds (``update_params``), summed.
        """
        version = int(version)
        if not self.pause:
            self.publish_wait_s += self.wait_retired()  # bound: the current and at most one retiring version
        outgoing = [v for v in self.scorer.versions if v < version]
        self.put(version, params, copy=False)
        cast_s = 0.0
        for g in generators:  # cast/reshard outside any pause; a generator may already swap at its next step
            cast_s += float(g.update_params(params, version) or 0.0)
        if self.pause:
            t0 = time.perf_counter()
            with contextlib.ExitStack() as paused:
                for g in generators:
                    paused.enter_context(g.paused())
                for g in generators:
                    g.apply_update_now()
                for v in outgoing:
                    self.retire(v)
            self.stall_s += time.perf_counter() - t0
        else:
            for g in generators:
                g.apply_update_now()  # waits for the decode step in progress; then the fleet has left the outgoing
            for v in outgoing:
                self._submit(v)
        return cast_s

    def _submit(self, version: int) -> None:
        with self._cv:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="old-logits-retire", daemon=True)
                self._thread.start()
        self._jobs.put(version)

    def _run(self) -> None:
        while True:
            v = self._jobs.get()
            if v is None:
                return
            try:
                self.retire(v)
            except Exception as e:  # its trajectories find neither stash nor params: dropped and counted
                log.exception("old logits: retire of version %d failed", v)
                self.errors = (self.errors + [f"retire {v}: {e!r}"])[-20:]
                self.retire_errors += 1
                self.scorer.drop(v)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def wait_retired(self, timeout: Optional[float] = None) -> float:
        """Block until no retire is queued or running; returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0, timeout=timeout)
        return time.perf_counter() - t0

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the background retire thread (a retire in progress finishes first)."""
        if self._thread is not None and not self._stopped:
            self._stopped = True
            self._jobs.put(None)
            self._thread.join(timeout=timeout)

    def stats(self) -> dict[str, float]:
        """The scorer's columns plus ``old_logits_stall_s_total``, ``old_logits_publish_wait_s_total``,
        ``old_logits_retired``, ``old_logits_retire_rows``, ``old_logits_max_held``,
        ``old_logits_stash_mismatch``, ``old_logits_retire_errors``, ``old_logits_retire_partial``,
        ``old_logits_stashed`` (episodes
        with stashed tokens now)."""
        with self._lock:
            stashed = len(self._stash)
        return {**self.scorer.stats(), "old_logits_stall_s_total": float(self.stall_s),
                "old_logits_publish_wait_s_total": float(self.publish_wait_s),
                "old_logits_retired": float(self.retired), "old_logits_retire_rows": float(self.retire_rows),
                "old_logits_retire_s_total": float(self.retire_s),
                "old_logits_max_held": float(self.max_held), "old_logits_stash_mismatch": float(self.stash_mismatch),
                "old_logits_retire_errors": float(self.retire_errors),
                "old_logits_retire_partial": float(self.retire_partial),
                "old_logits_stashed": float(stashed)}
