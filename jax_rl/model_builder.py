"""Building the model on a mesh: the one place that resolves the mesh, the model config and the
abstract (``eval_shape``) model from a run config (MaxText's ``model_creation_utils``: above both
``sharding.py``, which knows no model, and ``models/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import jax.numpy as jnp
from flax import nnx

from jax_rl.config import Config

__all__ = ["resolve_mesh", "resolve_model_config", "model_kwargs", "abstract_model_split"]


def resolve_mesh(cfg: Config, mesh=None, devices=None):
    """``mesh`` if given, else the ``('data','fsdp','tensor','expert')`` mesh of ``cfg.mesh``."""
    from jax_rl.sharding import make_mesh

    if mesh is not None:
        return mesh
    m = cfg.mesh
    kw = {} if devices is None else {"devices": devices}
    return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, expert=m.expert, **kw)


def resolve_model_config(model_cfg, model_config: Optional[Any] = None) -> Any:
    """``Qwen3Config`` from ``cfg.model``: the checkpoint's config.json, else the preset with
    ``hf_overrides`` (``model_config`` if already given)."""
    from jax_rl.models.qwen3 import Qwen3Config, get_preset

    if model_config is not None:
        return model_config
    if model_cfg.checkpoint:
        hf = json.loads((Path(model_cfg.checkpoint) / "config.json").read_text())
        hf.update(model_cfg.hf_overrides)
        return Qwen3Config.from_hf(hf)
    return get_preset(model_cfg.preset, **model_cfg.hf_overrides)


def model_kwargs(cfg: Config) -> dict:
    """Learner-numerics model kwargs: compute dtype ``model.dtype``, fp32 params, dispatch, remat."""
    return dict(dtype=jnp.dtype(cfg.model.dtype), param_dtype=jnp.float32,
                moe_dispatch=cfg.model.moe_dispatch, remat=cfg.model.remat)


def abstract_model_split(model_config, **model_kw) -> tuple[Any, Any, Any]:
    """``(graphdef, abstract params, abstract rest)`` of a ``Qwen3ForCausalLM`` (nothing allocated)."""
    from jax_rl.models.qwen3 import Qwen3ForCausalLM

    abs_model = nnx.eval_shape(lambda: Qwen3ForCausalLM(model_config, rngs=nnx.Rngs(0), **model_kw))
    return nnx.split(abs_model, nnx.Param, ...)
