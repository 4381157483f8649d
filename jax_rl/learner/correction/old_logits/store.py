"""The snapshot route's store and forwards (``old_logits.route=snapshot``, the paper's first route,
docs/design.md §2.2 Correction modes).

- :class:`SnapshotStore` keeps the params of the last ``K+1`` published versions
  (``K = async.max_staleness``), either in host memory as numpy (``old_logits.store=host``) or
  on local disk through Orbax (``old_logits.store=disk``), and evicts older ones on every
  :meth:`SnapshotStore.put`.
- :func:`snapshot_logprobs` runs one training-numerics forward per version present in a batch
  (over the whole batch: tokens of other versions are context, as they must be, because a
  partial rollout's prefix was produced by an older version but is still conditioned on) and
  keeps each token's log-prob from its own version's forward (:func:`logprobs_by_version`, which
  the rollout-side scorers of :mod:`jax_rl.learner.correction.old_logits.scorer` run too).
- A loss token whose version is not held (evicted, never stored, or from the future) raises
  :class:`StaleVersionError`; there is no silent fallback.

System-cost figures (the paper's): ``old_logits_bytes`` (bytes the store holds, host RAM or
disk), ``old_logits_versions`` (how many versions it holds) and ``old_logits_s`` (wall seconds
spent in :func:`snapshot_logprobs` for one batch, loads + forwards).

Host store layout: per leaf, only the shards this process can address, with replicas dropped
(``replica_id == 0``), keyed by their index in the global array. So every process of a
multi-process run keeps only its own part (host bytes = params bytes / number of processes for
fully sharded params) and :meth:`SnapshotStore.get` rebuilds the global array with
``jax.make_array_from_single_device_arrays`` without any cross-process traffic. The sharding
used by :meth:`get` must be the one the params had at :meth:`put` (true within a run; a restore
onto another mesh goes through :meth:`export` / :meth:`load`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jax_rl.checkpoint import abstract_like

__all__ = ["SnapshotStore", "StaleVersionError", "snapshot_logprobs", "versions_needed", "logprobs_by_version"]


class StaleVersionError(LookupError):
    """A loss token's behaviour version is not in the snapshot store (evicted or never stored)."""


def _index_key(index: tuple) -> tuple:
    """Hashable key for a shard index (tuple of slices over the global shape)."""
    return tuple((s.start, s.stop, s.step) for s in index)


class _HostLeaf:
    """One param leaf in host memory: this process's distinct shards as numpy arrays."""

    __slots__ = ("shape", "dtype", "shards")

    def __init__(self, x: jax.Array):
        self.shape = tuple(x.shape)
        self.dtype = x.dtype
        self.shards: dict[tuple, np.ndarray] = {}
        for sh in x.addressable_shards:
            key = _index_key(sh.index)
            if key not in self.shards:
                self.shards[key] = np.array(sh.data)  # copies device -> host

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.shards.values())

    def to_device(self, sharding: jax.sharding.Sharding) -> jax.Array:
        arrays = []
        for dev, index in sharding.addressable_devices_indices_map(self.shape).items():
            key = _index_key(index)
            if key not in self.shards:
                raise ValueError(
                    f"snapshot leaf of shape {self.shape} was stored under another sharding than {sharding}; "
                    "the store must be read with the sharding the params had when stored"
                )
            arrays.append(jax.device_put(self.shards[key], dev))
        return jax.make_array_from_single_device_arrays(self.shape, sharding, arrays)


