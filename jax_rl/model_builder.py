"""Building the model on a mesh: the one place that resolves the mesh, the model config and the
abstract (``eval_shape``) model from a run config (MaxText's ``model_creation_utils``: above both
``sharding.py``, which knows no model, and ``models/``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from jax_rl.checkpoint import describe_model, model_name, saved_layer_layout
from jax_rl.config import Config, ConfigError
from jax_rl.models.expert_parallel import resolve_moe_matmul
from jax_rl.models.hf_io import CheckpointError, read_safetensors_index
from jax_rl.models.hf_io import check_tensors as check
from jax_rl.models.qwen3 import PRESETS, Qwen3Config, Qwen3ForCausalLM, get_preset, model_kwargs, resolve_attention
from jax_rl.placement import resolve_roles
from jax_rl.routing_replay import RoutingReplay
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
        run_dir = next((r for r in (d, d.parent, d.parent.parent)
                        if (r / "checkpoints").is_dir() or (r / "config.yaml").is_file()), None)
        if run_dir is not None:  # a jax-rl run (or its checkpoints/): the export that makes an HF dir of it
            raise ConfigError(f"model.checkpoint={ckpt!r} is a jax-rl run's checkpoint, not an HF checkpoint: run "
                              f"`jax-rl export {ckpt} OUT_DIR` and set model.checkpoint=OUT_DIR (or continue the "
                              "run itself with --resume)")
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
    already given). Used by the learner, ``jax-rl compile`` and
    :func:`build_model_config` (which adds the run's own checks).

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
    ``moe`` (:class:`jax_rl.models.qwen3.MoEOptions`) with its ``matmul`` resolved the same way
    (``model.moe_matmul``: ``auto`` -> ``megablox`` on a TPU, else ``ragged_dot``).

    ``role="learner"``: learner numerics: compute dtype ``model.dtype``, fp32 params,
    ``remat_policy`` (``model.remat`` folded in). ``role="rollout"``: what
    ``rollout.engine.Qwen3Engine(model_kwargs=...)`` takes: no dtypes (the engine's ``dtype``,
    ``rollout.dtype``, sets compute and params) and no remat (the engine never differentiates);
    ``rollout.moe_router_dtype`` / ``rollout.moe_capacity_factor`` when set (the engine's MoE
    routing then differs from the learner's: ``moe.router_dtype``, ``moe.capacity_factor`` with
    ``moe.capacity_all_paths``).

    Raises:
        ValueError: ``role`` is not ``"learner"`` or ``"rollout"``.
    """
    if role not in MODEL_ROLES:
        raise ValueError(f"role must be one of {MODEL_ROLES}, got {role!r}")
    kw = model_kwargs(cfg.model)
    kw["attention"] = resolve_attention(kw["attention"])
    kw["moe"] = dataclasses.replace(kw["moe"], matmul=resolve_moe_matmul(kw["moe"].matmul))
    if role == "rollout":
        kw.pop("remat_policy")
        r = cfg.rollout  # the engine-only MoE options, applied only when set: else the learner's
        if r.moe_router_dtype != "float32":
            kw["moe"] = dataclasses.replace(kw["moe"], router_dtype=r.moe_router_dtype)
        if r.moe_capacity_factor is not None:
            kw["moe"] = dataclasses.replace(kw["moe"], capacity_factor=r.moe_capacity_factor, capacity_all_paths=True)
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


def build_model_config(cfg: Config, tokenizer=None):
    """The run's Qwen3Config (:func:`jax_rl.model_builder.resolve_model_config`, the one resolver:
    ``model.checkpoint``'s config.json, else ``model.preset``, with ``model.hf_overrides``; with a
    checkpoint the safetensors headers are checked against it too, no tensor data read), then the
    run's own checks: a resume's model, the tokenizer's vocabulary, the keys that need a model
    property (:func:`_check_model_fits_config`). So a bad model is refused here, before a run dir exists.

    Raises:
        ConfigError: unknown preset, bad override, a vocab smaller than the tokenizer's; for
            ``model.checkpoint`` (message naming the file): a missing dir or config.json, a
            config.json that is not a JSON object or lacks :data:`jax_rl.model_builder.HF_REQUIRED_FIELDS`, or
            safetensors that are missing, truncated or do not match the config.
    """
    mc = resolve_model_config(cfg.model, check_tensors=True)
    _check_resumed_model(cfg, mc)
    if tokenizer is not None and tokenizer.vocab_size > mc.vocab_size:
        raise ConfigError(
            f"model.vocab_size={mc.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, model.tokenizer={cfg.model.tokenizer!r})"
        )
    _check_model_fits_config(cfg, mc)
    return mc


