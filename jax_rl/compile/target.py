"""The compile target (part of :mod:`jax_rl.compile`): the topology's devices, the roles placed on
them, the learner's mesh and the model config (:class:`_Target`, :func:`_target`), and the abstract
learner and batch every program is built from. Nothing is allocated: arguments are
``jax.ShapeDtypeStruct`` trees."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence

import jax.numpy as jnp

from jax_rl.config import Config, ConfigError
from jax_rl.learner.spec import learner_batch_spec, learner_spec
from jax_rl.model_builder import resolve_model_config
from jax_rl.models.qwen3 import get_preset, model_kwargs
from jax_rl.placement import BatchPlacement, resolve_roles
from jax_rl.routing_replay import RoutingReplay
from jax_rl.sharding import make_mesh
from jax_rl.compile.topology import get_topology, resolve_topology


@dataclasses.dataclass
class _Target:
    cfg: Config
    topology: str
    spec: Any  # jax_rl.compile.topology.TopologySpec
    devices: list  # the learner's devices (placement.learner; every device by default)
    mesh: Any  # the learner's mesh (mesh.* over ``devices``)
    model_config: Any
    learner_kw: dict
    engine_kw: dict
    notes: list
    all_devices: list = dataclasses.field(default_factory=list)  # the topology's devices
    roles: Any = None  # jax_rl.placement.Roles over ``all_devices``


def _model_config(cfg: Config, notes: list):
    """The run's ``Qwen3Config``: the checkpoint's config.json when it exists, else the preset
    (a TPU config names a checkpoint path on the pod, usually absent on the compiling host)."""
    ck = cfg.model.checkpoint
    if ck and not (Path(ck) / "config.json").is_file():
        if not cfg.model.preset:
            raise ConfigError(f"model.checkpoint={ck}: no config.json there and no model.preset to take the "
                              "shapes from")
        notes.append(f"model.checkpoint {ck} has no config.json here: shapes from preset {cfg.model.preset}")
        return get_preset(cfg.model.preset, **cfg.model.hf_overrides)
    return resolve_model_config(cfg.model)


def _target(cfg: Config, topology: str) -> _Target:
    spec = resolve_topology(topology)
    all_devices = list(get_topology(topology).devices)
    try:
        roles = resolve_roles(cfg, all_devices)
    except ValueError as e:
        raise ConfigError(f"{e} (on {topology}: {len(all_devices)} devices)") from None
    devices = list(roles.learner)
    m = cfg.mesh
    where = "" if len(devices) == len(all_devices) else " given to the learner by placement.*"
    try:
        mesh = make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, expert=m.expert, devices=devices)
    except ValueError as e:
        raise ConfigError(f"mesh {m.data}x{m.fsdp}x{m.tensor}x{m.expert} (data x fsdp x tensor x expert) on "
                          f"{topology} ({len(devices)} devices{where}): {e}") from None
    notes: list[str] = []
    mc = _model_config(cfg, notes)
    kw = model_kwargs(cfg.model)
    if kw.get("attention") == "auto":  # the target is a TPU, whatever this host is
        kw["attention"] = "splash"
    if kw["moe"].matmul == "auto":
        kw["moe"] = dataclasses.replace(kw["moe"], matmul="megablox")
    if kw.get("scan_unroll") == "auto":  # one layer per loop iteration, as on a TPU
        kw["scan_unroll"] = 1
    learner_kw = dict(kw, dtype=jnp.dtype(cfg.model.dtype), param_dtype=jnp.float32)
    engine_kw = {k: kw[k] for k in ("moe", "scan_layers", "attention") if k in kw}
    return _Target(cfg, topology, spec, devices, mesh, mc, learner_kw, engine_kw, notes, all_devices, roles)


def _learner(t: _Target, model_config=None, cfg: Optional[Config] = None, **kw_over):
    """The learner's recipe on the target mesh, abstract (:func:`jax_rl.learner.spec.learner_spec`,
    the one ``Learner.__init__`` builds from); ``kw_over`` overrides model build options (e.g.
    ``scan_layers=False`` for the cost pieces)."""
    return learner_spec(cfg or t.cfg, model_config or t.model_config, t.mesh, abstract=True,
                        model_kw=dict(t.learner_kw, **kw_over))


def _batch(t: _Target, strategy, U: int, m: int, r: int, T: int):
    """The abstract learner batch [U, m, r, T] the run's train step reads
    (:func:`jax_rl.learner.spec.learner_batch_spec`, as ``Learner.abstract_batch``: the recorded
    routes included under ``moe.routing_replay`` r2/r3)."""
    sh = BatchPlacement(t.mesh, U, m).batch_sharding(r)
    routing = RoutingReplay.from_config(t.cfg, t.model_config)
    return learner_batch_spec(strategy, routing, t.model_config, (U, m, r, T), sh), sh


def _layout(B: int, U: int, m: int, what: str) -> int:
    if B % (U * m):
        raise ConfigError(f"{what}: B={B} rows is not a multiple of minibatches*microbatches={U * m}")
    return B // (U * m)


def _depth(mc, L: int):
    return dataclasses.replace(mc, num_hidden_layers=L)


def _devices_per_chip(t: _Target) -> float:
    """JAX devices per chip of the topology (1 on v5e/v6e and on v5p, whose two TensorCores are one
    megacore device; 2 where a chip's cores are separate devices): per-device cost -> per chip."""
    return len(t.all_devices or t.devices) / t.spec.num_chips


def _chips(t: _Target, devices: Sequence) -> int:
    """How many chips ``devices`` (some of the topology's) span."""
    return max(1, round(len(devices) / _devices_per_chip(t)))


def _engine_mesh(t: _Target):
    """Engine 0's mesh (``rollout.mesh`` over its devices), or None for the colocated one-device engine."""
    if t.roles is None or t.roles.engines is None:
        return None
    return make_mesh(**t.roles.engine_mesh, devices=t.roles.engines[0])
