"""The programs and their rows (part of :mod:`jax_rl.compile`): :func:`compile_programs` compiles
each of :data:`FUNCTIONS` for the target and returns one row per function; the rollout, scorer and
weight-sync rows; what the rollout and scorer chips hold (:func:`_on_chip`); the publish programs
:func:`weight_sync_fn` / :func:`cast_fn`."""

from __future__ import annotations

import collections
import math
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_rl.checkpoint import abstract_like
from jax_rl.compile.analysis import HBM_SIDE_OPTIONS, _compile_or_oom, _is_hbm_oom, _oom_analysis, _oom_text
from jax_rl.compile.flops import model_flops_per_token
from jax_rl.compile.pieces import _fit, _opt_update_cost, _sft_fn_args, _train_cost
from jax_rl.compile.target import (_Target, _batch, _chips, _depth, _devices_per_chip, _engine_mesh, _layout,
                                   _learner, _target)
from jax_rl.config import Config, ConfigError
from jax_rl.dtypes import cast_floating, is_floating, resolve_dtype
from jax_rl.learner.spec import make_sft_optimizer, scorer_placement
from jax_rl.model_builder import abstract_model_split, resolve_model_config
from jax_rl.placement import BatchPlacement
from jax_rl.routing_replay import RoutingReplay
from jax_rl.sharding import make_mesh, state_shardings
from jax_rl.compile.engine import compile_rollout
from jax_rl.learner.train_step import StepParts, make_logprob_step, make_train_step
from rollout.engine.spec import EngineSpec

if TYPE_CHECKING:  # annotations only
    from jax_rl.learner.spec import LearnerSpec


FUNCTIONS = ("train_step", "sft_step", "prefill", "append_prefill", "decode_step", "weight_sync", "score_step",
             "user_prefill", "user_decode_step")


def _row(t: _Target, function: str, a: dict, compile_s: float, cost: Optional[dict], model_flops: Optional[float],
         shape: Sequence[int], pieces_s: float, *, role: str = "learner", devices: Optional[Sequence] = None) -> dict:
    """One row. ``role``: learner / rollout / scorer / user / sync; ``devices``: the role's devices (default the
    learner's): ``role_chips`` and the model FLOPs per chip are over them."""
    chip = t.spec.chip
    chips = t.spec.num_chips
    devs = t.devices if devices is None else devices
    head = {"role": role, "role_chips": _chips(t, devs), "device_ids": [int(d.id) for d in devs]}
    if "oom" in a:  # refused by the compiler: only what its message says is known
        return {**head, "function": function, "topology": t.spec.topology_name, "chips": chips, "hbm_args_bytes": None,
                "hbm_temp_bytes": None, "hbm_out_bytes": None, "hbm_total_bytes": None,
                "hbm_required_bytes": a["required"],
                "chip_hbm_bytes": chip.hbm_bytes, "fits": False, "compile_s": round(compile_s, 2),
                "flops_per_chip": None, "bytes_accessed_per_chip": None, "roofline_step_s": None,
                "mfu_bound": None, "model_flops_per_chip": None, "flops_ratio": None, "shape": list(shape),
                "cost_pieces_s": 0.0, "error": f"compiler: {a['oom']}"}
    total = a["peak_bytes_per_chip"]
    row = {
        **head, "function": function, "topology": t.spec.topology_name, "chips": chips,
        "hbm_args_bytes": a["argument_size_in_bytes"], "hbm_temp_bytes": a["temp_size_in_bytes"],
        "hbm_out_bytes": a["output_size_in_bytes"] - a["alias_size_in_bytes"],
        "hbm_total_bytes": total, "chip_hbm_bytes": chip.hbm_bytes, "fits": total <= chip.hbm_bytes,
        "compile_s": round(compile_s, 2), "flops_per_chip": None, "bytes_accessed_per_chip": None,
        "roofline_step_s": None, "mfu_bound": None, "model_flops_per_chip": None, "flops_ratio": None,
        "shape": list(shape), "cost_pieces_s": round(pieces_s, 2),
    }
    if cost is not None:
        per_dev = _devices_per_chip(t)
        fl, by = cost["flops"] * per_dev, cost["bytes_accessed"] * per_dev
        roof = max(fl / chip.peak_bf16_flops, by / chip.hbm_bandwidth)
        row.update(flops_per_chip=fl, bytes_accessed_per_chip=by, roofline_step_s=roof)
        if model_flops is not None:
            mf = model_flops / head["role_chips"]
            row.update(model_flops_per_chip=mf, flops_ratio=fl / mf if mf else None,
                       mfu_bound=(mf / (roof * chip.peak_bf16_flops)) if roof else None)
    return row


