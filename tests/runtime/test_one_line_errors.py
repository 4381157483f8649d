"""Inputs that used to end in a traceback, an OOM kill or a misleading line (issue 25, part 2):
each is refused in one line naming the key, exit 2, before anything is compiled or written.

The disk-full case is ``tests/runtime/test_resume_faults.py::test_disk_full_one_line_last_checkpoint_intact``
(a real full disk, no warning filter in the CLI)."""

from __future__ import annotations

import pytest

from jax_rl.cli import build_parser, main
from jax_rl.config import CONFIG_DIR, ConfigError, dump_config, load_config
from jax_rl.model_builder import build_model_config
from jax_rl.runtime import resources as R
from jax_rl.runtime.run_dir import delete_earlier_run, resolve_run_dir

TINY_CFG = str(CONFIG_DIR / "tiny_cpu.yaml")
TINY_MOE_CFG = str(CONFIG_DIR / "tiny_moe_cpu.yaml")
# the compact byte tokenizer (no BPE training) and a cache its prompts fit (see test_cli_inputs.py)
FAST = ["model.tokenizer=compact", "rollout.max_cache_len=256", "optim.max_seq_len=256"]


def _one_line_exit_2(capsys, argv, *names):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jax-rl:") and "\n" not in err and "Traceback" not in err, err
    for n in names:
        assert n in err, (n, err)
    return err


# ----------------------------------------------------------------------------- rollout.slots


def _tiny(overrides=()):
    cfg = load_config(TINY_CFG, [*FAST, *overrides])
    return cfg, build_model_config(cfg)


def test_slots_refused_when_the_decode_buffers_do_not_fit(monkeypatch):
    """The KV cache alone fits; the decode state and the decode step's buffers do not: refused (the contiguous
    cache's message; the paged pool's: test_paged_pool_refused_by_its_own_keys below)."""
    cfg, mc = _tiny(["rollout.kv_layout=contiguous"])
    engines = cfg.rollout.threads + 1
    kv_only = R.kv_cache_bytes(cfg, mc) * engines
    monkeypatch.setattr(R, "available_memory_bytes", lambda: (int(kv_only * 1.5), "test RAM"))
    with pytest.raises(ConfigError) as e:
        R.check_kv_cache(cfg, mc)
    msg = str(e.value)
    assert msg.startswith(f"rollout.slots={cfg.rollout.slots}:") and "slot(s) fit" in msg, msg
    # what fits is what the message says
    fit = int(msg.split("at most ")[1].split()[0])
    assert 0 < fit < cfg.rollout.slots
    monkeypatch.setattr(R, "available_memory_bytes",
                        lambda: (engines * R.engine_memory_bytes(cfg, mc)["total"], "test RAM"))
    assert R.check_kv_cache(cfg, mc) == kv_only  # exactly enough: accepted; returns the KV bytes


def test_paged_pool_refused_by_its_own_keys(monkeypatch):
    """A paged engine whose pool does not fit: the line names rollout.kv_pool_gib (what set the pool) and the
    pages that would fit, not max_cache_len x layers (the contiguous cache's formula); a pool of that many
    pages is then accepted."""
    cfg, mc = _tiny(["rollout.kv_layout=paged", "rollout.kv_pool_gib=0.5"])
    engines = cfg.rollout.threads + 1
    mem = R.engine_memory_bytes(cfg, mc)
    have = engines * (mem["total"] - mem["kv_cache"] // 2)  # room for half the pool
    monkeypatch.setattr(R, "available_memory_bytes", lambda: (have, "test RAM"))
    with pytest.raises(ConfigError) as e:
        R.check_kv_cache(cfg, mc)
    msg = str(e.value)
    assert msg.startswith("rollout.kv_layout=paged:") and "set by rollout.kv_pool_gib=0.5" in msg and "\n" not in msg, msg
    fit_pages = int(msg.split("at most ")[1].split()[0])
    assert 0 < fit_pages < R.kv_pool_pages(cfg, mc)
    ok, _ = _tiny(["rollout.kv_layout=paged", f"rollout.kv_pages={fit_pages}"])
    assert R.check_kv_cache(ok, mc) == fit_pages * R.kv_page_bytes(ok, mc) * engines


def test_engine_memory_estimate_bounds_what_xla_allocates():
    """The estimate is at least the decode step's real footprint (XLA's memory_analysis of the
    engine's generate step: arguments + temporaries) and not far above it, for the bf16 cache on the
    CPU (kept as its bits; the dot upcasts the layer it reads to f32) and an f32 one with top-p (sort buffers)."""
    import jax

    from jax_rl.model_builder import rollout_model_kwargs
    from rollout.engine import Qwen3Engine

    for extra in ([], ["rollout.dtype=float32", "rollout.top_p=0.9"]):
        cfg, mc = _tiny(["rollout.slots=64", *extra])
        r = cfg.rollout
        e = Qwen3Engine(mc, None, slots=r.slots, max_cache_len=r.max_cache_len, dtype=r.dtype, top_p=r.top_p,
                        model_kwargs=rollout_model_kwargs(cfg), kv_layout="contiguous")
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), e.abstract_params)
        state = jax.eval_shape(e.programs["init_state"], params)
        ma = e.programs["decode"].lower(params, state).compile().memory_analysis()
        real = ma.argument_size_in_bytes + ma.temp_size_in_bytes
        est = R.engine_memory_bytes(cfg, mc)["total"]
        assert real <= est <= 1.5 * real, (extra, real, est)


