"""``jax-rl compile``: AOT compile of a run's programs for a TPU topology (libtpu's compiler on
this CPU host), the per-chip table and ``--json``, and the cost-from-pieces method checked
against a program whose ``cost_analysis`` has no loop to undercount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR, load_config

pytest.importorskip("libtpu")

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"function", "topology", "chips", "hbm_args_bytes", "hbm_temp_bytes", "hbm_out_bytes", "hbm_total_bytes",
        "chip_hbm_bytes", "fits", "compile_s", "flops_per_chip", "bytes_accessed_per_chip", "roofline_step_s",
        "mfu_bound"}
TINY = ["optim.batch_size=8", "optim.max_seq_len=64", "rollout.max_cache_len=64", "rollout.max_prefill_length=32",
        "rollout.max_tokens_per_episode=48", "rollout.max_new_tokens_per_turn=16", "rollout.slots=8",
        "sft.batch_size=8", "optim.microbatches=2",
        # the rows these tests pin are the contiguous engine's; tiny_cpu's heads (64) are narrower than the TPU
        # paged kernel's 128 lanes: the paged rows are the tests that set rollout.kv_layout=paged (and head_dim 128)
        "rollout.kv_layout=contiguous"]


def _cli(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user runs it
    return subprocess.run([sys.executable, "-m", "jax_rl.cli", "compile", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_compiles_all_six_programs_for_v5e_2x2(tmp_path):
    out = tmp_path / "c.json"
    r = _cli(str(CONFIG_DIR / "tiny_cpu.yaml"), "--topology", "v5e:2x2", *TINY, "--no-cost", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "TPU_WORKER_HOSTNAMES" not in r.stderr and "INVALID_ARGUMENT" not in r.stderr, r.stderr[-2000:]
    assert "not TPU measurements" in r.stdout
    rows = json.loads(out.read_text())
    assert [x["function"] for x in rows] == ["train_step", "sft_step", "prefill", "append_prefill", "decode_step",
                                             "weight_sync"]
    # colocated (placement.* null): today's rows, each with its role; the engines beside the learner
    assert [x["role"] for x in rows] == ["learner", "learner", "rollout", "rollout", "rollout", "sync"]
    # the append-prefill (an agent turn onto every slot's kept K/V): [slots, max_prefill_length] new tokens
    assert rows[3]["shape"] == [json.loads(out.read_text())[4]["shape"][0], rows[2]["shape"][1]]
    dec = rows[4]
    assert dec["engine_mesh"] is None and dec["device_ids"] == [0] and dec["engines"] == 2  # threads + eval
    assert dec["hbm_with_learner_bytes"] == rows[0]["hbm_total_bytes"] + 2 * dec["hbm_total_bytes"]
    assert dec["fits_with_learner"] is True and dec["hbm_on_chip_bytes"] == dec["hbm_with_learner_bytes"]
    for x in rows:
        assert KEYS <= set(x), KEYS - set(x)
        assert x["topology"] == "v5e:2x2" and x["chips"] == 4 and x["fits"] is True
        assert x["hbm_total_bytes"] == x["hbm_args_bytes"] + x["hbm_temp_bytes"] + x["hbm_out_bytes"]
        assert 0 < x["hbm_total_bytes"] < x["chip_hbm_bytes"] == 16 * 10**9
        assert x["flops_per_chip"] is None and x["mfu_bound"] is None  # --no-cost
    train = rows[0]
    assert train["shape"] == [1, 2, 4, 64]  # [minibatches, microbatches, rows, T]
    # the params (fp32, fsdp over 4 chips) + AdamW moments + the EWMA copy are arguments
    assert train["hbm_args_bytes"] > 4 * rows[1]["hbm_args_bytes"] / 3 * 0.9


def test_weight_sync_row_is_the_publish_reshard():
    """``weight_sync``: the learner's fp32 params (fsdp over the 4 chips) cast to rollout.dtype and
    replicated as the engine reads them; per chip its input is a quarter of the fp32 params and its
    output a whole copy in the rollout dtype (TPU tiling pads the tiny model's small arrays, so
    the bounds are loose), and it reads and writes at least those bytes."""
    import jax
    from flax import nnx

    from jax_rl.compile import _model_config, compile_programs
    from jax_rl.models.qwen3 import Qwen3ForCausalLM

    rows = {}
    for dt in ("bfloat16", "float32"):
        cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, f"rollout.dtype={dt}"])
        (rows[dt],) = compile_programs(cfg, "v5e:2x2", functions=("weight_sync",))
    mc = _model_config(cfg, [])
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    n = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    for dt, size in (("bfloat16", 2), ("float32", 4)):
        x = rows[dt]
        assert KEYS <= set(x), KEYS - set(x)
        assert x["function"] == "weight_sync" and x["shape"] == [n] and x["fits"] is True
        assert n * 4 / 4 <= x["hbm_args_bytes"] < n * 4  # the learner's fsdp shard, not the whole
        assert n * size <= x["hbm_out_bytes"] < n * (size + 2)  # one whole copy in the rollout dtype
        assert x["bytes_accessed_per_chip"] >= x["hbm_args_bytes"] + x["hbm_out_bytes"]
        assert x["roofline_step_s"] > 0 and x["mfu_bound"] is None and x["model_flops_per_chip"] is None
    assert rows["float32"]["hbm_out_bytes"] > rows["bfloat16"]["hbm_out_bytes"]  # the cast is in the program


COLOCATED = ["placement.learner=null", "placement.rollout=null", "rollout.threads=1", "rollout.mesh.tensor=1"]


def test_cli_does_not_fit_exit_1_and_bad_topology_exit_2(tmp_path):
    # Qwen3-4B's decode step on a v5e (16 GB per chip), colocated: 8 GB of bf16 params + 16 slots x
    # 8192 positions of KV (19 GB), replicated on every chip as the one-device engine holds them
    out = tmp_path / "d.json"
    r = _cli(str(CONFIG_DIR / "qwen3_4b.yaml"), "--topology", "v5e:2x2", "--only", "decode_step", "--no-cost",
             "--json", str(out), *COLOCATED)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "does not fit in HBM: decode_step" in r.stdout
    (row,) = json.loads(out.read_text())  # the TPU compiler itself refuses it
    assert row["fits"] is False and "exceeds available HBM" in row["error"], row
    assert row["hbm_required_bytes"] > 16 * 10**9
    for bad in ("v9z-8", "v5e:1x1"):  # unknown generation; smaller than one host's chips
        r = _cli(str(CONFIG_DIR / "tiny_cpu.yaml"), "--topology", bad, "--no-cost")
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and last.startswith(f"jax-rl: error: --topology {bad}"), r.stderr[-2000:]
        assert "Traceback" not in r.stderr
    r = _cli(str(CONFIG_DIR / "tiny_cpu.yaml"), "--topology", "v5e:2x2", "mesh.tensor=3")
    assert r.returncode == 2 and "mesh" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def _tiny_params(rollout_dtype_bytes: int) -> int:
    """The tiny model's params in bytes at ``rollout_dtype_bytes`` per element (all leaves are float)."""
    import jax
    from flax import nnx

    from jax_rl.compile import _model_config
    from jax_rl.models.qwen3 import Qwen3ForCausalLM

    mc = _model_config(load_config(CONFIG_DIR / "tiny_cpu.yaml", TINY), [])
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) * rollout_dtype_bytes


