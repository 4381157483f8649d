"""Orbax checkpointing for the learner: one ``CheckpointManager`` with separate items.

Items of one checkpoint (a step directory ``<dir>/<step>/``):

- ``state``: the learner's :class:`~jax_rl.learner.train_step.TrainState` minus the correction's
  state, as a nested dict of jax arrays ``{params, opt_state, version, step, rng}``;
- the correction strategy's items (:meth:`jax_rl.learner.correction.Correction.checkpoint_items`;
  ``ewma``: ``{params, count, streak, resets}`` for the EWMA strategy);
- ``snapshots``: the snapshot store of :mod:`jax_rl.learner.correction.old_logits`, ``{"v<n>": params}``
  (only when the store holds something);
- ``metadata``: JSON. ``rl_step`` (the RL loop step the state is at; the runtime resumes
  from exactly this step), ``version`` (published versions), ``opt_step`` (optimizer updates;
  ``ppo_epochs x minibatches`` per RL step; also written as ``step``),
  ``config_hash`` (:func:`jax_rl.config.config_hash`), ``model_arch`` (the model's HF config
  dict), ``correction``, ``snapshot_versions`` and ``runtime`` (whatever JSON-able dict the
  runtime hands in: buffer state, rollout counters).

The runtime names step directories by the RL step (``checkpoints/<rl_step>``); a learner used
on its own names them by version.

Faults. A save writes into ``<step>.orbax-checkpoint-tmp*`` and renames it when committed, so
a killed or failed save never leaves a step a restore would pick (the tmp dir is removed on
the next start or at once after a failure). :meth:`Checkpointer.check_step` validates a step
(items present, metadata JSON parses); :meth:`jax_rl.learner.checkpoints.LearnerCheckpoints.restore` adds the array
restore and falls back past bad steps (:class:`CheckpointCorruptError`). A save that would not
fit on the disk (raw array bytes vs ``shutil.disk_usage``), or that fails with ENOSPC /
``RESOURCE_EXHAUSTED`` in Orbax's background thread, raises one
:class:`CheckpointDiskFullError` line; the older steps stay intact. The tracebacks the failed
writes would print are dropped: no-space records of the ``absl`` and ``asyncio`` loggers, and
tensorstore's ``Event loop is closed`` unraisable exceptions (``_ClosedLoopHook``).

Saves are asynchronous when ``checkpoint.async_save`` (Orbax writes in a background thread;
:meth:`Checkpointer.save` returns after the device->host copy). Restores take abstract
targets (``jax.ShapeDtypeStruct`` with a ``sharding``), so a checkpoint written on one mesh
restores onto any other mesh: Orbax reads each shard the new layout needs.

Multi-process: every process calls :meth:`save` / :meth:`restore` with its (global) arrays;
Orbax coordinates the write, and the JSON item is written by the primary process only.

No pickle anywhere: arrays go through tensorstore, metadata through JSON.

The package: :mod:`~jax_rl.checkpoint.manager` (:class:`Checkpointer`), :mod:`~jax_rl.checkpoint.trees` (array
trees, restore targets, the train state's items), :mod:`~jax_rl.checkpoint.faults` (errors, disk full, dropped
tracebacks) and :mod:`~jax_rl.checkpoint.compat` (model / correction checks, :func:`resolve_checkpoint_dir`);
every name is importable from ``jax_rl.checkpoint``.
"""

from jax_rl.checkpoint.compat import check_compatible, describe_model, model_name, resolve_checkpoint_dir
from jax_rl.checkpoint.faults import (CheckpointCommitError, CheckpointCorruptError, CheckpointDiskFullError, CheckpointMismatchError,
                                      _cancel_unstarted_writes, _install_closed_loop_hook, disk_full_error, is_no_space,
                                      one_line)
from jax_rl.checkpoint.manager import ITEM_NAMES, Checkpointer, restore_train_state
from jax_rl.checkpoint.trees import (STATE_KEYS, abstract_like, from_nested, saved_layer_layout, to_nested,
                                     train_state_items, tree_nbytes)

__all__ = ["Checkpointer", "CheckpointCommitError", "CheckpointMismatchError", "CheckpointCorruptError", "CheckpointDiskFullError",
           "ITEM_NAMES", "abstract_like", "tree_nbytes", "is_no_space", "disk_full_error", "to_nested",
           "from_nested", "train_state_items", "restore_train_state", "saved_layer_layout", "check_compatible",
           "resolve_checkpoint_dir", "describe_model", "model_name", "one_line", "STATE_KEYS",
           "_cancel_unstarted_writes", "_install_closed_loop_hook"]
