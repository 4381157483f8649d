"""bench/hlo_traffic.py's HLO text accounting, on a hand-written module (no compile)."""

from __future__ import annotations

import pytest

from tests.bench_module import load_bench

HLO = """HloModule jit_f, is_scheduled=true

%fused_computation (param_0: f32[8,4], param_1: f32[8,4]) -> f32[8,4] {
  %param_0 = f32[8,4]{1,0} parameter(0)
  %param_1 = f32[8,4]{1,0} parameter(1)
  ROOT %add.9 = f32[8,4]{1,0} add(%param_0, %param_1)
}

%region_sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[8,4], p1: bf16[16]) -> (f32[8,4], f32[]) {
  %p0 = f32[8,4]{1,0} parameter(0)
  %p1 = bf16[16]{0} parameter(1)
  %bc = f32[32]{0} bitcast(%p0)
  %fusion = f32[8,4]{1,0} fusion(%p0, %p0), kind=kLoop, calls=%fused_computation
  %cc = (f32[8,4]{1,0}, s32[2]{0}) custom-call(%fusion, %p1), custom_call_target="k", backend_config={"a":
{"b": 1
}}, metadata={op_name="jit(f)/checkpoint/pallas_call"}
  %gte = f32[8,4]{1,0} get-tuple-element(%cc), index=0
  %r = f32[] reduce(%gte, %c), dimensions={0,1}, to_apply=%region_sum
  ROOT %t = (f32[8,4]{1,0}, f32[]) tuple(%gte, %r)
}
"""


@pytest.fixture(scope="module")
def ht():
    return load_bench("hlo_traffic")


def test_shape_bytes_sums_tuples(ht):
    assert ht.shape_bytes("(f32[8,4]{1,0}, s32[2]{0})") == 8 * 4 * 4 + 2 * 4
    assert ht.shape_bytes("bf16[16]{0:T(1024)}") == 32
    assert ht.shape_bytes("f32[]") == 4


def test_top_level_traffic_counts_each_instruction_once(ht):
    rows = {r["name"]: r for r in ht.top_level_traffic(HLO)}
    # fusion and reducer bodies are not top-level; parameters, bitcasts, tuples and
    # get-tuple-elements move nothing
    assert set(rows) == {"%fusion", "%cc", "%r"}
    assert rows["%fusion"]["bytes"] == 3 * 128  # two operands + the output, f32[8,4] each
    # a custom call's multi-line config ("}}" lines) does not end the entry computation
    assert rows["%cc"]["bytes"] == 128 + 32 + 136 and rows["%cc"]["op_name"] == "jit(f)/checkpoint/pallas_call"
    assert rows["%r"]["bytes"] == 128 + 4 and rows["%r"]["computation"] == "%main"
    out = ht.report(list(rows.values()), top=2, shape="8")
    assert out[0].startswith(f"top-level traffic: {3 * 128 + 296 + 132:.3e} B over 3 instructions")
    assert any("with 8 in the output shape" in line for line in out)