class SnapshotStore:
    """Params of the last ``keep`` published versions, on the host or on local disk.

    Args:
        keep: versions held (``K+1``: the live version g and g-1..g-K). >= 1.
        store: ``"host"`` (numpy in RAM) or ``"disk"`` (Orbax, one dir per version).
        directory: root for ``store="disk"``; default a fresh temp dir (removed by :meth:`close`).
            In multi-process runs it must be visible to all processes (Orbax writes one
            checkpoint per version cooperatively).

    Thread-safety: none; the learner calls it from one thread.
    """

    def __init__(self, keep: int, store: str = "host", directory: Optional[str | Path] = None):
        if keep < 1:
            raise ValueError(f"SnapshotStore keep={keep} must be >= 1")
        if store not in ("host", "disk"):
            raise ValueError(f"old_logits.store={store!r} must be 'host' or 'disk'")
        self.keep = int(keep)
        self.kind = store
        self._host: dict[int, Any] = {}  # version -> tree of _HostLeaf
        self._disk: dict[int, Path] = {}
        self._own_dir = False
        self._ckptr = None
        self._shapes = None  # tree of ShapeDtypeStruct of the stored params (disk store)
        if store == "disk":
            import orbax.checkpoint as ocp

            if directory is None:
                directory = tempfile.mkdtemp(prefix="jax_rl_snapshots_")
                self._own_dir = True
            self.directory = Path(directory).absolute()
            self.directory.mkdir(parents=True, exist_ok=True)
            self._ckptr = ocp.StandardCheckpointer()
        else:
            self.directory = None

    # ---------------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        """Versions held, ascending."""
        return sorted(self._host) if self.kind == "host" else sorted(self._disk)

    def __contains__(self, version: int) -> bool:
        return int(version) in (self._host if self.kind == "host" else self._disk)

    def __len__(self) -> int:
        return len(self.versions)

    @property
    def nbytes(self) -> int:
        """Bytes held by this process: host RAM (host store) or files on disk (disk store)."""
        if self.kind == "host":
            return int(sum(leaf.nbytes for tree in self._host.values() for leaf in jax.tree.leaves(tree, is_leaf=_is_host_leaf)))
        self._wait()
        return int(sum(f.stat().st_size for p in self._disk.values() if p.exists() for f in p.rglob("*") if f.is_file()))

    def put(self, version: int, params: Any) -> list[int]:
        """Store a copy of ``params`` (tree of jax arrays) as ``version``; evict versions beyond ``keep``.

        Putting a version that is already held replaces it. Returns the evicted versions.
        """
        version = int(version)
        if self.kind == "host":
            self._host[version] = jax.tree.map(_HostLeaf, params)
        else:
            path = self.directory / f"v{version}"
            self._wait()
            if path.exists() and jax.process_index() == 0:
                shutil.rmtree(path)
            self._ckptr.save(path, params, force=True)
            self._disk[version] = path
            self._shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        evicted = []
        while len(self.versions) > self.keep:
            old = self.versions[0]
            self.evict(old)
            evicted.append(old)
        return evicted

    def evict(self, version: int) -> None:
        """Drop ``version`` (no error if absent)."""
        version = int(version)
        if self.kind == "host":
            self._host.pop(version, None)
        else:
            path = self._disk.pop(version, None)
            if path is not None:
                self._wait()
                if jax.process_index() == 0:
                    shutil.rmtree(path, ignore_errors=True)

    def get(self, version: int, shardings: Any) -> Any:
        """Params of ``version`` as device arrays with ``shardings`` (a tree matching the params).

        Raises:
            StaleVersionError: ``version`` is not held; the message lists what is.
        """
        version = int(version)
        if version not in self:
            raise StaleVersionError(
                f"old logits for version {version} requested but the snapshot store holds versions "
                f"{self.versions} (keep={self.keep} = async.max_staleness+1); the token is staler than "
                "the store covers: raise async.max_staleness or drop stale trajectories in the buffer"
            )
        if self.kind == "host":
            return jax.tree.map(lambda leaf, s: leaf.to_device(s), self._host[version], shardings, is_leaf=_is_host_leaf)
        self._wait()
        target = abstract_like(self._shapes, shardings)
        return self._ckptr.restore(self._disk[version], target)

    def export(self, shardings: Any) -> dict[str, Any]:
        """All held versions as ``{"v<n>": params on device}`` (for an Orbax checkpoint item)."""
        return {f"v{v}": self.get(v, shardings) for v in self.versions}

    def load(self, exported: dict[str, Any]) -> None:
        """Replace the content with an :meth:`export`-ed dict (after a restore, on any mesh)."""
        for v in list(self.versions):
            self.evict(v)
        for key in sorted(exported, key=lambda k: int(k[1:])):
            self.put(int(key[1:]), exported[key])

    def close(self) -> None:
        """Wait for disk writes and remove an owned temp dir."""
        if self._ckptr is not None:
            self._ckptr.wait_until_finished()
            self._ckptr.close()
            self._ckptr = None
            if self._own_dir and jax.process_index() == 0:
                shutil.rmtree(self.directory, ignore_errors=True)

    # ---------------------------------------------------------------------------------
    def _wait(self) -> None:
        if self._ckptr is not None:
            self._ckptr.wait_until_finished()


def _is_host_leaf(x: Any) -> bool:
    return isinstance(x, _HostLeaf)


