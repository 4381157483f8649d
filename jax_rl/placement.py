"""Where each role runs, and putting things on its mesh.

Roles (``placement.*``, docs/placement.md): :func:`resolve_roles` maps the learner, the rollout
engines, the old-logit scorer and the tau² user model to device sets (a role -> devices map, as Tunix's
``role_to_mesh`` and MaxText RL's N-train / M-sample split); the learner's mesh is ``mesh.*`` over
its set, each engine's ``rollout.mesh.*`` over its share of the rollout set.

Placing: ``jax.distributed`` start-up, user params, and host batches as global [U, m, r, T] arrays
(the row axis ``r`` sharded over the mesh axes of the logical name ``activation_batch``; mesh axes
that do not divide r are dropped). Rows are split ``B = U * m * r`` (U = ``optim.minibatches``,
m = ``optim.microbatches``); minibatch u, microbatch j is rows ``(u*m + j)*r : (u*m + j + 1)*r`` of
the batch."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import distributed
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_rl.errors import BatchError
from jax_rl.sharding import logical_to_pspec
from jax_rl.weight_sync import configure_transfer

if TYPE_CHECKING:  # annotations only
    from jax_rl.config import RuntimeConfig

__all__ = ["initialize_distributed", "place_params", "BatchPlacement", "Roles", "resolve_roles", "engine_mesh_sizes",
           "user_mesh_sizes"]


def _spec_str(spec: Any) -> str:
    return str(list(spec)) if isinstance(spec, (list, tuple)) else str(spec)


@dataclasses.dataclass(frozen=True)
class Roles:
    """The devices of each role, each list in ``jax.devices()`` order (global across processes).

    Attributes:
        learner: the learner's devices (``mesh.*`` is laid over them).
        engines: one device list per rollout engine (``rollout.threads`` of them), each the devices of
            that engine's ``rollout.mesh``; ``None`` = colocated on the learner's first device, the
            single-device engine of waves 1-2 (unchanged behaviour).
        scorer: the dedicated old-logit scorer's devices, ``None`` = it shares the learner's mesh.
        engine_mesh: the resolved ``rollout.mesh`` sizes ``{data, fsdp, tensor, expert}``.
        user: the tau² user simulator model's devices (``placement.user``), ``None`` = it runs on the
            eval engine's devices.
        user_mesh: the user model engine's mesh sizes over ``user`` (:func:`user_mesh_sizes`), ``None``
            with ``user``.
    """

    learner: list
    engines: Optional[list[list]]
    scorer: Optional[list]
    engine_mesh: dict[str, int]
    user: Optional[list] = None
    user_mesh: Optional[dict[str, int]] = None

    @property
    def separate_rollout(self) -> bool:
        """True when no engine device is a learner device (the roles really are apart)."""
        if self.engines is None:
            return False
        ids = {d.id for d in self.learner}
        return not any(d.id in ids for e in self.engines for d in e)

    def local_engines(self) -> list[tuple[int, list]]:
        """``(engine index, devices)`` of the engines whose devices all belong to this process (the
        engines this process runs; multi-host: each host its own)."""
        if self.engines is None:
            return []
        me = jax.process_index()
        return [(i, e) for i, e in enumerate(self.engines) if all(d.process_index == me for d in e)]

    def rollout_processes(self) -> list[int]:
        """The processes that run rollout engines, in order (colocated: every process)."""
        if self.engines is None:
            return list(range(jax.process_count()))
        return sorted({e[0].process_index for e in self.engines})

    def learner_processes(self) -> list[int]:
        """The processes that hold learner devices, in order."""
        return sorted({d.process_index for d in self.learner})

    @property
    def split_processes(self) -> bool:
        """Multi-process with some process holding no learner device or no engine (disaggregated across
        processes: e.g. the learner on one host, the engines on another). Then the rollout processes hand
        their groups to every process each step (``jax_rl.runtime.loop``) and the learner trains on the global
        batch, instead of each process feeding its own rows."""
        n = jax.process_count()
        return n > 1 and (len(self.rollout_processes()) < n or len(self.learner_processes()) < n)


def engine_mesh_sizes(mesh_cfg: Any, n_devices: int, *, where: str = "") -> dict[str, int]:
    """``rollout.mesh`` axis sizes over an engine's ``n_devices`` (a -1 axis takes the rest).

    Raises:
        ValueError: (one line naming ``rollout.mesh.*`` and ``where``) the sizes do not fit.
    """
    sizes = mesh_cfg.resolve(n_devices)
    if sizes is None:
        wild = -1 in mesh_cfg.sizes().values()
        shown = " ".join(f"rollout.mesh.{k}={v}" for k, v in mesh_cfg.sizes().items())
        raise ValueError(f"{shown} does not fit the {n_devices} device(s) of each engine{where}: the product of the "
                         f"axes other than a -1 one ({mesh_cfg.fixed_product()}) must {'divide' if wild else 'equal'} it")
    return sizes


def user_mesh_sizes(cfg: Any, n_devices: int) -> dict[str, int]:
    """The user model engine's mesh over its ``n_devices`` (``placement.user``): ``rollout.mesh`` when it
    names an axis over 1 (a -1 axis takes the rest), else (the default ``rollout.mesh``, one device per
    engine) ``fsdp`` over all of them, the scorer's layout.

    Raises:
        ValueError: (one line naming ``placement.user`` and ``rollout.mesh.*``) the sizes do not fit, or
            ``rollout.slots`` does not split over the mesh's data axis.
    """
    if cfg.rollout.mesh.fixed_product() == 1:  # no explicit axis (data=-1 alone): the colocated default
        sizes = {"data": 1, "fsdp": n_devices, "tensor": 1, "expert": 1}
    else:
        sizes = engine_mesh_sizes(cfg.rollout.mesh, n_devices, where=f" (placement.user={_spec_str(cfg.placement.user)}, "
                                                                     "the user model's engine)")
    _check_slots(cfg, sizes)
    return sizes


def _take(spec: Any, key: str, devs: list, *, from_end: bool, pool: Optional[list] = None) -> Optional[list]:
    """The devices ``spec`` names: an int n = the first (or last) n of ``pool`` (default ``devs``), a list =
    ids. Raises ValueError naming ``key``."""
    if spec is None:
        return None
    pool = devs if pool is None else pool
    if isinstance(spec, int):
        if spec > len(pool):
            raise ValueError(f"{key}={spec} asks for {spec} device(s); {len(pool)} are available to it "
                             f"(of {len(devs)} in all)")
        return list(pool[-spec:] if from_end else pool[:spec])
    by_id = {d.id: d for d in devs}
    unknown = [i for i in spec if i not in by_id]
    if unknown:
        raise ValueError(f"{key}={_spec_str(spec)}: no device with id(s) {unknown}; the ids are "
                         f"{sorted(by_id)}")
    chosen = set(spec)
    return [d for d in devs if d.id in chosen]


def _check_slots(cfg: Any, sizes: dict[str, int]) -> None:
    """An engine splits its decode slots over its ``data`` axis (the KV cache's ``cache_batch``)."""
    if cfg.rollout.slots % sizes["data"]:
        raise ValueError(f"rollout.slots={cfg.rollout.slots} does not split over the engine's data axis of "
                         f"{sizes['data']} (rollout.mesh.data={cfg.rollout.mesh.data}): use a multiple of "
                         f"{sizes['data']} slots or set rollout.mesh.data")


def _take_scorer_and_user(pl: Any, devs: list, rids: set) -> tuple[Optional[list], Optional[list]]:
    """``placement.scorer`` then ``placement.user`` resolved (an int n: the last n devices the roles before it
    do not take). Raises ValueError when either overlaps a role resolved before it."""
    scorer = _take(pl.scorer, "placement.scorer", devs, from_end=True,
                   pool=[d for d in devs if d.id not in rids] if isinstance(pl.scorer, int) else None)
    sids = {d.id for d in scorer or []}
    if scorer is not None and rids & sids:
        raise ValueError(f"placement.scorer={_spec_str(pl.scorer)} overlaps placement.rollout={_spec_str(pl.rollout)} "
                         f"on device(s) {sorted(rids & sids)}: the scorer needs devices of its own")
    upl = getattr(pl, "user", None)
    user = _take(upl, "placement.user", devs, from_end=True,
                 pool=[d for d in devs if d.id not in rids | sids] if isinstance(upl, int) else None)
    uids = {d.id for d in user or []}
    for key, spec, other in (("placement.rollout", pl.rollout, rids), ("placement.scorer", pl.scorer, sids)):
        if uids & other:
            raise ValueError(f"placement.user={_spec_str(upl)} overlaps {key}={_spec_str(spec)} on device(s) "
                             f"{sorted(uids & other)}: the user model needs devices of its own")
    return scorer, user


def _take_learner(pl: Any, devs: list, taken: set, any_taken: bool) -> list:
    """``placement.learner`` resolved (an int n: the first n devices; null: every device the other roles, ids
    ``taken``, leave, or all of them when ``any_taken`` is false). Raises ValueError when null leaves none."""
    if pl.learner is not None:
        return _take(pl.learner, "placement.learner", devs, from_end=False)
    learner = [d for d in devs if d.id not in taken] if any_taken else devs
    if not learner:
        taken_by = " and ".join(f"{k}={_spec_str(v)}" for k, v in (("placement.rollout", pl.rollout),
                                                                   ("placement.scorer", pl.scorer),
                                                                   ("placement.user", getattr(pl, "user", None)))
                                if v is not None)
        raise ValueError(f"{taken_by} take(s) all {len(devs)} device(s); the learner needs at least one: give "
                         "placement.learner explicitly (it may overlap placement.rollout) or use fewer")
    return learner


def _check_own_devices(pl: Any, learner: list, scorer: Optional[list], user: Optional[list],
                       single_process_check: bool) -> None:
    """The scorer and the user model on devices of their own (not the learner's) and, placed at all, in a
    single-process run (``single_process_check``: the run's own devices). Raises ValueError naming the key."""
    upl = getattr(pl, "user", None)
    lids, sids, uids = ({d.id for d in x or []} for x in (learner, scorer, user))
    if lids & sids:
        raise ValueError(f"placement.scorer={_spec_str(pl.scorer)} overlaps placement.learner="
                         f"{_spec_str(pl.learner)} on device(s) {sorted(lids & sids)}: the scorer needs devices of "
                         "its own (null shares the learner's mesh)")
    if lids & uids:
        raise ValueError(f"placement.user={_spec_str(upl)} overlaps placement.learner={_spec_str(pl.learner)} on "
                         f"device(s) {sorted(lids & uids)}: the user model needs devices of its own (null runs it "
                         "on the eval engine's devices)")
    if scorer is not None and jax.process_count() > 1 and single_process_check:
        raise ValueError(f"placement.scorer={_spec_str(pl.scorer)} needs a single-process run (this one has "
                         f"{jax.process_count()} processes); set placement.scorer=null")
    if user is not None and jax.process_count() > 1 and single_process_check:
        raise ValueError(f"placement.user={_spec_str(upl)} needs a single-process run (this one has "
                         f"{jax.process_count()} processes); set placement.user=null")


def _rollout_engines(cfg: Any, pl: Any, rollout: list, threads: int) -> tuple[list, dict]:
    """The rollout set split into ``threads`` equal, consecutive engine groups, each on one host, and their mesh
    sizes. Raises ValueError when it does not split evenly, an engine spans processes, or the mesh is bad."""
    if len(rollout) % threads:
        raise ValueError(f"placement.rollout={_spec_str(pl.rollout)} ({len(rollout)} devices) does not split "
                         f"evenly over rollout.threads={threads} engines")
    per = len(rollout) // threads
    sizes = engine_mesh_sizes(cfg.rollout.mesh, per,
                              where=f" (placement.rollout={_spec_str(pl.rollout)} over rollout.threads={threads})")
    _check_slots(cfg, sizes)
    engines = [rollout[i * per:(i + 1) * per] for i in range(threads)]
    for i, e in enumerate(engines):
        if len({d.process_index for d in e}) > 1:
            raise ValueError(f"placement.rollout={_spec_str(pl.rollout)}: engine {i}'s devices span several "
                             "processes; an engine's mesh must lie on one host (give each host's devices whole "
                             "engines: rollout.threads a multiple of the process count)")
    return engines, sizes


def resolve_roles(cfg: Any, devices: Optional[Sequence] = None) -> Roles:
    """Map ``placement.*`` to device sets (docs/placement.md).

    Resolution: the rollout set first (an int n = the last n devices), then the scorer (an int n = the last n
    devices the rollout does not take), then the user model (an int n = the last n devices neither takes), then
    the learner (an int n = the first n; null = every device none of them takes). The rollout set is split into ``rollout.threads`` equal, consecutive engine groups; with
    ``placement.rollout`` null but a ``rollout.mesh`` of more than one device (its explicit axes), every
    engine is laid over the learner's first devices (colocated, sharded).

    Args:
        cfg: the run :class:`~jax_rl.config.Config`.
        devices: the devices to place on (default ``jax.devices()``; a TPU topology's devices for
            ``jax-rl compile``).

    Raises:
        ValueError: one line naming the ``placement.*`` / ``rollout.mesh.*`` key: an unknown id, a count over
            the devices there are, the scorer or the user model overlapping another role, a learner with no
            device, a rollout set that does not split into ``rollout.threads`` engines of ``rollout.mesh``.
    """
    devs = list(jax.devices() if devices is None else devices)
    pl = cfg.placement
    threads = int(cfg.rollout.threads)
    rollout = _take(pl.rollout, "placement.rollout", devs, from_end=True)
    rids = {d.id for d in rollout or []}
    scorer, user = _take_scorer_and_user(pl, devs, rids)
    taken = rids | {d.id for d in scorer or []} | {d.id for d in user or []}
    learner = _take_learner(pl, devs, taken, bool(rollout or scorer or user))
    _check_own_devices(pl, learner, scorer, user, devices is None)
    uk = {"user": user, "user_mesh": None if user is None else user_mesh_sizes(cfg, len(user))}
    if rollout is None:
        explicit = cfg.rollout.mesh.fixed_product()
        if explicit == 1:
            return Roles(learner, None, scorer, {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}, **uk)
        if explicit > len(learner):
            raise ValueError(f"rollout.mesh needs {explicit} device(s) per engine; colocated engines "
                             f"(placement.rollout=null) lie on the learner's {len(learner)}")
        group = learner[:explicit]
        sizes = engine_mesh_sizes(cfg.rollout.mesh, explicit, where=" (colocated on the learner's first devices)")
        _check_slots(cfg, sizes)
        return Roles(learner, [group] * threads, scorer, sizes, **uk)
    engines, sizes = _rollout_engines(cfg, pl, rollout, threads)
    return Roles(learner, engines, scorer, sizes, **uk)




def _distributed_initialized() -> bool:
    try:
        return distributed.global_state.client is not None
    except Exception:  # pragma: no cover - private API moved
        return False


def initialize_distributed(runtime: RuntimeConfig) -> bool:
    """``jax.distributed.initialize`` from ``runtime.coordinator/num_processes/process_id``.

    With no coordinator, a TPU pod (``TPU_WORKER_HOSTNAMES`` lists several hosts) is
    auto-detected by ``jax.distributed.initialize()``. Must run before jax's backend starts.
    Returns True when this process is part of a multi-process run. Idempotent.
    """
    if _distributed_initialized():
        return jax.process_count() > 1
    if runtime.coordinator:
        if runtime.num_processes is None or runtime.process_id is None:
            raise ValueError("runtime.coordinator needs runtime.num_processes and runtime.process_id")
        configure_transfer(runtime)  # the cross-host transfer server (weight sync), before the backend starts
        jax.distributed.initialize(
            coordinator_address=runtime.coordinator,
            num_processes=runtime.num_processes,
            process_id=runtime.process_id,
            heartbeat_timeout_seconds=max(1, int(getattr(runtime, "peer_timeout_s", 100))),
        )
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h]) > 1:
        jax.distributed.initialize()
        return True
    return False


