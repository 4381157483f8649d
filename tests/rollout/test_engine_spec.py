"""The engine spec and the K/V layout registry (issue 61): an engine is built from one frozen EngineSpec,
built once from the config; its K/V layout is an object chosen once from KV_LAYOUTS, and the engine's
host operations go through it (no layout mixin, no name compared)."""

from __future__ import annotations

import dataclasses

import pytest

from jax_rl.config import RolloutConfig, load_config
from jax_rl.models.qwen3 import Qwen3Config
from jax_rl.runtime.engines import engine_spec
from rollout.engine import EngineSpec, Qwen3Engine
from rollout.engine.contiguous import ContiguousLayout
from rollout.engine.layout import KVLayout
from rollout.engine.layouts import KV_LAYOUTS, kv_layout_class
from rollout.engine.paged.layout import PagedLayout

MC = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)


def test_the_registry_names_each_layout_class_once():
    assert KV_LAYOUTS == {"contiguous": ContiguousLayout, "paged": PagedLayout}
    assert all(issubclass(c, KVLayout) and c.name == n for n, c in KV_LAYOUTS.items())
    with pytest.raises(ValueError, match=r"kv_layout must be one of \['contiguous', 'paged'\], got 'ring'"):
        kv_layout_class("ring")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_engine_holds_the_layout_object_its_spec_names(layout):
    spec = EngineSpec(slots=2, max_cache_len=32, dtype="float32", kv_layout=layout, kv_page_size=8)
    eng = Qwen3Engine(MC, None, spec)
    assert eng.spec is spec and type(eng.kv) is KV_LAYOUTS[layout]
    assert eng.kv.table is KV_LAYOUTS[layout].table and set(eng.programs) == set(eng.kv.table)
    assert {"decode", "decode_steps", "decode_result"} <= set(eng.programs) and "generate" not in eng.programs
    # the contiguous layout budgets nothing (every slot's positions reserved); the paged one counts pages
    assert (eng.kv.admission_budget(1) is None) == (layout == "contiguous")
    assert (eng.kv.stats() == {}) == (layout == "contiguous")


def test_keyword_fields_are_a_spec_and_not_both():
    eng = Qwen3Engine(MC, None, slots=3, max_cache_len=32, dtype="float32")
    assert eng.spec == EngineSpec(slots=3, max_cache_len=32, dtype="float32")
    # the spec's layout default is the config's (rollout.kv_layout), so a hand-built engine is the run's
    assert EngineSpec().kv_layout == RolloutConfig().kv_layout == "paged" and eng.kv.pooled
    with pytest.raises(TypeError, match="not both"):
        Qwen3Engine(MC, None, EngineSpec(), slots=3)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        Qwen3Engine(MC, None, kv_layout="ring")


@pytest.mark.parametrize("field, value, match", [("slots", 0, "slots must be >= 1"), ("top_p", 0.0, "top_p must be"),
                                                 ("sampler", "gpu", "sampler must be"),
                                                 ("quantize", "int2", "rollout.quantize must be one of"),
                                                 ("prefill_chunk_size", 48, "must be a power of two")])
def test_a_spec_field_out_of_range_is_refused_naming_it(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineSpec(**{field: value})


def test_the_spec_is_built_once_from_the_config():
    """``engine_spec``: every rollout knob the engine takes, from the config; frozen."""
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.kv_layout=paged", "rollout.kv_page_size=8",
                                                "rollout.top_k=5", "rollout.sampler=xla"])
    spec = engine_spec(cfg, MC)
    r = cfg.rollout
    assert (spec.slots, spec.max_cache_len, spec.kv_layout, spec.kv_page_size, spec.top_k, spec.sampler) == (
        r.slots, r.max_cache_len, "paged", 8, 5, "xla")
    assert spec.temperature == cfg.algo.temperature and spec.kv_pages == r.slots * -(-r.max_cache_len // 8)
    assert engine_spec(cfg, MC, slots=2, temperature=0.5).slots == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.slots = 1