def versions_needed(versions: np.ndarray, loss_mask: np.ndarray) -> list[int]:
    """Sorted distinct behaviour versions of the loss tokens, unioned over all processes.

    Args:
        versions: int [B_local, T] (this process's rows).
        loss_mask: bool [B_local, T].
    """
    local = np.unique(np.asarray(versions)[np.asarray(loss_mask, bool)]).astype(np.int64)
    if jax.process_count() == 1:
        return [int(v) for v in local]
    width = 256  # at most this many distinct versions per batch
    if local.size > width:
        raise ValueError(f"a batch holds {local.size} distinct versions; at most {width} are supported")
    buf = np.full((width,), -(2**31), np.int64)
    buf[: local.size] = local
    allv = np.asarray(multihost_utils.process_allgather(buf)).reshape(-1)
    return sorted({int(v) for v in allv if v != -(2**31)})


@jax.jit
def _select(acc: jax.Array, logp: jax.Array, versions: jax.Array, v: jax.Array) -> jax.Array:
    return jnp.where(versions == v, logp, acc)


def logprobs_by_version(params_of: Callable[[int], Any], logprob_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
                        *, tokens: jax.Array, attention_mask: jax.Array, versions: jax.Array, needed: list[int]
                        ) -> jax.Array:
    """The one exact old-logit computation every route shares: one ``logprob_fn`` forward over the
    whole batch per version in ``needed`` (tokens of other versions are context), each token
    keeping the log-prob of its own version's forward.

    Args:
        params_of: version -> params (device arrays laid out for ``logprob_fn``).
        logprob_fn: ``(params, tokens, attention_mask) -> logp`` float32, like ``tokens``.
        tokens, attention_mask, versions: device arrays of one shape ([U, m, r, T] chunks).
        needed: the versions to score (sorted distinct versions of the loss tokens).

    Returns:
        float32 device array like ``tokens``: log pi_v (nats) where ``versions == v`` for a ``v``
        in ``needed``, 0 elsewhere. Blocks until computed.
    """
    old = jnp.zeros(tokens.shape, jnp.float32)
    for v in needed:
        params = params_of(int(v))
        lp = logprob_fn(params, tokens, attention_mask)
        old = _select(old, lp, versions, jnp.int32(v))
        del params
    old.block_until_ready()
    return old


def snapshot_logprobs(
    store: SnapshotStore,
    logprob_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    *,
    tokens: jax.Array,
    attention_mask: jax.Array,
    versions: jax.Array,
    needed: list[int],
    current_version: int,
    current_params: Any,
    shardings: Any,
) -> tuple[jax.Array, dict[str, float]]:
    """Exact old log-probs: each token's log pi_v under its own behaviour version v.

    Args:
        store: the snapshot store (must hold every version in ``needed`` except
            ``current_version``, which uses ``current_params``).
        logprob_fn: ``(params, tokens, attention_mask) -> logp [..., T] float32``, the learner's
            jitted training-numerics forward (``out[..., 0] = 0``).
        tokens, attention_mask, versions: global device arrays, same leading shape.
        needed: distinct versions of the loss tokens (:func:`versions_needed`).
        current_version: the learner's version g (its params are live on device).
        current_params: params of version g.
        shardings: param shardings (to load snapshots onto the mesh).

    Returns:
        ``(old_logp, stats)``: float32 array like ``tokens`` (0 where no version in ``needed``
        matches), and ``{"old_logits_s", "old_logits_bytes", "old_logits_versions",
        "old_logits_forwards"}``.

    Raises:
        StaleVersionError: a needed version is neither held nor current.
    """
    t0 = time.perf_counter()
    missing = [v for v in needed if v != current_version and v not in store]
    if missing:
        raise StaleVersionError(
            f"loss tokens of version(s) {missing} have no snapshot: the store holds {store.versions} "
            f"and the learner is at version {current_version} (keep={store.keep} = async.max_staleness+1); "
            "evicted or future versions cannot get exact old logits"
        )
    old = logprobs_by_version(
        lambda v: current_params if v == current_version else store.get(v, shardings), logprob_fn,
        tokens=tokens, attention_mask=attention_mask, versions=versions, needed=needed)
    stats = {
        "old_logits_s": time.perf_counter() - t0,
        "old_logits_bytes": float(store.nbytes),
        "old_logits_versions": float(len(store)),
        "old_logits_forwards": float(len(needed)),
    }
    return old, stats
