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
from jax_rl.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, get_preset
from jax_rl.sharding import make_mesh, state_shardings

__all__ = ["resolve_mesh", "resolve_model_config", "learner_model_kwargs", "abstract_model_split", "abstract_model",
           "create_sharded_model"]


def resolve_mesh(cfg: Config, mesh=None, devices=None):
    """``mesh`` if given, else the ``('data','fsdp','tensor','expert')`` mesh of ``cfg.mesh``."""
    if mesh is not None:
        return mesh
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


def learner_model_kwargs(cfg: Config) -> dict:
    """Learner-numerics model kwargs: compute dtype ``model.dtype``, fp32 params, dispatch, remat."""
    return dict(dtype=jnp.dtype(cfg.model.dtype), param_dtype=jnp.float32,
                moe_dispatch=cfg.model.moe_dispatch, remat=cfg.model.remat)


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