def test_cli_slots_100000_is_one_line(tmp_path, capsys, monkeypatch):
    """``rollout.slots=100000`` on tiny_cpu used to be OOM-killed after start-up (exit 137)."""
    monkeypatch.setattr(R, "available_memory_bytes", lambda: (16 << 30, "available host RAM"))
    _one_line_exit_2(capsys, ["train", TINY_CFG, *FAST, "rollout.slots=100000", "rollout.kv_layout=contiguous",
                              f"run.dir={tmp_path / 'r'}"],
                     "rollout.slots=100000", "decode buffers", "slot(s) fit")
    assert not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- MoE / mesh.expert


def test_num_experts_must_divide_by_mesh_expert(tmp_path, capsys):
    _one_line_exit_2(capsys, ["train", TINY_MOE_CFG, *FAST, "mesh.expert=8", f"run.dir={tmp_path / 'r'}"],
                     "mesh.expert=8", "num_experts=4", "model.preset=tiny_moe")
    # the mesh fits the 8 devices (fsdp 2 x expert 4); 6 experts do not split over 4
    _one_line_exit_2(capsys, ["train", TINY_MOE_CFG, *FAST, "model.moe_dispatch=ragged", "mesh.fsdp=2",
                              "mesh.expert=4", "model.hf_overrides.num_experts=6", f"run.dir={tmp_path / 'r'}"],
                     "mesh.expert=4", "num_experts=6")
    assert not (tmp_path / "r").exists()


def test_routing_replay_on_a_dense_model_is_one_line(tmp_path, capsys):
    _one_line_exit_2(capsys, ["train", TINY_CFG, *FAST, "moe.routing_replay=r3", f"run.dir={tmp_path / 'r'}"],
                     "moe.routing_replay=r3", "no MoE layer", "model.preset=tiny_dense")


# ----------------------------------------------------------------------------- config files / run dirs


def test_empty_config_file_is_refused_for_what_it_is(tmp_path, capsys):
    f = tmp_path / "empty.yaml"
    f.write_text("# nothing set yet\n")
    _one_line_exit_2(capsys, ["train", str(f), f"run.dir={tmp_path / 'r'}"], "empty.yaml is empty", "tiny_cpu.yaml")


def test_partial_run_dir_is_refused_unless_overwrite(tmp_path, capsys):
    """A run killed during SFT leaves config.yaml (and sft.jsonl) but no metrics or checkpoint."""
    d = tmp_path / "r"
    d.mkdir()
    dump_config(load_config(TINY_CFG, FAST), d / "config.yaml")
    (d / "notes.txt").write_text("mine")
    _one_line_exit_2(capsys, ["train", TINY_CFG, *FAST, f"run.dir={d}"], "already holds a run", "config.yaml",
                     "--overwrite")
    # --overwrite: accepted; the earlier run's files (only those) go when the new run materializes
    args = build_parser().parse_args(["train", TINY_CFG, *FAST, f"run.dir={d}", "--overwrite"])
    from jax_rl.cli import _load

    cfg = _load(args)
    assert cfg.run.overwrite is True
    resolve_run_dir(cfg, create=False, check_fresh=True)
    (d / "checkpoints" / "3").mkdir(parents=True)
    delete_earlier_run(cfg, d)
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]
    assert cfg.run.overwrite is False  # the new run's config.yaml does not carry it


def test_resume_with_another_model_size_names_both_models(tmp_path, capsys):
    d = tmp_path / "r"
    d.mkdir()
    dump_config(load_config(TINY_CFG, FAST), d / "config.yaml")
    err = _one_line_exit_2(capsys, ["train", TINY_CFG, *FAST, "--resume", f"run.dir={d}",
                                    "model.hf_overrides.num_hidden_layers=4"],
                           "was written for model.preset=tiny_dense", "2 layers", "this config asks for", "4 layers")
    assert "vocab_size" not in err.split("this config asks for")[0].split("written for")[0]


def test_checkpoint_mismatch_names_saved_and_asked_model():
    from jax_rl.checkpoint import CheckpointMismatchError, check_compatible

    saved = {"model_arch": {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 640}, "model_name":
             "model.preset=tiny_dense"}
    with pytest.raises(CheckpointMismatchError) as e:
        check_compatible(saved, model_arch={"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 640},
                         correction="ppo", model="model.preset=small")
    msg = str(e.value)
    assert "written for model.preset=tiny_dense (dense, hidden 64, 2 layers" in msg, msg
    assert "asks for model.preset=small (dense, hidden 128, 4 layers" in msg, msg
    assert msg.index("hidden_size: saved") < msg.index("num_hidden_layers: saved")  # size fields first


# ----------------------------------------------------------------------------- disk full


def test_disk_full_cancels_the_writes_orbax_never_started():
    """A save that hit a full disk leaves write coroutines Orbax created but never ran (kept alive by
    its stored exception); collected at shutdown they print ``coroutine ... was never awaited`` after
    the one-line error. The disk-full path closes them (the CLI no longer filters the warning)."""
    import gc
    import warnings

    from orbax.checkpoint._src.serialization import serialization as ser

    from jax_rl import checkpoint as ckpt

    def dropped(cancel: bool) -> list[str]:
        held = [ser.async_serialize_from_host(None, {})]  # created, never awaited (like write_fragment)
        if cancel:
            assert ckpt._cancel_unstarted_writes() >= 1
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            held.clear()
            gc.collect()
        return [str(x.message) for x in w if "was never awaited" in str(x.message)]

    assert dropped(cancel=False)  # the symptom is real
    assert not dropped(cancel=True)
