"""Exact old logits (pi_v at each token's own behaviour version v): the snapshot, dedicated, interrupt and
retire routes.

``old_logits.route=snapshot`` (paper 2605.12070 §4 route 1, research/paper_spec.md §2.6, §4):

- :class:`SnapshotStore` keeps the params of the last ``K+1`` published versions
  (``K = async.max_staleness``), either in host memory as numpy (``old_logits.store=host``) or
  on local disk through Orbax (``old_logits.store=disk``), and evicts older ones on every
  :meth:`SnapshotStore.put`.
- :func:`snapshot_logprobs` runs one training-numerics forward per version present in a batch
  (over the whole batch: tokens of other versions are context, as they must be, because a
  partial rollout's prefix was produced by an older version but is still conditioned on) and
  keeps each token's log-prob from its own version's forward.
- A loss token whose version is not held (evicted, never stored, or from the future) raises
  :class:`StaleVersionError`; there is no silent fallback.

System-cost figures (the paper's): ``old_logits_bytes`` (bytes the store holds, host RAM or
disk), ``old_logits_versions`` (how many versions it holds) and ``old_logits_s`` (wall seconds
spent in :func:`snapshot_logprobs` for one batch, loads + forwards).

``old_logits.route=dedicated`` (paper §4 route 2, "a dedicated old-logit model"):

- :class:`OldLogitScorer` holds ``{version: params}`` for the versions the rollout fleet may still
  have tokens of ([g-K, g], at most K+1; on the learner's devices, or on ``placement.scorer``,
  :func:`jax_rl.placement.resolve_roles`) and scores a group's tokens with the learner's own jitted forward through
  :func:`logprobs_by_version`, the computation :func:`snapshot_logprobs` runs, so the two routes
  agree token for token (bitwise for the same input shape).
- :class:`ScoringQueue` is the bounded queue and the thread between the rollout threads and the
  buffer (:class:`jax_rl.runtime.embedded.EmbeddedProducer` wires them): a group enters the
  buffer only once scored, and the learner runs no old-logit forward.
- A trajectory with a token of a version no longer held is dropped and counted, never approximated.

``old_logits.route=interrupt`` (paper §4 route 3) and ``old_logits.route=retire`` (ours):
:class:`RetiringScorer` scores version v's tokens, in finished and in in-flight (partial)
trajectories, with theta_v when the fleet leaves v, then drops theta_v: the rollouts pause for
it (interrupt, a measured stall per publish) or keep generating at v+1 while a background thread
does it (retire). The scorer holds the fleet's current version and at most one retiring one.

Host store layout: per leaf, only the shards this process can address, with replicas dropped
(``replica_id == 0``), keyed by their index in the global array. So every process of a
multi-process run keeps only its own part (host bytes = params bytes / number of processes for
fully sharded params) and :meth:`SnapshotStore.get` rebuilds the global array with
``jax.make_array_from_single_device_arrays`` without any cross-process traffic. The sharding
used by :meth:`get` must be the one the params had at :meth:`put` (true within a run; a restore
onto another mesh goes through :meth:`export` / :meth:`load`).
"""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

__all__ = ["SnapshotStore", "StaleVersionError", "snapshot_logprobs", "versions_needed", "logprobs_by_version",
           "OldLogitScorer", "ScoringQueue", "RetiringScorer", "trajectory_key"]


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
        from jax_rl.checkpoint import abstract_like

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
    from jax.experimental import multihost_utils

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


# ======================================================================================
# The dedicated route: a scorer holding the live versions, fed by a bounded queue
# ======================================================================================


def _tree_nbytes(tree: Any) -> int:
    """Bytes of a tree of jax arrays on this process's devices (replicas counted once per device)."""
    return int(sum(sh.data.nbytes for x in jax.tree.leaves(tree) for sh in x.addressable_shards))


