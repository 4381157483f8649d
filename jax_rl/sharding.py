"""Device meshes and logical-axis sharding (MaxText style, one rules table).

Mesh axes are ``('data', 'fsdp', 'tensor', 'expert')``, all ``AxisType.Auto`` (classic GSPMD:
the compiler propagates shardings; we annotate params and the main activations). Params carry
logical axis names in their ``out_sharding`` metadata (see ``jax_rl.models.qwen3``);
``LOGICAL_RULES`` maps each logical name to mesh axes. Use ``jax.set_mesh(mesh)``, never
``with mesh:``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

__all__ = [
    "MESH_AXES",
    "LOGICAL_RULES",
    "make_mesh",
    "axis_names",
    "logical_to_pspec",
    "state_shardings",
    "constrain",
]

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical name -> mesh axis (str), several mesh axes (tuple) or None (replicated).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    # params
    ("layers", None),  # the stacked decoder-layer axis of model.scan_layers (MaxText "layers")
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("router", None),
    ("norm", None),
    # activations
    # the batch is split over expert too (MaxText's activation_batch): outside the MoE blocks an
    # expert group is data parallel, inside them expert_parallel_moe exchanges its tokens.
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_vocab", "tensor"),
    # kv cache [L,B,S,K,H]
    ("cache_layers", None),
    # decode slots over expert too, as activation_batch: an expert-parallel engine's decode activations
    # are split over expert, so a cache replicated over it was copied whole every step (jax-rl compile,
    # Qwen3-30B-A3B engine on 4 v5p chips at expert 4: 24 GiB of temporaries for a 12 GiB cache; now
    # 3 GiB of cache per chip and no copy)
    ("cache_batch", ("data", "fsdp", "expert")),
    ("cache_sequence", None),
    ("cache_kv_heads", "tensor"),
    ("cache_head_dim", None),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, expert: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``('data','fsdp','tensor','expert')`` mesh with ``AxisType.Auto`` axes.

    One size may be -1, meaning "the remaining devices". The product must equal the number of
    devices (``jax.devices()`` by default).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor, expert]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be positive or -1, got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices are not divisible by {known} ({sizes})")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"have {len(devices)}")
    types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=types, devices=devices)
    except AssertionError:
        # a TPU device subset that is no sub-torus of the slice (e.g. 3 of a 2x2's chips, a role's share
        # of the devices): jax's physical-mesh layout asserts; lay the devices out in the order given
        return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES, axis_types=types)


def axis_names(entry) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec (or logical rule) entry: None -> (), a name -> (name,),
    a tuple of names -> that tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _mesh_sizes(mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes)) if hasattr(mesh, "axis_sizes") else dict(
        mesh.shape)


def logical_to_pspec(names: Sequence[str | None] | None, rules=LOGICAL_RULES, *,
                     shape: Sequence[int] | None = None, mesh=None) -> P:
    """Map logical axis names to a PartitionSpec through ``rules``.

    A mesh axis is used at most once (first dim wins). With ``mesh`` given, mesh axes of size 1
    or that do not divide the dimension (``shape``) are dropped, so e.g. 2 kv heads on a
    4-way ``tensor`` axis are replicated instead of failing. Unknown names are an error.
    """
    if names is None:
        return P()
    table = dict(rules)
    sizes = _mesh_sizes(mesh) if mesh is not None else None
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no sharding rule")
        target = table[name]
        axes = axis_names(target)
        kept = []
        dim = None if shape is None else shape[i]
        for ax in axes:
            if ax in used:
                continue
            if sizes is not None:
                if ax not in sizes or sizes[ax] == 1:
                    continue
                prod = math.prod(sizes[a] for a in kept) * sizes[ax]
                if dim is not None and dim % prod:
                    continue
            kept.append(ax)
        used.update(kept)
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return P(*out)


def constrain(x: jax.Array, names: Sequence[str | None], rules=LOGICAL_RULES) -> jax.Array:
    """``with_sharding_constraint`` by logical names under the ambient ``jax.set_mesh`` mesh;
    a no-op when no mesh is set."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    if any(t != AxisType.Auto for t in mesh.axis_types):
        return x
    spec = logical_to_pspec(names, rules, shape=x.shape, mesh=mesh)
    if all(s is None for s in spec):
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def _var_names(v: nnx.Variable):
    return v.get_metadata().get("out_sharding")


def state_shardings(state, mesh: Mesh, rules=LOGICAL_RULES):
    """Tree (same structure as ``state``) of NamedShardings from each Variable's logical
    names. Works on abstract (eval_shape) and concrete states."""

    def f(v):
        if isinstance(v, nnx.Variable):
            return v.replace(NamedSharding(
                mesh, logical_to_pspec(_var_names(v), rules, shape=v.get_value().shape, mesh=mesh)))
        return NamedSharding(mesh, P())

    return jax.tree.map(f, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_array(x: np.ndarray | jax.Array, names, mesh: Mesh, rules=LOGICAL_RULES) -> jax.Array:
    """Place one host array on ``mesh`` by logical names (each device gets its shard)."""
    return jax.device_put(x, NamedSharding(
        mesh, logical_to_pspec(names, rules, shape=np.shape(x), mesh=mesh)))