def compile_programs(cfg: Config, topology: str, *, functions: Sequence[str] = FUNCTIONS, cost: bool = True,
                     log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """AOT-compile ``functions`` of the run ``cfg`` for ``topology`` (``v5p-32``, ``v5e:2x2``, ...).

    Args:
        cfg: the run config (model, mesh, optim, loss, rollout, sft sections are read).
        topology: a Cloud TPU type or raw topology (:func:`jax_rl.compile.topology.resolve_topology`).
        functions: a subset of :data:`FUNCTIONS`.
        cost: also compile the loop-free cost pieces (FLOPs, bytes, roofline; :mod:`jax_rl.compile`'s docstring).
        log: progress lines (one per compiled program).

    Returns:
        one dict per function (:mod:`jax_rl.compile`'s docstring: the ``--json`` keys). Bytes are per chip.

    Raises:
        ConfigError: a mesh that does not fit the topology, a batch that does not split, an
            unknown function. RuntimeError: libtpu is not installed.
    """
    bad = [f for f in functions if f not in FUNCTIONS]
    if bad:
        raise ConfigError(f"unknown function(s) {bad}; choose from {list(FUNCTIONS)}")
    t = _target(cfg, topology)
    for n in t.notes:
        log(n)
    rows = []
    lrn = None
    if "train_step" in functions or "sft_step" in functions:
        lrn = _learner(t)
    if "train_step" in functions:
        rows.append(_train_step_row(t, lrn, cost, log))
    if "sft_step" in functions:
        rows.append(_sft_step_row(t, lrn, cost, log))
    em = _engine_mesh(t)
    if em is not None and any(f in functions for f in ("prefill", "append_prefill", "decode_step")):
        _log_engines(t, log)
    for fname in ("prefill", "append_prefill", "decode_step"):
        if fname not in functions:
            continue
        rows.append(_rollout_row(t, fname, cost, log, em))
    if "score_step" in functions and t.roles.scorer is not None:
        rows.append(_scorer_row(t, log))
    for fname in ("user_prefill", "user_decode_step"):
        if fname in functions and t.roles.user is not None:
            rows.append(_user_row(t, fname, log))
    if "weight_sync" in functions:
        rows.append(_weight_sync_row(t, lrn, cost, log, em))
    _on_chip(t, rows)
    return rows


def _train_step_row(t: _Target, lrn, cost: bool, log) -> dict:
    """The learner's RL step (role ``learner``): ``optim.batch_size`` x ``optim.max_seq_len`` laid out as
    [minibatches, microbatches, rows, T], with its loop-free cost pieces and model FLOPs when ``cost``."""
    cfg, mc = t.cfg, t.model_config
    T = int(cfg.optim.max_seq_len)
    B = int(cfg.optim.batch_size)
    U, m = cfg.optim.minibatches, cfg.optim.microbatches
    r = _layout(B, U, m, "optim.batch_size")
    b, sh = _batch(t, lrn.strategy, U, m, r, T)
    fn = make_train_step(cfg, StepParts.of(lrn), t.mesh, state_shardings=lrn.state_shardings, batch_sharding=sh)
    log(f"train_step: compiling [{B}, {T}] as [{U}, {m}, {r}, {T}] ({lrn.strategy.name}) ...")
    a, secs = _compile_or_oom(fn, (lrn.state, b), t.mesh)
    c, ps, mflops, reset = None, 0.0, None, None
    if cost and "oom" not in a:
        log("train_step: cost pieces ...")
        c, ps, f, reset = _train_cost(t, lrn, B, T)
        E = cfg.optim.ppo_epochs
        # model FLOPs: policy forward + backward per epoch, plus one pi_prox forward if the
        # strategy runs any (the cost is of a step without a reset: one forward for ppo_ewma)
        mflops = B * T * model_flops_per_token(mc, T) * (3 * E + min(f, 1))
    row = _row(t, "train_step", a, secs, c, mflops, [U, m, r, T], ps)
    if c is not None:
        per_dev = _devices_per_chip(t)
        row["reset_step_extra_flops_per_chip"] = reset["flops"] * per_dev if reset else None
        row["reset_step_extra_bytes_per_chip"] = reset["bytes_accessed"] * per_dev if reset else None
    log(f"train_step: {secs:.1f} s")
    return row


def _sft_step_row(t: _Target, lrn, cost: bool, log) -> dict:
    """The SFT warm-start step (role ``learner``): ``sft.batch_size`` x ``optim.max_seq_len`` as
    [1, microbatches, rows, T], its cost fitted from unscanned pieces when ``cost``."""
    cfg, mc = t.cfg, t.model_config
    L, T = mc.num_hidden_layers, int(cfg.optim.max_seq_len)
    B = int(cfg.sft.batch_size)
    m = cfg.optim.microbatches
    r = _layout(B, 1, m, "sft.batch_size")
    tx, sched = make_sft_optimizer(cfg)
    fn, args = _sft_fn_args(t, lrn, tx, sched, m, r, T)
    log(f"sft_step: compiling [{B}, {T}] as [1, {m}, {r}, {T}] ...")
    a, secs = _compile_or_oom(fn, args, t.mesh)
    c, ps, mflops = None, 0.0, None
    if cost and "oom" not in a:
        log("sft_step: cost pieces ...")
        one, ps = _fit(lambda cfg_, mc_: _sft_fn_args(t, _learner(t, mc_, cfg_, scan_layers=False), tx, sched,
                                                      1, r, T, cfg_), t, L, T, r)
        upd = _opt_update_cost(t, lrn, tx)
        ps += upd[1]
        c = {k: m * (one[k] - upd[0][k]) + upd[0][k] for k in ("flops", "bytes_accessed")}
        mflops = B * T * model_flops_per_token(mc, T) * 3
    log(f"sft_step: {secs:.1f} s")
    return _row(t, "sft_step", a, secs, c, mflops, [1, m, r, T], ps)


def _log_engines(t: _Target, log) -> None:
    """One progress line on the engines the rollout rows compile for (their count, mesh and devices)."""
    n = len(t.roles.engines)
    log(f"rollout: {n} engine(s), each on a {'x'.join(str(v) for v in t.roles.engine_mesh.values())} "
        f"(data x fsdp x tensor x expert) mesh of {len(t.roles.engines[0])} device(s); "
        + (f"the {n} engines have the same shape: compiled once, for engine 0 (devices "
           f"{[d.id for d in t.roles.engines[0]]})" if n > 1 else "compiled for its devices"))


def _rollout_row(t: _Target, fname: str, cost: bool, log, em=None) -> dict:
    """A rollout row (role ``rollout``): the colocated engine's step (``em`` None: params replicated,
    as the one-device engine holds them) or a sharded engine's on its mesh ``em`` (engine 0's; every
    engine has the same shape, so one compile stands for all: ``same_shape_engines``)."""
    r = t.cfg.rollout
    key = {"prefill": "prefill", "append_prefill": "append_prefill"}.get(fname, "decode")
    # the configured engine (the paged layout: its programs over the configured pool, rollout/engine/paged/)
    spec = EngineSpec(slots=r.slots, max_cache_len=r.max_cache_len, dtype=r.dtype, sampler=r.sampler,
                      model_kwargs=t.engine_kw, kv_layout=r.kv_layout, kv_page_size=r.kv_page_size,
                      kv_pages=r.kv_pages, prefill_chunk_size=r.prefill_chunk_size)
    kw = dict(prefill_len=r.max_prefill_length, only=(key,), mesh=em)
    devs = list(t.all_devices) if em is None else list(t.roles.engines[0])
    rk = dict(role="rollout", devices=devs)
    log(f"{fname}: compiling ({r.slots} slots, cache {r.max_cache_len}, prefill {r.max_prefill_length}) ...")
    shape = ([1, r.max_prefill_length] if key == "prefill" else [r.slots, r.max_prefill_length]
             if key == "append_prefill" else [r.slots, r.max_cache_len])
    t0 = time.perf_counter()
    try:
        full = compile_rollout(t.model_config, t.topology, spec, **kw)[key]
    except Exception as e:  # noqa: BLE001 - the TPU compiler refuses a program over HBM
        if not _is_hbm_oom(e):
            raise
        log(f"{fname}: does not fit ({_oom_text(e)})")
        row = _row(t, fname, _oom_analysis(e), time.perf_counter() - t0, None, None, shape, 0.0, **rk)
        _engine_keys(t, row, em)
        return row
    shape = full.get("tokens_shape", shape)  # a paged engine's chunked append-prefill program
    a = full
    c, ps = None, 0.0
    if cost:
        L = t.model_config.num_hidden_layers
        ek = dict(t.engine_kw, scan_layers=False)

        def pieces(options: Optional[dict]) -> tuple[dict, float]:
            """Unrolled depths 1 and 2, extrapolated to depth L: ({flops, bytes_accessed}, compile seconds)."""
            x = [compile_rollout(_depth(t.model_config, d), t.topology, spec.replace(model_kwargs=ek),
                                 compiler_options=options, **kw)[key] for d in (1, 2)]
            return ({k: x[0][k] + (L - 1) * (x[1][k] - x[0][k]) for k in ("flops", "bytes_accessed")},
                    sum(r_["compile_s"] for r_ in x))

        c, ps = pieces(None)
        if key == "decode":  # the same pieces with no VMEM staging: the HBM-side count
            hbm, s = pieces(HBM_SIDE_OPTIONS)
            c["hbm_side_bytes"], ps = hbm["bytes_accessed"], ps + s
    row = _row(t, fname, a, full["compile_s"], c, None, shape, ps, **rk)
    row["kv_layout"] = r.kv_layout
    _engine_keys(t, row, em)
    if key == "decode":
        base = full["params_per_chip"] + full["kv_cache_per_chip"]
        per_dev = _devices_per_chip(t)
        row["params_and_kv_cache_bytes_per_chip"] = base * per_dev
        row["params_bytes_per_chip"] = full["params_per_chip"] * per_dev
        row["kv_cache_bytes_per_chip"] = full["kv_cache_per_chip"] * per_dev
        if c is not None:
            row["bytes_accessed_ratio"] = c["bytes_accessed"] / base
            row["hbm_side_bytes_accessed_per_chip"] = c["hbm_side_bytes"] * per_dev
            row["hbm_side_ratio"] = c["hbm_side_bytes"] / base
    log(f"{fname}: {full['compile_s']:.1f} s")
    return row


def _engine_keys(t: _Target, row: dict, em) -> None:
    """The engine layout of a rollout row: ``engine_mesh`` (axis sizes; None = the colocated one-device
    engine) and ``same_shape_engines`` (how many engines this one compile stands for)."""
    row["engine_mesh"] = None if em is None else dict(t.roles.engine_mesh)
    row["same_shape_engines"] = int(t.cfg.rollout.threads) if em is None else len(t.roles.engines)
    if em is None:  # the colocated engine lives on the learner's first device; the program is replicated
        row["device_ids"] = [int(t.devices[0].id)]
        row["role_chips"] = 1


def _scorer_row(t: _Target, log) -> dict:
    """The ``score_step`` row (role ``scorer``): the dedicated old-logit scorer's forward
    (:meth:`jax_rl.learner.correction.old_logits.stage.OldLogitStage.make_scorer` with ``placement.scorer``: fp32 params on an
    ``fsdp`` mesh over the scorer's devices, one GRPO group of ``algo.group_size`` rows x
    ``optim.max_seq_len`` per call). Its chips also hold ``versions_held`` = ``async.max_staleness`` + 1
    param versions (:func:`_on_chip` adds the other versions' params)."""
    cfg = t.cfg
    devs = t.roles.scorer
    mesh, abs_params, sh = scorer_placement(cfg, t.model_config, devs, model_kw=t.learner_kw)
    graphdef, _, rest = abstract_model_split(t.model_config, **t.learner_kw)
    routing = RoutingReplay.from_config(cfg, t.model_config)
    forced = routing.forces_rollout_routes  # an r3 scorer runs the forward with the recorded routes forced
    fn = make_logprob_step(cfg, graphdef, rest=rest, param_shardings=sh, with_routes=forced)
    G, T = int(cfg.algo.group_size), int(cfg.optim.max_seq_len)
    bs = BatchPlacement(mesh, 1, 1).batch_sharding(G)
    args = (abstract_like(abs_params, sh), jax.ShapeDtypeStruct((1, 1, G, T), jnp.int32, sharding=bs),
            jax.ShapeDtypeStruct((1, 1, G, T), jnp.bool_, sharding=bs))
    if forced:
        (tail, dt) = routing.route_spec(t.model_config)
        args = args + (jax.ShapeDtypeStruct((1, 1, G, T, *tail), dt, sharding=bs),)
    log(f"score_step: compiling the scorer's forward ([{G}, {T}], fsdp over {len(devs)} device(s)) ...")
    a, secs = _compile_or_oom(fn, args, mesh)
    log(f"score_step: {secs:.1f} s")
    row = _row(t, "score_step", a, secs, None, None, [1, 1, G, T], 0.0, role="scorer", devices=devs)
    row["versions_held"] = int(cfg.async_.max_staleness) + 1
    row["params_bytes_per_chip"] = _shard_bytes(abs_params, sh, jnp.float32) * _devices_per_chip(t)
    return row


def _user_model_config(t: _Target):
    """The tau² user model's ``Qwen3Config``: ``env.tau2.user_model.checkpoint``'s ``config.json``, or the
    policy's (a frozen copy of its starting weights)."""
    cfg = t.cfg
    ck = cfg.env.tau2.user_model.checkpoint
    if not ck:
        return t.model_config
    ucfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"checkpoint": ck, "hf_overrides": {}})})
    try:
        return resolve_model_config(ucfg.model, check_tensors=False)
    except Exception as e:  # noqa: BLE001 - one line naming the key
        raise ConfigError(f"env.tau2.user_model.checkpoint={ck!r}: {e}") from None


