"""bench/decode_hlo.py's per-step accounting of a compiled module's text, on a hand-written module
(no compile): loop bodies times their trip count, in-place updates as their updates, materialised
slices and gathers as the part they read; and the decode roofline by hand."""

from __future__ import annotations

import pytest

from tests.bench_module import load_bench

HLO = """HloModule jit_step, is_scheduled=true

%slice_comp (p0: f32[4,8,16], p1: s32[]) -> f32[8,16] {
  %p0 = f32[4,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,16}
  ROOT %bc = f32[8,16]{1,0} bitcast(%ds)
}

%dus_comp (q0: f32[4,8,16], q1: f32[1,8,1], q2: s32[]) -> f32[4,8,16] {
  %q0 = f32[4,8,16]{2,1,0} parameter(0)
  %q1 = f32[1,8,1]{2,1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,8,16]{2,1,0} dynamic-update-slice(%q0, %q1, %q2, %z, %z)
}

%dot_comp (r0: f32[2,8], r1: f32[8,16]) -> f32[2,16] {
  %r0 = f32[2,8]{1,0} parameter(0)
  %r1 = f32[8,16]{1,0} parameter(1)
  ROOT %d = f32[2,16]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (t: (s32[], f32[4,8,16], f32[2,8])) -> (s32[], f32[4,8,16], f32[2,8]) {
  %t = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %c = f32[4,8,16]{2,1,0} get-tuple-element(%t), index=1
  %x = f32[2,8]{1,0} get-tuple-element(%t), index=2
  %w = f32[8,16]{1,0} fusion(%c, %i), kind=kLoop, calls=%slice_comp
  %y = f32[2,16]{1,0} fusion(%x, %w), kind=kOutput, calls=%dot_comp
  %u = f32[1,8,1]{2,1,0} constant({...})
  %c2 = f32[4,8,16]{2,1,0} fusion(%c, %u, %i), kind=kLoop, calls=%dus_comp
  ROOT %o = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}) tuple(%i, %c2, %x)
}

%cond (s: (s32[], f32[4,8,16], f32[2,8])) -> pred[] {
  %s = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%gather_comp (g0: f32[100,8], g1: s32[2]) -> f32[2,8] {
  %g0 = f32[100,8]{1,0} parameter(0)
  %g1 = s32[2]{0} parameter(1)
  ROOT %g = f32[2,8]{1,0} gather(%g0, %g1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
}

ENTRY %main (emb: f32[100,8], ids: s32[2], cache: f32[4,8,16]) -> (s32[], f32[4,8,16], f32[2,8]) {
  %emb = f32[100,8]{1,0} parameter(0)
  %ids = s32[2]{0} parameter(1)
  %cache = f32[4,8,16]{2,1,0} parameter(2)
  %x0 = f32[2,8]{1,0} fusion(%emb, %ids), kind=kLoop, calls=%gather_comp
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}) tuple(%zero, %cache, %x0)
  ROOT %loop = (s32[], f32[4,8,16]{2,1,0}, f32[2,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


@pytest.fixture(scope="module")
def dh():
    return load_bench("decode_hlo")


def test_step_profile_counts_loop_bodies_by_trip_count(dh):
    p = dh.step_profile(HLO)
    by = {r["name"]: r for r in p["rows"]}
    assert set(by) == {"%x0", "%w", "%y", "%c2"}  # constants, tuples, the while itself excluded
    assert p["kernels"] == 1 + 3 * 3 and p["fusions"] == 10 and p["unknown_trip_loops"] == 0
    assert by["%w"]["n"] == 3 and by["%x0"]["n"] == 1
    # the slice of a layer [8,16] f32 (512 B) out of [4,8,16]: read 512 + written 512 (+ the s32 index)
    assert by["%w"]["kind"] == "materialised dynamic-slice" and by["%w"]["bytes"] == 4 + 2 * 512
    # the in-place update writes its [1,8,1] f32 (32 B) (+ index), not the 2 KiB buffer twice
    assert by["%c2"]["kind"] == "in-place dynamic-update-slice" and by["%c2"]["bytes"] == 2 * (32 + 4)
    # the gather reads 2 rows of the table, not the table
    assert by["%x0"]["kind"] == "gather" and by["%x0"]["bytes"] == 8 + 2 * 64
    assert by["%y"]["bytes"] == 64 + 512 + 128
    assert p["traffic"] == 136 + 3 * (1028 + 704 + 72)
    assert p["slice_bytes"] == 3 * 1028 and p["inplace_bytes"] == 3 * 36


def test_unknown_trip_count_is_reported(dh):
    p = dh.step_profile(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""))
    assert p["unknown_trip_loops"] == 1 and p["kernels"] == 4


def test_roofline_bytes_by_hand(dh):
    from jax_rl.models.qwen3 import get_preset

    cfg = get_preset("qwen3_0p6b")
    r = dh.roofline_bytes(cfg, slots=64, live=320, itemsize=2)
    layer = 1024 * 16 * 128 * 2 + 1024 * 8 * 128 * 2 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    assert r["weights"] == (28 * layer + 151936 * 1024 + 1024) * 2  # tied: the table once, gather rows not extra
    assert r["kv_read"] == 64 * 320 * 28 * 2 * 8 * 128 * 2
    assert r["kv_write"] == 64 * 28 * 2 * 8 * 128 * 2
    assert r["total"] == r["weights"] + r["kv_read"] + r["kv_write"]


def test_default_engine_step_copies_no_cache_or_weight_slices(dh):
    """The engine's default decode step (per-layer cache, unrolled layers; every backend but a TPU)
    reads each layer's K/V and weights in place; the stacked, scanned step (the GPU default before
    issue 37) copies them out of the stacked buffers before its dots (XLA:CPU, tiny model, fp32)."""
    from jax_rl.models.qwen3 import get_preset

    cfg = get_preset("tiny_dense")
    S, slots = 64, 4
    L, K, H = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    layer_kv = slots * K * S * H * 4  # one layer's K (or V) buffer, fp32
    prof = {}
    for layout in ("per_layer", "scan"):
        compiled, _ = dh.compile_generate(cfg, slots=slots, cache=S, layout=layout, dtype="float32", backend="cpu")
        prof[layout] = dh.step_profile(compiled.as_text())
    big = lambda p: [r for r in p["rows"] if r["kind"].startswith("materialised")  # noqa: E731
                     and r["bytes"] >= 2 * layer_kv]
    assert big(prof["per_layer"]) == []
    assert sum(r["n"] for r in big(prof["scan"])) >= 2 * L  # K and V of every layer, per step
    # the cache is written in place: the new entries only (K and V, every layer, one position per slot)
    assert prof["per_layer"]["inplace_bytes"] >= 2 * L * slots * K * H * 4
    assert prof["per_layer"]["inplace_bytes"] < layer_kv