def test_separate_placement_has_a_block_per_role():
    """learner on chips 0-1, one engine tensor-parallel on chips 2-3: the learner's rows are over its 2
    chips; the engine's rows are compiled on its own mesh, its params split by tensor; what its chips
    hold is the engine (and the eval engine), not the learner's shard; the sync row moves one engine's
    params in bf16 and has a positive ICI roofline."""
    from jax_rl.compile import compile_programs

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, "placement.learner=2", "placement.rollout=2",
                                                     "rollout.mesh.tensor=2"])
    rows = compile_programs(cfg, "v5e:2x2", functions=("train_step", "decode_step", "weight_sync"), cost=False)
    by = {x["function"]: x for x in rows}
    assert [x["role"] for x in rows] == ["learner", "rollout", "sync"]
    for x in rows:
        assert KEYS <= set(x), KEYS - set(x)
    tr, dec, sync = by["train_step"], by["decode_step"], by["weight_sync"]
    assert tr["device_ids"] == [0, 1] and tr["role_chips"] == 2 and tr["fits"] is True
    assert dec["device_ids"] == [2, 3] and dec["role_chips"] == 2 and dec["fits"] is True
    assert dec["engine_mesh"] == {"data": 1, "fsdp": 1, "tensor": 2, "expert": 1}
    assert dec["same_shape_engines"] == 1 and dec["engines_on_chip"] == 2  # the engine + the eval engine
    assert dec["learner_on_chip"] is False and "hbm_with_learner_bytes" not in dec
    # its chips hold two engines' programs, not the learner's shard
    assert dec["hbm_on_chip_bytes"] == 2 * dec["hbm_total_bytes"] and dec["fits_on_chip"] is True
    whole = _tiny_params(2)
    assert whole / 2 <= dec["params_bytes_per_chip"] < whole  # split over tensor (norms replicated)
    assert sync["sync_bytes"] == whole and sync["sync_engines"] == 1
    assert sync["sync_in_bytes_per_chip"] == dec["params_bytes_per_chip"]  # each engine chip takes its shards
    assert sync["sync_ici_roofline_s"] == pytest.approx(
        max(sync["sync_in_bytes_per_chip"], sync["sync_out_bytes_per_chip"]) / (400e9 / 2))
    assert sync["sync_dest_device_ids"] == [2, 3]
    # across processes (jax_rl.weight_sync): each learner chip stages one engine chip's shard, never the whole
    # copy; one engine, one replica group of the learner's 2 chips: each chip sends its staged shard once
    assert sync["sync_staged_bytes_per_learner_chip"] == sync["sync_in_bytes_per_chip"] < whole
    assert sync["sync_send_bytes_per_learner_chip"] == sync["sync_staged_bytes_per_learner_chip"]
    assert sync["sync_recv_bytes_per_engine_chip"] == sync["sync_in_bytes_per_chip"]
    assert sync["dcn_bandwidth"] is None and sync["sync_dcn_roofline_s"] is None  # v5e: no per-chip DCN figure
    assert sync["sync_ici_cross_roofline_s"] == pytest.approx(sync["sync_in_bytes_per_chip"] / (400e9 / 2))
    # the learner's chips during a publish: live state (train_step's arguments) + the staged shard
    assert tr["hbm_during_sync_bytes"] == tr["hbm_args_bytes"] + sync["sync_staged_bytes_per_learner_chip"]
    assert tr["fits_during_sync"] is True
    # two one-device engines on the rollout chips: one compile stands for both
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, "placement.learner=2", "placement.rollout=2",
                                                     "rollout.threads=2"])
    (dec2,) = compile_programs(cfg, "v5e:2x2", functions=("decode_step",), cost=False)
    assert dec2["same_shape_engines"] == 2 and dec2["device_ids"] == [2] and dec2["engines_on_chip"] == 2
    assert dec2["fits_on_chip"] is True


