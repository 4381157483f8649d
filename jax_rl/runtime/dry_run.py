"""``jax-rl train CONFIG --dry-run``: build everything a run needs, compile one train step, exit.

Builds the env factory, tokenizer, model config, mesh and :class:`~jax_rl.learner.learner.Learner`
(params on the mesh) exactly as ``jax-rl train`` does, checks that the rollout KV cache fits,
then lowers and compiles the learner's train step for the worst-case batch ``[optim.batch_size,
optim.max_seq_len]`` from shapes alone (no batch is allocated, no step runs). Prints one table.
Creates no run dir and writes nothing.

Before the weights are downloaded (a pod config's placeholder ``model.checkpoint`` / ``model.tokenizer``
paths, absent here) it checks everything that does not need them: the shapes from ``model.preset``
(random init), the compact demo tokenizer in the tokenizer's place. When this host has fewer devices
than the config places (a pod config on a laptop), nothing can be built on the run's mesh: it checks the
config, the env, the mesh / placement arithmetic and the memory per role from the shapes alone
(:func:`weightless_report`) and names ``jax-rl compile`` for the programs. Either way ONE line says what
was skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from jax_rl.config import Config, ConfigError
from jax_rl.model_builder import layers_stacked, learner_model_kwargs, resolve_model_config
from jax_rl.models.qwen3 import count_params
from jax_rl.runtime.context import RunContext
from jax_rl.runtime.envs import build_env_factory
from jax_rl.runtime.resources import engine_memory_bytes, kv_pool_pages

__all__ = ["dry_run", "run_dry_run", "stand_ins", "weightless_report"]


def stand_ins(cfg: Config) -> tuple[Config, list[str]]:
    """``cfg`` with stand-ins for the inputs absent on this host, and what each one skips: a
    ``model.checkpoint`` path that does not exist -> ``None`` (shapes from ``model.preset``, random init; a
    path that exists is never replaced, so a run dir or a dir without config.json gets the loader's error);
    a ``model.tokenizer`` path that does not exist -> ``compact``. ``cfg`` itself is not changed.

    Raises:
        ConfigError: the checkpoint is absent and no ``model.preset`` gives the shapes.
    """
    skipped: list[str] = []
    m = cfg.model
    update: dict[str, Any] = {}
    ck = m.checkpoint
    if ck and not Path(ck).exists():
        if not m.preset:
            raise ConfigError(f"model.checkpoint={ck}: not here and no model.preset to take the shapes "
                              "from (set model.preset to dry-run before the weights are here)")
        update["checkpoint"] = None
        skipped.append(f"loading the weights (model.checkpoint={ck} is not here: shapes from preset {m.preset}, "
                       "random weights where built)")
    tok = str(m.tokenizer)
    if tok not in ("compact", "bpe") and not Path(tok).exists():
        update["tokenizer"] = "compact"
        skipped.append(f"the tokenizer (model.tokenizer={tok} is not here: the compact demo tokenizer stands in)")
    if not update:
        return cfg, skipped
    out = cfg.model_copy(deep=True)
    out.model = m.model_copy(update=update)
    return out, skipped


def _placed_devices(cfg: Config) -> int:
    """Devices the config asks for: the sum of the ``placement.*`` roles (a count or a list of ids), else the
    fixed product of ``mesh.*`` (-1 axes count 1)."""
    pl = cfg.placement
    roles = [v for v in (pl.learner, pl.rollout, pl.scorer, pl.user) if v is not None]
    if roles:
        return sum(len(v) if isinstance(v, list) else int(v) for v in roles)
    return int(cfg.mesh.fixed_product())


def weightless_report(cfg: Config, skipped: list[str]) -> dict[str, Any]:
    """The checks of a config whose devices are not on this host, from shapes alone (nothing built, nothing
    compiled): the env (one built), the model config, parameter count, the learner's mesh on its devices,
    the learner's bytes per device (fp32 params + AdamW's two moments, 12 B per parameter, split over the
    mesh's fsdp x tensor x expert shards; activations not counted) and each rollout engine's bytes per
    device (:func:`jax_rl.runtime.resources.engine_memory_bytes`' params copy, KV cache and decode state,
    split over ``rollout.mesh``'s devices; the decode step's temporaries not counted). Estimates, not
    measurements; ``jax-rl compile`` gives the compiler's figures per program.

    Raises:
        ConfigError: the env, model or mesh does not resolve.
    """
    build_env_factory(cfg)
    mc = resolve_model_config(cfg.model)
    n = count_params(mc)
    pl = cfg.placement
    need = _placed_devices(cfg)
    n_learner = (len(pl.learner) if isinstance(pl.learner, list) else int(pl.learner)) if pl.learner else need
    sizes = cfg.mesh.resolve(n_learner)
    if sizes is None:
        shown = " ".join(f"mesh.{k}={v}" for k, v in cfg.mesh.sizes().items())
        raise ConfigError(f"{shown} does not fit the learner's {n_learner} device(s)")
    shards = sizes.get("fsdp", 1) * sizes.get("tensor", 1) * sizes.get("expert", 1)
    em = engine_memory_bytes(cfg, mc)
    eng_devices = max(1, int(cfg.rollout.mesh.fixed_product()))
    return {"weightless": True, "params": n, "param_bytes": 4 * n, "model": mc,
            "learner_devices": n_learner, "mesh": sizes, "learner_bytes_per_device": 12 * n // shards,
            "rollout_engines": cfg.rollout.threads, "engine_devices": eng_devices,
            "engine_bytes_per_device": (em["params"] + em["kv_cache"] + em["state"]) // eng_devices,
            "kv_cache_bytes_per_engine": em["kv_cache"], "kv_pool_pages": kv_pool_pages(cfg, mc),
            "batch_shape": [cfg.optim.batch_size, cfg.optim.max_seq_len],
            "devices_needed": need, "devices": f"{jax.device_count()} x {jax.default_backend()}",
            "skipped": skipped + [f"building the learner and engines and compiling the train step (the config places "
                                  f"{need} devices, this host has {jax.device_count()} {jax.default_backend()}): "
                                  "`jax-rl compile CONFIG --topology <TPU type>` compiles every program for the pod "
                                  "from this host"]}


def dry_run(cfg: Config) -> dict[str, Any]:
    """Build the run's pieces and compile one train step; return the figures as a dict.

    Keys: ``params`` (count), ``param_bytes`` (fp32 master params), ``kv_cache_bytes`` (all
    rollout engines: ``rollout.threads`` + 1 eval), ``kv_cache_bytes_per_engine``,
    ``batch_shape`` ``[B, T]``, ``batch_layout`` ``[minibatches, microbatches, rows, T]``,
    ``mesh``, ``devices``, ``layers`` (``"stacked (scan)"`` or ``"unrolled"``: the learner's and
    the engines' decoder layout, ``model.scan_layers``), ``attention`` (resolved: ``xla`` /
    ``splash``), ``compile_s`` and, when XLA reports it, ``compiled_temp_bytes``.

    Raises:
        ConfigError: everything ``jax-rl train`` would refuse before its first step (bad
            tokenizer, checkpoint, env, mesh, a KV cache larger than memory).
    """
    t0 = time.perf_counter()
    cfg, skipped = stand_ins(cfg)
    cfg = cfg.model_copy(deep=True)
    cfg.resume = False  # a dry run restores nothing
    if _placed_devices(cfg) > jax.device_count():
        return weightless_report(cfg, skipped)
    tr = RunContext(cfg, create_dir=False)
    try:
        lr = tr.learner
        build_s = time.perf_counter() - t0
        leaves = jax.tree.leaves(lr.state.params)
        n_params = int(sum(int(np.prod(x.shape)) for x in leaves))
        B, T = cfg.optim.batch_size, cfg.optim.max_seq_len
        U, m, r = lr.placement.layout(B)
        t1 = time.perf_counter()
        compiled = lr.lower_train_step(B, T).compile()
        compile_s = time.perf_counter() - t1
        out: dict[str, Any] = {
            "params": n_params,
            "param_bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
            "kv_cache_bytes": int(tr.kv_cache_bytes),
            "kv_cache_bytes_per_engine": engine_memory_bytes(cfg, tr.model_config)["kv_cache"],
            "kv_pool_pages": kv_pool_pages(cfg, tr.model_config),
            "rollout_engines": cfg.rollout.threads + 1,
            "batch_shape": [B, T],
            "batch_layout": [U, m, r, T],
            "mesh": dict(zip(lr.mesh.axis_names, (int(s) for s in lr.mesh.devices.shape))),
            "devices": f"{jax.device_count()} x {jax.default_backend()}",
            "correction": cfg.loss.correction,
            "layers": "stacked (scan)" if layers_stacked(tr.model_config, cfg.model.scan_layers) else "unrolled",
            "attention": learner_model_kwargs(cfg)["attention"],
            "tokenizer": f"{cfg.model.tokenizer} (vocab {tr.tokenizer.vocab_size})",
            "build_s": round(build_s, 2),
            "compile_s": round(compile_s, 2),
            "skipped": skipped,
        }
        try:
            ma = compiled.memory_analysis()
            temp = getattr(ma, "temp_size_in_bytes", None)
            if temp is not None:
                out["compiled_temp_bytes"] = int(temp)
        except Exception:  # not every backend reports memory analysis
            pass
        return out
    finally:
        tr.learner.close()


def _human(n: int) -> str:
    """``1536`` -> ``1.50 KiB (1,536 B)``."""
    for i, unit in enumerate(("KiB", "MiB", "GiB", "TiB")):
        if n < 1024 ** (i + 2) or unit == "TiB":
            return f"{n:,} B" if n < 1024 else f"{n / 1024 ** (i + 1):.2f} {unit} ({n:,} B)"
    return f"{n:,} B"  # pragma: no cover


def run_dry_run(cfg: Config, console: Optional[Any] = None) -> int:
    """``--dry-run``: :func:`dry_run`, then a rich table on stdout. Returns 0.

    Raises:
        ConfigError: as :func:`dry_run`.
    """
    from rich.console import Console
    from rich.table import Table

    res = dry_run(cfg)
    if res.get("weightless"):
        return _print_weightless(cfg, res, console)
    t = Table(title=f"jax-rl dry run: {cfg.run.name} (nothing written)", title_justify="left",
              header_style="bold")
    t.add_column("what", style="cyan", no_wrap=True)
    t.add_column("value", overflow="fold")
    rows = [
        ("parameters", f"{res['params']:,}"),
        ("param bytes (fp32 master)", _human(res["param_bytes"])),
        ("KV cache, all engines", f"{_human(res['kv_cache_bytes'])} = {res['rollout_engines']} engine(s) x "
                                  f"{_human(res['kv_cache_bytes_per_engine'])}"),
        *_pool_row(cfg, res),
        ("learner batch [B, T]", str(res["batch_shape"])),
        ("batch layout [U, m, r, T]", str(res["batch_layout"])),
        ("mesh", " ".join(f"{k}={v}" for k, v in res["mesh"].items()) + f" on {res['devices']}"),
        ("loss.correction", res["correction"]),
        ("decoder layers", f"{res['layers']} (model.scan_layers={str(cfg.model.scan_layers).lower()}), "
                           f"attention {res['attention']}"),
        ("tokenizer", res["tokenizer"]),
        ("build time", f"{res['build_s']:.2f} s"),
        ("train-step compile", f"{res['compile_s']:.2f} s"),
    ]
    if "compiled_temp_bytes" in res:
        rows.append(("compiled temp memory", _human(res["compiled_temp_bytes"])))
    for k, v in rows:
        t.add_row(k, v)
    (console or Console()).print(t)
    _print_skipped(res["skipped"])
    return 0


def _pool_row(cfg: Config, res: dict[str, Any]) -> list[tuple[str, str]]:
    """The paged layout's pool (``rollout.kv_layout=paged``): pages, their size, the positions and bytes per
    engine, beside what the contiguous layout would reserve; none for the contiguous layout."""
    pages, r = res.get("kv_pool_pages"), cfg.rollout
    if pages is None:
        return []
    by = "rollout.kv_pages" if r.kv_pages is not None else "rollout.kv_pool_gib" if r.kv_pool_gib is not None \
        else "default: the contiguous layout's memory"
    return [("KV pool (paged) per engine", f"{pages:,} pages x rollout.kv_page_size={r.kv_page_size} = "
             f"{pages * r.kv_page_size:,} positions, {_human(res['kv_cache_bytes_per_engine'])} ({by}; contiguous: "
             f"rollout.slots={r.slots} x max_cache_len={r.max_cache_len} = {r.slots * r.max_cache_len:,} positions)")]


def _print_skipped(skipped: list[str]) -> None:
    if skipped:  # one line, plain print (a rich console would wrap it)
        print("skipped (not on this host): " + "; ".join(skipped), flush=True)


def _print_weightless(cfg: Config, res: dict[str, Any], console: Optional[Any]) -> int:
    from rich.console import Console
    from rich.table import Table

    mc = res["model"]
    t = Table(title=f"jax-rl dry run: {cfg.run.name} (shapes only, nothing built or written)", title_justify="left",
              header_style="bold")
    t.add_column("what", style="cyan", no_wrap=True)
    t.add_column("value", overflow="fold")
    rows = [
        ("model", f"{mc.num_hidden_layers} layers, d={mc.hidden_size}, heads {mc.num_attention_heads}/"
                  f"{mc.num_key_value_heads}x{mc.head_dim}, vocab {mc.vocab_size}"
                  + (f", {mc.num_experts} experts top-{mc.num_experts_per_tok}" if mc.is_moe else "")),
        ("parameters", f"{res['params']:,}"),
        ("param bytes (fp32 master)", _human(res["param_bytes"])),
        ("devices placed", f"{res['devices_needed']} (learner {res['learner_devices']}: mesh "
                           + " ".join(f"{k}={v}" for k, v in res["mesh"].items()) + ")"),
        ("learner per device (est.)", f"{_human(res['learner_bytes_per_device'])}: fp32 params + AdamW moments, "
                                      "before activations"),
        ("rollout engine per device (est.)", f"{_human(res['engine_bytes_per_device'])} on each of "
                                             f"{res['engine_devices']} device(s) x {res['rollout_engines']} engine(s): "
                                             "params copy + KV cache + decode state"),
        ("KV cache per engine", _human(res["kv_cache_bytes_per_engine"])),
        *_pool_row(cfg, res),
        ("learner batch [B, T]", str(res["batch_shape"])),
        ("this host", res["devices"]),
    ]
    for k, v in rows:
        t.add_row(k, v)
    (console or Console()).print(t)
    _print_skipped(res["skipped"])
    return 0
