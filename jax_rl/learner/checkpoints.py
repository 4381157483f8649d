"""The learner's checkpoint stage: its train state to and from Orbax (:mod:`jax_rl.checkpoint`).

:class:`LearnerCheckpoints` (``Learner.checkpoints``, built from the learner's pieces: its state holder, shardings,
correction strategy, snapshot store, model config and processes) saves the learner's
:class:`~jax_rl.learner.train_step.TrainState`, the correction strategy's items and the snapshot store
(:func:`jax_rl.checkpoint.train_state_items`) with the run's metadata, restores them onto the
learner's mesh (any shape) with a fallback past bad steps, and keeps one
:class:`~jax_rl.checkpoint.Checkpointer` per checkpoint directory. Every process calls
:meth:`~LearnerCheckpoints.save` / :meth:`~LearnerCheckpoints.restore` (Orbax writes and reads
cooperatively); with the learner on some processes only, the holders write and read and the other
processes take the metadata they restored.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import jax

from jax_rl import checkpoint as ckpt
from jax_rl.config import Config, config_hash
from jax_rl.learner.correction import Correction
from jax_rl.learner.correction.old_logits import SnapshotStore
from jax_rl.learner.holder import LearnerProcesses, StateHolder
from jax_rl.collectives import allgather_json

__all__ = ["LearnerCheckpoints"]

log = logging.getLogger(__name__)


class LearnerCheckpoints:
    """Checkpoints of one learner (``checkpoint.*``: ``every``, ``max_to_keep``, ``async_save``), built from the
    learner's pieces (it holds no learner).

    Args:
        cfg: the run config (``checkpoint``, ``model.preset`` / ``model.checkpoint``, the checkpoint directory
            of :func:`jax_rl.checkpoint.resolve_checkpoint_dir`; the whole config is hashed into the metadata).
        held: the learner's :class:`~jax_rl.learner.holder.StateHolder`: the train state saved, and where a
            restore writes the restored state, ``skipped_steps`` and (version, step).
        state_shardings: the train state's shardings (a restore places the arrays there, any mesh shape).
        param_shardings: the params' shardings (the snapshot store exports its versions there).
        strategy: the correction strategy (:class:`jax_rl.learner.correction.Correction`: its name and its
            checkpoint items).
        store: the snapshot store (:class:`jax_rl.learner.correction.old_logits.SnapshotStore`), or None.
        model_config: the ``Qwen3Config`` (its HF dict is the checkpoint's ``model_arch``).
        processes: the processes holding the learner (:class:`~jax_rl.learner.holder.LearnerProcesses`).
    """

    def __init__(self, cfg: Config, held: StateHolder, *, state_shardings: Any, param_shardings: Any,
                 strategy: Correction, store: Optional[SnapshotStore], model_config: Any, processes: LearnerProcesses):
        self.cfg, self.held, self.strategy, self.store = cfg, held, strategy, store
        self.state_shardings, self.param_shardings = state_shardings, param_shardings
        self.model_config, self.procs = model_config, processes
        self._ckptrs: dict[str, ckpt.Checkpointer] = {}
        self._readers: dict[str, ckpt.Checkpointer] = {}
        self._in_shared = False

    def checkpointer(self, ckpt_dir: Optional[str | Path] = None) -> ckpt.Checkpointer:
        """The :class:`~jax_rl.checkpoint.Checkpointer` of ``ckpt_dir`` (default: the run's,
        :func:`jax_rl.checkpoint.resolve_checkpoint_dir`), built once per directory.

        Raises:
            ValueError: no ``ckpt_dir`` and the config names no checkpoint directory.
        """
        d = ckpt_dir or ckpt.resolve_checkpoint_dir(self.cfg, error=ValueError)[1]
        d = str(Path(d).absolute())
        if d not in self._ckptrs:
            c = self.cfg.checkpoint
            active = set(self.procs.holders) if self.procs.on_some_processes else None
            self._ckptrs[d] = ckpt.Checkpointer(d, every=c.every, max_to_keep=c.max_to_keep, async_save=c.async_save,
                                                active_processes=active)
        return self._ckptrs[d]

    def reader(self, ckpt_dir: str | Path) -> ckpt.Checkpointer:
        """A read-only :class:`~jax_rl.checkpoint.Checkpointer` of ``ckpt_dir`` (``read_only=True``: it
        creates, cleans and deletes nothing there; a live writer's save in flight is left alone)."""
        d = str(Path(ckpt_dir).absolute())
        if d not in self._readers:
            self._readers[d] = ckpt.Checkpointer(d, read_only=True)
        return self._readers[d]

    def metadata(self, extra: Optional[dict], rl_step: Optional[int] = None) -> dict:
        """The ``metadata`` item of a checkpoint (:mod:`jax_rl.checkpoint`); ``extra`` goes under ``runtime``."""
        store = self.store
        return {
            "rl_step": int(self.held.version if rl_step is None else rl_step),
            "version": self.held.version,
            "opt_step": self.held.step,
            "config_hash": config_hash(self.cfg),
            "model_arch": self.model_config.to_hf(),
            "model_name": ckpt.model_name(self.cfg.model.preset, self.cfg.model.checkpoint),
            "correction": self.strategy.name,
            "skipped_steps": self.held.skipped_steps,
            "snapshot_versions": store.versions if store is not None else [],
            "process_count": jax.process_count(),
            "runtime": dict(extra or {}),
        }

    def save(self, ckpt_dir: Optional[str | Path] = None, extra_metadata: Optional[dict] = None, *,
             wait: bool = False, rl_step: Optional[int] = None) -> bool:
        """Save a checkpoint (async unless ``wait``) in the step dir ``<ckpt_dir>/<rl_step>``.

        Items (:func:`jax_rl.checkpoint.train_state_items`): state (params, opt_state, version,
        step, rng), the correction strategy's items, snapshots (snapshot store), metadata (JSON:
        ``rl_step``, ``version``, ``opt_step`` (optimizer updates), model/correction identity;
        ``extra_metadata`` goes under ``"runtime"``). Re-saving the same step replaces that
        checkpoint. Every process must call it.

        Args:
            rl_step: the RL step this state is at (the runtime's loop counter); the step dir's
                name. None (a learner used on its own) names it by the version.

        Returns:
            True when a save was started (False on a process holding no learner device).

        Raises:
            jax_rl.checkpoint.CheckpointDiskFullError: not enough disk space (one line; earlier
                steps intact).
        """
        if not self.procs.holds_learner:  # a process with no learner device: the holders save (checkpoint.Checkpointer)
            return False
        ck = self.checkpointer(ckpt_dir)
        store = self.store
        snaps = store.export(self.param_shardings) if store is not None and len(store) else None
        items = ckpt.train_state_items(self.held.state, self.strategy, snaps)
        v = self.held.version if rl_step is None else int(rl_step)
        if v in ck.all_steps():
            ck.wait()
            ck.delete(v)
        ok = ck.save(v, metadata=self.metadata(extra_metadata, v), **items)
        if wait:
            ck.wait()
        return ok

    def maybe_save(self, ckpt_dir: Optional[str | Path] = None, extra_metadata: Optional[dict] = None) -> bool:
        """Save when ``checkpoint.every`` divides the current version (> 0)."""
        if self.checkpointer(ckpt_dir).should_save(self._self.held.version):
            return self.save(ckpt_dir, extra_metadata)
        return False

    def restore(self, ckpt_dir: Optional[str | Path] = None, step: Optional[int] = None, *,
                read_only: bool = False) -> dict:
        """Restore a checkpoint onto the learner's mesh (any shape).

        With ``step=None`` the newest committed step is validated (item dirs present, metadata JSON
        parses, the arrays restore); a bad one is skipped with a one-line warning and the next
        newest is tried, until one restores. With an explicit ``step`` only that one is tried.
        ``read_only``: a reader (``jax-rl eval`` / ``export``, maybe of a live run): the dir is opened
        through :meth:`reader` (nothing there is created or removed; a save in flight, not committed, is
        not a step), and a step the live writer deleted meanwhile (``checkpoint.max_to_keep``) is not
        an error: the newest committed step is taken again.

        Returns:
            the metadata dict (``rl_step``, ``version``, ``opt_step``, ``config_hash``,
            ``correction``, ``model_arch``, ``runtime`` = the ``extra_metadata`` given to
            :meth:`save`, ...) plus ``checkpoint_step`` (the step dir restored) and
            ``skipped_checkpoints`` (``[[step, reason], ...]`` for bad newer steps passed over).

        Raises:
            FileNotFoundError: no checkpoint (or no such ``step``).
            CheckpointMismatchError: the checkpoint is from a different model architecture or
                correction mode (never skipped: the whole dir is another run's).
            CheckpointCorruptError: ``step`` given and bad, or every step is bad (one line).
        """
        if self.procs.on_some_processes and not self._in_shared:  # the holders restore
            return self._restore_shared(ckpt_dir, step, read_only)  # and the others read the metadata they restored
        if read_only:
            ck = self.reader(ckpt_dir or ckpt.resolve_checkpoint_dir(self.cfg, error=ValueError)[1])
        else:
            ck = self.checkpointer(ckpt_dir)
        if step is not None:
            ck.resolve(step)  # FileNotFoundError naming the steps there
            candidates = [int(step)]
        else:
            ck.resolve(None)
            candidates = sorted(ck.all_steps(), reverse=True)
        skipped: list = []
        retries = 3 if read_only and step is None else 0
        while candidates:
            s = candidates.pop(0)
            try:
                meta = self._restore_step(ck, s)
            except (ckpt.CheckpointMismatchError, KeyboardInterrupt):
                raise
            except Exception as e:
                if retries and s not in ck.all_steps(reload=True):  # the live writer deleted it under us
                    retries -= 1
                    tried = {t for t, _ in skipped}
                    candidates = sorted((t for t in ck.all_steps() if t not in tried and (t > s or t in candidates)),
                                        reverse=True)
                    continue
                why = str(e) if isinstance(e, ckpt.CheckpointCorruptError) else \
                    f"checkpoint {ck.directory / str(s)} failed to restore ({ckpt.one_line(e)})"
                if step is not None:
                    raise ckpt.CheckpointCorruptError(why) from None
                log.warning("%s; trying an older step", why)
                skipped.append([s, why])
                continue
            meta["checkpoint_step"] = s
            meta["skipped_checkpoints"] = skipped
            return meta
        raise ckpt.CheckpointCorruptError(
            f"no restorable checkpoint in {ck.directory}: " + "; ".join(w for _, w in skipped))

    def _restore_shared(self, ckpt_dir, step, read_only: bool = False) -> dict:
        """:meth:`restore` with the learner on some processes only (a collective every process calls): the
        holders restore, then every process gets the first holder's metadata (or its one-line error) through
        the ``jax.distributed`` key-value store; a process without learner devices takes the recorded
        counters (version, optimizer step)."""
        meta, err = None, None
        if self.procs.holds_learner:
            self._in_shared = True  # restore as a plain holder
            try:
                meta = self.restore(ckpt_dir, step, read_only=read_only)
            except Exception as e:  # noqa: BLE001 - handed to every process, then raised everywhere
                err = e
            finally:
                self._in_shared = False
        mine = None if not self.procs.holds_learner or jax.process_index() != self.procs.holders[0] else \
            ({"meta": json.loads(json.dumps(meta, default=str))} if err is None else
             {"error": type(err).__name__, "message": ckpt.one_line(err)})
        got = allgather_json(mine, timeout_s=self.procs.peer_timeout_s, what="restored checkpoint")
        got = got[self.procs.holders[0]]
        if err is not None:
            raise err
        if "error" in got:
            kinds = {"FileNotFoundError": FileNotFoundError, "CheckpointMismatchError": ckpt.CheckpointMismatchError,
                     "CheckpointCorruptError": ckpt.CheckpointCorruptError}
            raise kinds.get(got["error"], RuntimeError)(got["message"])
        if self.procs.holds_learner:
            return meta
        meta = got["meta"]
        self.held.skipped_steps = int(meta.get("skipped_steps", 0))
        self.held.track_counters(int(meta["version"]), int(meta["opt_step"]))
        return meta

    def _restore_step(self, ck: ckpt.Checkpointer, step: int) -> dict:
        store = self.store
        meta = ck.check_step(step)
        ckpt.check_compatible(meta, model_arch=self.model_config.to_hf(), correction=self.strategy.name,
                              directory=ck.directory,
                              model=ckpt.model_name(self.cfg.model.preset, self.cfg.model.checkpoint))
        snap_versions = [int(v) for v in meta.get("snapshot_versions", [])] if store is not None else []
        need = (tuple(self.strategy.checkpoint_items(self.held.state.correction))
                + (("snapshots",) if snap_versions else ()))
        if need:
            ck.check_step(step, need)
        self.held.state, snaps = ckpt.restore_train_state(ck, step, self.held.state, self.state_shardings,
                                                          self.strategy, snap_versions)
        if store is not None:
            if snaps is not None:
                store.load(snaps)
            else:
                for v in list(store.versions):
                    store.evict(v)
                store.put(self.held.version, self.held.state.params)
        self.held.skipped_steps = int(meta.get("skipped_steps", 0))
        return meta

    def delete_after(self, step: int, ckpt_dir: Optional[str | Path] = None) -> list[int]:
        """Delete the checkpoint steps newer than ``step`` (on the primary holder); returns them."""
        if jax.process_index() != self.procs.primary:
            return []
        return self.checkpointer(ckpt_dir).delete_after(step)

    def wait(self) -> None:
        """Block until every async save has been committed."""
        for c in self._ckptrs.values():
            c.wait()

    def close(self) -> None:
        """Finish pending writes and close every checkpointer."""
        try:
            for c in self._ckptrs.values():
                c.close()
        finally:
            for c in self._readers.values():
                c.close()
            self._ckptrs.clear()
            self._readers.clear()