def test_scorer_row_on_its_own_chip():
    """placement.scorer: the scorer's forward on its own chip, holding async.max_staleness + 1 versions."""
    from jax_rl.compile import compile_programs

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, "loss.correction=exact", "old_logits.route=dedicated",
                                                     "placement.scorer=1"])
    (row,) = compile_programs(cfg, "v5e:2x2", functions=("score_step",), cost=False)
    assert row["role"] == "scorer" and row["device_ids"] == [3] and row["fits"] is True
    assert row["versions_held"] == cfg.async_.max_staleness + 1
    assert row["params_bytes_per_chip"] == _tiny_params(4)  # fp32, the whole model on one chip
    assert row["hbm_on_chip_bytes"] == row["hbm_total_bytes"] + (row["versions_held"] - 1) * row["params_bytes_per_chip"]


def test_routing_replay_programs_take_the_recorded_routes():
    """moe.routing_replay=r3: compile lowers the step training runs, with the recorded routes
    [U, m, r, T, n_moe_layers, k] in its batch (the batch Learner.abstract_batch builds: one
    recipe, jax_rl.learner.spec.learner_batch_spec), and the dedicated scorer's forward with the
    routes forced; without replay, no routes."""
    import jax

    from jax_rl import compile as C
    from jax_rl.learner.learner import Learner

    moe = CONFIG_DIR / "tiny_moe_cpu.yaml"
    for rr in ("none", "r3"):
        cfg = load_config(moe, [*TINY, "loss.correction=exact", f"moe.routing_replay={rr}"])
        t = C._target(cfg, "v5e:2x2")
        lrn = C._learner(t)
        b, _ = C._batch(t, lrn.strategy, 1, 2, 4, 64)
        mc = t.model_config
        want = None if rr == "none" else (1, 2, 4, 64, len(mc.moe_layers), mc.num_experts_per_tok)
        assert (None if b.routes is None else b.routes.shape) == want
        ours = Learner(cfg).abstract_batch(8, 64)  # the run's own batch: same fields, shapes, dtypes
        shapes = lambda x: jax.tree.map(lambda a: (a.shape, a.dtype), x)  # noqa: E731
        assert shapes(ours) == shapes(b)
    cfg = load_config(moe, [*TINY, "loss.correction=exact", "old_logits.route=dedicated", "placement.scorer=1",
                            "moe.routing_replay=r3"])
    (row,) = C.compile_programs(cfg, "v5e:2x2", functions=("score_step",), cost=False)
    assert row["role"] == "scorer" and row["fits"] is True


