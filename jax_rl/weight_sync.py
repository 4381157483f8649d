"""Learner -> rollout engine weight sync across processes, shard by shard (no full gather).

A multi-process publish (``jax.distributed``; docs/placement.md "Multi-host") moves the learner's
params, sharded over the learner's mesh on every host, to every rollout engine, each on the devices
of one host. Two steps per distinct engine layout, every process running them at the same point:

1. **Reshard + cast, on the learner's side, in one program.** ONE jitted program over the learner's
   devices runs the engine's own cast / layer re-layout (``Qwen3Engine``'s cast to ``rollout.dtype``,
   the unstacking of ``scan_layers`` layers for an unrolled CPU engine, or its quantisation) and lays
   the result out in the ENGINE's layout: the learner's n_l devices are viewed as a mesh
   ``(_replica=n_l/n_e, *engine mesh)`` and every output leaf gets the engine's PartitionSpec on it.
   Each learner device then holds exactly the shard that the engine device at the same position needs,
   in ``rollout.dtype``: |params in rollout.dtype| / n_e bytes per learner device (n_e = devices per
   engine), never the full gathered copy (unless n_e = 1: an engine on one device needs everything).
2. **Cross-process transfer.** For each engine, the replica group of n_e learner devices that lies
   best for it (its own devices first, then its own host) is the source; ``jax.device_put`` of that
   group's shards (re-wrapped without a copy as an array on a mesh of the engine's shape) onto the
   engine's shardings copies shard i to engine device i. Same HLO sharding and device count on both
   sides, so jax 0.10.2 runs it as a cross-host transfer (``jax._src.dispatch``
   ``_is_supported_cross_host_transfer``) when the group and the engine are on different processes
   (both processes call it), and as a plain device-to-device copy when they share one.

Why ``jax.device_put`` and not ``jax.experimental.transfer``: the transfer server's ``await_pull`` /
``pull`` pair moves a pytree by id but leaves the pairing of ids, the matching of shard layouts and the
liveness of the sources to the caller, and it needs a server address per process exchanged out of
band. ``device_put`` across processes uses the same DCN transfer library (the one transfer server jax
starts when ``jax_cross_host_transfer_socket_address`` is set), pairs the two sides through the
``jax.distributed`` key-value store, checks the layouts, and is a no-op change on a backend with native
cross-host transfers (TPU). What it requires, and this module arranges: the same HLO sharding on both
sides (hence step 1's engine-shaped source) and every involved process calling it.

Liveness. The sources must outlive the receive: after its receives are complete, every process writes
``jax_rl/weight_sync/<seq>/<process>`` to the key-value store and waits for every other process's key,
``runtime.peer_timeout_s`` at most; a peer that does not answer (a lost host) raises
:class:`WeightSyncError` naming it, never a hang. The transfer's own metadata exchange is bounded by the
same timeout (``jax_cross_host_transfer_timeout_seconds``, set by :func:`configure_transfer`).

Versions are the caller's: :meth:`ShardedWeightSync.push` returns each local engine's params, which the
caller hands to ``Generator.update_params(params, version)`` exactly as in one process.

Listeners: :func:`configure_transfer` binds the transfer server and its transports to the coordinator's
host (127.0.0.1 in a local run) unless ``runtime.transfer_address`` names another; jax's default
transports would listen on 0.0.0.0.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax._src import distributed
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jax_rl.collectives import PeerLostError
from jax_rl.sharding import make_mesh

__all__ = ["WeightSyncError", "SyncTarget", "ShardedWeightSync", "configure_transfer", "transfer_address",
           "engine_targets", "shard_bytes"]

_SEQ = itertools.count()


class WeightSyncError(PeerLostError):
    """A weight sync across processes failed: a peer did not confirm in time (a lost host) or a
    transfer raised. The message is one line and names the peer process(es)."""


def transfer_address(runtime: Any) -> Optional[str]:
    """The ``host:port`` this process's cross-host transfer server listens on: ``runtime.transfer_address``,
    else the coordinator's host with port coordinator port + 1 + ``runtime.process_id`` (the jax transfer
    server needs a fixed port: port 0 is not published to the peers and the transfer hangs). None
    without a coordinator (a TPU pod's backend transfers natively)."""
    if getattr(runtime, "transfer_address", None):
        return str(runtime.transfer_address)
    if not runtime.coordinator:
        return None
    host, _, port = str(runtime.coordinator).rpartition(":")
    return f"{host or '127.0.0.1'}:{int(port) + 1 + int(runtime.process_id or 0)}"


def configure_transfer(runtime: Any) -> Optional[str]:
    """Set jax's cross-host transfer flags from ``runtime.*``; must run before jax's backend starts
    (:func:`jax_rl.placement.initialize_distributed` calls it before ``jax.distributed.initialize``).

    Sets ``jax_cross_host_transfer_socket_address`` (:func:`transfer_address`),
    ``jax_cross_host_transport_addresses`` to the same host with port 0 (jax's default is four
    ``0.0.0.0:0`` listeners) and ``jax_cross_host_transfer_timeout_seconds`` to
    ``runtime.peer_timeout_s``. Returns the address, or None when nothing was set."""
    addr = transfer_address(runtime)
    if addr is None:
        return None
    host = addr.rpartition(":")[0] or "127.0.0.1"
    jax.config.update("jax_cross_host_transfer_socket_address", addr)
    jax.config.update("jax_cross_host_transport_addresses", f"{host}:0")
    jax.config.update("jax_cross_host_transfer_timeout_seconds", max(1, int(getattr(runtime, "peer_timeout_s", 100))))
    return addr


def shard_bytes(arrays: Sequence[jax.Array]) -> int:
    """Bytes of the shards of ``arrays`` that live on this process's devices."""
    return int(sum(s.data.nbytes for a in arrays for s in a.addressable_shards))


@dataclasses.dataclass(frozen=True)
class SyncTarget:
    """One engine layout to fill: ``mesh`` (a sharded engine's mesh) or ``device`` (the colocated
    single-device engine). ``key`` (the device ids) identifies it; engines on the same devices with the
    same layout share one target (their params are read-only)."""

    mesh: Optional[Mesh] = None
    device: Any = None

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat) if self.mesh is not None else [self.device]

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices)

    @property
    def processes(self) -> set[int]:
        return {d.process_index for d in self.devices}


