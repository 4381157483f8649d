"""Checkpoint trees (part of :mod:`jax_rl.checkpoint`): array bytes, abstract restore targets, the decoder
layers' layout of a params tree or a saved step, and the train state as the nested-dict items Orbax writes
(:func:`train_state_items`; :func:`~jax_rl.checkpoint.manager.restore_train_state` reads them back)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np



def tree_nbytes(*trees: Any) -> int:
    """Total bytes of the array leaves of ``trees`` (global shapes; None trees count 0)."""
    n = 0
    for t in trees:
        if t is None:
            continue
        for x in jax.tree.leaves(t):
            size, dt = getattr(x, "size", None), getattr(x, "dtype", None)
            if size is not None and dt is not None:
                n += int(size) * int(getattr(dt, "itemsize", 0) or 4)
    return n


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` tree for ``tree`` (arrays), with ``shardings`` (same tree) if given.

    Used as an Orbax restore target: the restored arrays get these shapes, dtypes and
    shardings (resharding from whatever layout was saved).
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _layers_layout_of_paths(paths) -> Optional[str]:
    """``"stacked"`` / ``"unrolled (one subtree per layer)"`` from the key paths of a params
    tree (the key after ``layers`` is a layer index in the unrolled layout), None if no
    ``layers`` key."""
    for path in paths:
        path = [str(k) for k in path]
        if "layers" in path[:-1]:
            nxt = path[path.index("layers") + 1]
            return "unrolled (one subtree per layer)" if nxt.isdigit() else "stacked"
    return None


def _layers_layout_of_tree(tree: Any) -> Optional[str]:
    paths = [[getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in p]
             for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return _layers_layout_of_paths(paths)


def saved_layer_layout(directory: str | Path, step: Optional[int] = None) -> Optional[str]:
    """How a checkpoint's ``state`` item stores the decoder layers, read from its tree metadata
    (no array is read): ``"stacked"`` (``params/layers/<name>`` [L, ...], ``model.scan_layers``),
    ``"unrolled (one subtree per layer)"`` (``params/layers/<i>/<name>``) or None (no ``layers``
    subtree, no such step, or unreadable metadata). ``step=None``: the newest step dir under
    ``directory`` whose metadata reads."""
    directory = Path(directory)
    if step is None:
        try:
            steps = sorted((int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()),
                           reverse=True)
        except OSError:
            return None
    else:
        steps = [int(step)]
    for s in steps:
        paths = _saved_state_paths(directory, s)
        if paths is not None:
            return _layers_layout_of_paths(paths)
    return None


def _saved_state_paths(directory: Path, step: int) -> Optional[list[list[str]]]:
    """The key path of every leaf of a checkpoint's ``state`` item, read from its tree metadata (no
    array is read); None when the metadata does not read (an unreadable step is reported by the
    restore itself)."""
    try:
        meta = json.loads((Path(directory) / str(int(step)) / "state" / "_METADATA").read_text())
        return [[k["key"] for k in v["key_metadata"]] for v in meta["tree_metadata"].values()]
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _host_local_to_numpy(tree: Any) -> Any:
    """``tree`` with every fully addressable ``jax.Array`` as a numpy array (None stays None)."""
    if tree is None:
        return None
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x, tree)


STATE_KEYS = ("params", "opt_state", "version", "step")

RETIRED_STATE_LEAVES = {"rng": ((2,), "uint32")}
"""Leaves of the ``state`` item that checkpoints of earlier versions hold and the TrainState no longer
has (name -> saved shape, dtype): :meth:`jax_rl.checkpoint.Checkpointer.restore` reads and drops them."""


def saved_state_keys(directory: str | Path, step: int) -> set[str]:
    """The top-level keys of a checkpoint's ``state`` item, read from its tree metadata (no array is
    read); empty when the metadata does not read."""
    return {p[0] for p in _saved_state_paths(Path(directory), step) or [] if p}


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def to_nested(tree: Any) -> dict:
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


def from_nested(nested: dict, like: Any) -> Any:
    """Inverse of :func:`to_nested` onto the structure of ``like``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for path, _ in flat:
        node = nested
        for k in [_key_name(k) for k in path] or ["value"]:
            node = node[k]
        leaves.append(node)
    return jax.tree.unflatten(treedef, leaves)


def _core(state: Any) -> dict:
    return {k: getattr(state, k) for k in STATE_KEYS}


def train_state_items(state: Any, strategy: Any, snapshots: Optional[dict] = None) -> dict[str, Any]:
    """Checkpoint items of a TrainState: ``state`` (:data:`STATE_KEYS`), the correction
    strategy's items and ``snapshots`` (``{"v<n>": params}``, when given and not empty)."""
    items = {"state": to_nested(_core(state))}
    items.update({k: to_nested(v) for k, v in strategy.checkpoint_items(state.correction).items()})
    if snapshots:
        items["snapshots"] = {k: to_nested(v) for k, v in snapshots.items()}
    return items