def place_params(init_params: Any, like: Any, param_shardings: Any) -> Any:
    """Put user-given params (State / Module / nested dict; numpy or jax) on the mesh.

    ``init_params`` may hold the decoder layers in either layout, one subtree per layer
    (``["layers"][i]``) or stacked [L, ...] (``model.scan_layers``): they are converted to the
    layout of ``like``. Returns an ``nnx.State`` shaped like ``like``, fp32 leaves placed with
    ``param_shardings``. Raises ValueError when the trees or a leaf's shape do not match.
    """
    if isinstance(init_params, nnx.Module):
        init_params = nnx.state(init_params, nnx.Param)
    if isinstance(init_params, nnx.State):
        init_params = nnx.to_pure_dict(init_params)
    ref = _stringify(nnx.to_pure_dict(like))
    given = _match_layer_layout(_stringify(init_params), ref)
    shard = _stringify(nnx.to_pure_dict(param_shardings))
    if jax.tree.structure(given) != jax.tree.structure(ref):
        raise ValueError(
            "init_params do not match the model's param tree: "
            f"got {jax.tree.structure(given)}, expected {jax.tree.structure(ref)}"
        )
    placed = jax.tree.map(_put, given, shard, ref)
    out = jax.tree.map(lambda x: x, like)  # fresh State containers
    nnx.replace_by_pure_dict(out, placed)
    return out