def engine_targets(cfg: Any, roles: Any, *, eval_only: bool = False) -> list[SyncTarget]:
    """Every process's rollout engines as sync targets, the same list in the same order on every process.

    ``roles`` (:func:`jax_rl.placement.resolve_roles`): with ``roles.engines`` None (colocated), every
    process's engines lie on its first device (one target per process); else engine i's
    ``rollout.mesh`` over ``roles.engines[i]``. ``eval_only``: the eval engines, the first engine of
    each process (``jax_rl.runtime.engines.engine_mesh(cfg, None)`` on that process)."""
    devs = jax.devices()
    if roles.engines is None:
        firsts: dict[int, Any] = {}
        for d in devs:
            firsts.setdefault(d.process_index, d)
        return [SyncTarget(device=firsts[p]) for p in sorted(firsts)]
    out, seen, procs = [], set(), set()
    for group in roles.engines:
        proc = group[0].process_index
        if eval_only and proc in procs:
            continue
        procs.add(proc)
        t = SyncTarget(mesh=make_mesh(**roles.engine_mesh, devices=group))
        if t.key not in seen:
            seen.add(t.key)
            out.append(t)
    return out


class ShardedWeightSync:
    """Moves learner params to every engine target in the engine's layout (module docstring).

    Args:
        learner_mesh: the learner's mesh (its params' shardings lie on it).
        targets: every engine target of every process (:func:`engine_targets`), identical on every process.
        fn: params -> the engine's param tree in ``rollout.dtype`` (a local engine's cast / re-layout,
            ``Qwen3Engine._cast_jit``); pure and traceable; the same function on every process.
        template: a local engine whose params' tree and shardings every target copies (all engines of a
            run share ``rollout.mesh``, dtype and layout; only the devices differ).
        timeout_s: how long a process waits for a peer (``runtime.peer_timeout_s``).

    Raises:
        ValueError: (one line) an engine's device count does not divide the learner's.
    """

    def __init__(self, learner_mesh: Mesh, targets: Sequence[SyncTarget], fn: Callable, template: Any,
                 *, timeout_s: float = 100.0):
        self.learner_mesh = learner_mesh
        self.targets = list(targets)
        self.timeout_s = float(timeout_s)
        self._fn = fn
        self._abstract = template.abstract_params
        self._treedef = jax.tree.structure(self._abstract)
        shardings = template.param_shardings if getattr(template, "quantize", "none") == "none" else \
            getattr(template, "_engine_shardings", None)
        leaves = jax.tree.leaves(self._abstract)
        if shardings is None:  # the colocated single-device engine: every leaf whole on one device
            self._emesh_shape, self._eaxes, self._specs = (), (), [P()] * len(leaves)
        else:
            sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
            if len(sh) != len(leaves):
                raise ValueError(f"engine shardings have {len(sh)} leaves, its params {len(leaves)}")
            m = sh[0].mesh
            self._emesh_shape, self._eaxes = tuple(m.devices.shape), tuple(m.axis_names)
            self._specs = [s.spec for s in sh]
        self._shapes = [(tuple(a.shape), a.dtype) for a in leaves]
        ldevs = list(learner_mesh.devices.flat)
        self._n_l, self._n_e = len(ldevs), int(np.prod(self._emesh_shape)) if self._emesh_shape else 1
        if self._n_l % self._n_e:
            raise ValueError(f"weight sync: each engine has {self._n_e} device(s), which do not divide the learner's "
                             f"{self._n_l}; make the learner's device count a multiple of the engine's (placement.learner "
                             "/ rollout.mesh)")
        r = self._n_l // self._n_e
        shape = (r,) + (self._emesh_shape or (1,))
        axes = ("_replica",) + (self._eaxes or ("_engine",))
        self._rep_mesh = Mesh(np.array(ldevs, dtype=object).reshape(shape), axes)
        self._groups = [list(g.flat) for g in self._rep_mesh.devices]  # group g: its devices at engine positions
        out_sh = [NamedSharding(self._rep_mesh, s) for s in self._specs]
        self._prog = jax.jit(lambda p: jax.tree.leaves(fn(p)), out_shardings=out_sh)
        self._source = self._assign_groups()
        self.last: dict[str, float] = {}

    # ------------------------------------------------------------------ layout
    def _assign_groups(self) -> list[int]:
        """The replica group each target copies from: most devices shared with the target, then most on
        its host, then the least used (spreads the sends), then the first."""
        used = [0] * len(self._groups)
        out = []
        for t in self.targets:
            tids, tproc = set(t.key), t.processes
            best = max(range(len(self._groups)), key=lambda g: (
                sum(d.id in tids for d in self._groups[g]),
                sum(d.process_index in tproc for d in self._groups[g]), -used[g], -g))
            used[best] += 1
            out.append(best)
        return out

    def _dst(self, t: SyncTarget) -> list:
        if t.mesh is None:
            return [SingleDeviceSharding(t.device)] * len(self._specs)
        return [NamedSharding(t.mesh, s) for s in self._specs]

    def _src(self, g: int) -> tuple[Mesh, list]:
        devs = self._groups[g]
        if not self._emesh_shape:
            return None, [SingleDeviceSharding(devs[0])] * len(self._specs)
        m = Mesh(np.array(devs, dtype=object).reshape(self._emesh_shape), self._eaxes)
        return m, [NamedSharding(m, s) for s in self._specs]

    def source_processes(self, i: int) -> set[int]:
        """The processes holding target ``i``'s source shards."""
        return {d.process_index for d in self._groups[self._source[i]]}

    # ------------------------------------------------------------------ publish
    def push(self, params: Any, version: int) -> dict[tuple[int, ...], Any]:
        """Send ``params`` (the learner's, on its mesh) to every target; a collective: every process calls
        it at the same point with the same ``version``.

        Returns:
            ``{target key: params}`` for the targets on this process's devices, each the engine's tree
            (``Qwen3Engine.load_params`` takes it as is) with the engine's shardings, in ``rollout.dtype``.
            :attr:`last` holds the figures of this push (bytes per process, seconds).

        Raises:
            WeightSyncError: a transfer failed or a peer did not confirm within ``timeout_s`` (one line
                naming the peer process(es)).
        """
        me = jax.process_index()
        t0 = time.perf_counter()
        with jax.set_mesh(self.learner_mesh):
            staged = self._prog(params)
        staged_bytes = shard_bytes(staged)
        per_dev: dict[int, int] = {}
        for a in staged:
            for s in a.addressable_shards:
                per_dev[s.device.id] = per_dev.get(s.device.id, 0) + s.data.nbytes
        t1 = time.perf_counter()
        out: dict[tuple[int, ...], Any] = {}
        sent = recv = 0
        for i, t in enumerate(self.targets):
            g = self._source[i]
            gdevs = {d.id for d in self._groups[g]}
            src_procs, dst_procs = self.source_processes(i), t.processes
            if me not in src_procs and me not in dst_procs:
                continue
            _, src_sh = self._src(g)
            srcs = [jax.make_array_from_single_device_arrays(
                shp, sh, [s.data for s in a.addressable_shards if s.device.id in gdevs], dtype=a.dtype)
                for a, sh, (shp, _) in zip(staged, src_sh, self._shapes)]
            peers = sorted((src_procs | dst_procs) - {me})
            try:
                got = jax.device_put(srcs, self._dst(t))
                if me in dst_procs:
                    got = jax.block_until_ready(got)
            except Exception as e:  # noqa: BLE001 - named and re-raised as one line
                raise WeightSyncError(f"weight sync of version {version} to the engine on devices {list(t.key)} failed "
                                      f"(peer process(es) {peers}): {str(e).splitlines()[0][:200]}") from None
            if me in src_procs and dst_procs != {me}:
                sent += sum(s.data.nbytes for a in srcs for s in a.addressable_shards)
            if me in dst_procs:
                recv += shard_bytes(got)
                out[t.key] = jax.tree.unflatten(self._treedef, got)
        t2 = time.perf_counter()
        self._confirm(version)
        del staged
        self.last = {"weight_sync_stage_s": t1 - t0, "weight_sync_transfer_s": t2 - t1,
                     "weight_sync_confirm_s": time.perf_counter() - t2,
                     "weight_sync_staged_bytes": float(staged_bytes),
                     "weight_sync_staged_max_device_bytes": float(max(per_dev.values(), default=0)),
                     "weight_sync_sent_bytes": float(sent),
                     "weight_sync_recv_bytes": float(recv)}
        return out

    def _confirm(self, version: int) -> None:
        """Every process says its receives are done and waits for all the others (the sources stay alive
        until then); a peer silent for ``timeout_s`` is a lost host: WeightSyncError naming it."""
        if jax.process_count() == 1:
            return
        client = distributed.global_state.client
        seq = next(_SEQ)
        base = f"jax_rl/weight_sync/{seq}"
        client.key_value_set(f"{base}/{jax.process_index()}", str(int(version)))
        deadline = time.monotonic() + self.timeout_s
        for q in range(jax.process_count()):
            if q == jax.process_index():
                continue
            left_ms = max(1, int(1000 * (deadline - time.monotonic())))
            try:
                got = client.blocking_key_value_get(f"{base}/{q}", left_ms)
            except Exception:  # noqa: BLE001 - a timeout or the coordination service gone
                raise WeightSyncError(f"weight sync of version {version}: process {q} did not confirm within "
                                      f"{self.timeout_s:g} s (runtime.peer_timeout_s): peer lost") from None
            if int(got) != int(version):
                raise WeightSyncError(f"weight sync: process {q} published version {got}, this process {version}: "
                                      "the processes are out of step")
        if seq >= 2:  # keys two pushes old are read by everyone by now
            try:
                client.key_value_delete(f"jax_rl/weight_sync/{seq - 2}/{jax.process_index()}")
            except Exception:  # noqa: BLE001 - housekeeping only
                pass
