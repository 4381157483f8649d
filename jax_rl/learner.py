"""Sharded learner: TrainState, the jitted train step, the log-prob forward, checkpoints.

One code path for 1 CPU device, 8 fake devices, several processes and a TPU pod:

- The model is a Flax NNX ``Qwen3ForCausalLM`` built directly in its sharded layout
  (:func:`jax_rl.sharding.create_sharded_model`) on the mesh ``('data','fsdp','tensor','expert')``
  from ``cfg.mesh`` (-1 = the remaining devices). ``nnx.split(model, nnx.Param, ...)`` gives the
  static graphdef, the params (an ``nnx.State``) and the rest (non-param variables).
- :class:`TrainState` holds fp32 master params, the optax state, the EWMA params (only for
  ``loss.correction=ppo_ewma``, same shardings as the params), the EWMA weight W and reset
  streak, ``version`` and ``step`` (int32) and an RNG key. Every leaf is placed explicitly:
  params by the logical-axis rules (``jax_rl.sharding.LOGICAL_RULES``), optimizer moments like
  their params, scalars replicated.
- :meth:`Learner.train_step` runs ONE ``jax.jit`` (explicit in/out shardings, the state
  donated) that does everything for one published version:

  1. pi_prox per ``loss.correction``: ``ppo`` -> ``behav_logp``; ``decoupled`` -> a no-grad
     forward with the params at the start of the step; ``linear_prox`` ->
     :func:`jax_rl.proximal.linear_prox_logp` from the (detached) log-probs of the gradient
     forward (no extra forward; see below for the exceptions); ``ppo_ewma`` -> a no-grad
     forward with ``ewma_params``; ``exact`` -> the snapshot route's old logits
     (:mod:`jax_rl.old_logits`, computed before the jit) or a batch-supplied ``old_logp``.
  2. ``ppo_ewma`` reset, effective for THIS step (paper_spec §3.2): the retained ratio R of
     the train-infer mask on pi_{theta_bar}/mu is evaluated on the batch before the loss;
     :func:`jax_rl.proximal.reset_predicate` decides; on a reset theta_bar <- theta (W <- 1)
     and pi_prox is recomputed with the current params (``lax.cond``: the second forward only
     runs when the reset fires).
  3. ``optim.ppo_epochs x optim.minibatches`` optimizer updates (``lax.scan``), each over
     ``optim.microbatches`` gradient-accumulation microbatches (``lax.scan``). Normalisation
     is global: every microbatch's loss is divided by the minibatch's
     :func:`jax_rl.losses.loss_denominator`, so the summed loss and gradient equal the
     single-microbatch ones whatever the split. An update with a non-finite loss, gradient
     norm or updated params is skipped (params and optimizer state kept; counted in
     ``nonfinite_updates``, with a warning). After ``optim.max_skipped_steps`` consecutive
     calls whose every update was skipped, :meth:`Learner.train_step` raises
     :class:`NonFiniteTrainingError` (also for SFT steps; 0 = never).
  4. EWMA update theta_bar <- beta*theta_bar + (1-beta)*theta (Hilton bias correction), once
     per version (beta is in version units, from ``async.max_staleness`` and
     ``loss.ewma_beta_rule``/``loss.ewma_beta``). A non-finite EWMA result is dropped (theta_bar
     kept; ``nonfinite_ewma`` = 1, with a warning).
  5. ``version += 1``, ``step += number of applied updates``.

  Metrics (python floats): the policy-loss metrics (:func:`jax_rl.losses.policy_loss`,
  combined over microbatches with :func:`jax_rl.losses.combine_metrics`, then averaged over
  the updates of the call), ``loss``, ``grad_norm`` (before clipping), ``lr``, ``tokens``
  (non-padding tokens), ``loss_tokens``, ``step_time_s`` (wall seconds of the call, host
  included), ``tokens_per_s``, ``updates``, ``nonfinite_updates``, ``version``, ``step``,
  ``skipped``, ``nonfinite_streak`` (consecutive all-non-finite calls); with ``ppo_ewma`` also
  ``nonfinite_ewma`` (0/1), ``ewma_reset`` (0/1), ``ewma_beta``, ``ewma_streak``,
  ``ewma_retained`` (R before the reset) and ``ewma_resets`` (total); with the snapshot route
  ``old_logits_bytes``, ``old_logits_versions``, ``old_logits_s``.

linear_prox exception: the interpolation needs log pi at the params of version g. With one
update per call the gradient forward's detached log-probs are exactly that. With several
updates per call (``ppo_epochs*minibatches > 1``), or when the loss denominator depends on
pi_prox (``loss.keep_masked_in_denominator=false`` with microbatches), one no-grad forward at
the start of the step supplies them instead.

Batch layout. The learner batch (DESIGN.md §3, docs/interfaces.md) is a dict of numpy arrays
[B, T] (:data:`BATCH_FIELDS`). Rows are split ``B = U * m * r`` (U = ``optim.minibatches``,
m = ``optim.microbatches``) into an array [U, m, r, T] whose row axis ``r`` is sharded over
the mesh axes of the logical name ``activation_batch`` (mesh axes that do not divide r are
dropped). Minibatch u, microbatch j is rows ``(u*m + j)*r : (u*m + j + 1)*r`` of the batch.

Compiled functions (init, train step, log-prob forward, grads) are cached at module level
by (config, model config, mesh) and shared between learners with equal keys (a restore into a
fresh learner compiles nothing); the cache holds only a static view of the learner, no arrays.
All log-prob forwards (proximal, EWMA, snapshot, the gradient forward) go through one
function, :meth:`Learner._logprobs` (``jax_rl.models.qwen3.sequence_logprobs``: fp32 logits,
temperature ``rollout.temperature``).

Multi-process (TPU pods, or CPU processes with gloo collectives): call
:func:`initialize_distributed` (done by :class:`Learner` when ``runtime.coordinator`` /
``runtime.num_processes`` are set, or on a TPU pod) before anything touches jax. Each process
then passes either the same global batch (``train_step(batch)``; each process feeds only its
rows through ``jax.make_array_from_process_local_data``) or its own rows
(``train_step(batch, process_local=True)``; see :meth:`Learner.process_rows` for which rows
of a global batch a process owns). Only process 0 writes log lines. Checkpoints are written and
read cooperatively by Orbax.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_rl import losses, proximal
from jax_rl.config import Config, OptimConfig, RuntimeConfig, config_hash

__all__ = [
    "BATCH_FIELDS",
    "BatchError",
    "NonFiniteTrainingError",
    "TrainState",
    "Learner",
    "collate",
    "validate_batch",
    "make_optimizer",
    "make_schedule",
    "initialize_distributed",
    "resolve_model_config",
]

log = logging.getLogger(__name__)

# (config json, model config, mesh) + function key -> jitted function (see Learner._cached_jit)
_JIT_CACHE: dict[Any, Any] = {}

# name -> (kind, dtype); kind: "int" | "bool" | "float"
BATCH_FIELDS: dict[str, tuple[str, Any]] = {
    "tokens": ("int", np.int32),
    "attention_mask": ("bool", np.bool_),
    "loss_mask": ("bool", np.bool_),
    "behav_logp": ("float", np.float32),
    "versions": ("int", np.int32),
    "turn_ids": ("int", np.int32),
    "advantages": ("float", np.float32),
}
OPTIONAL_FIELDS: dict[str, tuple[str, Any]] = {
    "old_logp": ("float", np.float32),  # exact log pi_v (e.g. from another old-logit route)
}


class BatchError(ValueError):
    """A malformed learner batch: missing field, wrong shape/dtype, too long, bad masks."""


class NonFiniteTrainingError(RuntimeError):
    """``optim.max_skipped_steps`` learner steps in a row (RL ``train_step`` or ``sft_step``) had
    every optimizer update skipped as non-finite. The params are those of the last finite update;
    the message (one line) names the step, the last loss / grad norm and the knobs to look at."""


# ======================================================================================
# Batches
# ======================================================================================


def collate(
    trajectories: Sequence[Any],
    advantages_per_traj: Sequence[Any],
    max_seq_len: int,
    pad_to_multiple: int = 16,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Right-pad trajectories into a learner batch.

    Args:
        trajectories: objects (or dicts) with ``tokens`` int [T_i], ``loss_mask`` bool [T_i],
            ``behav_logp`` float [T_i], ``versions`` int [T_i], ``turn_ids`` int [T_i]
            (``rollout.types.Trajectory``).
        advantages_per_traj: one float per trajectory (broadcast over its tokens) or an
            array [T_i] per trajectory.
        max_seq_len: longest accepted trajectory (``optim.max_seq_len``).
        pad_to_multiple: T is the longest length rounded up to this multiple (a bucket, so
            fewer distinct shapes are compiled), capped at ``max_seq_len``.
        pad_id: token id written in padding (masked out everywhere).

    Returns:
        dict of numpy arrays [B, T]: tokens int32, attention_mask bool, loss_mask bool,
        behav_logp float32, versions int32 (-1 pad), turn_ids int32 (-1 pad), advantages
        float32 (0 pad).

    Raises:
        BatchError: no trajectories, mismatched lengths, a trajectory longer than max_seq_len.
    """
    if len(trajectories) == 0:
        raise BatchError("collate got no trajectories")
    if len(advantages_per_traj) != len(trajectories):
        raise BatchError(
            f"collate got {len(trajectories)} trajectories but {len(advantages_per_traj)} advantages"
        )

    def get(t, k):
        return t[k] if isinstance(t, Mapping) else getattr(t, k)

    lens = [len(get(t, "tokens")) for t in trajectories]
    if max(lens) > max_seq_len:
        i = int(np.argmax(lens))
        raise BatchError(
            f"trajectory {i} has {lens[i]} tokens > optim.max_seq_len={max_seq_len}; "
            "raise optim.max_seq_len or cap rollout.max_cache_len"
        )
    m = max(1, int(pad_to_multiple))
    T = min(max_seq_len, -(-max(lens) // m) * m)
    B = len(trajectories)
    out = {
        "tokens": np.full((B, T), pad_id, np.int32),
        "attention_mask": np.zeros((B, T), bool),
        "loss_mask": np.zeros((B, T), bool),
        "behav_logp": np.zeros((B, T), np.float32),
        "versions": np.full((B, T), -1, np.int32),
        "turn_ids": np.full((B, T), -1, np.int32),
        "advantages": np.zeros((B, T), np.float32),
    }
    for b, (t, adv) in enumerate(zip(trajectories, advantages_per_traj)):
        n = lens[b]
        for k in ("tokens", "loss_mask", "behav_logp", "versions", "turn_ids"):
            a = np.asarray(get(t, k))
            if a.shape != (n,):
                raise BatchError(f"trajectory {b}: field {k} has shape {a.shape}, tokens has ({n},)")
            out[k][b, :n] = a
        out["attention_mask"][b, :n] = True
        a = np.asarray(adv, np.float32)
        if a.ndim == 0:
            out["advantages"][b, :n] = a
        elif a.shape == (n,):
            out["advantages"][b, :n] = a
        else:
            raise BatchError(f"trajectory {b}: advantages shape {a.shape}; expected a scalar or ({n},)")
    return out


def validate_batch(
    batch: Mapping[str, Any],
    *,
    max_seq_len: int,
    vocab_size: Optional[int] = None,
    row_divisor: int = 1,
    current_version: Optional[int] = None,
    require_versions: bool = False,
) -> dict[str, np.ndarray]:
    """Check a learner batch and return normalised numpy copies (int32 / bool / float32).

    Args:
        batch: dict with :data:`BATCH_FIELDS` (and optionally ``old_logp``), each [B, T].
        max_seq_len: T must be <= this.
        vocab_size: token ids under the attention mask must lie in [0, vocab_size).
        row_divisor: B must be a multiple of this (minibatches * microbatches).
        current_version: loss tokens may not carry a version above it (a future version).
        require_versions: every loss token must carry a version >= 0 (exact old logits).

    Returns:
        dict of numpy arrays with the dtypes of :data:`BATCH_FIELDS`.

    Raises:
        BatchError: with a message naming the field and the rule.
    """
    if not isinstance(batch, Mapping):
        raise BatchError(f"learner batch must be a dict of arrays, got {type(batch).__name__}")
    missing = [k for k in BATCH_FIELDS if k not in batch]
    if missing:
        raise BatchError(f"learner batch is missing field(s) {missing}; expected {list(BATCH_FIELDS)}")
    unknown = [k for k in batch if k not in BATCH_FIELDS and k not in OPTIONAL_FIELDS and k != "prox_logp"]
    if unknown:
        raise BatchError(f"learner batch has unknown field(s) {unknown}")
    tok = np.asarray(batch["tokens"])
    if tok.ndim != 2:
        raise BatchError(f"batch['tokens'] must be [B, T], got shape {tok.shape}")
    B, T = tok.shape
    if B == 0 or T == 0:
        raise BatchError(f"batch is empty: tokens shape {tok.shape}")
    if T > max_seq_len:
        raise BatchError(f"batch has T={T} > optim.max_seq_len={max_seq_len} (over-long sequences)")
    if B % row_divisor:
        raise BatchError(
            f"batch has B={B} rows, not a multiple of optim.minibatches*optim.microbatches={row_divisor}"
        )
    out: dict[str, np.ndarray] = {}
    spec = dict(BATCH_FIELDS)
    spec.update({k: v for k, v in OPTIONAL_FIELDS.items() if k in batch})
    if "prox_logp" in batch:
        spec["prox_logp"] = ("float", np.float32)
    for k, (kind, dt) in spec.items():
        a = np.asarray(batch[k])
        if a.shape != (B, T):
            raise BatchError(f"batch[{k!r}] has shape {a.shape}; expected {(B, T)} like tokens")
        if kind == "int":
            if not np.issubdtype(a.dtype, np.integer):
                raise BatchError(f"batch[{k!r}] has dtype {a.dtype}; expected an integer dtype (int32)")
            if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
                raise BatchError(f"batch[{k!r}] has values outside int32")
        elif kind == "bool":
            if a.dtype != np.bool_:
                raise BatchError(f"batch[{k!r}] has dtype {a.dtype}; expected bool")
        else:
            if not np.issubdtype(a.dtype, np.floating):
                raise BatchError(f"batch[{k!r}] has dtype {a.dtype}; expected a float dtype (float32)")
        out[k] = np.ascontiguousarray(a, dtype=dt)
    am, lm = out["attention_mask"], out["loss_mask"]
    if np.any(lm & ~am):
        raise BatchError("batch['loss_mask'] is True where attention_mask is False")
    if np.any(lm[:, 0]):
        raise BatchError("batch['loss_mask'][:, 0] must be False: the first token has no context to score it")
    if np.any(am[:, 1:] & ~am[:, :-1]):
        raise BatchError("batch must be right-padded: attention_mask rows must be a run of True then False")
    if vocab_size is not None:
        t = out["tokens"][am]
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise BatchError(f"batch['tokens'] has ids outside [0, {vocab_size}) (min {t.min()}, max {t.max()})")
    if not np.all(np.isfinite(out["advantages"][lm])):
        raise BatchError("batch['advantages'] is not finite on some loss tokens")
    v = out["versions"][lm]
    if current_version is not None and v.size and v.max() > current_version:
        raise BatchError(
            f"batch has loss tokens of version {int(v.max())} > the learner's version {current_version} (future version)"
        )
    if require_versions and v.size and v.min() < 0:
        raise BatchError("loss.correction=exact needs batch['versions'] >= 0 on every loss token")
    return out


# ======================================================================================
# Optimizer
# ======================================================================================


def make_schedule(lr: float, warmup_steps: int, schedule: str = "constant", total_steps: Optional[int] = None,
                  min_lr_ratio: float = 0.0) -> optax.Schedule:
    """Learning-rate schedule over optimizer updates: linear warmup 0 -> lr, then constant or
    cosine decay to ``lr * min_lr_ratio`` at ``total_steps`` (cosine only)."""
    if schedule == "cosine":
        total = max(int(total_steps or 1), warmup_steps + 1)
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps=warmup_steps, decay_steps=total, end_value=lr * min_lr_ratio
        )
    if schedule != "constant":
        raise ValueError(f"optim.schedule={schedule!r} must be 'constant' or 'cosine'")
    if warmup_steps <= 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)], [warmup_steps]
    )


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (not norms / biases)."""
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(optim: OptimConfig, total_steps: Optional[int] = None, *, lr: Optional[float] = None,
                   warmup_steps: Optional[int] = None, schedule: Optional[str] = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``optax.chain(clip_by_global_norm, adamw)`` with the warmup + constant|cosine schedule.

    Args:
        optim: the optim config section (b1, b2, eps, weight_decay, max_grad_norm, ...).
        total_steps: optimizer updates of the whole run (cosine decay length).
        lr / warmup_steps / schedule: overrides (the SFT chain uses sft.lr, constant).

    Returns:
        (tx, schedule): the schedule maps the update count (int) to the lr.
    """
    sched = make_schedule(
        optim.lr if lr is None else lr,
        optim.warmup_steps if warmup_steps is None else warmup_steps,
        optim.schedule if schedule is None else schedule,
        total_steps,
        optim.min_lr_ratio,
    )
    clip = optax.identity() if optim.max_grad_norm is None else optax.clip_by_global_norm(optim.max_grad_norm)
    tx = optax.chain(
        clip,
        optax.adamw(sched, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                    mask=_decay_mask),
    )
    return tx, sched