class BatchPlacement:
    """Layout and placement of learner batches on ``mesh`` (``minibatches x microbatches`` chunks)."""

    def __init__(self, mesh, minibatches: int, microbatches: int):
        self.mesh = mesh
        self.minibatches = int(minibatches)
        self.microbatches = int(microbatches)

    def layout(self, B: int, U: Optional[int] = None, m: Optional[int] = None) -> tuple[int, int, int]:
        U = self.minibatches if U is None else U
        m = self.microbatches if m is None else m
        if B % (U * m):
            raise BatchError(f"batch has B={B} rows, not a multiple of minibatches*microbatches={U * m}")
        return U, m, B // (U * m)

    def batch_sharding(self, r: int) -> NamedSharding:
        """Sharding of a chunked batch array [U, m, r, T]: rows over ``activation_batch``'s axes."""
        spec = logical_to_pspec(("activation_batch",), shape=(r,), mesh=self.mesh)
        return NamedSharding(self.mesh, P(None, None, spec[0], None))

    def process_rows(self, batch: Mapping[str, np.ndarray], U: Optional[int] = None, m: Optional[int] = None
                     ) -> dict[str, np.ndarray]:
        """This process's rows of a GLOBAL batch [B, T] (what ``train_step(..., process_local=True)`` takes).

        The global batch is laid out [U, m, r, T]; the process owns the row range of ``r``
        that its devices hold in :meth:`batch_sharding`, in every (u, j) chunk.
        """
        B, T = np.shape(batch["tokens"])
        U, m, r = self.layout(B, U, m)
        lo, hi = self.local_row_range(r, T)
        return {k: np.asarray(v).reshape((U, m, r) + np.shape(v)[1:])[:, :, lo:hi].reshape((-1,) + np.shape(v)[1:])
                for k, v in batch.items()}

    def local_row_range(self, r: int, T: int) -> tuple[int, int]:
        sh = self.batch_sharding(r)
        idx = sh.addressable_devices_indices_map((1, 1, r, T))
        los = [(i[2].start or 0) for i in idx.values()]
        his = [(r if i[2].stop is None else i[2].stop) for i in idx.values()]
        lo, hi = min(los), max(his)
        return lo, hi

    def device_batch(self, batch: Mapping[str, np.ndarray], *, process_local: bool, U=None, m=None
                      ) -> tuple[dict[str, jax.Array], int]:
        """Host batch -> dict of global [U, m, r, T] arrays (a field with trailing dims, e.g.
        ``routes`` [B, T, n_moe_layers, k], keeps them: [U, m, r, T, ...]). Returns (arrays, r)."""
        B_local, T = np.shape(batch["tokens"])
        nproc = jax.process_count()
        if process_local and nproc > 1:
            U_, m_, r_local = self.layout(B_local, U, m)
            # every process owns an equal slice of each chunk's rows
            r = r_local * nproc
            lo, hi = self.local_row_range(r, T)
            if hi - lo != r_local:
                raise BatchError(
                    f"process-local batch: {r_local} rows per chunk on each of {nproc} processes do not match the "
                    f"mesh's batch sharding ({self.batch_sharding(r).spec} over {r} rows); pass the global batch "
                    "or a row count divisible by the batch axes"
                )
            U, m = U_, m_
        else:
            U, m, r = self.layout(B_local, U, m)
        sh = self.batch_sharding(r)
        gshape = (U, m, r, T)
        out = {}
        if nproc > 1 and not process_local and not sh.addressable_devices:
            # this process holds no learner device (disaggregated): an array of the others' shards only
            for k, v in batch.items():
                a = np.asarray(v)
                a = a.reshape(gshape + a.shape[2:])
                out[k] = jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx], dtype=a.dtype)
            return out, r
        if nproc > 1:
            lo, hi = self.local_row_range(r, T)
        for k, v in batch.items():
            a = np.asarray(v)
            tail = a.shape[2:]
            if process_local and nproc > 1:
                local = a.reshape(U, m, -1, T, *tail)
            elif nproc > 1:
                local = a.reshape(U, m, r, T, *tail)[:, :, lo:hi]
            else:
                out[k] = jax.device_put(a.reshape(gshape + tail), sh)
                continue
            out[k] = jax.make_array_from_process_local_data(sh, np.ascontiguousarray(local), gshape + tail)
        return out, r

    def sync_global(self, b: dict) -> tuple[dict, int]:
        """Multi-process: pad T to the global max and count loss tokens over all processes."""
        n_loss = int(b["loss_mask"].sum())
        if jax.process_count() == 1:
            return b, n_loss
        T = b["tokens"].shape[1]
        allv = np.asarray(multihost_utils.process_allgather(np.array([T, n_loss], np.int64))).reshape(-1, 2)
        T_glob, n_glob = int(allv[:, 0].max()), int(allv[:, 1].sum())
        if T_glob > T:
            pad = {"tokens": 0, "versions": -1, "turn_ids": -1, "routes": -1}
            b = {k: np.pad(v, ((0, 0), (0, T_glob - T)) + ((0, 0),) * (np.ndim(v) - 2), constant_values=pad.get(k, 0))
                 for k, v in b.items()}
        return b, n_glob


