"""The learner's recipe, in one place: what a config builds for the train step.

:func:`learner_spec` is used by :class:`jax_rl.learner.learner.Learner` (real arrays on the mesh, which
the dry run ``jax-rl train --dry-run`` compiles) and by ``jax-rl compile`` (abstract shapes on a
TPU topology): the model split, the param shardings, the optimizer and its schedule, the
correction strategy, the routing-replay policy, the train-state shardings and the initial state.
So the program ``jax-rl compile`` sizes is the program training runs, as MaxText's
``train_compile.py`` shares its state setup with ``train.py``.

:func:`make_sft_optimizer` is the SFT phase's optimizer (:class:`jax_rl.learner.sft.SftRunner` and
``jax-rl compile``'s ``sft_step``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
from flax import nnx

from jax_rl.learner.batch import abstract_batch
from jax_rl.checkpoint import abstract_like
from jax_rl.config import Config, ConfigError
from jax_rl.learner.correction import Correction, make_correction, plan_host_inputs
from jax_rl.model_builder import abstract_model_split, create_sharded_model, learner_model_kwargs
from jax_rl.placement import place_params
from jax_rl.routing_replay import RoutingReplay
from jax_rl.sharding import make_mesh, state_shardings
from jax_rl.learner.train_step import (TrainState, init_train_state, initial_state, make_optimizer,
                               train_state_shardings)

__all__ = ["LearnerSpec", "learner_spec", "total_updates", "make_sft_optimizer", "learner_batch_spec",
           "scorer_placement"]


@dataclasses.dataclass
class LearnerSpec:
    """The learner's pieces for one config, model and mesh (:func:`learner_spec`).

    Attributes:
        graphdef / rest: the model's static graph and non-param variables (``nnx.split``).
        params: the params: an ``nnx.State`` of device arrays, or of ``jax.ShapeDtypeStruct``
            (abstract).
        param_shardings: a tree like ``params`` of ``NamedSharding`` on the mesh.
        tx / schedule: the RL optimizer chain and its learning-rate schedule (:func:`make_optimizer`).
        strategy: the correction strategy (``loss.correction``).
        routing: the routing-replay policy (``moe.routing_replay``).
        state: the step-0 :class:`jax_rl.learner.train_step.TrainState` (arrays, or ShapeDtypeStructs
            with their shardings when abstract).
        state_shardings: the TrainState's shardings.
    """

    graphdef: Any
    rest: Any
    params: Any
    param_shardings: Any
    tx: Any
    schedule: Any
    strategy: Correction
    routing: RoutingReplay
    state: TrainState
    state_shardings: TrainState


def total_updates(cfg: Config) -> int:
    """Optimizer updates over the run: ``max(1, run.steps) * optim.ppo_epochs * optim.minibatches``."""
    return max(1, cfg.run.steps) * int(cfg.optim.ppo_epochs) * int(cfg.optim.minibatches)


def make_sft_optimizer(cfg: Config):
    """``(tx, schedule)`` of the SFT phase: the RL optimizer's chain (``optim.*``: AdamW, clipping,
    weight decay) at ``sft.lr`` with ``sft.warmup_steps`` of warmup, then constant."""
    return make_optimizer(cfg.optim, None, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps, schedule="constant")


def learner_batch_spec(strategy: Correction, routing: RoutingReplay, model_config: Any, shape: tuple,
                       sharding: Any):
    """The abstract learner batch (``jax.ShapeDtypeStruct`` fields, :func:`jax_rl.learner.batch.abstract_batch`)
    the run's train step reads, of ``shape`` = [U, m, r, T] with ``sharding``: ``prox_logp`` under
    ``exact``, ``old_logp`` when an approximate mode measures its error against the learner's
    snapshot store, ``routes`` [U, m, r, T, n_moe_layers, k] when the routing-replay policy records
    them. Used by :meth:`jax_rl.learner.learner.Learner.abstract_batch` (the dry run) and ``jax-rl compile``,
    so both lower the program training runs."""
    plan = plan_host_inputs(strategy, given=True, store=False)  # the fields, as the learner's host step fills them
    return abstract_batch(tuple(shape), sharding, prox=plan.field == "prox_logp", old=plan.field == "old_logp",
                          routes=routing.route_spec(model_config))


def scorer_placement(cfg: Config, model_config: Any, devices: Any, model_kw: Optional[dict] = None):
    """``(mesh, abstract params, param shardings)`` of an old-logit scorer on its own ``devices``
    (``placement.scorer``): a ``('data','fsdp','tensor','expert')`` mesh with fsdp = all of them and
    the learner's fp32 params sharded by the learner's logical rules there. Used by
    :meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.make_scorer` and ``jax-rl compile``'s ``score_step``."""
    mesh = make_mesh(fsdp=-1, devices=devices)
    _, abs_params, _ = abstract_model_split(model_config, **(learner_model_kwargs(cfg) if model_kw is None
                                                             else dict(model_kw)))
    return mesh, abs_params, state_shardings(abs_params, mesh)


def learner_spec(cfg: Config, model_config: Any, mesh: Any, *, abstract: bool, init_params: Any = None,
                 model_kw: Optional[dict] = None) -> LearnerSpec:
    """Build the learner's recipe for ``cfg`` on ``mesh``.

    Args:
        model_config: the ``Qwen3Config`` (:func:`jax_rl.model_builder.resolve_model_config`).
        mesh: a ``('data','fsdp','tensor','expert')`` mesh (devices of this host, or of a TPU
            topology when ``abstract``).
        abstract: True: shapes only (nothing allocated; ``jax-rl compile``); False: the params
            built directly in their sharded layout and the initial state on the mesh.
        init_params: initial params (an ``nnx.State`` of Params or the matching nested dict, numpy
            or jax arrays; either decoder-layer layout); default random init with ``run.seed``.
            Not with ``abstract``.
        model_kw: the model's build options (default :func:`jax_rl.model_builder.learner_model_kwargs`).

    Raises:
        jax_rl.config.ConfigError: routing replay on a dense model; an abstract model with
            non-parameter state.
        ValueError: ``init_params`` that do not match the model's param tree, or with ``abstract``.
    """
    if abstract and init_params is not None:
        raise ValueError("learner_spec: init_params need abstract=False")
    kw = learner_model_kwargs(cfg) if model_kw is None else dict(model_kw)
    strategy = make_correction(cfg)
    routing = RoutingReplay.from_config(cfg, model_config)
    params = None
    if abstract or init_params is not None:  # no random init: the abstract model (+ the given values)
        graphdef, abs_params, rest = abstract_model_split(model_config, **kw)
        if abstract and jax.tree.leaves(rest):
            raise ConfigError("the model has non-parameter state; jax-rl compile handles parameter-only models")
        if not jax.tree.leaves(rest):
            param_shardings = state_shardings(abs_params, mesh)
            params = abs_params if abstract else place_params(init_params, abs_params, param_shardings)
    if params is None:
        model = create_sharded_model(model_config, mesh, seed=cfg.run.seed, **kw)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        del model
        param_shardings = jax.tree.map(lambda x: x.sharding, params)
        if init_params is not None:
            params = place_params(init_params, params, param_shardings)
    tx, schedule = make_optimizer(cfg.optim, total_updates(cfg))
    state_sh = train_state_shardings(tx, strategy, param_shardings, params, mesh)
    if abstract:
        state = abstract_like(jax.eval_shape(lambda p: initial_state(tx, strategy, p), params), state_sh)
    else:
        with jax.set_mesh(mesh):
            state = init_train_state(tx, strategy, params, state_sh)
    return LearnerSpec(graphdef=graphdef, rest=rest, params=params, param_shardings=param_shardings, tx=tx,
                       schedule=schedule, strategy=strategy, routing=routing, state=state,
                       state_shardings=state_sh)