def _user_row(t: _Target, fname: str, log) -> dict:
    """A ``user_prefill`` / ``user_decode_step`` row (role ``user``): the tau² user simulator model's engine
    (``env.tau2.user=model``) on ``placement.user``'s devices, laid out by
    :func:`jax_rl.placement.user_mesh_sizes`, with the rollout engines' slots, cache and dtype
    (:func:`jax_rl.runtime.envs.start_tau2_user_model` builds it so). Its params are frozen: no
    publish reaches it. No cost pieces (HBM only); the decode row adds ``params_bytes_per_chip`` /
    ``kv_cache_bytes_per_chip``, and ``hbm_on_chip_bytes`` / ``fits_on_chip`` (one engine per chip)."""
    r = t.cfg.rollout
    key = "prefill" if fname == "user_prefill" else "decode"
    devs = list(t.roles.user)
    mesh = make_mesh(**t.roles.user_mesh, devices=devs)
    mc = _user_model_config(t)
    shape = [1, r.max_prefill_length] if key == "prefill" else [r.slots, r.max_cache_len]
    log(f"{fname}: compiling the user model's {key} ({r.slots} slots, cache {r.max_cache_len}; "
        f"{'x'.join(str(v) for v in t.roles.user_mesh.values())} mesh over {len(devs)} device(s)) ...")
    t0 = time.perf_counter()
    try:
        spec = EngineSpec(slots=r.slots, max_cache_len=r.max_cache_len, dtype=r.dtype, model_kwargs=t.engine_kw, kv_layout="contiguous")
        full = compile_rollout(mc, t.topology, spec, prefill_len=r.max_prefill_length, only=(key,), mesh=mesh)[key]
    except Exception as e:  # noqa: BLE001 - the TPU compiler refuses a program over HBM
        if not _is_hbm_oom(e):
            raise
        log(f"{fname}: does not fit ({_oom_text(e)})")
        return _row(t, fname, _oom_analysis(e), time.perf_counter() - t0, None, None, shape, 0.0, role="user",
                    devices=devs)
    row = _row(t, fname, full, full["compile_s"], None, None, shape, 0.0, role="user", devices=devs)
    row["user_mesh"] = dict(t.roles.user_mesh)
    if key == "decode":
        per_dev = _devices_per_chip(t)
        row["params_bytes_per_chip"] = full["params_per_chip"] * per_dev
        row["kv_cache_bytes_per_chip"] = full["kv_cache_per_chip"] * per_dev
        row["hbm_on_chip_bytes"] = row["hbm_total_bytes"]
        row["fits_on_chip"] = row["fits"]
    log(f"{fname}: {full['compile_s']:.1f} s")
    return row