def _stringify(tree: Any) -> Any:
    """Nested dict with string keys (so int and str layer keys compare equal)."""
    if isinstance(tree, Mapping):
        return {str(k): _stringify(v) for k, v in tree.items()}
    return tree


def _is_unrolled(layers: Any) -> bool:
    return isinstance(layers, Mapping) and bool(layers) and all(str(k).isdigit() for k in layers)


def _match_layer_layout(given: Any, ref: Any) -> Any:
    """``given`` (string-keyed nested dict) with its ``layers`` subtree restacked or unstacked to
    the layout of ``ref``; unchanged when both agree or either has no ``layers`` subtree."""
    if not (isinstance(given, Mapping) and isinstance(ref, Mapping)):
        return given
    g, r = given.get("layers"), ref.get("layers")
    if not (isinstance(g, Mapping) and isinstance(r, Mapping)) or _is_unrolled(g) == _is_unrolled(r):
        return given
    out = dict(given)
    if _is_unrolled(g):  # one subtree per layer -> [L, ...]
        keys = sorted(g, key=int)
        if keys != [str(i) for i in range(len(keys))]:
            raise ValueError(f"init_params['layers'] has layer keys {keys}; expected 0..{len(keys) - 1}")
        out["layers"] = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *[g[k] for k in keys])
    else:  # [L, ...] -> one subtree per layer
        L = len(r)
        bad = [np.shape(a) for a in jax.tree.leaves(g) if not np.shape(a) or np.shape(a)[0] != L]
        if bad:
            raise ValueError(f"init_params['layers'] is stacked but a leaf has shape {bad[0]}; the model has {L} layers")
        out["layers"] = {str(i): jax.tree.map(lambda a, i=i: np.asarray(a)[i], g) for i in range(L)}
    return out


def _put(value: Any, sharding: Any, ref: Any) -> jax.Array:
    a = np.asarray(value) if not isinstance(value, jax.Array) else value
    if tuple(a.shape) != tuple(ref.shape):
        raise ValueError(f"init_params leaf has shape {a.shape}; the model expects {ref.shape}")
    return jax.device_put(jnp.asarray(a, jnp.float32) if isinstance(a, jax.Array) else a.astype(np.float32), sharding)