# ======================================================================================
# Distributed / model setup
# ======================================================================================


def _distributed_initialized() -> bool:
    try:
        from jax._src import distributed

        return distributed.global_state.client is not None
    except Exception:  # pragma: no cover - private API moved
        return False


def initialize_distributed(runtime: RuntimeConfig) -> bool:
    """``jax.distributed.initialize`` from ``runtime.coordinator/num_processes/process_id``.

    With no coordinator, a TPU pod (``TPU_WORKER_HOSTNAMES`` lists several hosts) is
    auto-detected by ``jax.distributed.initialize()``. Must run before jax's backend starts.
    Returns True when this process is part of a multi-process run. Idempotent.
    """
    if _distributed_initialized():
        return jax.process_count() > 1
    if runtime.coordinator:
        if runtime.num_processes is None or runtime.process_id is None:
            raise ValueError("runtime.coordinator needs runtime.num_processes and runtime.process_id")
        jax.distributed.initialize(
            coordinator_address=runtime.coordinator,
            num_processes=runtime.num_processes,
            process_id=runtime.process_id,
        )
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h]) > 1:
        jax.distributed.initialize()
        return True
    return False


def resolve_model_config(model_cfg) -> Any:
    """``Qwen3Config`` from ``cfg.model``: the checkpoint's config.json, else the preset with
    ``hf_overrides``."""
    from jax_rl.models.qwen3 import Qwen3Config, get_preset

    if model_cfg.checkpoint:
        import json

        hf = json.loads((Path(model_cfg.checkpoint) / "config.json").read_text())
        hf.update(model_cfg.hf_overrides)
        return Qwen3Config.from_hf(hf)
    return get_preset(model_cfg.preset, **model_cfg.hf_overrides)