def _exact(monkeypatch, *extra):
    """The train step's own cost_analysis with every loop written out (unrolled layers, one
    minibatch / microbatch / epoch, the LM-head chunk loop unrolled), with (target, learner)."""
    from jax_rl import compile as C
    from jax_rl.learner import logprobs
    from jax_rl.learner.train_step import StepParts, make_train_step

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, "optim.microbatches=1", "model.scan_layers=false",
                                                     *extra])
    t = C._target(cfg, "v5e:2x2")
    lrn = C._learner(t)
    B, T = 8, 64
    b, sh = C._batch(t, lrn.strategy, 1, 1, B, T)
    fn = make_train_step(cfg, StepParts(lrn.graphdef, lrn.rest, lrn.tx, lrn.schedule, lrn.strategy), t.mesh,
                         state_shardings=lrn.state_shardings, batch_sharding=sh)
    with monkeypatch.context() as mp:
        mp.setattr(logprobs, "_UNROLL_CHUNKS", True)
        # the splash kernels' matmuls are added analytically in both (XLA cannot see into Pallas)
        exact, _ = C._compile(fn, (lrn.state, b), t.mesh, C._attn_unit(t, B, T))
    assert exact.get("splash_calls"), exact  # the step attends by splash on the TPU
    return exact, t, lrn


def _exact_and_estimate(monkeypatch, *extra):
    """:func:`_exact` (decoupled) next to the estimate from the pieces."""
    from jax_rl import compile as C

    exact, t, lrn = _exact(monkeypatch, "loss.correction=decoupled", *extra)
    est, _, f, reset = C._train_cost(t, lrn, 8, 64)
    assert f == 1 and reset is None  # decoupled: one pi_prox forward, no reset branch
    return exact, est