class OldLogitScorer:
    """Exact old log-probs with the learner's training numerics, from params it holds by version.

    The scorer of ``old_logits.route=dedicated`` (and the piece later exact routes reuse): it
    holds ``{version: params}`` on its devices (:meth:`put` / :meth:`drop`, at most ``keep``, the
    oldest evicted first) and scores tokens exactly as :func:`snapshot_logprobs` does: the same
    jitted forward (:func:`jax_rl.train_step.make_logprob_step`: fp32 master params, the model's
    compute dtype, ``rollout.temperature``, the sampler's ``rollout.top_k`` / ``top_p``
    truncation reproduced), one forward per version present (:func:`logprobs_by_version`), each
    token keeping its own version's log-prob.

    Args:
        logprob_fn: jitted ``(params, tokens [1,1,B,T], attention_mask) -> logp`` float32.
        param_shardings: where held params live (a tree like the params).
        mesh: the mesh of ``param_shardings`` (rows of a scored batch are sharded over it).
        keep: versions held at most (``async.max_staleness + 1``), >= 1.
        max_seq_len: longest trajectory scored (``optim.max_seq_len``).
        pad_id: token written in padding (masked; causal attention never reads it).
        pad_to_multiple: T of a scored group is its longest trajectory rounded up to this (as
            :func:`jax_rl.batch.collate`), so few shapes are compiled.

    Thread-safety: :meth:`put`, :meth:`drop` and the scoring methods may run on different threads
    (the held dict is locked; a forward keeps references to the params it reads, so a version
    dropped meanwhile stays alive until that forward ends).

    Counters (cumulative): ``seconds`` (wall seconds in scoring, placement + forwards),
    ``forwards``, ``scored`` (trajectories), ``dropped`` (trajectories with a loss token whose
    version is not held).
    """

    def __init__(self, logprob_fn: Callable, param_shardings: Any, mesh: Any, *, keep: int, max_seq_len: int,
                 pad_id: int = 0, pad_to_multiple: int = 16):
        if keep < 1:
            raise ValueError(f"OldLogitScorer keep={keep} must be >= 1")
        from jax_rl.placement import BatchPlacement

        self.logprob_fn = logprob_fn
        self.param_shardings = param_shardings
        self.mesh = mesh
        self.keep = int(keep)
        self.max_seq_len = int(max_seq_len)
        self.pad_id = int(pad_id)
        self.pad_to_multiple = int(pad_to_multiple)
        self.placement = BatchPlacement(mesh, 1, 1)
        self._params: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.seconds = 0.0
        self.forwards = 0
        self.scored = 0
        self.dropped = 0
        self.routes_fn: Optional[Callable] = None
        """``moe.routing_replay=r3``: ``(params, tokens, attention_mask, routes) -> logp``, the same
        forward with the batch's recorded expert ids forced (:meth:`score_arrays` ``routes``)."""

    @classmethod
    def for_learner(cls, learner: Any, cfg: Any, *, pad_id: int = 0, keep: Optional[int] = None) -> "OldLogitScorer":
        """The scorer of ``learner``'s run: on the learner's mesh with the learner's own jitted
        forward (``placement.scorer`` null), else on a ``('data','fsdp','tensor','expert')`` mesh
        over the scorer's devices (fsdp = all of them) with the same forward re-jitted there.
        ``keep`` defaults to ``async.max_staleness + 1`` (the dedicated route's live versions)."""
        if jax.process_count() > 1:
            raise ValueError(f"old_logits.route={cfg.old_logits.route} runs its scorer thread in a single-process run "
                             f"only (this one has {jax.process_count()} processes): use old_logits.route=snapshot")
        keep = int(cfg.async_.max_staleness) + 1 if keep is None else int(keep)
        from jax_rl.placement import resolve_roles

        devs = resolve_roles(cfg).scorer
        common = dict(keep=keep, max_seq_len=cfg.optim.max_seq_len, pad_id=pad_id)
        r3 = getattr(getattr(cfg, "moe", None), "routing_replay", "none") == "r3"
        if devs is None:
            sc = cls(learner._logprob_jit, learner.param_shardings, learner.mesh, **common)
            sc.routes_fn = learner._logprob_routes_jit if r3 else None
            return sc
        from jax_rl.model_builder import abstract_model_split, learner_model_kwargs
        from jax_rl.sharding import make_mesh, state_shardings
        from jax_rl.train_step import make_logprob_step

        mesh = make_mesh(fsdp=-1, devices=devs)
        _, abs_params, _ = abstract_model_split(learner.model_config, **learner_model_kwargs(cfg))
        shardings = state_shardings(abs_params, mesh)
        if jax.tree.leaves(learner.rest):
            raise ValueError("placement.scorer: the model has non-param state; share the learner's devices "
                             "(placement.scorer=null)")
        fn = make_logprob_step(cfg, learner.graphdef, rest=learner.rest, param_shardings=shardings)
        sc = cls(fn, shardings, mesh, **common)
        if r3:
            sc.routes_fn = make_logprob_step(cfg, learner.graphdef, rest=learner.rest, param_shardings=shardings,
                                             with_routes=True)
        return sc

    # ---------------------------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        """Versions held, ascending."""
        with self._lock:
            return sorted(self._params)

    def __contains__(self, version: int) -> bool:
        with self._lock:
            return int(version) in self._params

    def __len__(self) -> int:
        with self._lock:
            return len(self._params)

    @property
    def nbytes(self) -> int:
        """Device bytes of the held params (a version shared with another holder counts fully)."""
        with self._lock:
            trees = list(self._params.values())
        return sum(_tree_nbytes(t) for t in trees)

    def put(self, version: int, params: Any, *, copy: bool = True) -> list[int]:
        """Hold ``params`` (tree of jax arrays) as ``version``; evict the oldest beyond ``keep``.

        The params are placed with the scorer's shardings: a device-to-device copy when the scorer
        has its own devices (``placement.scorer``), else, on the learner's devices, a copy only
        with ``copy=True`` (``copy=False`` keeps a reference: only for arrays nobody donates, e.g.
        ``Learner.get_params()``'s copy). Returns the evicted versions.
        """
        placed = jax.device_put(params, self.param_shardings, may_alias=False if copy else None)
        with self._lock:
            self._params[int(version)] = placed
            evicted = []
            while len(self._params) > self.keep:
                old = min(self._params)
                del self._params[old]
                evicted.append(old)
        return evicted

    def held(self) -> dict:
        """``{version: params}`` held now (a shallow copy: later puts and drops do not change it)."""
        with self._lock:
            return dict(self._params)

    def drop(self, version: int) -> None:
        """Stop holding ``version`` (no error if absent)."""
        with self._lock:
            self._params.pop(int(version), None)

    def drop_below(self, version: int) -> list[int]:
        """Drop every held version < ``version``; returns them."""
        with self._lock:
            old = [v for v in self._params if v < int(version)]
            for v in old:
                del self._params[v]
        return old

    # ---------------------------------------------------------------------------------
    def score_arrays(self, tokens: np.ndarray, attention_mask: np.ndarray, versions: np.ndarray,
                     loss_mask: np.ndarray, *, held: Optional[dict] = None,
                     routes: Optional[np.ndarray] = None) -> np.ndarray:
        """Exact old log-probs of a right-padded host batch.

        Args:
            tokens: int32 [B, T]; attention_mask, loss_mask: bool [B, T]; versions: int32 [B, T]
                (the behaviour version of each token, -1 where not generated).
            held: ``{version: params}`` to read (default: the versions held now).
            routes: int [B, T, n_moe_layers, k] recorded expert ids (``Trajectory.routes``), forced
                in every forward when :attr:`routes_fn` is set (``moe.routing_replay=r3``).

        Returns:
            float32 [B, T] (numpy): log pi_v (nats) of each loss token under its own version v,
            0 where ``versions`` names no loss-token version (prompt, tool output, padding).

        Raises:
            StaleVersionError: a loss token's version is not held.
        """
        t0 = time.perf_counter()
        if held is None:
            with self._lock:
                held = dict(self._params)
        needed = versions_needed(versions, loss_mask)
        missing = [v for v in needed if v not in held]
        if missing:
            raise StaleVersionError(f"old logits for version(s) {missing} requested but the scorer holds "
                                    f"{sorted(held)} (keep={self.keep} = async.max_staleness+1)")
        B, T = np.shape(tokens)
        host = {"tokens": np.asarray(tokens, np.int32), "attention_mask": np.asarray(attention_mask, bool),
                "versions": np.asarray(versions, np.int32)}
        forced = routes is not None and self.routes_fn is not None
        if forced:
            host["routes"] = np.asarray(routes)
        dev, _ = self.placement.device_batch(host, process_local=False)
        fn = (lambda p, t, a: self.routes_fn(p, t, a, dev["routes"])) if forced else self.logprob_fn
        # called like the learner's snapshot route calls it (outside any ``jax.set_mesh``): same program
        old = logprobs_by_version(held.__getitem__, fn, tokens=dev["tokens"],
                                  attention_mask=dev["attention_mask"], versions=dev["versions"], needed=needed)
        out = np.asarray(old).reshape(B, T)
        with self._lock:
            self.seconds += time.perf_counter() - t0
            self.forwards += len(needed)
        return out

    def score_group(self, trajectories: list) -> tuple[list, list]:
        """Fill ``old_logp`` of each trainable trajectory of one group (in place).

        Failed or over-long trajectories (``info["failed"]``, ``info["overlong"]``, longer than
        ``max_seq_len``) pass through unscored: the buffer drops and counts them. A trajectory with
        a loss token whose version is not held is not scored and is returned in ``dropped`` (and
        counted in :attr:`dropped`): never approximated.

        Returns:
            ``(kept, dropped)``: the group without the dropped trajectories (order kept), and them.
        """
        from jax_rl.batch import collate

        with self._lock:
            held = dict(self._params)
        kept, dropped, todo = [], [], []
        for t in trajectories:
            if t.failed or t.overlong or len(t) > self.max_seq_len:
                kept.append(t)
                continue
            need = {int(v) for v in np.unique(t.versions[t.loss_mask])}
            if need - set(held):
                dropped.append(t)
                continue
            kept.append(t)
            todo.append(t)
        if todo:
            b = collate(todo, [0.0] * len(todo), self.max_seq_len, pad_to_multiple=self.pad_to_multiple,
                        pad_id=self.pad_id)
            old = self.score_arrays(b["tokens"], b["attention_mask"], b["versions"], b["loss_mask"], held=held,
                                    routes=b.get("routes"))
            for i, t in enumerate(todo):
                t.old_logp = old[i, : len(t)].copy()
        with self._lock:
            self.scored += len(todo)
            self.dropped += len(dropped)
        return kept, dropped

    def stats(self) -> dict[str, float]:
        """``old_logits_versions``, ``old_logits_bytes`` (now) and the cumulative counters."""
        return {"old_logits_versions": float(len(self)), "old_logits_bytes": float(self.nbytes),
                "old_logits_scorer_s_total": float(self.seconds), "old_logits_scorer_forwards": float(self.forwards),
                "old_logits_scored": float(self.scored), "old_logits_dropped": float(self.dropped)}