def _tree_finite(tree: Any) -> jax.Array:
    """Scalar bool: every element of every leaf is finite (one cheap reduction per leaf, in jit)."""
    ok = jnp.bool_(True)
    for x in jax.tree.leaves(tree):
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _tree_where(pred: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _to_nested(tree: Any) -> dict:
    """Tree -> nested dict with string keys (Orbax-friendly, readable on disk)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out: dict = {}
    for path, leaf in flat:
        node = out
        keys = [_key_name(k) for k in path] or ["value"]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return out


def _from_nested(nested: dict, like: Any) -> Any:
    """Inverse of :func:`_to_nested` onto the structure of ``like``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for path, _ in flat:
        node = nested
        for k in [_key_name(k) for k in path] or ["value"]:
            node = node[k]
        leaves.append(node)
    return jax.tree.unflatten(treedef, leaves)


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


# ======================================================================================
# Train state
# ======================================================================================


@flax.struct.dataclass
class TrainState:
    """Everything the train step reads and writes (a pytree; donated to the step).

    Fields:
        params: ``nnx.State`` of the model's ``nnx.Param``s, fp32 master weights.
        opt_state: optax state of ``make_optimizer``'s chain (moments like the params).
        ewma_params: ``nnx.State`` like ``params`` (fp32, same shardings) for ``ppo_ewma``;
            None otherwise.
        ewma_count: fp32 scalar, the EWMA's total weight W (Hilton bias correction).
        ewma_streak: int32 scalar, consecutive steps with R below the reset threshold.
        version: int32 scalar, published versions (one per ``Learner.train_step``).
        step: int32 scalar, applied optimizer updates.
        rng: uint32 [2] PRNG key (split once per step; reserved for stochastic parts).
    """

    params: Any
    opt_state: Any
    ewma_params: Any
    ewma_count: jax.Array
    ewma_streak: jax.Array
    version: jax.Array
    step: jax.Array
    rng: jax.Array


# ======================================================================================
# Learner
# ======================================================================================


class Learner:
    """The sharded learner (docs/interfaces.md "Learner batch").

    Args:
        cfg: the run config (sections model, mesh, optim, loss, async, rollout.temperature,
            old_logits, checkpoint, runtime, sft, run.seed are used).
        mesh: a ``('data','fsdp','tensor','expert')`` mesh; default from ``cfg.mesh``.
        model_config: a ``Qwen3Config``; default from ``cfg.model`` (:func:`resolve_model_config`).
        init_params: initial params (an ``nnx.State`` of Params or the matching nested dict,
            numpy or jax arrays, e.g. from ``hf_io``); default: random init with ``run.seed``.

    Attributes:
        version (int), step (int), mesh, model_config, graphdef, state (:class:`TrainState`),
        state_shardings, skipped_steps (int: all-masked batches skipped).
    """

    def __init__(self, cfg: Config, mesh=None, model_config=None, init_params=None):
        from jax_rl.sharding import create_sharded_model, make_mesh

        initialize_distributed(cfg.runtime)
        self.cfg = cfg
        lc = cfg.loss
        self.mesh = mesh if mesh is not None else make_mesh(
            data=cfg.mesh.data, fsdp=cfg.mesh.fsdp, tensor=cfg.mesh.tensor, expert=cfg.mesh.expert
        )
        self.model_config = model_config if model_config is not None else resolve_model_config(cfg.model)
        self.correction = lc.correction
        self.K = int(cfg.async_.max_staleness)
        self.temperature = float(cfg.rollout.temperature)
        self.U = int(cfg.optim.minibatches)
        self.E = int(cfg.optim.ppo_epochs)
        self.m = int(cfg.optim.microbatches)
        self.skipped_steps = 0
        self._nonfinite_streak = 0  # consecutive train/SFT steps whose every update was non-finite
        self._is_main = jax.process_index() == 0
        self._replicated = NamedSharding(self.mesh, P())
        self._sft_pending = False
        self._sft_opt_state = None
        self._sft_count = 0
        self._resets = 0  # EWMA resets so far (host counter, checkpointed in metadata)
        self._ckptrs: dict[str, Any] = {}
        self._jits: dict[Any, Any] = {}

        model_kw = dict(dtype=jnp.dtype(cfg.model.dtype), param_dtype=jnp.float32,
                        moe_dispatch=cfg.model.moe_dispatch, remat=cfg.model.remat)
        params = None
        if init_params is not None:
            # no random init: abstract model (eval_shape) + the given values on the mesh
            from jax_rl.models.qwen3 import Qwen3ForCausalLM
            from jax_rl.sharding import state_shardings

            abs_model = nnx.eval_shape(lambda: Qwen3ForCausalLM(self.model_config, rngs=nnx.Rngs(0), **model_kw))
            self.graphdef, abs_params, abs_rest = nnx.split(abs_model, nnx.Param, ...)
            if not jax.tree.leaves(abs_rest):
                self._rest = abs_rest
                self.param_shardings = state_shardings(abs_params, self.mesh)
                params = self._place_params(init_params, abs_params)
        if params is None:
            model = create_sharded_model(self.model_config, self.mesh, seed=cfg.run.seed, **model_kw)
            self.graphdef, params, self._rest = nnx.split(model, nnx.Param, ...)
            del model
            self.param_shardings = jax.tree.map(lambda x: x.sharding, params)
            if init_params is not None:
                params = self._place_params(init_params, params)
        # compiled functions are shared by learners with the same config, model and mesh
        self._static_key = (
            (cfg.model_dump_json(), repr(self.model_config), self.mesh)
            if not jax.tree.leaves(self._rest) else None
        )

        total_updates = max(1, cfg.run.steps) * self.E * self.U
        self.tx, self.schedule = make_optimizer(cfg.optim, total_updates)
        self.ewma_beta = proximal.ewma_beta(self.K, lc.ewma_beta_rule, lc.ewma_beta)
        self._use_ewma = self.correction == "ppo_ewma"
        self._measure = bool(cfg.old_logits.measure_error) and self.correction in ("ppo_ewma", "linear_prox")
        self._use_store = self.correction == "exact" or self._measure

        self.state_shardings = self._make_state_shardings(params)
        self.state = self._init_state(params)
        self._logprob_jit = self._cached_jit(("logprobs",), lambda s: jax.jit(
            s._chunk_logprobs, in_shardings=(s.param_shardings, None, None)))
        self.store = None
        if self._use_store:
            from jax_rl.old_logits import SnapshotStore

            store_dir = getattr(cfg.old_logits, "dir", None) or (
                str(Path(cfg.run.dir) / "old_logits") if cfg.run.dir else None)
            self.store = SnapshotStore(self.K + 1, cfg.old_logits.store, store_dir)
            self.store.put(0, self.state.params)

    # ---------------------------------------------------------------------------------
    # setup helpers
    # ---------------------------------------------------------------------------------
    def _place_params(self, init_params: Any, like: Any) -> Any:
        """Put user-given params (State / Module / nested dict; numpy or jax) on the mesh."""
        if isinstance(init_params, nnx.Module):
            init_params = nnx.state(init_params, nnx.Param)
        if isinstance(init_params, nnx.State):
            init_params = nnx.to_pure_dict(init_params)
        given = _stringify(init_params)
        ref = _stringify(nnx.to_pure_dict(like))
        shard = _stringify(nnx.to_pure_dict(self.param_shardings))
        if jax.tree.structure(given) != jax.tree.structure(ref):
            raise ValueError(
                "init_params do not match the model's param tree: "
                f"got {jax.tree.structure(given)}, expected {jax.tree.structure(ref)}"
            )
        placed = jax.tree.map(_put, given, shard, ref)
        out = jax.tree.map(lambda x: x, like)  # fresh State containers
        nnx.replace_by_pure_dict(out, placed)
        return out

    def _make_state_shardings(self, params: Any) -> TrainState:
        psh = self.param_shardings
        abs_opt = jax.eval_shape(self.tx.init, params)
        opt_sh = optax.tree_map_params(
            self.tx, lambda _, s: s, abs_opt, psh,
            transform_non_params=lambda _: self._replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        rep = self._replicated
        return TrainState(
            params=psh,
            opt_state=opt_sh,
            ewma_params=psh if self._use_ewma else None,
            ewma_count=rep, ewma_streak=rep, version=rep, step=rep, rng=rep,
        )

    def _init_fn(self, params: Any) -> TrainState:
        return TrainState(
            params=params,
            opt_state=self.tx.init(params),
            ewma_params=jax.tree.map(lambda x: x.astype(jnp.float32), params) if self._use_ewma else None,
            ewma_count=jnp.float32(1.0),
            ewma_streak=jnp.int32(0),
            version=jnp.int32(0),
            step=jnp.int32(0),
            rng=jax.random.PRNGKey(self.cfg.run.seed),
        )

    def _init_state(self, params: Any) -> TrainState:
        fn = self._cached_jit(("init",), lambda s: jax.jit(
            s._init_fn, in_shardings=(s.param_shardings,), out_shardings=s.state_shardings))
        with jax.set_mesh(self.mesh):
            return fn(params)

    def _static_view(self) -> "Learner":
        """A shallow copy without the train state, store and checkpointers: what a cached
        jitted function may keep alive (traces read only config-derived attributes)."""
        v = copy.copy(self)
        for name in ("state", "store", "_sft_opt_state"):
            v.__dict__.pop(name, None)
        v._ckptrs, v._jits = {}, {}
        return v

    def _cached_jit(self, key: tuple, build):
        """A jitted function for ``key``, shared with other learners of the same static key.

        ``build(view)`` makes the function from a :meth:`_static_view` of this learner, so the
        module-level cache never keeps a learner's arrays alive.
        """
        if key in self._jits:
            return self._jits[key]
        full = None if self._static_key is None else (self._static_key, key)
        if full is not None and full in _JIT_CACHE:
            fn = _JIT_CACHE[full]
        else:
            fn = build(self._static_view())
            if full is not None:
                _JIT_CACHE[full] = fn
        self._jits[key] = fn
        return fn

    # ---------------------------------------------------------------------------------
    # properties
    # ---------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Published versions so far (params after n published updates are version n)."""
        return int(self.state.version)

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return int(self.state.step)

    @property
    def params(self) -> Any:
        """The live params (``nnx.State``; donated by the next train step: copy before keeping)."""
        return self.state.params

    def get_params(self, host: bool = False) -> Any:
        """A copy of the current params for the rollout side.

        Returns an ``nnx.State`` with the structure of ``nnx.split(model, nnx.Param)[1]``
        (what ``Qwen3Engine.load_params`` takes). ``host=False``: device arrays with the
        learner's shardings (a copy: the learner donates its own buffers). ``host=True``:
        numpy arrays (single-process only).
        """
        self._finish_sft()
        if host:
            if jax.process_count() > 1:
                raise ValueError("get_params(host=True) needs a single process; use device arrays")
            return jax.tree.map(lambda x: np.asarray(x), self.state.params)
        return jax.tree.map(lambda x: x.copy(), self.state.params)

    # ---------------------------------------------------------------------------------
    # forward
    # ---------------------------------------------------------------------------------
    def _model(self, params: Any):
        return nnx.merge(self.graphdef, params, self._rest)

    def _logprobs(self, params: Any, tokens: jax.Array, attention_mask: jax.Array,
                  return_entropy: bool = False):
        """[r, T] training-numerics log-probs (fp32 logits, temperature), out[:, 0] = 0; with
        ``return_entropy`` also the [r, T] entropy (nats) of each predicting distribution."""
        from jax_rl.models.qwen3 import sequence_logprobs

        return sequence_logprobs(self._model(params), tokens, attention_mask, temperature=self.temperature,
                                 return_entropy=return_entropy)

    def _chunk_logprobs(self, params: Any, tokens: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """Log-probs of a chunked batch [U, m, r, T] (one microbatch forward at a time)."""
        U, m, r, T = tokens.shape
        tk = tokens.reshape(U * m, r, T)
        am = attention_mask.reshape(U * m, r, T)
        if U * m == 1:
            out = self._logprobs(params, tk[0], am[0])[None]
        else:
            out = lax.map(lambda xs: self._logprobs(params, xs[0], xs[1]), (tk, am))
        return out.reshape(U, m, r, T)

    # ---------------------------------------------------------------------------------
    # batch placement
    # ---------------------------------------------------------------------------------
    def _layout(self, B: int, U: Optional[int] = None, m: Optional[int] = None) -> tuple[int, int, int]:
        U = self.U if U is None else U
        m = self.m if m is None else m
        if B % (U * m):
            raise BatchError(f"batch has B={B} rows, not a multiple of minibatches*microbatches={U * m}")
        return U, m, B // (U * m)

    def batch_sharding(self, r: int) -> NamedSharding:
        """Sharding of a chunked batch array [U, m, r, T]: rows over ``activation_batch``'s axes."""
        from jax_rl.sharding import logical_to_pspec

        spec = logical_to_pspec(("activation_batch",), shape=(r,), mesh=self.mesh)
        return NamedSharding(self.mesh, P(None, None, spec[0], None))

    def process_rows(self, batch: Mapping[str, np.ndarray], U: Optional[int] = None, m: Optional[int] = None
                     ) -> dict[str, np.ndarray]:
        """This process's rows of a GLOBAL batch [B, T] (what ``train_step(..., process_local=True)`` takes).

        The global batch is laid out [U, m, r, T]; the process owns the row range of ``r``
        that its devices hold in :meth:`batch_sharding`, in every (u, j) chunk.
        """
        B, T = np.shape(batch["tokens"])
        U, m, r = self._layout(B, U, m)
        lo, hi = self._local_row_range(r, T)
        return {k: np.asarray(v).reshape((U, m, r) + np.shape(v)[1:])[:, :, lo:hi].reshape((-1,) + np.shape(v)[1:])
                for k, v in batch.items()}

    def _local_row_range(self, r: int, T: int) -> tuple[int, int]:
        sh = self.batch_sharding(r)
        idx = sh.addressable_devices_indices_map((1, 1, r, T))
        los = [(i[2].start or 0) for i in idx.values()]
        his = [(r if i[2].stop is None else i[2].stop) for i in idx.values()]
        lo, hi = min(los), max(his)
        return lo, hi

    def _device_batch(self, batch: Mapping[str, np.ndarray], *, process_local: bool, U=None, m=None
                      ) -> tuple[dict[str, jax.Array], int]:
        """Host batch -> dict of global [U, m, r, T] arrays. Returns (arrays, r)."""
        B_local, T = np.shape(batch["tokens"])
        nproc = jax.process_count()
        if process_local and nproc > 1:
            U_, m_, r_local = self._layout(B_local, U, m)
            # every process owns an equal slice of each chunk's rows
            r = r_local * nproc
            lo, hi = self._local_row_range(r, T)
            if hi - lo != r_local:
                raise BatchError(
                    f"process-local batch: {r_local} rows per chunk on each of {nproc} processes do not match the "
                    f"mesh's batch sharding ({self.batch_sharding(r).spec} over {r} rows); pass the global batch "
                    "or a row count divisible by the batch axes"
                )
            U, m = U_, m_
        else:
            U, m, r = self._layout(B_local, U, m)
        sh = self.batch_sharding(r)
        gshape = (U, m, r, T)
        out = {}
        if nproc > 1:
            lo, hi = self._local_row_range(r, T)
        for k, v in batch.items():
            a = np.asarray(v)
            if process_local and nproc > 1:
                local = a.reshape(U, m, -1, T)
            elif nproc > 1:
                local = a.reshape(U, m, r, T)[:, :, lo:hi]
            else:
                out[k] = jax.device_put(a.reshape(gshape), sh)
                continue
            out[k] = jax.make_array_from_process_local_data(sh, np.ascontiguousarray(local), gshape)
        return out, r

    # ---------------------------------------------------------------------------------
    # the jitted step
    # ---------------------------------------------------------------------------------
    def _needs_prox_forward_linear(self) -> bool:
        return self.E * self.U > 1 or (self.m > 1 and not self.cfg.loss.keep_masked_in_denominator)

    def _retained(self, prox: jax.Array, b: dict) -> jax.Array:
        """Train-infer retained ratio R of the whole batch for pi_prox = ``prox``."""
        lc = self.cfg.loss
        U, m, r, T = prox.shape
        flat = lambda x: x.reshape(U * m, r, T)  # noqa: E731
        ti = jax.vmap(lambda p, bl, lm, tid: losses.train_infer_factor(p, bl, lm, lc, turn_ids=tid))(
            flat(prox), flat(b["behav_logp"]), flat(b["loss_mask"]), flat(b["turn_ids"])
        )
        nv = jnp.sum(ti.valid.astype(jnp.float32))
        nk = jnp.sum((ti.kept & ti.valid).astype(jnp.float32))
        return jnp.where(nv > 0, nk / jnp.maximum(nv, 1.0), 1.0)

    def _minibatch_grads(self, params, mb: dict, prox, exact, g):
        """Loss, grads and combined metrics of one minibatch ([m, r, T] arrays), accumulated
        over its m microbatches with the minibatch's global denominator."""
        lc = self.cfg.loss
        m, r, T = mb["tokens"].shape
        f2 = lambda x: x.reshape(m * r, T)  # noqa: E731
        denom = losses.loss_denominator(
            f2(mb["loss_mask"]), lc,
            prox_logp=None if prox is None else f2(prox),
            behav_logp=f2(mb["behav_logp"]),
            turn_ids=f2(mb["turn_ids"]),
        )

        def micro_loss(p, x, prox_j, exact_j):
            ent = None
            if lc.entropy_coef != 0.0:  # entropy bonus: one pass over the same logits
                logp, ent = self._logprobs(p, x["tokens"], x["attention_mask"], return_entropy=True)
            else:
                logp = self._logprobs(p, x["tokens"], x["attention_mask"])
            pl = prox_j if prox_j is not None else proximal.linear_prox_logp(x["behav_logp"], logp, x["versions"], g)
            return losses.policy_loss(
                logp, pl, x["behav_logp"], x["advantages"], x["loss_mask"], lc,
                turn_ids=x["turn_ids"], versions=x["versions"], current_version=g,
                exact_logp=exact_j, denominator=denom, entropy=ent,
            )

        vg = jax.value_and_grad(micro_loss, has_aux=True)

        def body(acc, xs):
            x, prox_j, exact_j = xs
            (loss, metr), grads = vg(params, x, prox_j, exact_j)
            acc_g, acc_l = acc
            acc_g = jax.tree.map(jnp.add, acc_g, grads)
            return (acc_g, acc_l + loss), metr

        if m == 1:
            x0 = {k: v[0] for k, v in mb.items()}
            (loss, metr), grads = vg(params, x0, None if prox is None else prox[0], None if exact is None else exact[0])
            return loss, grads, metr
        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, loss), metr = lax.scan(body, (zeros, jnp.float32(0.0)), (mb, prox, exact))
        return loss, grads, losses.combine_metrics(metr)

    def _train_core(self, state: TrainState, b: dict) -> tuple[TrainState, dict]:
        lc = self.cfg.loss
        corr = self.correction
        g = state.version
        params0 = state.params
        extra: dict[str, jax.Array] = {}
        ewma_params, ewma_count, streak = state.ewma_params, state.ewma_count, state.ewma_streak
        tokens, amask = b["tokens"], b["attention_mask"]

        if corr == "ppo":
            prox = b["behav_logp"]
        elif corr == "decoupled":
            prox = lax.stop_gradient(self._chunk_logprobs(params0, tokens, amask))
        elif corr == "linear_prox":
            if self._needs_prox_forward_linear():
                lp0 = lax.stop_gradient(self._chunk_logprobs(params0, tokens, amask))
                prox = proximal.linear_prox_logp(
                    b["behav_logp"].reshape(-1, tokens.shape[-1]), lp0.reshape(-1, tokens.shape[-1]),
                    b["versions"].reshape(-1, tokens.shape[-1]), g,
                ).reshape(tokens.shape)
            else:
                prox = None
        elif corr == "ppo_ewma":
            ew_lp = self._chunk_logprobs(ewma_params, tokens, amask)
            R = self._retained(ew_lp, b)
            reset, streak = proximal.reset_predicate(R, lc.ewma_reset_threshold, lc.ewma_reset_patience, streak)
            ewma_params, ewma_count = proximal.ewma_reset(ewma_params, params0, reset, ewma_count)
            prox = lax.cond(reset, lambda: self._chunk_logprobs(params0, tokens, amask), lambda: ew_lp)
            prox = lax.stop_gradient(prox)
            extra.update(ewma_reset=reset.astype(jnp.float32), ewma_retained=R)
        elif corr == "exact":
            prox = b["prox_logp"]
        else:  # pragma: no cover - config validation forbids it
            raise ValueError(f"unknown loss.correction {corr!r}")
        exact = b.get("old_logp")

        U = tokens.shape[0]

        def one_update(carry, i):
            params, opt_state, step = carry
            u = i % U
            take = lambda x: None if x is None else lax.dynamic_index_in_dim(x, u, 0, keepdims=False)  # noqa: E731
            mb = {k: take(b[k]) for k in BATCH_FIELDS}
            loss, grads, metr = self._minibatch_grads(params, mb, take(prox), take(exact), g)
            gnorm = optax.tree.norm(grads)
            updates, new_opt = self.tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            # a finite loss and gradient can still give non-finite params (a huge lr, an overflow)
            finite = jnp.isfinite(gnorm) & jnp.isfinite(loss) & _tree_finite(new_params)
            params = _tree_where(finite, new_params, params)
            opt_state = _tree_where(finite, new_opt, opt_state)
            lr = self.schedule(step)
            metr = dict(metr)
            metr.update(loss=loss, grad_norm=gnorm, lr=jnp.asarray(lr, jnp.float32),
                        nonfinite_updates=(~finite).astype(jnp.float32))
            return (params, opt_state, step + finite.astype(jnp.int32)), metr

        n_up = self.E * U
        (params, opt_state, step), metr = lax.scan(
            one_update, (params0, state.opt_state, state.step), jnp.arange(n_up, dtype=jnp.int32)
        )
        metrics = {k: (jnp.sum(v) if k == "nonfinite_updates" else jnp.mean(v)) for k, v in metr.items()}

        if self._use_ewma:
            new_ew, new_count = proximal.ewma_update(
                ewma_params, params, self.ewma_beta, ewma_count, lc.ewma_bias_correction
            )
            ew_ok = _tree_finite(new_ew) & jnp.isfinite(new_count)
            ewma_params = _tree_where(ew_ok, new_ew, ewma_params)
            ewma_count = jnp.where(ew_ok, new_count, ewma_count)
            extra["nonfinite_ewma"] = (~ew_ok).astype(jnp.float32)
            extra.update(ewma_beta=jnp.float32(self.ewma_beta), ewma_streak=streak.astype(jnp.float32))
        metrics.update(extra)
        metrics["tokens"] = jnp.sum(amask.astype(jnp.float32))
        metrics["loss_tokens"] = jnp.sum(b["loss_mask"].astype(jnp.float32))
        metrics["updates"] = jnp.float32(n_up)
        new_state = TrainState(
            params=params, opt_state=opt_state, ewma_params=ewma_params, ewma_count=ewma_count,
            ewma_streak=streak, version=g + 1, step=step, rng=jax.random.split(state.rng)[0],
        )
        return new_state, metrics

    def _batch_keys(self, have_old: bool) -> tuple[str, ...]:
        keys = list(BATCH_FIELDS)
        if self.correction == "exact":
            keys.append("prox_logp")
        if self._measure and have_old:
            keys.append("old_logp")
        return tuple(keys)

    def _train_jit(self, r: int, keys: tuple[str, ...]):
        bsh = self.batch_sharding(r)
        return self._cached_jit(("train", r, keys), lambda s: jax.jit(
            s._train_core,
            in_shardings=(s.state_shardings, {k: bsh for k in keys}),
            out_shardings=(s.state_shardings, s._replicated),
            donate_argnums=(0,),
        ))

    # ---------------------------------------------------------------------------------
    # public API
    # ---------------------------------------------------------------------------------
    def train_step(self, batch: Mapping[str, Any], *, process_local: bool = False) -> dict[str, float]:
        """Train on one batch: ``ppo_epochs x minibatches`` updates, then publish one version.

        Args:
            batch: learner batch (:data:`BATCH_FIELDS`, numpy [B, T]; optional ``old_logp``
                [B, T] exact old log-probs, used instead of the snapshot route under
                ``exact`` and as the reference of ``measure_error``). B must be a multiple of
                ``minibatches*microbatches`` (of the process's rows with ``process_local``).
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
        self._finish_sft()
        g = self.version
        b = validate_batch(
            batch, max_seq_len=self.cfg.optim.max_seq_len, vocab_size=self.model_config.vocab_size,
            row_divisor=self.U * self.m, current_version=g,
            require_versions=self.correction == "exact" and "old_logp" not in batch,
        )
        b.pop("prox_logp", None)
        b, n_loss = self._sync_global(b)
        if n_loss == 0:
            self.skipped_steps += 1
            if self._is_main:
                log.warning("learner: batch without loss tokens skipped (%d so far)", self.skipped_steps)
            return {"skipped": 1.0, "skipped_steps": float(self.skipped_steps), "version": float(g),
                    "step": float(self.step), "step_time_s": time.perf_counter() - t0, "tokens": 0.0,
                    "tokens_per_s": 0.0}
        have_old = "old_logp" in b
        dev, r = self._device_batch(b, process_local=process_local)
        old_stats: dict[str, float] = {}
        if self.correction == "exact" and have_old:
            dev["prox_logp"] = dev.pop("old_logp")
        elif self.store is not None and (self.correction == "exact" or not have_old):
            from jax_rl.old_logits import snapshot_logprobs, versions_needed

            needed = versions_needed(b["versions"], b["loss_mask"])
            old, old_stats = snapshot_logprobs(
                self.store, self._logprob_jit, tokens=dev["tokens"], attention_mask=dev["attention_mask"],
                versions=dev["versions"], needed=needed, current_version=g,
                current_params=self.state.params, shardings=self.param_shardings,
            )
            dev["prox_logp" if self.correction == "exact" else "old_logp"] = old
            have_old = True
        keys = self._batch_keys(have_old)
        dev = {k: dev[k] for k in keys}
        with jax.set_mesh(self.mesh):
            self.state, metrics = self._train_jit(r, keys)(self.state, dev)
        if self.store is not None:
            self.store.put(g + 1, self.state.params)
            old_stats["old_logits_bytes"] = float(self.store.nbytes)
            old_stats["old_logits_versions"] = float(len(self.store))
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out.update(old_stats)
        dt = time.perf_counter() - t0
        out.update(step_time_s=dt, tokens_per_s=out["tokens"] / max(dt, 1e-9), version=float(g + 1),
                   step=float(self.step), skipped=0.0, skipped_steps=float(self.skipped_steps))
        if self._use_ewma:
            self._resets += int(out.get("ewma_reset", 0.0) > 0)
            out["ewma_resets"] = float(self._resets)
        self._note_nonfinite(out, "train_step", int(out["updates"]), g + 1)
        return out

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

    def _sync_global(self, b: dict) -> tuple[dict, int]:
        """Multi-process: pad T to the global max and count loss tokens over all processes."""
        n_loss = int(b["loss_mask"].sum())
        if jax.process_count() == 1:
            return b, n_loss
        from jax.experimental import multihost_utils

        T = b["tokens"].shape[1]
        allv = np.asarray(multihost_utils.process_allgather(np.array([T, n_loss], np.int64))).reshape(-1, 2)
        T_glob, n_glob = int(allv[:, 0].max()), int(allv[:, 1].sum())
        if T_glob > T:
            pad = {"tokens": 0, "versions": -1, "turn_ids": -1}
            b = {k: np.pad(v, ((0, 0), (0, T_glob - T)), constant_values=pad.get(k, 0)) for k, v in b.items()}
        return b, n_glob

    def logprobs(self, batch: Mapping[str, Any], params: Any = None) -> np.ndarray:
        """Training-numerics log-probs [B, T] float32 of ``batch['tokens']`` (needs ``tokens``
        and ``attention_mask``; ``out[:, 0] = 0``, 0 on padding) under ``params`` (default:
        current). Single-process result on the host (multi-process: a global jax.Array)."""
        tok = np.asarray(batch["tokens"])
        B, T = tok.shape
        sub = {"tokens": tok.astype(np.int32), "attention_mask": np.asarray(batch["attention_mask"], bool)}
        U, m = (self.U, self.m) if B % (self.U * self.m) == 0 else (1, 1)
        dev, r = self._device_batch(sub, process_local=False, U=U, m=m)
        with jax.set_mesh(self.mesh):
            out = self._logprob_jit(self.state.params if params is None else params, dev["tokens"], dev["attention_mask"])
        if jax.process_count() > 1:
            return out
        return np.asarray(out).reshape(B, T)

    def loss_and_grads(self, batch: Mapping[str, Any]) -> tuple[float, Any, dict]:
        """Loss, grads (an ``nnx.State`` like the params, sharded like them) and metrics of the
        FIRST minibatch of ``batch`` at the current params, with microbatch accumulation and the
        correction mode's pi_prox (``ppo``/``decoupled``/``linear_prox``; for tests and
        debugging; ``ppo_ewma``/``exact`` use behav_logp as pi_prox here). No state changes."""
        b = validate_batch(batch, max_seq_len=self.cfg.optim.max_seq_len, vocab_size=self.model_config.vocab_size,
                           row_divisor=self.U * self.m)
        dev, r = self._device_batch({k: b[k] for k in BATCH_FIELDS}, process_local=False)
        bsh = self.batch_sharding(r)

        def build(s):
            def fn(params, version, d):
                mb = {k: v[0] for k, v in d.items()}
                if s.correction == "decoupled" or (s.correction == "linear_prox" and s._needs_prox_forward_linear()):
                    lp0 = lax.stop_gradient(s._chunk_logprobs(params, d["tokens"], d["attention_mask"]))[0]
                    if s.correction == "linear_prox":
                        T = lp0.shape[-1]
                        prox = proximal.linear_prox_logp(mb["behav_logp"].reshape(-1, T), lp0.reshape(-1, T),
                                                         mb["versions"].reshape(-1, T), version).reshape(lp0.shape)
                    else:
                        prox = lp0
                elif s.correction == "linear_prox":
                    prox = None
                else:
                    prox = mb["behav_logp"]
                return s._minibatch_grads(params, mb, prox, None, version)

            return jax.jit(
                fn, in_shardings=(s.param_shardings, s._replicated, {k: bsh for k in BATCH_FIELDS}),
                out_shardings=(s._replicated, s.param_shardings, s._replicated),
            )

        fn = self._cached_jit(("grads", r), build)
        with jax.set_mesh(self.mesh):
            loss, grads, metr = fn(self.state.params, self.state.version, dev)
        return float(loss), grads, {k: float(v) for k, v in metr.items()}

    # ---------------------------------------------------------------------------------
    # SFT
    # ---------------------------------------------------------------------------------
    def sft_step(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One supervised step: mean cross-entropy over ``loss_mask`` tokens.

        Args:
            batch: ``tokens`` int [B, T], ``attention_mask`` bool [B, T], ``loss_mask`` bool
                [B, T] (right-padded; loss_mask[:, 0] False). B a multiple of
                ``optim.microbatches`` (used for accumulation; the loss is normalised by the
                batch's total loss tokens).

        Uses its own optax chain (clip ``optim.max_grad_norm``, AdamW with ``sft.lr`` and
        ``sft.warmup_steps``, constant), whose state lives outside the TrainState (not
        checkpointed). Version and step do not change; the first RL step afterwards resets
        the EWMA to the SFT params and re-snapshots the current version.

        Returns:
            ``{"sft_loss", "sft_tokens", "grad_norm", "lr", "nonfinite_updates", "nonfinite_streak",
            "step_time_s", "tokens_per_s"}``. A non-finite loss, gradient or update is skipped
            (params kept) with a warning.

        Raises:
            NonFiniteTrainingError: ``optim.max_skipped_steps`` non-finite steps in a row.
        """
        t0 = time.perf_counter()
        sub = {k: batch[k] for k in ("tokens", "attention_mask", "loss_mask")}
        B, T = np.shape(sub["tokens"])
        full = dict(sub, behav_logp=np.zeros((B, T), np.float32), versions=np.full((B, T), -1, np.int32),
                    turn_ids=np.full((B, T), -1, np.int32), advantages=np.zeros((B, T), np.float32))
        b = validate_batch(full, max_seq_len=self.cfg.optim.max_seq_len, vocab_size=self.model_config.vocab_size,
                           row_divisor=self.m)
        n_loss = int(b["loss_mask"].sum())
        if n_loss == 0:
            return {"skipped": 1.0, "sft_loss": 0.0, "sft_tokens": 0.0, "step_time_s": time.perf_counter() - t0}
        sft_tx, sft_sched = make_optimizer(self.cfg.optim, None, lr=self.cfg.sft.lr,
                                           warmup_steps=self.cfg.sft.warmup_steps, schedule="constant")
        if self._sft_opt_state is None:
            opt_sh = optax.tree_map_params(
                sft_tx, lambda _, s: s, jax.eval_shape(sft_tx.init, self.state.params), self.param_shardings,
                transform_non_params=lambda _: self._replicated, is_leaf=lambda x: isinstance(x, NamedSharding),
            )
            self._sft_opt_sh = opt_sh
            with jax.set_mesh(self.mesh):
                self._sft_opt_state = jax.jit(sft_tx.init, out_shardings=opt_sh)(self.state.params)
        dev, r = self._device_batch({k: b[k] for k in ("tokens", "attention_mask", "loss_mask")},
                                    process_local=False, U=1, m=self.m)
        key = ("sft", r)
        if key not in self._jits:
            bsh = self.batch_sharding(r)

            def fn(params, opt_state, count, d):
                n = jnp.maximum(jnp.sum(d["loss_mask"].astype(jnp.float32)), 1.0)

                def mloss(p, x):
                    lp = self._logprobs(p, x["tokens"], x["attention_mask"])
                    return -jnp.sum(jnp.where(x["loss_mask"], lp, 0.0)) / n

                vg = jax.value_and_grad(mloss)
                xs = {k: v[0] for k, v in d.items()}  # [m, r, T]

                def body(acc, x):
                    l, gr = vg(params, x)
                    return (jax.tree.map(jnp.add, acc[0], gr), acc[1] + l), None

                (grads, loss), _ = lax.scan(body, (jax.tree.map(jnp.zeros_like, params), jnp.float32(0)), xs)
                gnorm = optax.tree.norm(grads)
                upd, new_opt = sft_tx.update(grads, opt_state, params)
                new_p = optax.apply_updates(params, upd)
                finite = jnp.isfinite(gnorm) & jnp.isfinite(loss) & _tree_finite(new_p)
                return (_tree_where(finite, new_p, params), _tree_where(finite, new_opt, opt_state),
                        {"sft_loss": loss, "grad_norm": gnorm, "lr": jnp.asarray(sft_sched(count), jnp.float32),
                         "nonfinite_updates": (~finite).astype(jnp.float32)})

            self._jits[key] = jax.jit(
                fn,
                in_shardings=(self.param_shardings, self._sft_opt_sh, self._replicated,
                              {k: bsh for k in ("tokens", "attention_mask", "loss_mask")}),
                out_shardings=(self.param_shardings, self._sft_opt_sh, self._replicated),
                donate_argnums=(0, 1),
            )
        with jax.set_mesh(self.mesh):
            params, self._sft_opt_state, metr = self._jits[key](
                self.state.params, self._sft_opt_state, jnp.int32(self._sft_count), dev)
        self.state = self.state.replace(params=params)
        self._sft_pending = True
        out = {k: float(v) for k, v in jax.device_get(metr).items()}
        self._sft_count += int(out["nonfinite_updates"] == 0)  # like AdamW's count: applied updates
        dt = time.perf_counter() - t0
        out.update(sft_tokens=float(n_loss), step_time_s=dt, tokens_per_s=float(b["attention_mask"].sum()) / dt)
        self._note_nonfinite(out, "sft_step", 1, self.version)
        return out

    def _finish_sft(self) -> None:
        """After SFT steps: theta_bar <- theta (W = 1, streak 0) and re-snapshot the current version."""
        if not self._sft_pending:
            return
        self._sft_pending = False
        if self._use_ewma:
            with jax.set_mesh(self.mesh):
                ew = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.float32), p),
                             in_shardings=(self.param_shardings,), out_shardings=self.param_shardings)(self.state.params)
            self.state = self.state.replace(
                ewma_params=ew,
                ewma_count=jax.device_put(jnp.float32(1.0), self._replicated),
                ewma_streak=jax.device_put(jnp.int32(0), self._replicated),
            )
        if self.store is not None:
            self.store.put(self.version, self.state.params)

    # ---------------------------------------------------------------------------------
    # checkpoints
    # ---------------------------------------------------------------------------------
    def _checkpointer(self, ckpt_dir: Optional[str | Path]):
        from jax_rl.checkpoint import Checkpointer

        d = ckpt_dir or self.cfg.checkpoint.dir or (
            str(Path(self.cfg.run.dir) / "checkpoints") if self.cfg.run.dir else None)
        if d is None:
            raise ValueError("no checkpoint dir: pass ckpt_dir or set checkpoint.dir / run.dir")
        d = str(Path(d).absolute())
        if d not in self._ckptrs:
            c = self.cfg.checkpoint
            self._ckptrs[d] = Checkpointer(d, every=c.every, max_to_keep=c.max_to_keep, async_save=c.async_save)
        return self._ckptrs[d]

    def _metadata(self, extra: Optional[dict], rl_step: Optional[int] = None) -> dict:
        return {
            "rl_step": int(self.version if rl_step is None else rl_step),
            "version": self.version,
            "opt_step": self.step,
            "step": self.step,  # = opt_step (kept for checkpoints read by older code)
            "config_hash": config_hash(self.cfg),
            "model_arch": self.model_config.to_hf(),
            "correction": self.correction,
            "skipped_steps": self.skipped_steps,
            "snapshot_versions": self.store.versions if self.store is not None else [],
            "ewma_resets": self._resets,
            "process_count": jax.process_count(),
            "runtime": dict(extra or {}),
        }

    def save(self, ckpt_dir: Optional[str | Path] = None, extra_metadata: Optional[dict] = None, *,
             wait: bool = False, rl_step: Optional[int] = None) -> bool:
        """Save a checkpoint (async unless ``wait``) in the step dir ``<ckpt_dir>/<rl_step>``.

        Items: state (params, opt_state, version, step, rng, ewma count/streak), ewma
        (``ppo_ewma``), snapshots (snapshot store), metadata (JSON: ``rl_step``, ``version``,
        ``opt_step`` (optimizer updates), model/correction identity; ``extra_metadata`` goes
        under ``"runtime"``: buffer state, rollout counters). Re-saving the same step replaces
        that checkpoint. Every process must call it.

        Args:
            rl_step: the RL step this state is at (the runtime's loop counter); the step dir's
                name. None (a learner used on its own) names it by the version.

        Raises:
            jax_rl.checkpoint.CheckpointDiskFullError: not enough disk space (one line; earlier
                steps intact).
        """
        self._finish_sft()
        ck = self._checkpointer(ckpt_dir)
        st = self.state
        state_item = _to_nested({"params": st.params, "opt_state": st.opt_state, "version": st.version,
                                 "step": st.step, "rng": st.rng, "ewma_count": st.ewma_count,
                                 "ewma_streak": st.ewma_streak})
        ewma_item = _to_nested({"params": st.ewma_params}) if self._use_ewma else None
        snaps = None
        if self.store is not None and len(self.store):
            snaps = {k: _to_nested(v) for k, v in self.store.export(self.param_shardings).items()}
        v = self.version if rl_step is None else int(rl_step)
        if v in ck.all_steps():
            ck.wait()
            ck._mgr.delete(v)
        ok = ck.save(v, state=state_item, metadata=self._metadata(extra_metadata, v), ewma=ewma_item,
                     snapshots=snaps)
        if wait:
            ck.wait()
        return ok

    def maybe_save(self, ckpt_dir: Optional[str | Path] = None, extra_metadata: Optional[dict] = None) -> bool:
        """Save when ``checkpoint.every`` divides the current version (> 0)."""
        ck = self._checkpointer(ckpt_dir)
        if ck.should_save(self.version):
            return self.save(ckpt_dir, extra_metadata)
        return False

    def restore(self, ckpt_dir: Optional[str | Path] = None, step: Optional[int] = None) -> dict:
        """Restore a checkpoint onto this learner's mesh (any shape).

        With ``step=None`` the newest step is validated (item dirs present, metadata JSON
        parses, the arrays restore); a bad one is skipped with a one-line warning and the next
        newest is tried, until one restores. With an explicit ``step`` only that one is tried.

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
        from jax_rl.checkpoint import CheckpointCorruptError, CheckpointMismatchError, _one_line

        ck = self._checkpointer(ckpt_dir)
        if step is not None:
            ck._resolve(step)  # FileNotFoundError naming the steps there
            candidates = [int(step)]
        else:
            ck._resolve(None)
            candidates = sorted(ck.all_steps(), reverse=True)
        skipped: list = []
        for s in candidates:
            try:
                meta = self._restore_step(ck, s)
            except (CheckpointMismatchError, KeyboardInterrupt):
                raise
            except Exception as e:
                why = str(e) if isinstance(e, CheckpointCorruptError) else \
                    f"checkpoint {ck.directory / str(s)} failed to restore ({_one_line(e)})"
                if step is not None:
                    raise CheckpointCorruptError(why) from None
                log.warning("%s; trying an older step", why)
                skipped.append([s, why])
                continue
            meta["checkpoint_step"] = s
            meta["skipped_checkpoints"] = skipped
            return meta
        raise CheckpointCorruptError(
            f"no restorable checkpoint in {ck.directory}: " + "; ".join(w for _, w in skipped))

    def _restore_step(self, ck, step: int) -> dict:
        from jax_rl.checkpoint import abstract_like, check_compatible

        meta = ck.check_step(step)
        check_compatible(meta, model_arch=self.model_config.to_hf(), correction=self.correction,
                         directory=ck.directory)
        snap_versions = [int(v) for v in meta.get("snapshot_versions", [])]
        need = (("ewma",) if self._use_ewma else ()) + (("snapshots",) if self.store is not None and snap_versions else ())
        if need:
            ck.check_step(step, need)
        st, sh = self.state, self.state_shardings
        like = {"params": st.params, "opt_state": st.opt_state, "version": st.version, "step": st.step,
                "rng": st.rng, "ewma_count": st.ewma_count, "ewma_streak": st.ewma_streak}
        like_sh = {"params": sh.params, "opt_state": sh.opt_state, "version": sh.version, "step": sh.step,
                   "rng": sh.rng, "ewma_count": sh.ewma_count, "ewma_streak": sh.ewma_streak}
        target = _to_nested(abstract_like(like, like_sh))
        ewma_t = _to_nested(abstract_like({"params": st.params}, {"params": sh.params})) if self._use_ewma else None
        snap_t = None
        if self.store is not None and snap_versions:
            one = _to_nested(abstract_like(st.params, self.param_shardings))
            snap_t = {f"v{v}": one for v in snap_versions}
        out = ck.restore(step, state=target, ewma=ewma_t, snapshots=snap_t)
        r = _from_nested(out["state"], like)
        self.state = TrainState(
            params=r["params"], opt_state=r["opt_state"],
            ewma_params=_from_nested(out["ewma"], {"params": st.params})["params"] if self._use_ewma else None,
            ewma_count=r["ewma_count"], ewma_streak=r["ewma_streak"], version=r["version"], step=r["step"],
            rng=r["rng"],
        )
        if self.store is not None:
            if snap_t is not None:
                self.store.load({k: _from_nested(v, st.params) for k, v in out["snapshots"].items()})
            else:
                for v in list(self.store.versions):
                    self.store.evict(v)
                self.store.put(self.version, self.state.params)
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self._resets = int(meta.get("ewma_resets", 0))
        self._sft_pending = False
        return meta

    def delete_checkpoints_after(self, step: int, ckpt_dir: Optional[str | Path] = None) -> list[int]:
        """Delete the checkpoint steps newer than ``step`` (primary process); returns them."""
        if jax.process_index() != 0:
            return []
        return self._checkpointer(ckpt_dir).delete_after(step)

    def wait_for_checkpoints(self) -> None:
        """Block until every async save has been committed."""
        for c in self._ckptrs.values():
            c.wait()

    def close(self) -> None:
        """Finish pending checkpoint writes and release the snapshot store."""
        for c in self._ckptrs.values():
            c.close()
        self._ckptrs.clear()
        if self.store is not None:
            self.store.close()


def _stringify(tree: Any) -> Any:
    """Nested dict with string keys (so int and str layer keys compare equal)."""
    if isinstance(tree, Mapping):
        return {str(k): _stringify(v) for k, v in tree.items()}
    return tree


def _put(value: Any, sharding: Any, ref: Any) -> jax.Array:
    a = np.asarray(value) if not isinstance(value, jax.Array) else value
    if tuple(a.shape) != tuple(ref.shape):
        raise ValueError(f"init_params leaf has shape {a.shape}; the model expects {ref.shape}")
    return jax.device_put(jnp.asarray(a, jnp.float32) if isinstance(a, jax.Array) else a.astype(np.float32), sharding)
