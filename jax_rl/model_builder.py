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

from jax_rl.config import Config, ConfigError
from jax_rl.models.expert_parallel import resolve_moe_matmul
from jax_rl.models.qwen3 import PRESETS, Qwen3Config, Qwen3ForCausalLM, get_preset, model_kwargs, resolve_attention
from jax_rl.placement import resolve_roles
from jax_rl.sharding import make_mesh, state_shardings

__all__ = ["HF_REQUIRED_FIELDS", "resolve_mesh", "resolve_model_config", "model_kwargs_for", "learner_model_kwargs", "rollout_model_kwargs",
           "layers_stacked", "abstract_model_split", "abstract_model", "create_sharded_model"]


def resolve_mesh(cfg: Config, mesh=None, devices=None):
    """``mesh`` if given, else the ``('data','fsdp','tensor','expert')`` mesh of ``cfg.mesh`` over
    ``devices`` (default: the learner's devices, ``placement.*`` resolved by
    :func:`jax_rl.placement.resolve_roles`)."""
    if mesh is not None:
        return mesh
    if devices is None:
        pl = cfg.placement
        if pl.learner is not None or pl.rollout is not None or pl.scorer is not None or pl.user is not None:
            devices = resolve_roles(cfg).learner
    m = cfg.mesh
    kw = {} if devices is None else {"devices": devices}
    return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, expert=m.expert, **kw)


# config.json fields that fix the architecture: a file without them is refused rather than
# silently given Qwen3-8B's defaults
HF_REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "vocab_size")


def _read_hf_config(ckpt: str) -> dict:
    d = Path(ckpt)
    if not d.is_dir():
        what = "not a directory" if d.exists() else "does not exist"
        raise ConfigError(f"model.checkpoint={ckpt!r}: no HF checkpoint there ({d} {what}; expected a dir "
                          "holding config.json + model.safetensors)")
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"model.checkpoint={ckpt!r}: no HF checkpoint there ({f} not found)")
    try:
        hf = json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"model.checkpoint: {f} is not UTF-8 text (offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.checkpoint: {f} is not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"model.checkpoint: cannot read {f} ({e.strerror or e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.checkpoint: {f} must hold a JSON object, got {type(hf).__name__}")
    return hf


def resolve_model_config(model_cfg, model_config: Optional[Any] = None, *, check_tensors: bool = False) -> Any:
    """The one model-config resolver: ``Qwen3Config`` from ``cfg.model``, the checkpoint's
    config.json with ``hf_overrides`` applied, else the preset with them (``model_config`` if
    already given). Used by the learner, ``jax-rl compile`` and the run's components
    (:func:`jax_rl.runtime.components.build_model_config`, which adds the run's own checks).

    Args:
        model_cfg: ``cfg.model`` (``checkpoint``, ``preset``, ``hf_overrides``).
        check_tensors: with a checkpoint, also read the safetensors headers (no tensor data) and
            check them against the config.

    Raises:
        jax_rl.config.ConfigError: unknown preset or bad override; for ``model.checkpoint``
            (message naming the file): a missing dir or config.json, a config.json that is not
            UTF-8 JSON holding an object or lacks :data:`HF_REQUIRED_FIELDS`, an invalid
            config, or (``check_tensors``) safetensors that are missing, truncated or do not
            match the config.
    """
    if model_config is not None:
        return model_config
    if model_cfg.checkpoint:
        hf = _read_hf_config(model_cfg.checkpoint)
        f = Path(model_cfg.checkpoint) / "config.json"
        hf.update(model_cfg.hf_overrides)
        missing = [k for k in HF_REQUIRED_FIELDS if k not in hf]
        if missing:
            raise ConfigError(f"model.checkpoint: {f} lacks the field(s) {missing} (set them there or in "
                              "model.hf_overrides)")
        try:
            mc = Qwen3Config.from_hf(hf)
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"model.checkpoint: {f}: {e}") from None
        if check_tensors:
            from jax_rl.models.hf_io import CheckpointError, check_tensors as check, read_safetensors_index

            try:
                check(mc, read_safetensors_index(model_cfg.checkpoint))
            except CheckpointError as e:
                raise ConfigError(f"model.checkpoint={model_cfg.checkpoint!r}: {e}") from None
        return mc
    if model_cfg.preset not in PRESETS:
        raise ConfigError(f"model.preset={model_cfg.preset!r}: unknown preset; known: {sorted(PRESETS)}")
    try:
        return get_preset(model_cfg.preset, **model_cfg.hf_overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model: {e}") from None


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
    ``rollout.dtype``, sets compute and params) and no remat (the engine never differentiates);
    ``rollout.moe_router_dtype`` / ``rollout.moe_capacity_factor`` when set (the engine's MoE
    routing then differs from the learner's: ``moe_router_dtype``, ``moe_capacity_factor`` with
    ``moe_capacity_all_paths``).

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
        r = cfg.rollout  # the engine-only MoE options (issue 27), passed only when set: else the learner's
        if r.moe_router_dtype != "float32":
            kw["moe_router_dtype"] = r.moe_router_dtype
        if r.moe_capacity_factor is not None:
            kw.update(moe_capacity_factor=r.moe_capacity_factor, moe_capacity_all_paths=True)
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
