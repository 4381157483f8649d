"""``jax-rl train CONFIG --dry-run``: build everything a run needs, compile one train step, exit.

Builds the env factory, tokenizer, model config, mesh and :class:`~jax_rl.learner.learner.Learner`
(params on the mesh) exactly as ``jax-rl train`` does, checks that the rollout KV cache fits,
then lowers and compiles the learner's train step for the worst-case batch ``[optim.batch_size,
optim.max_seq_len]`` from shapes alone (no batch is allocated, no step runs). Prints one table.
Creates no run dir and writes nothing.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax
import numpy as np

from jax_rl.config import Config
from jax_rl.model_builder import layers_stacked, learner_model_kwargs
from jax_rl.runtime.context import RunContext
from jax_rl.runtime.resources import kv_cache_bytes

__all__ = ["dry_run", "run_dry_run"]


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
    cfg = cfg.model_copy(deep=True)
    cfg.resume = False  # a dry run restores nothing
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
            "kv_cache_bytes_per_engine": kv_cache_bytes(cfg, tr.model_config),
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
    t = Table(title=f"jax-rl dry run: {cfg.run.name} (nothing written)", title_justify="left",
              header_style="bold")
    t.add_column("what", style="cyan", no_wrap=True)
    t.add_column("value", overflow="fold")
    rows = [
        ("parameters", f"{res['params']:,}"),
        ("param bytes (fp32 master)", _human(res["param_bytes"])),
        ("KV cache, all engines", f"{_human(res['kv_cache_bytes'])} = {res['rollout_engines']} engine(s) x "
                                  f"{_human(res['kv_cache_bytes_per_engine'])}"),
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
    return 0
