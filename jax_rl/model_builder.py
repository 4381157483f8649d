"""Building the model on a mesh: the one place that resolves the mesh, the model config and the
abstract (``eval_shape``) model from a run config (MaxText's ``model_creation_utils``: above both
``sharding.py``, which knows no model, and ``models/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jax_rl.config import Config
from jax_rl.models.expert_parallel import resolve_moe_matmul
from jax_rl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, get_preset, model_kwargs, resolve_attention
from jax_rl.placement import resolve_roles
from jax_rl.sharding import make_mesh, state_shardings

__all__ = ["resolve_mesh", "resolve_model_config", "model_kwargs_for", "learner_model_kwargs", "rollout_model_kwargs",
           "layers_stacked", "abstract_model_split", "abstract_model", "create_sharded_model"]


def resolve_mesh(cfg: Config, mesh=None, devices=None):
    """``mesh`` if given, else the ``('data','fsdp','tensor','expert')`` mesh of ``cfg.mesh`` over
    ``devices`` (default: the learner's devices, ``placement.*`` resolved by
    :func:`jax_rl.placement.resolve_roles`)."""
    if mesh is not None:
        return mesh
    if devices is None:
        pl = cfg.placement
        if pl.learner is not None or pl.rollout is not None or pl.scorer is not None:
            devices = resolve_roles(cfg).learner
    m = cfg.mesh
    kw = {} if devices is None else {"devices": devices}
    return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, expert=m.expert, **kw)


def resolve_model_config(model_cfg, model_config: Optional[Any] = None) -> Any:
    """``Qwen3Config`` from ``cfg.model``: the checkpoint's config.json, else the preset with
    ``hf_overrides`` (``model_config`` if already given)."""
    if model_config is not None:
        return model_config
    if model_cfg.checkpoint:
        hf = json.loads((Path(model_cfg.checkpoint) / "config.json").read_text())
        hf.update(model_cfg.hf_overrides)
        return Qwen3Config.from_hf(hf)
    return get_preset(model_cfg.preset, **model_cfg.hf_overrides)


MODEL_ROLES = ("learner", "rollout")


def layers_stacked(model_config, scan_layers: bool) -> bool:
    """Whether ``Qwen3ForCausalLM(model_config, scan_layers=scan_layers)`` stores its decoder
    layers stacked [L, ...] (``params["layers"][name]``) rather than one subtree per layer
    (``params["layers"][i]``): ``scan_layers`` and every layer of one kind (a mixed dense/MoE
    stack stays unrolled), the model's own rule."""
    kinds = {model_config.layer_is_moe(i) for i in range(model_config.num_hidden_layers)}
    return bool(scan_layers) and len(kinds) == 1


def model_kwargs_for(cfg: Config, role: str = "learner") -> dict:
    """``Qwen3ForCausalLM`` keyword arguments for one side of a run, from ``cfg.model``.

    Both sides get the same ``scan_layers`` and ``moe_dispatch`` (the params tree the learner
    publishes must be the one every rollout engine was built for), ``attention`` resolved
    (``auto`` -> ``splash`` on a TPU backend, ``xla`` elsewhere, by ``jax.default_backend()``) and
    ``moe_matmul`` resolved the same way (``auto`` -> ``megablox`` on a TPU, else ``ragged_dot``).

    ``role="learner"``: learner numerics: compute dtype ``model.dtype``, fp32 params,
    ``remat_policy`` (``model.remat`` folded in). ``role="rollout"``: what
    ``rollout.engine.Qwen3Engine(model_kwargs=...)`` takes: no dtypes (the engine's ``dtype``,
    ``rollout.dtype``, sets compute and params) and no remat (the engine never differentiates).

    Raises:
        ValueError: ``role`` is not ``"learner"`` or ``"rollout"``.
    """
    if role not in MODEL_ROLES:
        raise ValueError(f"role must be one of {MODEL_ROLES}, got {role!r}")
    kw = model_kwargs(cfg.model)
    kw["attention"] = resolve_attention(kw["attention"])
    kw["moe_matmul"] = resolve_moe_matmul(kw["moe_matmul"])
    if role == "rollout":
        kw.pop("remat_policy")
        return kw
    return dict(dtype=jnp.dtype(cfg.model.dtype), param_dtype=jnp.float32, **kw)


def learner_model_kwargs(cfg: Config) -> dict:
    """Learner-numerics model kwargs: ``model_kwargs_for(cfg, "learner")``."""
    return model_kwargs_for(cfg, "learner")


def rollout_model_kwargs(cfg: Config) -> dict:
    """Rollout-engine model kwargs (``Qwen3Engine(model_kwargs=...)``):
    ``model_kwargs_for(cfg, "rollout")``."""
    return model_kwargs_for(cfg, "rollout")


def abstract_model_split(model_config, **model_kw) -> tuple[Any, Any, Any]:
    """``(graphdef, abstract params, abstract rest)`` of a ``Qwen3ForCausalLM`` (nothing allocated)."""
    return nnx.split(_eval_shape(model_config, **model_kw), nnx.Param, ...)


def _eval_shape(config, **model_kw):
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0), **model_kw))


def abstract_model(config, mesh=None, **model_kw):
    """(graphdef, abstract state, shardings or None) for a Qwen3 model, without allocating."""
    graphdef, abs_state = nnx.split(_eval_shape(config, **model_kw))
    shardings = None if mesh is None else state_shardings(abs_state, mesh)
    return graphdef, abs_state, shardings


_INIT_CACHE: dict[Any, Any] = {}


def _jitted_init(config, mesh, model_kw: dict):
    """The jitted random init (seed -> state) for (config, mesh, model kwargs), compiled once
    per key and reused by every later ``create_sharded_model`` call."""
    try:
        key = (config, mesh, tuple(sorted(model_kw.items())))
        hash(key)
    except TypeError:
        key = None
    hit = _INIT_CACHE.get(key) if key is not None else None
    if hit is not None:
        return hit
    graphdef, _, shardings = abstract_model(config, mesh, **model_kw)

    def init(key):
        return nnx.state(Qwen3ForCausalLM(config, rngs=nnx.Rngs(key), **model_kw))

    hit = (graphdef, jax.jit(init, out_shardings=shardings))
    if key is not None:
        _INIT_CACHE[key] = hit
    return hit


def create_sharded_model(config, mesh, seed: int = 0, **model_kw):
    """Initialise a ``Qwen3ForCausalLM`` directly in its sharded layout.

    The init runs under ``jax.jit`` with ``out_shardings`` from the params' logical names, so
    each device only materialises its own shards (no full copy on one device). The jitted
    init is cached per (config, mesh, model kwargs), with the seed as an argument, so repeated
    calls (e.g. several learners) compile it once.
    """
    graphdef, init = _jitted_init(config, mesh, model_kw)
    with jax.set_mesh(mesh):
        state = init(jax.random.key(seed))
    return nnx.merge(graphdef, state)