def test_ppo_ewma_cost_is_of_a_step_without_reset(monkeypatch):
    """XLA costs ppo_ewma's reset ``lax.cond`` with its second forward in full; the estimate is of a
    step without a reset (the program traced with the reset off has no such branch), and the
    reset's forward is reported apart: the two add up to the program with the branch."""
    from jax_rl import compile as C

    with_branch, t, lrn = _exact(monkeypatch, "loss.correction=ppo_ewma", "loss.ewma_reset_threshold=0.9")
    no_branch, _, _ = _exact(monkeypatch, "loss.correction=ppo_ewma", "loss.ewma_reset_threshold=0")
    assert with_branch["flops"] > 1.15 * no_branch["flops"], (with_branch, no_branch)
    est, _, f, reset = C._train_cost(t, lrn, 8, 64)
    assert f == 1 and reset is not None
    assert est["flops"] == pytest.approx(no_branch["flops"], rel=0.05), (est, no_branch)
    assert est["flops"] + reset["flops"] == pytest.approx(with_branch["flops"], rel=0.05), (est, reset, with_branch)


@pytest.mark.parametrize("chunk", [None, 16])  # the LM head in one chunk / in 4 chunks of 16
def test_cost_from_pieces_matches_a_loop_free_program(monkeypatch, chunk):
    """With every loop written out the train step's own cost_analysis is exact; the estimate from
    the loop-free pieces (depth 1/2, two chunk lengths, trip counts) must agree with it."""
    exact, est = _exact_and_estimate(monkeypatch, *([f"model.logits_chunk_tokens={chunk}"] if chunk else []))
    # the pieces leave out a little glue of the whole step (metrics, the update loop's selects):
    # 3% of this tiny model's FLOPs, where elementwise work weighs far more than at 4B
    assert est["flops"] == pytest.approx(exact["flops"], rel=0.05), (est, exact)
    # bytes are rougher: XLA fuses a loop body and its written-out copies differently
    assert est["bytes_accessed"] == pytest.approx(exact["bytes_accessed"], rel=0.25), (est, exact)


def test_decode_row_has_the_hbm_side_count():
    """decode_step's cost pieces are also compiled with VMEM staging off (HBM_SIDE_OPTIONS): that
    count holds no VMEM copy, so it is below the default count and at least the cache it reads."""
    from jax_rl import compile as C

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, "rollout.slots=16", "rollout.max_cache_len=512", "optim.max_seq_len=512"])
    (row,) = C.compile_programs(cfg, "v5e:2x2", functions=("decode_step",))
    base = row["params_and_kv_cache_bytes_per_chip"]
    assert base > 0 and row["bytes_accessed_ratio"] == pytest.approx(row["bytes_accessed_per_chip"] / base)
    assert row["hbm_side_ratio"] == pytest.approx(row["hbm_side_bytes_accessed_per_chip"] / base)
    assert 0.9 < row["hbm_side_ratio"] < row["bytes_accessed_ratio"], row


def test_paged_layout_compiles_the_paged_programs():
    """rollout.kv_layout=paged: decode_step and append_prefill are the paged engine's programs (the TPU
    paged attention kernel) over the configured pool: the row's K/V bytes are the pool's (8 pages of 16
    positions), not the contiguous 8 slots x 64 positions, and the arguments shrink by the difference."""
    from jax_rl import compile as C

    rows = {}
    for layout in ("contiguous", "paged"):
        cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, *COLOCATED, f"rollout.kv_layout={layout}",
                                                         "rollout.kv_pages=8", "rollout.dtype=bfloat16",
                                                         # the TPU kernel's lanes: heads of 128
                                                         "model.hf_overrides.head_dim=128"])
        rows[layout] = {r["function"]: r for r in C.compile_programs(cfg, "v5e:2x2", cost=False,
                                                                      functions=("append_prefill", "decode_step"))}
    t = C._target(cfg, "v5e:2x2")
    mc = t.model_config
    per_pos = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 2  # bf16 K and V
    dec, old = rows["paged"]["decode_step"], rows["contiguous"]["decode_step"]
    assert dec["kv_layout"] == "paged" and old["kv_layout"] == "contiguous"
    assert dec["kv_cache_bytes_per_chip"] == 8 * 16 * per_pos
    assert old["kv_cache_bytes_per_chip"] == 8 * 64 * per_pos
    assert dec["hbm_args_bytes"] < old["hbm_args_bytes"] and dec["fits"]
    assert rows["paged"]["append_prefill"]["kv_layout"] == "paged" and rows["paged"]["append_prefill"]["fits"]


