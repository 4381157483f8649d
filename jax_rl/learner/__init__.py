"""The learner: everything that turns a batch of trajectories into new params.

- :mod:`jax_rl.learner.learner`: :class:`~jax_rl.learner.learner.Learner`, the host shell around the train
  step (state, placement, process-local rows, pi_prox's host-side inputs) and its stages.
- :mod:`jax_rl.learner.holder`: the pieces the stages share: the learner's mutable state
  (:class:`~jax_rl.learner.holder.StateHolder`) and the processes holding it.
- :mod:`jax_rl.learner.checkpoints`: the learner's checkpoint stage (save, restore with fallback).
- :mod:`jax_rl.learner.spec`: the learner's shapes and shardings (state, batch) for a config.
- :mod:`jax_rl.learner.train_step`: ``TrainState`` and the one pure jitted train step.
- :mod:`jax_rl.learner.losses`: the pure policy loss and its metrics; :mod:`jax_rl.learner.loss_metrics`: the
  loss's metric groups (fixed keys each) and their reductions; :mod:`jax_rl.learner.reductions`: how
  metrics combine over microbatches and updates.
- :mod:`jax_rl.learner.advantages`: the advantage estimators (one registry, ``algo.advantage``).
- :mod:`jax_rl.learner.batch`: ``LearnerBatch``, ``collate``, padding and validation.
- :mod:`jax_rl.learner.logprobs`: the RL log-prob heads (truncation, entropy).
- :mod:`jax_rl.learner.sft`: the SFT warm-start stage.
- :mod:`jax_rl.learner.trees`: the pytree helpers of the jitted steps (skip a non-finite update).
- :mod:`jax_rl.learner.correction`: where pi_prox comes from (``base``: the interface and the registry; ``modes``;
  ``host``: the host-side inputs; ``proximal``: the pure math; and in ``correction/old_logits/`` the exact
  old-logit routes, the snapshot store and the old-logit stage).

Each stage takes the pieces it uses (config, state holder, shardings, a params getter, ...) and none holds the
:class:`~jax_rl.learner.learner.Learner`, which composes them; nothing in ``correction/`` imports the learner
modules that import it (the old-logit stage gets the learner's forward as a callable).

This ``__init__`` re-exports nothing: importing one pure piece (``losses``) must not
build the whole learner, and the modules the learner imports (placement, routing replay) read
``jax_rl.learner.batch``, so a re-export of ``Learner`` here would close an import cycle.
"""
