"""``train --dry-run`` on the paged layout shows the pool (issue 63 item 6): its pages, page size, positions and
bytes per engine beside what the contiguous layout reserves; nothing for the contiguous layout."""

from __future__ import annotations

from jax_rl.config import load_config
from jax_rl.model_builder import resolve_model_config
from jax_rl.runtime.dry_run import _pool_row
from jax_rl.runtime.resources import engine_memory_bytes, kv_pool_pages


def _row(*overrides):
    cfg = load_config("tiny_cpu", ["model.tokenizer=compact", *overrides])
    mc = resolve_model_config(cfg.model)
    res = {"kv_pool_pages": kv_pool_pages(cfg, mc), "kv_cache_bytes_per_engine": engine_memory_bytes(cfg, mc)["kv_cache"]}
    return _pool_row(cfg, res)


def test_paged_dry_run_row_names_pages_and_positions():
    (what, line), = _row("rollout.kv_layout=paged", "rollout.kv_pages=100")
    assert what == "KV pool (paged) per engine"
    assert line.startswith("100 pages x rollout.kv_page_size=16 = 1,600 positions") and "(rollout.kv_pages;" in line
    assert "contiguous: rollout.slots=32 x max_cache_len=128 = 4,096 positions" in line, line
    (_, line), = _row("rollout.kv_layout=paged")  # the default pool: the contiguous layout's memory
    assert line.startswith("256 pages x rollout.kv_page_size=16 = 4,096 positions"), line
    assert _row("rollout.kv_layout=contiguous") == []
