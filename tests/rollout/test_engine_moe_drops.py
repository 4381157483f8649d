"""The rollout engine's MoE capacity drops (``rollout.moe_capacity_factor``) are counted per row in
every program (prefill, append-prefill, decode), per request by the generator and per step as
``rollout/moe_dropped_copies`` / ``rollout/moe_copies`` / ``rollout/moe_dropped_frac`` (issue 39).

The reference for a count is :func:`jax_rl.models.qwen3.layers.capacity_keep` applied by hand to
the routes the same engine recorded (``record_routes``): the engine's per-row counts must equal
what GShard capacity does to those routes, row by row and layer by layer."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jax_rl.models import qwen3 as q
from jax_rl.models.qwen3.layers import capacity_keep
from rollout.engine import Qwen3Engine, SlotPrefill, unpack_result

S = 48
CF = 0.25  # 4 slots x 2 copies / 4 experts x 0.25: C = 1 slot per expert at a decode step


@pytest.fixture(scope="module")
def moe():
    cfg = q.get_preset("tiny_moe")
    model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True)
    return cfg, nnx.state(model, nnx.Param)


def _engine(moe, cf=CF, record=True, slots=4):
    cfg, params = moe
    mk = dict(scan_layers=True)
    if cf is not None:
        mk.update(moe=q.MoEOptions(capacity_factor=cf, capacity_all_paths=True))
    return Qwen3Engine(cfg, params, slots=slots, max_cache_len=S, max_prefill_length=16, dtype="float32",
                       temperature=0.8, record_routes=record, model_kwargs=mk, kv_layout="contiguous")


def _hand_drops(routes, valid, E, cf):
    """routes [n, T, n_moe, k] int, valid [n, T] bool -> per-row dropped copies [n] (capacity_keep
    per MoE layer over the whole [n, T] program, as the engine's forward runs it)."""
    n_moe = routes.shape[2]
    out = np.zeros(routes.shape[0], np.int64)
    for layer in range(n_moe):
        keep, dropped = capacity_keep(routes[:, :, layer], valid, E, cf)
        per_row = np.sum(np.asarray(valid)[..., None] & ~np.asarray(keep), axis=(1, 2))
        assert per_row.sum() == int(dropped)
        out += per_row
    return out


def test_prefill_and_decode_count_the_drops_capacity_makes_of_their_routes(moe):
    cfg, _ = moe
    eng = _engine(moe)
    assert eng.counts_moe_drops and eng.moe_copies_per_token == len(cfg.moe_layers) * cfg.num_experts_per_tok
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [7, 8, 9], [100, 101, 102, 103, 104, 105, 106]]
    st = eng.init_decode_state()
    st, res = eng.prefill_slots(eng.params, st, [SlotPrefill(p, i, 10 + i, None, 0) for i, p in enumerate(prompts)])
    # the fresh rows ran in ONE program (bucket 16, row bucket 4): rebuild its [4, 16] routes and mask
    P = 16
    routes = np.zeros((4, P) + eng.route_shape, np.int64)
    valid = np.zeros((4, P), bool)
    for i, p in enumerate(prompts):
        m = len(p) - 1
        routes[i, :m], valid[i, :m] = res[i].routes, True
    want = _hand_drops(routes, valid, cfg.num_experts, CF)
    got = [r.moe_dropped for r in res]
    assert got == list(want[:3])
    assert sum(got) > 0  # the factor bites at this size (else the test could not fail)
    # decode: each step's StepOutput.moe_dropped counts the fed token's dropped copies, active slots only
    seen = 0
    for _ in range(4):
        st, out = eng.decode(eng.params, st)
        out = jax.device_get(out)
        assert out.route.shape == (4, *eng.route_shape)  # the drop count is not a route
        assert out.moe_dropped.shape == (4,) and out.moe_dropped.dtype == np.int32
        fed = np.asarray(out.route).reshape(4, 1, *eng.route_shape)
        want = _hand_drops(fed, np.asarray(out.valid)[:, None], cfg.num_experts, CF)
        np.testing.assert_array_equal(out.moe_dropped, want)
        assert out.moe_dropped[3] == 0 and not out.valid[3]  # the idle slot: no token, no drop
        seen += int(out.moe_dropped.sum())
    assert seen > 0
    # append-prefill (a later turn on the slot's own rows) counts its new positions
    st, res2 = eng.prefill_slots(eng.params, st, [SlotPrefill(prompts[1] + [1, 2, 3, 4, 5, 6], 1, 3, None, 3)])
    new = np.asarray(res2[0].routes)  # [5, n_moe, k]: positions 3..7, one row of a [1, 16] program
    want = _hand_drops(np.pad(new, ((0, P - len(new)), (0, 0), (0, 0)))[None], (np.arange(P) < len(new))[None],
                       cfg.num_experts, CF)
    assert res2[0].moe_dropped == int(want[0])
    # the JetStream-style prefill (serve, the prefix cache) counts too
    prefix = eng.prefill(params=eng.params, padded_tokens=np.asarray(prompts[0]), true_length=len(prompts[0]))
    r0 = np.asarray(prefix["routes"])
    want = _hand_drops(np.pad(r0, ((0, P - len(r0)), (0, 0), (0, 0)))[None], (np.arange(P) < len(r0))[None],
                       cfg.num_experts, CF)
    assert prefix["moe_dropped"] == int(want[0])