@pytest.mark.parametrize("axis,pages", [("tensor", 8), ("data", 8 * 2)])
def test_paged_layout_compiles_on_a_sharded_engine(axis, pages):
    """rollout.kv_layout=paged on a 2-chip engine (placement.rollout=2): tensor 2 (the pool's 2 kv heads split
    over it) or data 2 (the slots split over it, and the pool's pages with them: a sub-pool of 8 pages per
    shard of 4 slots, the write and the kernel per shard in shard_map): the paged programs compile on the
    engine's mesh, each chip holding half the pool."""
    from jax_rl import compile as C

    heads = "model.hf_overrides={num_attention_heads: 2, num_key_value_heads: 2, head_dim: 128, vocab_size: 640}"
    mesh = ["rollout.mesh.tensor=2"] if axis == "tensor" else ["rollout.mesh.tensor=1", "rollout.mesh.data=2"]
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, "placement.learner=2", "placement.rollout=2", *mesh,
                                                     "rollout.kv_layout=paged", f"rollout.kv_pages={pages}",
                                                     "rollout.dtype=bfloat16", heads])
    rows = {r["function"]: r for r in C.compile_programs(cfg, "v5e:2x2", cost=False,
                                                          functions=("append_prefill", "decode_step"))}
    mc = C._target(cfg, "v5e:2x2").model_config
    per_pos = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 2  # bf16 K and V
    dec = rows["decode_step"]
    assert dec["kv_layout"] == "paged" and dec["engine_mesh"][axis] == 2 and dec["device_ids"] == [2, 3]
    assert dec["fits"] and dec["kv_cache_bytes_per_chip"] == pages * 16 * per_pos // 2
    assert rows["append_prefill"]["kv_layout"] == "paged" and rows["append_prefill"]["fits"]


@pytest.mark.slow  # why the pieces exist (a fact of XLA); test_cost_from_pieces_* checks the pieces in make test
def test_scanned_layers_cost_analysis_undercounts():
    """Why the pieces exist: a scanned layer stack's loop body is counted once."""
    from jax_rl import compile as C
    from jax_rl.learner.train_step import StepParts, make_train_step

    figs = {}
    for scan in ("false", "true"):
        cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, "optim.microbatches=1", f"model.scan_layers={scan}",
                                                         "model.hf_overrides.num_hidden_layers=4"])
        t = C._target(cfg, "v5e:2x2")
        lrn = C._learner(t)
        # model.scan_unroll=auto means a loop of one layer per iteration for a TPU target,
        # though this host is a CPU (where auto writes the stack out)
        assert t.learner_kw["scan_unroll"] == 1
        b, sh = C._batch(t, lrn.strategy, 1, 1, 8, 64)
        fn = make_train_step(cfg, StepParts(lrn.graphdef, lrn.rest, lrn.tx, lrn.schedule, lrn.strategy), t.mesh,
                             state_shardings=lrn.state_shardings, batch_sharding=sh)
        figs[scan], _ = C._compile(fn, (lrn.state, b), t.mesh)
    assert figs["true"]["flops"] < 0.6 * figs["false"]["flops"], figs