def weight_sync_fn(abs_params, param_shardings, mesh, dtype: str):
    """The jitted reshard of a publish: learner params (``param_shardings``) -> the rollout
    engine's params: float leaves cast to ``dtype`` (``rollout.dtype``, as
    :meth:`rollout.engine.Qwen3Engine.load_params` casts them), every leaf replicated on ``mesh``.
    Returns ``(fn, args)`` with ``args`` the ``ShapeDtypeStruct`` params (nothing allocated)."""
    dt = resolve_dtype(dtype)
    rep = NamedSharding(mesh, P())

    def sync(params):  # cast in the learner's layout first, as load_params' eager astype: the gather moves rollout bytes
        return cast_floating(params, dt, param_shardings)

    fn = jax.jit(sync, in_shardings=(param_shardings,), out_shardings=jax.tree.map(lambda _: rep, abs_params))
    return fn, (abstract_like(abs_params, param_shardings),)


def cast_fn(abs_params, param_shardings, dtype: str):
    """The learner-side half of a publish to a sharded engine (:meth:`rollout.engine.Qwen3Engine.load_params`'s
    ``_cast_jit``): float leaves cast to ``dtype`` where the params are, in the learner's shardings; the
    shards then travel to the engine's devices by ``jax.device_put`` (a device-to-device copy over ICI, which
    no single program on one device set can express). Returns ``(fn, args)`` (nothing allocated)."""
    dt = resolve_dtype(dtype)
    fn = jax.jit(lambda params: cast_floating(params, dt), in_shardings=(param_shardings,), out_shardings=param_shardings)
    return fn, (abstract_like(abs_params, param_shardings),)