class ScoringQueue:
    """A bounded queue of finished groups and the thread that scores them (``old_logits.route=dedicated``).

    :meth:`submit` blocks while ``maxsize`` groups wait (backpressure on the rollout thread that
    finished the next one); the ``old-logits`` thread takes them in order, calls
    :meth:`OldLogitScorer.score_group` and hands the result to ``done(key, kept, dropped, error)``
    (``error`` is the exception when scoring raised; then ``kept`` is empty and ``dropped`` the
    whole group). Nothing is scored twice or lost: on :meth:`stop` the groups still queued are
    returned to the caller.

    Args:
        scorer: the :class:`OldLogitScorer`.
        done: called on the scoring thread for every group taken.
        maxsize: groups waiting at most (``old_logits.max_queued_groups``).
    """

    def __init__(self, scorer: OldLogitScorer, done: Callable[[Any, list, list, Optional[BaseException]], None],
                 maxsize: int = 4):
        self.scorer = scorer
        self.done = done
        self.maxsize = int(maxsize)
        self._q: queue.Queue = queue.Queue(maxsize=self.maxsize)
        self._stop = threading.Event()
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._run, name="old-logits", daemon=True)
        self.max_depth = 0  # the deepest the queue got (<= maxsize)

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def __len__(self) -> int:
        return self._q.qsize()

    def submit(self, key: Any, trajectories: list, *, poll_s: float = 0.2) -> bool:
        """Queue one group (blocking while full). False when stopped (nothing queued)."""
        while not self._stop.is_set():
            try:
                self._q.put((key, trajectories), timeout=poll_s)
            except queue.Full:
                continue
            self.max_depth = max(self.max_depth, self._q.qsize())
            return True
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                key, trajs = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            self._busy.set()
            try:
                try:
                    kept, dropped = self.scorer.score_group(trajs)
                except Exception as e:  # a scoring failure loses this group only, and says why
                    log.exception("old-logit scoring of group %r failed", key)
                    self.done(key, [], list(trajs), e)
                else:
                    self.done(key, kept, dropped, None)
            except Exception:  # pragma: no cover - the callback must not kill the thread
                log.exception("old-logit done callback failed for group %r", key)
            finally:
                self._busy.clear()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until the queue is empty and no group is being scored (True), or ``timeout``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._q.empty() and not self._busy.is_set():
                return True
            time.sleep(0.01)
        return False

    def stop(self, timeout: float = 30.0) -> list:
        """Stop the thread (the group being scored finishes first); returns ``[(key, group)]``
        still queued, unscored."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        left = []
        while True:
            try:
                left.append(self._q.get_nowait())
            except queue.Empty:
                return left


# ======================================================================================
# The interrupt and retire routes: score version v's tokens once, when the fleet leaves v
# ======================================================================================


def trajectory_key(t: Any) -> tuple[int, int]:
    """``(group_id, sample_idx)``: the id of an episode from its first token to its trajectory."""
    return int(t.group_id), int(t.info.get("sample_idx", 0))


class RetiringScorer:
    """Exact old log-probs scored per version at the moment the rollout fleet leaves it
    (``old_logits.route=interrupt`` and ``old_logits.route=retire``).

    When every generator has swapped from version v to v+1 (``Generator.apply_update_now``), no
    token of version v will ever be generated again: the set of v-tokens is final. Each of them
    sits in an episode the rollout side still holds (finished and waiting for its group or for
    scoring, or in flight: between turns, queued, or decoding in a slot), at the position it will
    keep, after a prefix that will not change (trajectories only grow; ``rollout.partial=abort``
    drops the current turn at the swap itself, before the capture). Causal attention makes the
    log-prob of a token a function of its prefix and the params only, so scoring the v-tokens of
    every episode's prefix with theta_v, at or after the swap, gives exactly the log-probs a
    forward over the finished trajectory with theta_v gives (the snapshot route's; equal up to the
    reduction order of another input shape, <= 1e-6 in fp32). theta_v is then dropped: at most
    the current version and one retiring version are held, whatever ``async.max_staleness`` is.

    What it needs from the rollout side (``sources``): at retire time, every episode not yet
    scored, as ``(key, tokens int32 [L], versions int32 [L], loss_mask bool [L][, routes])`` with
    its prefix so far (earlier turns, tool tokens, the current turn's tokens from the generator
    slot), the version of each generated token and (``moe.routing_replay=r3``) the recorded expert
    ids of its positions (int [L, n_moe_layers, k], ``ROUTE_MISSING`` where none), which the
    prefix's forward forces as the finished trajectory's forward does (``scorer.routes_fn``;
    without routes the prefix is scored by the router's own choice); the key (:func:`trajectory_key`) names the same
    episode's final :class:`rollout.types.Trajectory` when its group reaches :meth:`score_group`.
    ``rollout.agent.AgentLoop(track=True).unscored_prefixes`` ships exactly that; ``release(keys)``
    tells it a group is scored.

    A finished group's tokens are filled from what its versions' retires stashed, and the
    versions still held (the fleet's current one, or a retiring one whose job has not run) are
    scored by :meth:`OldLogitScorer.score_group`'s computation. A retire and a group's scoring
    never interleave (one lock), so each token is found either stashed or held. A trajectory
    whose stashed prefix does not match its final tokens, or with a version neither stashed nor
    held, is dropped and counted (``old_logits_dropped``, ``old_logits_stash_mismatch``).

    The two routes differ only in who waits (:meth:`publish`):

    - ``interrupt``: the publisher pauses every generator (their step locks), retires the
      outgoing version synchronously (score its unscored tokens, finished and partial, drop its
      params), swaps and resumes: the rollout stall is measured (``old_logits_stall_s``).
    - ``retire``: the generators swap at once and keep generating; the outgoing version is
      retired by a background thread while training goes on. A publish that finds the previous
      retire unfinished waits for it (``old_logits_publish_wait_s``: the learner waits, the
      rollouts never do), so at most 2 versions are held.

    Args:
        scorer: the :class:`OldLogitScorer` holding the params (``keep`` >= 2).
        sources: ``() -> list[(key, tokens, versions, loss_mask[, routes])]``, the unscored
            episodes now (``routes`` None or absent: not forced).
        release: ``(keys) -> None``, called with a group's keys once it is scored (or None).
        route: ``"interrupt"`` or ``"retire"``.
        rows_per_forward: captured prefixes scored per forward at most.

    Thread-safety: :meth:`score_group` (the scoring-queue thread), :meth:`publish` (the learner
    thread) and the background retire thread may run concurrently.

    Counters (cumulative): ``retired`` (versions), ``retire_s`` (wall seconds in retires),
    ``retire_rows`` (prefixes scored), ``stall_s`` (rollout pause, interrupt), ``publish_wait_s``
    (retire), ``max_held`` (most versions held at once), ``stash_mismatch``, ``retire_errors``,
    ``retire_partial`` (stashes used by a trajectory with tokens newer than the stashed version:
    it was in flight when that version retired).
    """

    def __init__(self, scorer: OldLogitScorer, sources: Callable[[], list], release: Optional[Callable] = None, *,
                 route: str = "retire", rows_per_forward: int = 8):
        if route not in ("interrupt", "retire"):
            raise ValueError(f"RetiringScorer route={route!r} must be 'interrupt' or 'retire'")
        if scorer.keep < 2:
            raise ValueError(f"RetiringScorer needs a scorer that holds 2 versions (keep={scorer.keep})")
        self.scorer = scorer
        self.sources = sources
        self.release = release
        self.route = route
        self.rows_per_forward = max(1, int(rows_per_forward))
        self._lock = threading.Lock()  # a retire and a group's scoring never interleave
        self._stash: dict[tuple, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0  # retires queued or running (route=retire)
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self.retired = 0
        self.retire_s = 0.0
        self.retire_rows = 0
        self.stall_s = 0.0
        self.publish_wait_s = 0.0
        self.max_held = len(scorer)
        self.stash_mismatch = 0
        self.retire_partial = 0  # stashed prefixes used that were partial when retired (the episode went on)
        self.retire_errors = 0  # background retires that raised (their tokens' trajectories are dropped, counted)
        self.errors: list[str] = []

    # ---------------------------------------------------------------------------------
    def _note_held(self) -> None:
        self.max_held = max(self.max_held, len(self.scorer))

    def put(self, version: int, params: Any, *, copy: bool = True) -> None:
        """Hold ``params`` as ``version`` (the fleet's next version)."""
        self.scorer.put(int(version), params, copy=copy)
        self._note_held()

    def _pad(self, rows: list) -> tuple[np.ndarray, ...]:
        """Right-pad ``(key, tokens, versions, mask, routes)`` rows: tokens/versions int32 [B, T],
        attention/loss mask bool [B, T], routes [B, T, n_moe_layers, k] (-1 pad) or None when the
        scorer forces none (not r3) or no row carries routes.

        Raises:
            ValueError: under r3, some rows carry routes and others not, or a row's routes do not
                match its tokens (the forward would silently route those rows by the router)."""
        m = max(1, self.scorer.pad_to_multiple)
        T = min(self.scorer.max_seq_len, -(-max(len(r[1]) for r in rows) // m) * m)
        B = len(rows)
        tok = np.full((B, T), self.scorer.pad_id, np.int32)
        am = np.zeros((B, T), bool)
        ver = np.full((B, T), -1, np.int32)
        lm = np.zeros((B, T), bool)
        for i, (_, t, v, l, _) in enumerate(rows):
            n = len(t)
            tok[i, :n], am[i, :n], ver[i, :n], lm[i, :n] = t, True, v, l
        rts = [r[4] for r in rows]
        routes = None
        if self.scorer.routes_fn is not None and any(r is not None for r in rts):
            bad = [r[0] for r in rows if r[4] is None]
            if bad:
                raise ValueError(f"retire: {len(bad)} of {B} prefixes carry no routes under moe.routing_replay=r3 "
                                 f"while the others do (episodes {bad[:4]})")
            tails = {np.shape(r)[1:] for r in rts}
            if len(tails) != 1:
                raise ValueError(f"retire: prefix routes must all be [L, n_moe_layers, k] of one shape; got {sorted(tails)}")
            routes = np.full((B, T, *next(iter(tails))), -1, np.asarray(rts[0]).dtype)
            for i, (key, t, _, _, r) in enumerate(rows):
                if len(r) != len(t):
                    raise ValueError(f"retire: episode {key}'s prefix routes have {len(r)} positions, its tokens "
                                     f"{len(t)}")
                routes[i, : len(t)] = r
        return tok, am, ver, lm, routes

    def retire(self, version: int) -> int:
        """Score every unscored episode's ``version`` tokens (finished and partial prefixes) with
        theta_version, stash them, then drop theta_version. Call only once the fleet has left
        ``version``. Returns the prefixes scored.

        Raises:
            StaleVersionError: ``version`` has tokens to score but is not held.
            ValueError: under r3, prefixes with and without routes, or routes not aligned with
                their tokens (:meth:`_pad`).
        """
        version = int(version)
        t0 = time.perf_counter()
        with self._lock:
            held = self.scorer.held()
            rows = []
            for key, tok, ver, lm, *rt in self.sources():
                tok, ver, lm = np.asarray(tok, np.int32), np.asarray(ver, np.int32), np.asarray(lm, bool)
                mine = lm & (ver == version)
                if not mine.any() or version in self._stash.get(key, {}) or len(tok) > self.scorer.max_seq_len:
                    continue  # nothing of this version, already stashed, or too long to train (dropped later)
                rows.append((key, tok, ver, mine, rt[0] if rt else None))
            if rows and version not in held:
                raise StaleVersionError(f"retire of version {version}: {len(rows)} episode(s) hold its tokens but the "
                                        f"scorer holds {sorted(held)}")
            for i in range(0, len(rows), self.rows_per_forward):
                chunk = rows[i: i + self.rows_per_forward]
                tok, am, ver, lm, routes = self._pad(chunk)
                old = self.scorer.score_arrays(tok, am, ver, lm, held={version: held[version]}, routes=routes)
                for j, (key, t, _, mine, _) in enumerate(chunk):
                    pos = np.flatnonzero(mine)
                    self._stash.setdefault(key, {})[version] = (pos, t[: int(pos[-1]) + 1].copy(), old[j, pos].copy())
            self.scorer.drop(version)
            self.retired += 1
            self.retire_rows += len(rows)
            self.retire_s += time.perf_counter() - t0
        return len(rows)

    def score_group(self, trajectories: list) -> tuple[list, list]:
        """Fill ``old_logp`` of each trainable trajectory of one finished group (in place), from the
        stashes of its retired versions and the params of the versions still held; then release the
        group's keys. Same contract as :meth:`OldLogitScorer.score_group`: ``(kept, dropped)``."""
        from jax_rl.batch import collate

        sc = self.scorer
        with self._lock:
            held = sc.held()
            kept, dropped, todo = [], [], []
            for t in trajectories:
                key = trajectory_key(t)
                stash = self._stash.pop(key, {})
                if t.failed or t.overlong or len(t) > sc.max_seq_len:
                    kept.append(t)
                    continue
                old = np.zeros(len(t), np.float32)
                need = {int(v) for v in np.unique(t.versions[t.loss_mask])}
                ok = True
                for v in need & set(stash):
                    pos, prefix, lp = stash[v]
                    now = np.flatnonzero(t.loss_mask & (t.versions == v))
                    if not (np.array_equal(now, pos) and len(t) >= len(prefix)
                            and np.array_equal(t.tokens[: len(prefix)], prefix)):
                        ok = False
                        self.stash_mismatch += 1
                        log.warning("old logits: episode %s's version-%d tokens differ from its retired prefix; dropped",
                                    key, v)
                        break
                    old[pos] = lp
                    self.retire_partial += int(t.max_version() > v)  # generated on after v retired: was partial
                rest = need - set(stash)
                if not ok or rest - set(held):
                    dropped.append(t)
                    continue
                kept.append(t)
                todo.append((t, old, rest))
            live = [(t, old, rest) for t, old, rest in todo if rest]
            if live:
                b = collate([t for t, _, _ in live], [0.0] * len(live), sc.max_seq_len,
                            pad_to_multiple=sc.pad_to_multiple, pad_id=sc.pad_id)
                vs = sorted(set().union(*(r for _, _, r in live)))
                lm = b["loss_mask"] & np.isin(b["versions"], vs)
                new = sc.score_arrays(b["tokens"], b["attention_mask"], b["versions"], lm, held=held,
                                      routes=b.get("routes"))
                for i, (t, old, rest) in enumerate(live):
                    sel = t.loss_mask & np.isin(t.versions, sorted(rest))
                    old[sel] = new[i, : len(t)][sel]
            for t, old, _ in todo:
                t.old_logp = old
            with sc._lock:
                sc.scored += len(todo)
                sc.dropped += len(dropped)
        if self.release is not None:
            self.release([trajectory_key(t) for t in trajectories])
        return kept, dropped

    # ---------------------------------------------------------------------------------
    def publish(self, version: int, params: Any, generators: list) -> float:
        """Move the fleet to ``version``: hold ``params``, hand them to every generator, make each
        swap before it returns (interrupt) or at once (retire), and retire the outgoing versions.

        Args:
            version: the new version; params: its params (kept by reference: a copy nobody donates).
            generators: objects with ``update_params(params, version)`` (returns cast seconds or
                None), ``apply_update_now()`` and (interrupt) ``paused()``.

        Returns:
            the generators' cast seconds (``update_params``), summed.
        """
        import contextlib

        version = int(version)
        if self.route == "retire":
            self.publish_wait_s += self.wait_retired()  # bound: the current and at most one retiring version
        outgoing = [v for v in self.scorer.versions if v < version]
        self.put(version, params, copy=False)
        cast_s = 0.0
        for g in generators:  # cast/reshard outside any pause; a generator may already swap at its next step
            cast_s += float(g.update_params(params, version) or 0.0)
        if self.route == "interrupt":
            t0 = time.perf_counter()
            with contextlib.ExitStack() as paused:
                for g in generators:
                    paused.enter_context(g.paused())
                for g in generators:
                    g.apply_update_now()
                for v in outgoing:
                    self.retire(v)
            self.stall_s += time.perf_counter() - t0
        else:
            for g in generators:
                g.apply_update_now()  # waits for the decode step in progress; then the fleet has left the outgoing
            for v in outgoing:
                self._submit(v)
        return cast_s

    def _submit(self, version: int) -> None:
        with self._cv:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="old-logits-retire", daemon=True)
                self._thread.start()
        self._jobs.put(version)

    def _run(self) -> None:
        while True:
            v = self._jobs.get()
            if v is None:
                return
            try:
                self.retire(v)
            except Exception as e:  # its trajectories find neither stash nor params: dropped and counted
                log.exception("old logits: retire of version %d failed", v)
                self.errors = (self.errors + [f"retire {v}: {e!r}"])[-20:]
                self.retire_errors += 1
                self.scorer.drop(v)
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def wait_retired(self, timeout: Optional[float] = None) -> float:
        """Block until no retire is queued or running; returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0, timeout=timeout)
        return time.perf_counter() - t0

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the background retire thread (a retire in progress finishes first)."""
        if self._thread is not None and not self._stopped:
            self._stopped = True
            self._jobs.put(None)
            self._thread.join(timeout=timeout)

    def stats(self) -> dict[str, float]:
        """The scorer's columns plus ``old_logits_stall_s_total``, ``old_logits_publish_wait_s_total``,
        ``old_logits_retired``, ``old_logits_retire_rows``, ``old_logits_max_held``,
        ``old_logits_stash_mismatch``, ``old_logits_retire_errors``, ``old_logits_retire_partial``,
        ``old_logits_stashed`` (episodes
        with stashed tokens now)."""
        with self._lock:
            stashed = len(self._stash)
        return {**self.scorer.stats(), "old_logits_stall_s_total": float(self.stall_s),
                "old_logits_publish_wait_s_total": float(self.publish_wait_s),
                "old_logits_retired": float(self.retired), "old_logits_retire_rows": float(self.retire_rows),
                "old_logits_retire_s_total": float(self.retire_s),
                "old_logits_max_held": float(self.max_held), "old_logits_stash_mismatch": float(self.stash_mismatch),
                "old_logits_retire_errors": float(self.retire_errors),
                "old_logits_retire_partial": float(self.retire_partial),
                "old_logits_stashed": float(stashed)}
