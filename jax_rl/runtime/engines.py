"""The rollout engines of a run: each engine's mesh (``placement.rollout`` / ``rollout.mesh``), a
:class:`rollout.engine.Qwen3Engine` with the run's sampling and numerics, its started
:class:`rollout.generator.Generator`, and engines that receive the learner's weights across processes."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax

from jax_rl.config import Config, ConfigError
from jax_rl.model_builder import rollout_model_kwargs
from jax_rl.placement import resolve_roles
from jax_rl.routing_replay import RoutingReplay
from jax_rl.runtime.resources import kv_pool_pages
from jax_rl.sharding import make_mesh
from jax_rl.weight_sync import ShardedWeightSync, SyncTarget, allgather_bytes, engine_targets
from rollout.engine import EngineSpec, Qwen3Engine
from rollout.generator import Generator
from rollout.types import decode_groups, encode_groups

__all__ = ["local_groups_per_step", "rollout_rank", "split_processes", "exchange_groups", "engine_mesh", "user_model_mesh", "engine_spec", "build_engine", "build_generator", "new_generator", "synced_generators"]


def local_groups_per_step(cfg: Config) -> int:
    """GRPO groups this process generates for each learner step: ``optim.batch_size / algo.group_size`` over
    the processes that run rollout engines (every process unless disaggregated, :func:`rollout_rank`; the run
    refuses a count that does not divide, ``RunContext``); 0 on a process that runs none."""
    groups = cfg.optim.batch_size // cfg.algo.group_size
    if jax.process_count() == 1:
        return groups
    rank, n = rollout_rank(cfg)
    return 0 if rank is None else groups // n


def rollout_rank(cfg: Config) -> tuple[Optional[int], int]:
    """``(rank, n)``: this process's index among the ``n`` processes that run rollout engines
    (:meth:`jax_rl.placement.Roles.rollout_processes`; colocated: every process, rank = process index), or
    ``(None, n)`` for a process that runs none (a learner-only host of a disaggregated run). Rollout process
    of rank r starts groups ``r, r + n, r + 2n, ...``."""
    if jax.process_count() == 1:
        return 0, 1
    procs = resolve_roles(cfg).rollout_processes()
    me = jax.process_index()
    return (procs.index(me) if me in procs else None), len(procs)


def exchange_groups(cfg: Config, groups: Sequence[Sequence[Any]]) -> list:
    """Every process's groups of this step, in process order (a collective every process calls once per step of
    a disaggregated run, :func:`split_processes`): the rollout processes' trajectories reach the learner's.

    Through the ``jax.distributed`` key-value store as arrays (:func:`rollout.types.encode_groups`: the
    :meth:`~rollout.types.Trajectory.to_record` record Ray ships, raw array bytes behind a small JSON header of
    dtypes and shapes; every value bit for bit, no JSON lists, no pickle), not a device collective, so it never
    waits on devices busy decoding and the processes need not agree on shapes. The arrays that arrive are
    read-only views of the received bytes. A learner process waits at most ``runtime.peer_timeout_s`` for a
    rollout process's groups of one step.

    Raises:
        jax_rl.weight_sync.WeightSyncError: (one line) a peer did not hand in its groups in time (a lost host).
    """
    every = allgather_bytes(encode_groups(groups), timeout_s=cfg.runtime.peer_timeout_s, what="rollout groups")
    return [g for part in every for g in decode_groups(part)]


def split_processes(cfg: Config) -> bool:
    """True in a multi-process run where some process holds no learner device or no engine
    (:attr:`jax_rl.placement.Roles.split_processes`): the groups then cross to every process each step and
    the learner trains on the global batch (``jax_rl.runtime.loop``)."""
    if jax.process_count() == 1:
        return False
    return resolve_roles(cfg).split_processes


def engine_mesh(cfg: Config, index: Optional[int] = 0, roles: Any = None):
    """The mesh of rollout engine ``index`` (``placement.rollout`` / ``rollout.mesh``,
    :func:`jax_rl.placement.resolve_roles`): ``rollout.mesh`` over that engine's devices, or None
    for the colocated single-device engine (the default placement).

    Raises:
        ConfigError: (one line naming the key) the placement does not resolve, or ``index`` is not an
            engine of ``rollout.threads``.
    """
    if roles is None:
        try:
            roles = resolve_roles(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if roles.engines is None:
        return None
    if index is None:  # the eval engine: the first engine this process runs (engine 0 in one process)
        local = roles.local_engines()
        if not local:
            raise ConfigError(f"placement.rollout={cfg.placement.rollout} gives process {jax.process_index()} no "
                              "rollout engine of its own: give every host whole engines")
        index = local[0][0]
    if not 0 <= index < len(roles.engines):
        raise ConfigError(f"rollout engine {index} does not exist: rollout.threads={cfg.rollout.threads}")
    return make_mesh(**roles.engine_mesh, devices=roles.engines[index])


def user_model_mesh(cfg: Config, roles: Any = None):
    """The tau² user model engine's mesh: ``placement.user``'s devices laid out by
    :func:`jax_rl.placement.user_mesh_sizes`, or None (``placement.user`` null: the eval engine's mesh).

    Raises:
        ConfigError: (one line naming the key) the placement does not resolve.
    """
    if cfg.placement.user is None:
        return None
    if roles is None:
        try:
            roles = resolve_roles(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return make_mesh(**roles.user_mesh, devices=roles.user)


def build_generator(cfg: Config, model_config, params, version: int, *, temperature: Optional[float] = None,
                    slots: Optional[int] = None, seed: int = 0, engine: Optional[int] = None, roles: Any = None,
                    mesh: Any = None):
    """A started :class:`rollout.generator.Generator` over a fresh :class:`Qwen3Engine`.

    The engine's model is built with :func:`jax_rl.model_builder.rollout_model_kwargs` (the
    learner's ``model.scan_layers`` / ``moe_dispatch``, ``attention`` for prefill), so ``params``
    and every later ``update_params`` take the learner's params tree as is. ``engine``: which of
    the ``rollout.threads`` engines this is; with ``placement.rollout`` / ``rollout.mesh`` it runs
    sharded on that engine's mesh (:func:`engine_mesh`; ``roles``: an already resolved
    :class:`jax_rl.placement.Roles`), else on this process's first device as always. The eval engine
    (``engine=None``) is on the mesh of the first engine this process runs (engine 0 in one process;
    multi-process: each host evaluates on its own engine's devices). ``mesh``: a mesh of its own instead
    (the tau² user model's on ``placement.user``, :func:`user_model_mesh`).
    """

    eng = build_engine(cfg, model_config, params, temperature=temperature, slots=slots, engine=engine, roles=roles,
                       mesh=mesh)
    gen = new_generator(cfg, eng, version)
    gen.start()
    return gen


def new_generator(cfg: Config, eng, version: int):
    """An unstarted :class:`rollout.generator.Generator` over ``eng`` with the run's rollout knobs
    (``rollout.partial``, ``decode_steps``, ``keep_kv``, ``prefill_tokens_per_step``, ``prefix_cache``)."""
    r = cfg.rollout
    # a paged engine shares prefix pages by reference itself (rollout.kv_layout): no copying prefix cache
    prefix_cache = 0 if eng.kv.keeps_prefix_pages else r.prefix_cache
    return Generator(eng, partial=r.partial, version=version, decode_steps=r.decode_steps, keep_kv=r.keep_kv,
                     prefill_budget=r.prefill_tokens_per_step, prefix_cache=prefix_cache)


def engine_spec(cfg: Config, model_config, *, temperature: Optional[float] = None,
                slots: Optional[int] = None) -> EngineSpec:
    """The :class:`rollout.engine.EngineSpec` of the run's rollout engines, built once from the config
    (``rollout.*``, ``algo.temperature``, the model kwargs of :func:`jax_rl.model_builder.rollout_model_kwargs`,
    routing replay's ``record_routes``). ``temperature`` / ``slots``: an engine of other ones (the eval
    engine's temperature, the tau² user model's slots).

    Raises:
        ConfigError: a paged pool too small for one sequence (:func:`jax_rl.runtime.resources.kv_pool_pages`).
    """
    r = cfg.rollout
    return EngineSpec(
        slots=slots or r.slots,
        max_cache_len=r.max_cache_len,
        max_prefill_length=r.max_prefill_length,
        dtype=r.dtype,
        temperature=temperature if temperature is not None else cfg.algo.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        model_kwargs=rollout_model_kwargs(cfg),
        record_routes=RoutingReplay.from_config(cfg, model_config).records,  # Trajectory.routes (r2/r3, MoE)
        quantize=r.quantize,
        kv_layout=r.kv_layout,
        kv_page_size=r.kv_page_size,
        kv_pages=kv_pool_pages(cfg, model_config, slots=slots or r.slots),
        sampler=r.sampler,
        prefill_chunk_size=r.prefill_chunk_size,
    )


def build_engine(cfg: Config, model_config, params=None, *, temperature: Optional[float] = None,
                 slots: Optional[int] = None, engine: Optional[int] = None, roles: Any = None, mesh: Any = None):
    """The :class:`Qwen3Engine` of :func:`build_generator` (same arguments), without a generator;
    ``params`` None leaves it empty (a multi-process publish fills it, :mod:`jax_rl.weight_sync`)."""
    spec = engine_spec(cfg, model_config, temperature=temperature, slots=slots)
    return Qwen3Engine(model_config, params, spec, mesh=engine_mesh(cfg, engine, roles) if mesh is None else mesh)


def synced_generators(cfg: Config, model_config, learner, indices: list, version: int, *,
                      temperature: Optional[float] = None, roles: Any = None, eval_only: bool = False):
    """Multi-process: engines ``indices`` of this process (None = the eval engine) built empty, then filled by
    ONE :class:`jax_rl.weight_sync.ShardedWeightSync` push of the learner's params (a collective: every
    process calls it at the same point). Returns ``(generators, sync, keys)``: started generators at
    ``version``, the sync for later publishes, and each generator's target key in ``sync.push``'s result."""
    roles = resolve_roles(cfg) if roles is None else roles
    engines = [build_engine(cfg, model_config, None, temperature=temperature, engine=i, roles=roles) for i in indices]
    keys = []
    for i in indices:
        m = engine_mesh(cfg, i, roles)
        keys.append(SyncTarget(mesh=m).key if m is not None else SyncTarget(device=jax.local_devices()[0]).key)
    # a process with no engine of its own (a learner-only host, disaggregated) still sends its learner shards:
    # its template is engine 0 built on the other host's devices (nothing is allocated here: jax runs a
    # program over another process's devices as a no-op on this one)
    template = engines[0] if engines else build_engine(cfg, model_config, None, temperature=temperature, engine=0,
                                                        roles=roles)
    sync = ShardedWeightSync(learner.mesh, engine_targets(cfg, roles, eval_only=eval_only), template._cast_jit,
                             template, timeout_s=cfg.runtime.peer_timeout_s)
    placed = sync.push(learner.params, int(version))
    gens = []
    for eng, k in zip(engines, keys):
        eng.params = eng.load_params(placed[k])  # already the engine's layout: taken as is
        g = new_generator(cfg, eng, version)
        g.start()
        gens.append(g)
    return gens, sync, keys