def _shard_bytes(abs_params, shardings, dtype) -> int:
    """Bytes of one device's shards of ``abs_params`` laid out by ``shardings``, float leaves in ``dtype``."""
    def one(x, sh):
        size = jnp.dtype(dtype).itemsize if is_floating(x) else x.dtype.itemsize
        return math.prod(sh.shard_shape(x.shape)) * size

    return sum(jax.tree.leaves(jax.tree.map(one, abs_params, shardings)))


def _weight_sync_row(t: _Target, lrn: Optional[LearnerSpec], cost: bool, log, em=None) -> dict:
    """The ``weight_sync`` row (role ``sync``); its shape is ``[param count]``. Loop-free: the full
    program's ``cost_analysis`` is its cost.

    Colocated engines (``em`` None): :func:`weight_sync_fn` compiled for the learner's mesh. Sharded
    engines (``em``, engine 0's mesh): :func:`cast_fn`, the cast on the learner's mesh, whose shards
    ``device_put`` then moves to each engine.

    The ICI figures (vendor peaks, a lower bound on the time: one direction of every link of a chip busy,
    no hop, contention or latency counted): ``sync_bytes`` = one engine's params in ``rollout.dtype``;
    ``sync_engines`` engines receive them every publish (``rollout.threads``; the eval engine takes its
    copy only at eval time); ``sync_in_bytes_per_chip`` = what one engine chip receives (its shards:
    replicated leaves whole), ``sync_out_bytes_per_chip`` = all engines' bytes over the learner's chips
    (evenly spread: the best case); ``sync_ici_roofline_s`` = max(in, out) / (half the chip's
    bidirectional ICI bandwidth, :data:`jax_rl.compile.topology.CHIPS`). Colocated: each engine's whole copy goes to
    the learner's first chip (in = engines x (sync_bytes - that chip's own shard), out = one shard)."""
    if lrn is not None:
        abs_params, param_sh = lrn.params, lrn.param_shardings
    else:
        _, abs_params, _ = abstract_model_split(t.model_config, **t.learner_kw)
        param_sh = state_shardings(abs_params, t.mesh)
    n = sum(int(x.size) for x in jax.tree.leaves(abs_params))
    dt = t.cfg.rollout.dtype
    if em is None:
        log(f"weight_sync: compiling the publish reshard ({n} params, fp32 learner layout -> {dt} replicated) ...")
        fn, args = weight_sync_fn(abs_params, param_sh, t.mesh, dt)
    else:
        log(f"weight_sync: compiling the publish cast ({n} params, fp32 -> {dt} in the learner's layout; the "
            "shards then move to each engine's mesh by device_put) ...")
        fn, args = cast_fn(abs_params, param_sh, dt)
    a, secs = _compile_or_oom(fn, args, t.mesh)
    c = {"flops": a["flops"], "bytes_accessed": a["bytes_accessed"]} if cost and "oom" not in a else None
    log(f"weight_sync: {secs:.1f} s")
    row = _row(t, "weight_sync", a, secs, c, None, [n], 0.0, role="sync")

    rdt = resolve_dtype(dt)
    one = sum(int(x.size) * (jax.numpy.dtype(rdt).itemsize if is_floating(x)
                             else x.dtype.itemsize) for x in jax.tree.leaves(abs_params))
    per_dev = _devices_per_chip(t)
    own = _shard_bytes(abs_params, param_sh, rdt) * per_dev  # one learner chip's shard, in the rollout dtype
    if em is None:
        engines = int(t.cfg.rollout.threads)
        into = engines * max(one - own, 0)
        out = into
        dest = [t.devices[0]]
    else:
        engines = len(t.roles.engines)
        into = _shard_bytes(abs_params, state_shardings(abs_params, em), rdt) * per_dev
        out = engines * into * _chips(t, t.roles.engines[0]) / row["role_chips"]
        dest = t.roles.engines[0]
    ici = t.spec.chip.ici_bandwidth
    row.update(sync_bytes=one, sync_engines=engines, sync_bytes_total=engines * one, sync_in_bytes_per_chip=into,
               sync_out_bytes_per_chip=out, ici_bandwidth=ici,
               sync_ici_roofline_s=(max(into, out) / (ici / 2)) if ici else None,
               sync_dest_device_ids=[int(d.id) for d in dest])
    # A publish across processes (jax_rl.weight_sync.ShardedWeightSync): each learner chip stages ONE engine
    # chip's shard in rollout.dtype (the learner's chips viewed as replicas of the engine's mesh; a one-chip
    # engine: the whole copy), each replica group sends it to the engines assigned to it (spread evenly), and
    # the learner holds it beside its live state (params + optimizer state: the train_step's arguments) while
    # the step's temporaries are gone. Rooflines at the vendor's per-chip ICI (one direction) and DCN figures.
    e_chips = _chips(t, t.roles.engines[0]) if em is not None else 1
    replicas = max(1, row["role_chips"] // max(1, e_chips))
    staged = into if em is not None else one
    send = -(-engines // replicas) * staged if em is not None else into
    dcn = t.spec.chip.dcn_bandwidth
    row.update(sync_staged_bytes_per_learner_chip=staged, sync_send_bytes_per_learner_chip=send,
               sync_recv_bytes_per_engine_chip=into, dcn_bandwidth=dcn,
               sync_ici_cross_roofline_s=(max(send, into) / (ici / 2)) if ici else None,
               sync_dcn_roofline_s=(max(send, into) / dcn) if dcn else None)
    return row


def _on_chip(t: _Target, rows: list[dict]) -> None:
    """What the rollout chips hold beside one engine's programs (the ``decode_step`` row) and what the
    scorer's chips hold (the ``score_step`` row):

    * colocated default (``placement.rollout`` null, one-device engines): ``jax-rl train`` (embedded
      runtime) puts its ``rollout.threads`` + 1 (eval) engines on the learner's first device, beside its
      shard: ``engines``, ``hbm_with_learner_bytes`` = train_step total + engines x decode_step total,
      ``fits_with_learner`` (and the same as ``hbm_on_chip_bytes`` / ``fits_on_chip``);
    * sharded engines: the busiest engine mesh holds ``engines_on_chip`` engines (engines sharing a device
      set add up; the eval engine is counted on engine 0's mesh), each with its params and KV cache:
      ``hbm_on_chip_bytes`` = that many decode_step totals, plus the learner's train_step total where an
      engine's devices are also the learner's (then ``hbm_with_learner_bytes`` / ``fits_with_learner`` too);
    * both: ``hbm_on_chip_during_sync_bytes`` / ``fits_during_sync``: + one new params copy per rollout
      engine a publish updates on those chips, held beside the old one until the engine swaps (the eval
      engine is updated at eval time, between publishes: at most as many copies).
    """
    by = {r["function"]: r for r in rows}
    tr, d = by.get("train_step"), by.get("decode_step")
    learner = tr["hbm_total_bytes"] if tr is not None else None
    if d is not None and d["hbm_total_bytes"] is not None:
        if t.roles is None or t.roles.engines is None:
            n, overlap = int(t.cfg.rollout.threads) + 1, True
            synced = n - 1
        else:
            sets = collections.Counter(tuple(x.id for x in e) for e in t.roles.engines)
            synced = max(sets.values())
            sets[tuple(x.id for x in t.roles.engines[0])] += 1  # the eval engine
            n = max(sets.values())
            lids = {x.id for x in t.devices}
            overlap = any(x.id in lids for e in t.roles.engines for x in e)
        d["engines"] = n
        d["engines_on_chip"] = n
        d["learner_on_chip"] = overlap
        if overlap and learner is None:
            d["hbm_on_chip_bytes"] = d["fits_on_chip"] = None  # the learner's share is unknown
        else:
            d["hbm_on_chip_bytes"] = n * d["hbm_total_bytes"] + (learner if overlap else 0)
            d["fits_on_chip"] = d["hbm_on_chip_bytes"] <= d["chip_hbm_bytes"]
            d["hbm_on_chip_during_sync_bytes"] = d["hbm_on_chip_bytes"] + synced * d["params_bytes_per_chip"]
            d["fits_during_sync"] = d["hbm_on_chip_during_sync_bytes"] <= d["chip_hbm_bytes"]
        if overlap and learner is not None:
            d["hbm_with_learner_bytes"] = d["hbm_on_chip_bytes"]
            d["fits_with_learner"] = d["fits_on_chip"]
    ws = by.get("weight_sync")
    if tr is not None and ws is not None and tr.get("hbm_args_bytes") is not None \
            and ws.get("sync_staged_bytes_per_learner_chip") is not None:
        # during a publish (between steps) a learner chip holds its live state plus the staged shard
        tr["hbm_during_sync_bytes"] = tr["hbm_args_bytes"] + ws["sync_staged_bytes_per_learner_chip"]
        tr["fits_during_sync"] = tr["hbm_during_sync_bytes"] <= tr["chip_hbm_bytes"]
    sc = by.get("score_step")
    if sc is not None and sc["hbm_total_bytes"] is not None:
        sc["hbm_on_chip_bytes"] = sc["hbm_total_bytes"] + (sc["versions_held"] - 1) * sc["params_bytes_per_chip"]
        sc["fits_on_chip"] = sc["hbm_on_chip_bytes"] <= sc["chip_hbm_bytes"]