def test_a_dropless_engine_counts_nothing_and_a_roomy_factor_drops_nothing(moe):
    plain = _engine(moe, cf=None, record=False)
    assert not plain.counts_moe_drops
    st = plain.init_decode_state()
    st, res = plain.prefill_slots(plain.params, st, [SlotPrefill([5, 6, 7], 0, 1, None, 0)])
    assert res[0].moe_dropped is None
    st, out = plain.decode(plain.params, st)
    assert out.moe_dropped is None
    st, out = plain.generate(plain.params, st)  # JetStream's adapter: 4 columns, no drop column
    assert np.asarray(out.data).shape[1] == 4 and "moe_dropped" not in unpack_result(out)
    roomy = _engine(moe, cf=100.0, record=False)
    st = roomy.init_decode_state()
    st, res = roomy.prefill_slots(roomy.params, st, [SlotPrefill([5, 6, 7, 8, 9], 0, 1, None, 0)])
    assert res[0].moe_dropped == 0
    st, out = roomy.decode(roomy.params, st)
    assert jax.device_get(out.moe_dropped).tolist() == [0, 0, 0, 0]
    st, out = roomy.generate(roomy.params, st)  # the adapter's rows are the same for a counting engine
    assert np.asarray(out.data).shape[1] == 4 and "moe_dropped" not in unpack_result(out)


def test_generator_info_adds_each_requests_drops_and_copies(moe):
    from rollout.generator import Generator

    eng = _engine(moe, record=False)
    gen = Generator(eng, params=eng.params)
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [7, 8, 9], [100, 101, 102, 103, 104, 105, 106]]
    comps = gen.generate(prompts, max_new_tokens=6, seeds=[1, 2, 3])
    cpt = eng.moe_copies_per_token
    for c in comps:
        # every prefilled position and every fed token (one per generated token) routed cpt copies
        assert c.info["moe_copies"] == (c.info["prefill_tokens"] + len(c.tokens)) * cpt
        assert 0 <= c.info["moe_dropped_copies"] <= c.info["moe_copies"]
    assert sum(c.info["moe_dropped_copies"] for c in comps) > 0


def test_step_row_sums_the_rollout_moe_drops():
    from jax_rl.runtime.loop import rollout_moe_drops

    class T:
        def __init__(self, info):
            self.info = info

    row = rollout_moe_drops([T({"moe_dropped_copies": 3, "moe_copies": 40}), T({"moe_dropped_copies": 1, "moe_copies": 40}),
                             T({})])
    assert row == {"rollout/moe_dropped_copies": 4, "rollout/moe_copies": 80, "rollout/moe_dropped_frac": 0.05}
    assert rollout_moe_drops([T({"moe_dropped_copies": 0, "moe_copies": 0})])["rollout/moe_dropped_frac"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_moe_run_logs_the_engines_drops(tmp_path):
    """``jax-rl train configs/tiny_moe_cpu.yaml rollout.moe_capacity_factor=0.5``: each step row has
    the engines' drops, counted over every copy the step's trajectories routed."""
    from jax_rl.config import CONFIG_DIR, load_config
    from jax_rl.metrics import read_jsonl
    from jax_rl.runtime.train import run_train
    from tests.runtime.test_train import TINY

    cfg = load_config(CONFIG_DIR / "tiny_moe_cpu.yaml", TINY + ["run.steps=1", "sft.steps=0",
                                                              "rollout.moe_capacity_factor=0.5",
                                                              f"run.dir={tmp_path / 'r'}"])
    assert run_train(cfg) == 0
    row = read_jsonl(tmp_path / "r" / "metrics.jsonl")[0]
    mc = q.get_preset("tiny_moe")
    assert row["rollout/moe_copies"] >= row["episode_tokens"] // 2 * len(mc.moe_layers) * mc.num_experts_per_tok
    assert 0 < row["rollout/moe_dropped_copies"] < row["rollout/moe_copies"]
    assert row["rollout/moe_dropped_frac"] == pytest.approx(row["rollout/moe_dropped_copies"] / row["rollout/moe_copies"])


def test_the_scanned_engine_counts_what_the_unrolled_one_does(moe):
    """kv_per_layer=False keeps scan_layers (the TPU default: the drops come stacked out of the layer
    scan); the counts equal the unrolled engine's, program by program."""
    cfg, params = moe
    kw = dict(slots=4, max_cache_len=S, max_prefill_length=16, dtype="float32", temperature=0.8,
              model_kwargs=dict(scan_layers=True, moe=q.MoEOptions(capacity_factor=CF, capacity_all_paths=True)),
              kv_layout="contiguous")
    got = []
    for per_layer in (True, False):
        eng = Qwen3Engine(cfg, params, kv_per_layer=per_layer, **kw)
        st = eng.init_decode_state()
        st, res = eng.prefill_slots(eng.params, st, [SlotPrefill([11, 12, 13, 14, 15, 16, 17], 0, 1, None, 0),
                                                     SlotPrefill([7, 8, 9], 1, 2, None, 0)])
        st, out = eng.decode_steps(eng.params, st, 3)
        got.append(([r.moe_dropped for r in res], jax.device_get(out.moe_dropped).tolist()))  # [3 steps, 4 slots]
    assert got[0] == got[1] and sum(got[0][0]) > 0
