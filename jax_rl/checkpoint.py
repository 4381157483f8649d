"""Orbax checkpointing for the learner: one ``CheckpointManager`` with separate items.

Items of one checkpoint (a step directory ``<dir>/<step>/``):

- ``state``: the learner's :class:`~jax_rl.learner.TrainState` minus the EWMA, as a nested
  dict of jax arrays ``{params, opt_state, version, step, rng, skipped}``;
- ``ewma``: ``{params, count, streak}`` (only when ``loss.correction=ppo_ewma``);
- ``snapshots``: the snapshot store of :mod:`jax_rl.old_logits`, ``{"v<n>": params}``
  (only when the store holds something);
- ``metadata``: JSON. ``version``, ``step``, ``config_hash`` (:func:`jax_rl.config.config_hash`),
  ``model_arch`` (the model's HF config dict), ``correction``, ``snapshot_versions`` and
  ``runtime`` (whatever JSON-able dict the runtime hands in: buffer state, rollout counters).

Saves are asynchronous when ``checkpoint.async_save`` (Orbax writes in a background thread;
:meth:`Checkpointer.save` returns after the device->host copy). Restores take abstract
targets (``jax.ShapeDtypeStruct`` with a ``sharding``), so a checkpoint written on one mesh
restores onto any other mesh: Orbax reads each shard the new layout needs.

Multi-process: every process calls :meth:`save` / :meth:`restore` with its (global) arrays;
Orbax coordinates the write, and the JSON item is written by the primary process only.

No pickle anywhere: arrays go through tensorstore, metadata through JSON.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "CheckpointMismatchError", "ITEM_NAMES", "abstract_like"]

log = logging.getLogger(__name__)

ITEM_NAMES = ("state", "ewma", "snapshots", "metadata")


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run whose model or correction mode differs from this one."""


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` tree for ``tree`` (arrays), with ``shardings`` (same tree) if given.

    Used as an Orbax restore target: the restored arrays get these shapes, dtypes and
    shardings (resharding from whatever layout was saved).
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
    """Thin wrapper over ``orbax.checkpoint.CheckpointManager`` with the learner's items.

    Args:
        directory: checkpoint root (created if missing). Must be visible to every process in
            multi-process runs (a shared filesystem or GCS).
        every: save interval in learner steps for :meth:`should_save` (0 = never periodic).
        max_to_keep: newest checkpoints kept; older ones are deleted after a save commits.
        async_save: write in a background thread (Orbax async checkpointing).
    """

    def __init__(self, directory: str | Path, *, every: int = 0, max_to_keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.every = int(every)
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=opts, item_names=ITEM_NAMES)

    # ---------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """True when ``every > 0`` and ``step`` is a positive multiple of it."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(
        self,
        step: int,
        *,
        state: dict,
        metadata: dict,
        ewma: Optional[dict] = None,
        snapshots: Optional[dict] = None,
    ) -> bool:
        """Save one checkpoint at ``step`` (async). Returns True if a save was started.

        Args:
            step: the learner step (directory name). Saving the same step twice is a no-op.
            state: nested dict of jax arrays (the train state without EWMA).
            metadata: JSON-serialisable dict.
            ewma: nested dict of jax arrays or None (item omitted).
            snapshots: ``{"v<n>": params}`` or None/empty (item omitted).
        """
        if step in self._mgr.all_steps():
            log.info("checkpoint for step %d already exists; skipping", step)
            return False
        items = {"state": ocp.args.StandardSave(state), "metadata": ocp.args.JsonSave(metadata)}
        if ewma is not None:
            items["ewma"] = ocp.args.StandardSave(ewma)
        if snapshots:
            items["snapshots"] = ocp.args.StandardSave(snapshots)
        return bool(self._mgr.save(step, args=ocp.args.Composite(**items), force=True))

    def latest_step(self) -> Optional[int]:
        """Newest saved step (committed or in flight from this process), or None."""
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def restore_metadata(self, step: Optional[int] = None) -> dict:
        """The JSON metadata item of ``step`` (default: latest).

        Raises:
            FileNotFoundError: no checkpoint in the directory.
        """
        step = self._resolve(step)
        return dict(self._mgr.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())).metadata)

    def restore(
        self,
        step: Optional[int] = None,
        *,
        state: Any,
        ewma: Any = None,
        snapshots: Any = None,
    ) -> dict:
        """Restore items of ``step`` (default latest) into abstract targets.

        Args:
            state / ewma / snapshots: trees of ``jax.ShapeDtypeStruct`` with shardings (see
                :func:`abstract_like`); None skips the item.

        Returns:
            ``{"state": ..., "ewma": ... or None, "snapshots": ... or None, "metadata": dict}``.

        Raises:
            FileNotFoundError: no checkpoint.
            ValueError: the saved tree does not match the target (Orbax's message).
        """
        step = self._resolve(step)
        items = {"state": ocp.args.StandardRestore(state), "metadata": ocp.args.JsonRestore()}
        if ewma is not None:
            items["ewma"] = ocp.args.StandardRestore(ewma)
        if snapshots:
            items["snapshots"] = ocp.args.StandardRestore(snapshots)
        out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        return {
            "state": out.state,
            "ewma": out.ewma if ewma is not None else None,
            "snapshots": out.snapshots if snapshots else None,
            "metadata": dict(out.metadata),
        }

    def wait(self) -> None:
        """Block until in-flight async saves are committed."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release Orbax's threads."""
        self._mgr.wait_until_finished()
        self._mgr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------
    def _resolve(self, step: Optional[int]) -> int:
        self._mgr.wait_until_finished()
        self._mgr.reload()
        if step is None:
            step = self._mgr.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        if step not in self._mgr.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        return int(step)


def check_compatible(saved: dict, *, model_arch: dict, correction: str, directory: Any = "") -> None:
    """Refuse a restore whose saved run had another model architecture or correction mode.

    Args:
        saved: the checkpoint's metadata dict.
        model_arch: this run's model HF config dict.
        correction: this run's ``loss.correction``.

    Raises:
        CheckpointMismatchError: naming the differing model fields or the two correction modes.
    """
    where = f" in {directory}" if directory else ""
    s_arch = saved.get("model_arch") or {}
    if s_arch and s_arch != model_arch:
        diff = sorted(k for k in set(s_arch) | set(model_arch) if s_arch.get(k) != model_arch.get(k))
        shown = ", ".join(f"{k}: saved={s_arch.get(k)!r} now={model_arch.get(k)!r}" for k in diff[:6])
        raise CheckpointMismatchError(
            f"checkpoint{where} was written for a different model ({shown}); "
            "restore with the same model config or start a fresh run dir"
        )
    s_corr = saved.get("correction")
    if s_corr is not None and s_corr != correction:
        raise CheckpointMismatchError(
            f"checkpoint{where} was written with loss.correction={s_corr!r} but this run has "
            f"loss.correction={correction!r}; the train state (EWMA, snapshot store) differs between modes"
        )


__all__.append("check_compatible")
