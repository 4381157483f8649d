"""The learner: a host shell around the pure train step (:mod:`jax_rl.learner.train_step`).

One code path for 1 CPU device, 8 fake devices, several processes and a TPU pod. The
:class:`Learner` holds the train state and the step: the model placed on the mesh (built directly
in its sharded layout on ``('data','fsdp','tensor','expert')``), host batches turned into global
[U, m, r, T] arrays (process-local rows), pi_prox's host-side inputs
(:func:`jax_rl.learner.correction.host_inputs`, the one decision) and the non-finite streak. Its stages
are objects of their own, each built from the pieces it uses and none holding the learner (the way
purejaxrl's ``make_train`` and AReaL's ``train()`` compose theirs): the train state lives in one
:class:`~jax_rl.learner.holder.StateHolder` (``Learner.held``) that the stages which change it (a restore, an SFT
step) write, the processes holding the learner in one :class:`~jax_rl.learner.holder.LearnerProcesses`:

- ``Learner.old_logits`` (:class:`jax_rl.learner.correction.old_logits.stage.OldLogitStage`): the no-grad forward,
  the snapshot store, the run's rollout-side scorer (from the config, a params getter, the mesh and param
  shardings, the routing policy, and the learner's forward and scorer placement as callables);
- ``Learner.checkpoints`` (:class:`jax_rl.learner.checkpoints.LearnerCheckpoints`): save,
  restore with fallback, delete newer steps (from the config, the state holder, the shardings, the strategy,
  the snapshot store, the model config and the processes);
- the SFT stage (:class:`jax_rl.learner.sft.SftRunner`, built at the first ``sft_step``);
- publishing to the engines is :class:`jax_rl.publish.Publisher` (``RunContext.publisher``, from the params
  getter ``Learner.held.params``, the mesh and ``rollout.dtype``), the one path of both runtimes.

Where pi_prox comes from is decided by the strategy of ``loss.correction``
(:mod:`jax_rl.learner.correction`); the learner never branches on the mode's name.

:meth:`Learner.train_step` metrics (python floats): the policy-loss metrics
(:func:`jax_rl.learner.losses.policy_loss`, combined over microbatches, averaged over the updates of the
call), ``loss``, ``grad_norm`` (before clipping), ``lr``, ``tokens``, ``loss_tokens``,
``padded_len`` (the T the step ran at: the batch's length padded to its ``optim.seq_len_buckets``
bucket), ``step_time_s`` (wall seconds, host included), ``tokens_per_s``, ``updates``,
``nonfinite_updates``, ``version``, ``step``, ``skipped``, ``skipped_steps``,
``nonfinite_streak`` (consecutive all-non-finite calls), the strategy's own (the EWMA strategy:
``nonfinite_ewma``, ``ewma_reset``, ``ewma_beta``, ``ewma_streak``, ``ewma_retained``,
``ewma_resets``), with the snapshot store, ``old_logits_bytes``, ``old_logits_versions``,
``old_logits_s``, and under ``exact`` ``old_logits_forwards`` (the learner's own old-logit
forwards this step: 0 under ``old_logits.route=dedicated``, whose batches arrive with
``old_logp``; :attr:`Learner.old_logit_forwards` sums them), under ``moe.routing_replay`` r2/r3
``routing_agreement`` / ``routing_pairs`` (:mod:`jax_rl.learner.train_step`). After ``optim.max_skipped_steps`` consecutive calls whose every update was
skipped as non-finite, :class:`NonFiniteTrainingError` is raised (also for SFT; 0 = never).

Fixed cost per step: a batch [B, T] is padded to the smallest of ``optim.seq_len_buckets``
(default powers of two up to ``optim.max_seq_len``, :func:`jax_rl.learner.batch.seq_buckets`) that holds T,
so a run compiles one train-step program per bucket it meets, not one per distinct T; the jitted step
computes the train-infer factor once per step (:func:`jax_rl.learner.train_step.train_infer_once`) and returns
every metric in one float32 vector, fetched in one device -> host transfer
(:class:`jax_rl.learner.train_step.PackedStep`); the version and optimizer step are then known on the host
without another transfer.

Multi-process (TPU pods, or CPU processes with gloo collectives): call
:func:`initialize_distributed` (done by :class:`Learner` when ``runtime.coordinator`` /
``runtime.num_processes`` are set, or on a TPU pod) before anything touches jax. Each process
then passes either the same global batch (``train_step(batch)``; each process feeds only its
rows through ``jax.make_array_from_process_local_data``) or its own rows
(``train_step(batch, process_local=True)``; see :meth:`Learner.process_rows`). Only process 0
writes log lines. Checkpoints are written and read cooperatively by Orbax.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jax_rl.learner.batch import (BATCH_FIELDS, BatchError, LearnerBatch, bucket_len, collate, pad_len, seq_buckets,
                          validate_batch)
from jax_rl.config import Config
from jax_rl.learner.correction import host_inputs, plan_host_inputs
from jax_rl.learner.checkpoints import LearnerCheckpoints
from jax_rl.learner.correction.old_logits.stage import OldLogitStage
from jax_rl.learner.holder import LearnerProcesses, StateHolder, copy_params
from jax_rl.learner.sft import SftRunner
from jax_rl.learner.spec import learner_batch_spec, learner_spec, scorer_placement
from jax_rl.learner.train_step import (StepParts, TrainState, make_grads_fn, make_logprob_step, make_optimizer,
                                       make_schedule, make_train_step)
from jax_rl.model_builder import resolve_mesh, resolve_model_config
from jax_rl.placement import BatchPlacement, initialize_distributed

__all__ = [
    "BATCH_FIELDS",
    "BatchError",
    "NonFiniteTrainingError",
    "TrainState",
    "Learner",
    "LearnerBatch",
    "collate",
    "validate_batch",
    "make_optimizer",
    "make_schedule",
    "initialize_distributed",
    "resolve_model_config",
]

log = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """``optim.max_skipped_steps`` learner steps in a row (RL ``train_step`` or ``sft_step``) had
    every optimizer update skipped as non-finite. The params are those of the last finite update;
    the message (one line) names the step, the last loss / grad norm and the knobs to look at."""


class Learner:
    """The sharded learner (docs/interfaces.md "Learner batch").

    Args:
        cfg: the run config (sections model, mesh, optim, loss, async, algo.temperature,
            old_logits, checkpoint, runtime, sft, run.seed are used).
        mesh: a ``('data','fsdp','tensor','expert')`` mesh; default from ``cfg.mesh``.
        model_config: a ``Qwen3Config``; default from ``cfg.model`` (:func:`resolve_model_config`).
        init_params: initial params (an ``nnx.State`` of Params or the matching nested dict,
            numpy or jax arrays, e.g. from ``hf_io``); default: random init with ``run.seed``.

    Attributes:
        version (int), step (int), mesh, model_config, graphdef, state (:class:`TrainState`, in ``held``: the
        :class:`~jax_rl.learner.holder.StateHolder` the stages share), processes (:class:`LearnerProcesses`),
        state_shardings, strategy (the correction strategy), skipped_steps (int: all-masked
        batches skipped), old_logits (the old-logit stage), checkpoints (the checkpoint stage),
        holders (the process indices holding learner devices), holds_learner (this process is one),
        on_some_processes (multi-process with the learner on some processes only).
    """

    def __init__(self, cfg: Config, mesh=None, model_config=None, init_params=None):
        initialize_distributed(cfg.runtime)
        self.cfg = cfg
        self.mesh = resolve_mesh(cfg, mesh)
        self.model_config = resolve_model_config(cfg.model, model_config)
        spec = learner_spec(cfg, self.model_config, self.mesh, abstract=False, init_params=init_params)
        self.strategy = spec.strategy
        self.correction = self.strategy.name
        self.routing = spec.routing  # moe.routing_replay: the policy every forward of this learner asks
        self.num_experts = self.routing.num_experts
        self.max_staleness = int(cfg.async_.max_staleness)
        self.minibatches = int(cfg.optim.minibatches)
        self.ppo_epochs = int(cfg.optim.ppo_epochs)
        self.microbatches = int(cfg.optim.microbatches)
        self.seq_buckets = seq_buckets(cfg.optim.max_seq_len, cfg.optim.seq_len_buckets)
        self.old_logit_forwards = 0  # old-logit forwards the learner ran itself (snapshot route), this session
        self._nonfinite_streak = 0  # consecutive train/SFT steps whose every update was non-finite
        self._is_main = jax.process_index() == 0
        # multi-process with the learner on some processes only (disaggregated: the engines' hosts hold no
        # learner device): the others run its programs as no-ops and read the step's metrics from a holder
        self.processes = LearnerProcesses.of(self.mesh, cfg.runtime.peer_timeout_s)
        self.holders = list(self.processes.holders)
        self.on_some_processes = self.processes.on_some_processes
        self.holds_learner = self.processes.holds_learner
        self._sft = None
        self.placement = BatchPlacement(self.mesh, self.minibatches, self.microbatches)
        self._steps: dict[Any, Any] = {}

        self.graphdef, self.rest = spec.graphdef, spec.rest
        self.param_shardings = spec.param_shardings
        self.tx, self.schedule = spec.tx, spec.schedule
        self.state_shardings = spec.state_shardings
        self.held = StateHolder(spec.state, self.holds_learner)  # the one mutable state the stages share
        del spec
        self._compose_stages()

    def _compose_stages(self) -> None:
        """The learner's stages, each from the pieces it uses (none holds the learner): the old-logit stage (the
        no-grad forward, the snapshot store, the run's scorer), then the checkpoint stage (which saves that store)."""
        cfg = self.cfg
        self.old_logits = OldLogitStage(
            cfg, self.held.params, keep_store=self.strategy.learner_store, mesh=self.mesh,
            param_shardings=self.param_shardings, routing=self.routing,
            make_forward=functools.partial(make_logprob_step, cfg, self.graphdef, rest=self.rest),
            place_scorer=functools.partial(scorer_placement, cfg, self.model_config),
            model_state=bool(jax.tree.leaves(self.rest)))
        self.checkpoints = LearnerCheckpoints(
            cfg, self.held, state_shardings=self.state_shardings, param_shardings=self.param_shardings,
            strategy=self.strategy, store=self.old_logits.store, model_config=self.model_config,
            processes=self.processes)

    def describe(self) -> str:
        """One line for the start of a run: the correction mode and its declared cost."""
        return self.strategy.describe()

    # ---------------------------------------------------------------------------------
    # state (jax_rl.learner.holder.StateHolder) and properties
    # ---------------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        """The current train state (held in :attr:`held`, shared with the stages that change it)."""
        return self.held.state

    @state.setter
    def state(self, value: TrainState) -> None:
        self.held.state = value

    @property
    def skipped_steps(self) -> int:
        """Batches without a loss token skipped so far (checkpointed)."""
        return self.held.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.held.skipped_steps = int(value)

    def track_counters(self, version: int, step: int) -> None:
        """:meth:`jax_rl.learner.holder.StateHolder.track_counters`."""
        self.held.track_counters(version, step)

    @property
    def version(self) -> int:
        """Published versions so far (params after n published updates are version n)."""
        return self.held.version

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return self.held.step

    def padded_len(self, T: int) -> int:
        """The length a batch of ``T`` columns is padded to: the smallest ``optim.seq_len_buckets``
        bucket that holds it (:func:`jax_rl.learner.batch.bucket_len`).

        Raises:
            BatchError: ``T`` > ``optim.max_seq_len``.
        """
        return bucket_len(int(T), self.seq_buckets)

    def _bucketed(self, b: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``b`` with its columns padded to :meth:`padded_len` (inert padding, :func:`jax_rl.learner.batch.pad_len`)."""
        return pad_len(dict(b), self.padded_len(np.shape(b["tokens"])[1]))

    @property
    def params(self) -> Any:
        """The live params (``nnx.State``; donated by the next train step: copy before keeping)."""
        return self.state.params

    def model(self, params: Any = None):
        """The NNX model with ``params`` (default: the live params) merged in."""
        return nnx.merge(self.graphdef, self.state.params if params is None else params, self.rest)

    def get_params(self, host: bool = False) -> Any:
        """A copy of the current params for the rollout side.

        Returns an ``nnx.State`` with the structure of ``nnx.split(model, nnx.Param)[1]``
        (what ``Qwen3Engine.load_params`` takes). ``host=False``: device arrays with the
        learner's shardings (a copy: the learner donates its own buffers). ``host=True``:
        numpy arrays (single-process only).
        """
        return copy_params(self.state.params, host=host)

    # ---------------------------------------------------------------------------------
    # batch placement (jax_rl.placement.BatchPlacement, ``Learner.placement``): the learner itself calls the
    # placement; these three are its public face for callers that place a batch by hand (tests, benches)
    # ---------------------------------------------------------------------------------
    def batch_sharding(self, r: int) -> NamedSharding:
        """Sharding of a chunked batch array [U, m, r, T]: rows over ``activation_batch``'s axes."""
        return self.placement.batch_sharding(r)

    def process_rows(self, batch: Mapping[str, np.ndarray], U: Optional[int] = None, m: Optional[int] = None
                     ) -> dict[str, np.ndarray]:
        """This process's rows of a GLOBAL batch [B, T] (what ``train_step(..., process_local=True)`` takes)."""
        return self.placement.process_rows(batch, U, m)

    def device_batch(self, batch: Mapping[str, np.ndarray], *, process_local: bool, U=None, m=None
                     ) -> tuple[dict[str, jax.Array], int]:
        """Host batch -> dict of global [U, m, r, T] arrays. Returns (arrays, r)."""
        return self.placement.device_batch(batch, process_local=process_local, U=U, m=m)

    # ---------------------------------------------------------------------------------
    # the train step
    # ---------------------------------------------------------------------------------
    def train_step_fn(self, r: int):
        """The jitted train step for batches with ``r`` rows per chunk (built once per ``r``; one
        compiled program per padded length T): a :class:`jax_rl.learner.train_step.PackedStep`,
        ``(state, LearnerBatch [U,m,r,T]) -> (state, metrics vector)``."""
        key = ("train", r)
        if key not in self._steps:
            self._steps[key] = make_train_step(
                self.cfg, StepParts.of(self), self.mesh, state_shardings=self.state_shardings,
                batch_sharding=self.placement.batch_sharding(r), packed_metrics=True)
        return self._steps[key]

    def abstract_batch(self, B: int, T: int) -> LearnerBatch:
        """``jax.ShapeDtypeStruct`` learner batch [U, m, r, T] (with the fields the jitted step
        reads under this correction mode), for AOT ``lower().compile()`` (``--dry-run``)."""
        U, m, r = self.placement.layout(B)
        return learner_batch_spec(self.strategy, self.routing, self.model_config, (U, m, r, T), self.placement.batch_sharding(r))

    def lower_train_step(self, B: int, T: int):
        """``jax.stages.Lowered`` of the train step for a [B, T] batch (call ``.compile()``)."""
        U, m, r = self.placement.layout(B)
        with jax.set_mesh(self.mesh):
            return self.train_step_fn(r).lower(self.state, self.abstract_batch(B, T))

    def train_step(self, batch: Mapping[str, Any], *, process_local: bool = False) -> dict[str, float]:
        """Train on one batch: ``ppo_epochs x minibatches`` updates, then publish one version.

        Args:
            batch: learner batch (:class:`jax_rl.learner.batch.LearnerBatch` fields as a dict of numpy
                [B, T]; optional ``old_logp`` [B, T] exact old log-probs, used instead of the
                snapshot route under ``exact`` and as the reference of ``measure_error``). B must
                be a multiple of ``minibatches*microbatches`` (of the process's rows with
                ``process_local``).
            process_local: the batch holds only this process's rows (multi-process).

        Returns:
            metrics dict of python floats (module docstring). A batch without any loss token
            is a counted no-op: nothing changes (version included), ``skipped = 1``.

        Raises:
            BatchError: malformed batch. StaleVersionError: exact old logits are needed for an
            evicted version. NonFiniteTrainingError: ``optim.max_skipped_steps`` calls in a row
            had every update skipped as non-finite (loss, grad norm or updated params).
        """
        t0 = time.perf_counter()
        g = self.version
        b = self._bucketed(self._host_batch(batch, current_version=g))
        b, n_loss = self.placement.sync_global(b)
        if n_loss == 0:
            self.skipped_steps += 1
            if self._is_main:
                log.warning("learner: batch without loss tokens skipped (%d so far)", self.skipped_steps)
            return {"skipped": 1.0, "skipped_steps": float(self.skipped_steps), "version": float(g),
                    "step": float(self.step), "step_time_s": time.perf_counter() - t0, "tokens": 0.0,
                    "tokens_per_s": 0.0}
        dev, r = self.placement.device_batch(b, process_local=process_local)
        dev, old_stats = self._prox_inputs(b, dev, g)
        if self.strategy.needs_exact:  # the learner's own old-logit forwards (0 under route=dedicated)
            old_stats.setdefault("old_logits_forwards", 0.0)
            self.old_logit_forwards += int(old_stats["old_logits_forwards"])
        fn, lb = self.train_step_fn(r), LearnerBatch.from_dict(dev)
        with jax.set_mesh(self.mesh):
            self.state, vec = fn(self.state, lb)
        store = self.old_logits.store
        if store is not None:
            store.put(g + 1, self.state.params)
            old_stats["old_logits_bytes"] = float(store.nbytes)
            old_stats["old_logits_versions"] = float(len(store))
        out = self.host_values(lambda: fn.metrics(lb, vec))  # every metric in one device -> host transfer
        opt_step = int(out.pop("opt_step"))
        self.track_counters(g + 1, opt_step)
        out.update(old_stats)
        dt = time.perf_counter() - t0
        out.update(step_time_s=dt, tokens_per_s=out["tokens"] / max(dt, 1e-9), version=float(g + 1),
                   step=float(opt_step), skipped=0.0, skipped_steps=float(self.skipped_steps),
                   padded_len=float(b["tokens"].shape[1]))
        self._note_nonfinite(out, "train_step", int(out["updates"]), g + 1)
        return out

    def host_values(self, get: Callable[[], dict]) -> dict[str, float]:
        """``get()`` (a step's metrics fetched to the host: ``{name: float}``); a process holding no learner
        device (disaggregated across processes) receives them from the first process that holds one, through
        the ``jax.distributed`` key-value store (:func:`jax_rl.collectives.allgather_json`; then a collective
        every process calls).

        Raises:
            jax_rl.collectives.PeerLostError: the holder did not answer within ``runtime.peer_timeout_s``.
        """
        return self.processes.host_values(get)

    def _host_batch(self, batch: Mapping[str, Any], current_version: Optional[int] = None) -> dict[str, np.ndarray]:
        """``batch`` validated (:func:`jax_rl.learner.batch.validate_batch`; loss tokens need a version >= 0 when the
        snapshot store scores them, :func:`jax_rl.learner.correction.plan_host_inputs`) and checked by the
        routing-replay policy (an r3 step never trains without the rollout's routes)."""
        route = getattr(self.strategy, "route", None)
        if route is not None and route.old_logp_is_behav:  # old_logits.route=behav: log pi_v is behav_logp
            batch = {**batch, "old_logp": batch["behav_logp"]}
        plan = plan_host_inputs(self.strategy, given="old_logp" in batch, store=self.old_logits.store is not None)
        b = validate_batch(batch, max_seq_len=self.cfg.optim.max_seq_len, vocab_size=self.model_config.vocab_size,
                           row_divisor=self.minibatches * self.microbatches, current_version=current_version,
                           require_versions=plan.score, num_experts=self.num_experts or None)
        self.routing.check_batch(b)
        b.pop("prox_logp", None)  # pi_prox is never the caller's: host_inputs decides it
        return b

    def _prox_inputs(self, b: dict, dev: dict, g: int) -> tuple[dict, dict]:
        """The device batch with pi_prox's host-side inputs (:func:`jax_rl.learner.correction.host_inputs`: the one
        decision, for :meth:`train_step` and :meth:`loss_and_grads` alike) and the store's stats."""
        score = None if self.old_logits.store is None else (lambda: self.old_logits.score(b, dev, g))
        return host_inputs(self.strategy, dev, score)

    def _note_nonfinite(self, out: dict, what: str, n_up: int, version: int) -> None:
        """Warn about skipped non-finite updates; count calls whose every update was skipped and
        raise :class:`NonFiniteTrainingError` after ``optim.max_skipped_steps`` in a row."""
        bad = int(out.get("nonfinite_updates", 0.0))
        if out.get("nonfinite_ewma", 0.0) > 0 and self._is_main:
            log.warning("learner: non-finite EWMA params at version %d; kept the previous theta_bar", version)
        self._nonfinite_streak = self._nonfinite_streak + 1 if bad >= n_up else 0
        out["nonfinite_streak"] = float(self._nonfinite_streak)
        if bad == 0:
            return
        limit = int(self.cfg.optim.max_skipped_steps)
        detail = (f"loss={out.get('loss', out.get('sft_loss'))}, grad_norm={out.get('grad_norm')}, "
                  f"lr={out.get('lr')}")
        if self._is_main:
            log.warning("learner: %s skipped %d of %d non-finite update(s) at version %d (%s); %d step(s) in a row "
                        "(optim.max_skipped_steps=%d)", what, bad, n_up, version, detail, self._nonfinite_streak,
                        limit)
        if limit > 0 and self._nonfinite_streak >= limit:
            raise NonFiniteTrainingError(
                f"{what}: {self._nonfinite_streak} steps in a row with every optimizer update non-finite "
                f"(last at version {version}: {detail}); params kept at the last finite update. Check "
                f"{'sft.lr' if what == 'sft_step' else 'optim.lr, the loss.* settings'} and the batches, or set "
                f"optim.max_skipped_steps=0 to keep going"
            )

    def logprobs(self, batch: Mapping[str, Any], params: Any = None) -> np.ndarray:
        """Training-numerics log-probs [B, T] float32 of ``batch['tokens']`` (needs ``tokens``
        and ``attention_mask``; ``out[:, 0] = 0``, 0 on padding) under ``params`` (default:
        current). Single-process result on the host (multi-process: a global jax.Array). Under
        ``rollout.top_k`` / ``rollout.top_p`` these are the truncated log-probs, ``-inf`` for a
        token outside the kept set (prompt tokens often are)."""
        tok = np.asarray(batch["tokens"])
        B, T = tok.shape
        sub = {"tokens": tok.astype(np.int32), "attention_mask": np.asarray(batch["attention_mask"], bool)}
        if self.routing.forces_rollout_routes and batch.get("routes") is not None:  # r3: forced routes
            sub["routes"] = np.asarray(batch["routes"])
        if T <= self.seq_buckets[-1] and jax.process_count() == 1:  # the train step's length buckets
            sub = self._bucketed(sub)
        U, m = self.minibatches, self.microbatches
        U, m = (U, m) if B % (U * m) == 0 else (1, 1)
        dev, r = self.placement.device_batch(sub, process_local=False, U=U, m=m)
        with jax.set_mesh(self.mesh):
            out = self.old_logits.forward(dev)(self.state.params if params is None else params, dev["tokens"],
                                        dev["attention_mask"])
        if jax.process_count() > 1:
            return out
        return np.asarray(out).reshape(B, -1)[:, :T]

    def loss_and_grads(self, batch: Mapping[str, Any]) -> tuple[float, Any, dict]:
        """Loss, grads (an ``nnx.State`` like the params, sharded like them) and metrics of the
        FIRST minibatch of ``batch`` at the current params, with microbatch accumulation and the
        correction strategy's pi_prox at the current state, its host-side inputs decided as in
        :meth:`train_step` (:func:`jax_rl.learner.correction.host_inputs`). No state changes (for tests and
        debugging).

        Raises:
            BatchError / ValueError: as :meth:`train_step`.
        """
        g = self.version
        b = self._bucketed(self._host_batch(batch, current_version=g))
        dev, r = self.placement.device_batch(b, process_local=False)
        dev, _ = self._prox_inputs(b, dev, g)
        key = ("grads", r)
        if key not in self._steps:
            self._steps[key] = make_grads_fn(self.cfg, self.graphdef, self.strategy, self.mesh, rest=self.rest,
                                             param_shardings=self.param_shardings,
                                             batch_sharding=self.placement.batch_sharding(r), routing=self.routing)
        with jax.set_mesh(self.mesh):
            loss, grads, metr = self._steps[key](self.state.params, self.state.correction, self.state.version,
                                                 LearnerBatch.from_dict(dev))
        return float(loss), grads, {k: float(v) for k, v in metr.items()}

    # ---------------------------------------------------------------------------------
    # SFT
    # ---------------------------------------------------------------------------------
    def sft_step(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One supervised step (:mod:`jax_rl.learner.sft`): mean cross-entropy over ``loss_mask`` tokens.

        Args:
            batch: ``tokens`` int [B, T], ``attention_mask`` bool [B, T], ``loss_mask`` bool
                [B, T] (right-padded; loss_mask[:, 0] False). B a multiple of
                ``optim.microbatches``.

        Version and step do not change. Call :meth:`reset_proximal` when SFT ends.

        Returns:
            ``{"sft_loss", "sft_tokens", "grad_norm", "lr", "nonfinite_updates", "nonfinite_streak",
            "step_time_s", "tokens_per_s"}``. A non-finite step is skipped (params kept).

        Raises:
            NonFiniteTrainingError: ``optim.max_skipped_steps`` non-finite steps in a row.
        """
        out = self._sft_runner().step(batch)
        if "nonfinite_updates" in out:
            self._note_nonfinite(out, "sft_step", 1, self.version)
        return out

    def set_sft_count(self, n: int) -> None:
        """A resumed SFT: its schedule continues at applied update ``n`` (the AdamW moments start fresh)."""
        self._sft_runner().count = int(n)

    def _sft_runner(self) -> SftRunner:
        if self._sft is None:
            self._sft = SftRunner(self.cfg, self.held, graphdef=self.graphdef, rest=self.rest, mesh=self.mesh,
                                  param_shardings=self.param_shardings, placement=self.placement,
                                  vocab_size=self.model_config.vocab_size, processes=self.processes)
        return self._sft

    def reset_proximal(self) -> None:
        """The params changed outside RL (SFT ended): re-anchor the correction strategy's state on
        them (EWMA: theta_bar <- theta, W = 1, streak 0) and re-snapshot the current version."""
        st = self.state
        with jax.set_mesh(self.mesh):
            cstate = jax.jit(self.strategy.reset, in_shardings=(self.param_shardings, self.state_shardings.correction),
                             out_shardings=self.state_shardings.correction)(st.params, st.correction)
        self.state = st.replace(correction=cstate)
        if self.old_logits.store is not None:
            self.old_logits.store.put(self.version, self.state.params)

    def close(self) -> None:
        """Finish pending checkpoint writes and release the snapshot store."""
        self.checkpoints.close()
        self.old_logits.close()