def test_model_flops_formula_dense_and_moe():
    from jax_rl.compile import model_flops_per_token
    from jax_rl.models.qwen3 import get_preset

    mc = get_preset("qwen3_4b")
    # Qwen3-4B: 36 layers, d 2560, 32 q / 8 kv heads of 128, mlp 9728, vocab 151936 (tied head)
    per_layer = 2560 * 32 * 128 * 2 + 2 * 2560 * 8 * 128 + 3 * 2560 * 9728
    want = 2 * (36 * per_layer + 2560 * 151936) + 2 * 36 * 32 * 128 * 4096
    assert model_flops_per_token(mc, 4096) == want
    moe = get_preset("qwen3_30b_a3b")
    f = model_flops_per_token(moe, 1)
    assert 2 * 3.0e9 < f < 2 * 3.6e9  # "A3B": ~3.3B active params per token


@pytest.mark.slow
@pytest.mark.full_depth
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("config,topology,functions", [
    ("qwen3_4b.yaml", "v5p-32", ("train_step", "decode_step")),
    ("qwen3_30b_a3b.yaml", "v5p-64", ("train_step",)),
])
def test_tpu_configs_fit_at_full_depth(tmp_path, config, topology, functions):
    """The TPU configs' learner step (and 4B's decode step) compile at full depth for their target
    topology and fit in HBM, the 4B learner with >= 10% headroom (memory only; the cost pieces,
    the SFT step and prefill are bench/tpu_compile.py's job: together they would add ~20 minutes
    of compiling to make test on the 2-core machine)."""
    out = tmp_path / "c.json"
    only = [a for f in functions for a in ("--only", f)]
    r = _cli(str(CONFIG_DIR / config), "--topology", topology, *only, "--no-cost", "--json", str(out), timeout=1400)
    rows = {x["function"]: x for x in json.loads(out.read_text())} if out.exists() else {}
    assert set(rows) == set(functions), r.stdout[-3000:] + r.stderr[-3000:]
    for name, x in rows.items():
        assert x["fits"], (name, x)
    if "4b" in config:
        assert rows["train_step"]["hbm_total_bytes"] <= 0.9 * rows["train_step"]["chip_hbm_bytes"]


def test_user_model_rows_on_their_own_chips(tmp_path):
    """placement.user: the tau² user model's prefill / decode on its own chips (a block of their own beside the
    scorer's), with the user model's own architecture when env.tau2.user_model.checkpoint names one."""
    from flax import nnx

    from jax_rl.compile import compile_programs
    from jax_rl.compile.table import format_table, summary_lines
    from jax_rl.models.hf_io import save_pretrained
    from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset

    pytest.importorskip("tau2")
    tau2 = ["env.name=tau2", "env.tau2.user=model", "placement.user=1", "loss.correction=exact",
            "old_logits.route=dedicated", "placement.scorer=1"]
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, *tau2])
    rows = compile_programs(cfg, "v5e:2x2", functions=("score_step", "user_prefill", "user_decode_step"), cost=False)
    sc, pre, dec = rows
    assert sc["role"] == "scorer" and sc["device_ids"] == [3]
    assert [pre["role"], dec["role"]] == ["user", "user"] and pre["device_ids"] == dec["device_ids"] == [2]
    assert dec["fits_on_chip"] is True and dec["params_bytes_per_chip"] == _tiny_params(2)  # bf16, one chip
    assert dec["user_mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1}
    assert any(line.startswith("user model: 1 chips") for line in summary_lines(rows))
    assert [c.header for c in format_table(rows).columns][0] == "role"
    # a user model of its own architecture (the tiny_dense preset saved as an HF checkpoint)
    mc = get_preset("tiny_dense")
    save_pretrained(Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)), mc, tmp_path / "hf")
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY, *tau2, f"env.tau2.user_model.checkpoint={tmp_path / 'hf'}"])
    (dec2,) = compile_programs(cfg, "v5e:2x2", functions=("user_decode_step",), cost=False)
    assert dec2["params_bytes_per_chip"] != dec["params_bytes_per_chip"]
    # no user model, no placement.user: no rows
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [*TINY])
    assert compile_programs(cfg, "v5e:2x2", functions=("user_decode_step",), cost=False) == []