def _check_resumed_model(cfg: Config, mc) -> None:
    """On a resume, the model of the run being resumed (its config.yaml, a preset model) against
    this config's, before anything else can name a symptom (the vocabulary, a param shape).
    The checkpoint's own metadata is checked again at restore (``check_compatible``)."""
    if not cfg.resume or not cfg.run.dir or not (Path(cfg.run.dir) / "config.yaml").is_file():
        return

    try:
        import yaml

        m = yaml.safe_load((Path(cfg.run.dir) / "config.yaml").read_text(encoding="utf-8"))["model"]
        if m.get("checkpoint"):
            return
        saved = get_preset(m["preset"], **(m.get("hf_overrides") or {}))
    except Exception:  # noqa: BLE001 - unreadable: the restore's own checks report the checkpoint
        return
    if saved.to_hf() == mc.to_hf():
        return

    raise ConfigError(
        f"resume: the run in run.dir={cfg.run.dir!r} was written for "
        f"{describe_model(saved.to_hf(), model_name(m['preset'], None))} but this config asks for "
        f"{describe_model(mc.to_hf(), model_name(cfg.model.preset, cfg.model.checkpoint))}; resume with the model "
        "the run was started with, or start a fresh run dir")


def _check_model_fits_config(cfg: Config, mc) -> None:
    """The config keys that need a property of the model (before anything is built)."""
    model = f"model.checkpoint={cfg.model.checkpoint!r}" if cfg.model.checkpoint else f"model.preset={cfg.model.preset}"
    RoutingReplay.from_config(cfg, mc)  # routing replay on a dense model: refused, naming the key
    ep = int(cfg.mesh.expert)
    if mc.is_moe and ep > 1 and mc.num_experts % ep:
        raise ConfigError(f"mesh.expert={ep}: the model's num_experts={mc.num_experts} ({model}) must divide by "
                          f"mesh.expert (the experts are split evenly over the expert axis); set mesh.expert to a "
                          f"divisor of {mc.num_experts}")
    rep = int(cfg.rollout.mesh.expert)
    if mc.is_moe and rep > 1 and mc.num_experts % rep:
        raise ConfigError(f"rollout.mesh.expert={rep}: the model's num_experts={mc.num_experts} ({model}) must divide "
                          f"by it (each engine splits the experts evenly); set a divisor of {mc.num_experts}")
    r = cfg.rollout
    if not mc.is_moe and r.moe_router_dtype != "float32":
        raise ConfigError(f"rollout.moe_router_dtype={r.moe_router_dtype} sets the engine's MoE router; the model "
                          f"({model}) has no MoE layer: set rollout.moe_router_dtype=float32")
    if not mc.is_moe and r.moe_capacity_factor is not None:
        raise ConfigError(f"rollout.moe_capacity_factor={r.moe_capacity_factor} drops the engine's MoE token copies; "
                          f"the model ({model}) has no MoE layer: set rollout.moe_capacity_factor=null")


def adopt_checkpoint_layer_layout(cfg: Config, ckpt_dir: Any, step: Optional[int] = None,
                                  model_config: Any = None) -> Optional[str]:
    """For the readers of a finished checkpoint (``jax-rl eval``, ``jax-rl export``), where the
    layer layout changes no number: set ``cfg.model.scan_layers`` to the layout the checkpoint
    at ``ckpt_dir`` (``step``, default newest) was saved in, when the config would build the other
    one (e.g. a run saved before train honoured ``model.scan_layers``). Returns the one-line note
    to print, or None when nothing changed (same layout, or the layout cannot be read). A resume
    never adopts: :meth:`jax_rl.checkpoint.Checkpointer.check_layer_layout` refuses it."""
    have = saved_layer_layout(ckpt_dir, step)
    if have is None:
        return None
    stacked = have == "stacked"
    try:
        mc = resolve_model_config(cfg.model, model_config)
        builds_stacked = layers_stacked(mc, cfg.model.scan_layers)
    except Exception:  # noqa: BLE001 - a bad model section is reported where the model is built
        builds_stacked = bool(cfg.model.scan_layers)
    if builds_stacked == stacked:
        return None
    cfg.model.scan_layers = stacked
    return (f"{ckpt_dir} stores the decoder layers {have}: reading it with "
            f"model.scan_layers={'true' if stacked else 'false'}")
