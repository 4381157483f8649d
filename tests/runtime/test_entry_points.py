"""Every entry point answers as ``jax-rl train`` does (issue 39): the held-out guard at config time
for every runtime, and in the Ray producer; one line and exit 2 for bad arguments, paths and files
of ``serve``, ``export``, ``eval``, ``plot``, ``compile`` and ``sft``; env knobs checked by a schema."""

from __future__ import annotations

import os

import pytest

from jax_rl.cli import main
from jax_rl.config import CONFIG_DIR, Config, ConfigError, load_config

TINY_CFG = str(CONFIG_DIR / "tiny_cpu.yaml")


def _err(capsys, argv, rc: int = 2) -> str:
    capsys.readouterr()
    assert main(argv) == rc
    err = capsys.readouterr().err.strip()
    assert err.startswith("jax-rl") and "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- held-out guard
@pytest.mark.parametrize("runtime", ["embedded", "ray"])
@pytest.mark.parametrize("overrides, words", [
    (["eval.seed_offset=50", "run.steps=10"], ["eval.seed_offset=50", "raise eval.seed_offset"]),
    (["env.train_seed_offset=1000000"], ["env.train_seed_offset=1000000", "eval.seed_offset=1000000"]),
    (["eval.seed_offset=4000", "run.steps=600"], ["run.steps=600", "4799"]),  # 600 steps x 8 groups
    (["eval.seed_offset=2500", "run.steps=10"], ["sft.num_demos=3000"]),
])
def test_held_out_guard_at_config_time(tmp_path, capsys, runtime, overrides, words):
    """Training seeds that would reach the held-out ones: one line naming the keys, exit 2, no run
    dir, under both runtimes (Ray trained on held-out tasks silently; embedded refused mid-run)."""
    d = tmp_path / "r"
    err = _err(capsys, ["train", TINY_CFG, f"runtime={runtime}", f"run.dir={d}", *overrides])
    assert all(w in err for w in words), err
    assert not d.exists()


def test_held_out_guard_counts_the_bpe_demos_and_sft_only_when_used():
    base = {"eval": {"seed_offset": 100}, "run": {"steps": 2}, "optim": {"batch_size": 8},
            "algo": {"group_size": 4}}
    cfg = Config.model_validate(base)
    assert cfg.training_seed_uses() == {"rl": 4}  # sft.steps=0, compact tokenizer: RL only
    with pytest.raises(ValueError, match="model.tokenizer=bpe"):
        Config.model_validate({**base, "model": {"tokenizer": "bpe"}})
    with pytest.raises(ValueError, match="sft.num_demos=200"):
        Config.model_validate({**base, "sft": {"steps": 1, "num_demos": 200}})
    Config.model_validate({**base, "sft": {"steps": 1, "num_demos": 100}})  # seeds 0..99 < 100


def test_held_out_guard_in_the_ray_producer():
    """A seed past the config's lower bound (re-drawn groups) stops the Ray producer before it is
    dispatched or admitted: ``fatal`` names it (the loop then ends the run with exit 1, checkpoint
    and summary written), as the embedded producer does."""
    from jax_rl.runtime.ray_runtime import RayProducer

    cfg = load_config(TINY_CFG, ["runtime=ray", "eval.seed_offset=10000"])
    calls = []

    class _Remote:
        def __init__(self, name):
            self.name = name

        def remote(self, *a):
            calls.append(self.name)
            return True

    class _Ray:
        @staticmethod
        def get(x):
            return x

    p = RayProducer.__new__(RayProducer)
    p.cfg, p._ray, p._fatal, p.reissue, p.in_flight, p.per_worker, p.version = cfg, _Ray, None, [], {}, 2, 0
    p.buffer = type("B", (), {"admit": _Remote("admit")})()
    p.workers = [type("W", (), {"run_group": _Remote("run_group")})()]
    p.guard = type("G", (), {"fatal": None})()
    p.next_gid = 9999
    p._dispatch()  # two slots: seed 9999 goes out; seed 10000 is neither admitted nor sent
    assert calls == ["admit", "run_group"] and p.next_gid == 10000
    assert "training task seed 10000 reached eval.seed_offset=10000" in p.fatal


# ---------------------------------------------------------------- serve
@pytest.mark.parametrize("argv, words", [
    (["preset:tiny_dense", "--port", "70000"], ["--port 70000", "0..65535"]),
    (["preset:tiny_dense", "--slots", "0"], ["--slots 0"]),
    (["preset:tiny_dense", "--max-len", "1"], ["--max-len 1"]),
    (["preset:tiny_dense", "--temperature", "nan"], ["--temperature nan"]),
    (["preset:tiny_dense", "--kv-page-size", "0"], ["--kv-page-size 0", "1..--max-len"]),
    (["preset:tiny_dense", "--host", "not.a.host"], ["--host not.a.host"]),
    (["preset:tiny_dense", "--host", "192.0.2.1"], ["--host 192.0.2.1", "not an address of this machine"]),
    # --port 0 skipped the host check: the model loaded, then gRPC's raw error blamed the port, exit 1
    (["preset:tiny_dense", "--host", "8.8.8.8", "--port", "0"], ["--host 8.8.8.8", "not an address of this machine"]),
    (["preset:tiny_dense", "--host", "::2", "--port", "0"], ["--host ::2", "not an address of this machine"]),
    (["preset:nope"], ["preset:nope", "tiny_dense"]),
    (["/nonexistent/hf"], ["/nonexistent/hf"]),
    # an engine that cannot fit: one line naming the flags (was an XLA RESOURCE_EXHAUSTED traceback)
    (["preset:tiny_dense", "--slots", "100000000"], ["--slots 100000000 --max-len 256", "slot(s) of --max-len 256 fit"]),
])
def test_serve_bad_arguments_are_one_line(capsys, argv, words):
    err = _err(capsys, ["serve", *argv])
    assert all(w in err for w in words), err


def test_serve_a_run_dir_names_the_export_command(tmp_path, capsys):
    """A run dir (or its checkpoints/N) instead of an HF export: one line giving the `jax-rl export`
    command, no chained tracebacks."""
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {steps: 3}\n")
    for target in (run, run / "checkpoints" / "3"):
        err = _err(capsys, ["serve", str(target)])
        assert f"jax-rl export {target} OUT_DIR" in err, err
    (tmp_path / "plain").mkdir()
    assert "no config.json" in _err(capsys, ["serve", str(tmp_path / "plain")])
    (tmp_path / "f").write_text("x")
    assert "is a file" in _err(capsys, ["serve", str(tmp_path / "f")])
    assert "is not a tokenizer.json" in _err(capsys, ["serve", "preset:tiny_dense", "--tokenizer", str(tmp_path / "f")])


def test_serve_corrupt_checkpoint_is_one_line(tmp_path, capsys):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    err = _err(capsys, ["serve", str(d), "--port", "0"])
    assert str(d) in err, err


# ---------------------------------------------------------------- the other subcommands
def test_plot_of_a_dir_without_metrics(tmp_path, capsys):
    assert "holds no metrics.jsonl" in _err(capsys, ["plot", str(tmp_path)])
    assert not (tmp_path / "plots").exists()
    assert "run dir not found" in _err(capsys, ["plot", str(tmp_path / "none")])
    (tmp_path / "f.txt").write_text("x")  # a file: its dir is the run dir, which has no metrics
    assert "holds no metrics.jsonl" in _err(capsys, ["plot", str(tmp_path / "f.txt")])


@pytest.mark.parametrize("cmd", [["train"], ["train", "--dry-run"], ["sft"], ["eval", "/nonexistent"],
                                 ["compile", "--topology", "v5e-8"]])
def test_base_yaml_is_refused_as_a_run(tmp_path, capsys, cmd):
    """``configs/base.yaml`` is the base of the shipped configs (its defaults do not fit its own
    KV cache): refused in one line by every command that runs it; ``--print-config`` prints it."""
    base = str(CONFIG_DIR / "base.yaml")
    argv = [cmd[0], *cmd[1:2], base, *cmd[2:]] if cmd[0] == "eval" else [cmd[0], base, *cmd[1:]]
    err = _err(capsys, [*argv, f"run.dir={tmp_path / 'r'}"])
    assert "base.yaml" in err and "not a run config" in err
    assert not (tmp_path / "r").exists()
    capsys.readouterr()
    assert main(["train", base, "--print-config"]) == 0


def test_unwritable_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """A run dir under a file, or one this user may not write (checked with os.access; root may
    write anything, so the permission case is simulated): one line naming the key and path."""
    import os

    (tmp_path / "f").write_text("x")
    err = _err(capsys, ["train", TINY_CFG, f"run.dir={tmp_path / 'f' / 'run'}"])
    assert "run.dir=" in err and "is a file" in err
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(ro) else real(p, mode, **kw))
    for cmd in ("train", "sft"):
        err = _err(capsys, [cmd, TINY_CFG, f"run.dir={ro / 'run'}"])
        assert "cannot write there" in err and str(ro) in err, err
    err = _err(capsys, ["train", TINY_CFG, f"run.dir={tmp_path / 'ok'}", f"checkpoint.dir={ro / 'ck'}"])
    assert "checkpoint.dir=" in err
    assert not (ro / "run").exists() and not (tmp_path / "ok").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
@pytest.mark.parametrize("key", ["run.dir", "checkpoint.dir"])
def test_a_dir_access_calls_writable_but_nothing_can_be_made_in(tmp_path, capsys, key):
    """/proc passes os.access(W_OK) as root, yet no dir can be made there (ENOENT): refused before
    the run in one line naming the key, not found mid-run at the first checkpoint."""
    over = [f"{key}=/proc/jax-rl-{os.getpid()}/x"] + ([f"run.dir={tmp_path / 'r'}"] if key != "run.dir" else [])
    err = _err(capsys, ["train", TINY_CFG, *over])
    assert err.startswith(f"jax-rl: config error: {key}=/proc/") and "cannot write there" in err, err
    assert not (tmp_path / "r").exists()


def test_permission_error_mid_run_names_the_path(capsys, monkeypatch):
    """A write refused later (a dir made read-only during the run, an Orbax-wrapped EROFS): one line
    naming the path, exit 2, not a traceback."""
    import errno

    import jax_rl.cli as cli

    def boom(args):
        try:
            raise OSError(errno.EROFS, "Read-only file system", "/ro/run/checkpoints/3")
        except OSError as e:
            raise ValueError("orbax: save failed") from e

    parser = cli.build_parser

    def patched():
        p = parser()
        p._subparsers._group_actions[0].choices["plot"].set_defaults(func=boom)
        return p

    monkeypatch.setattr(cli, "build_parser", patched)
    err = _err(capsys, ["plot", "/x"])
    assert err == "jax-rl: error: cannot write /ro/run/checkpoints/3: Read-only file system"


# ---------------------------------------------------------------- env knobs
@pytest.mark.parametrize("overrides, line", [
    (["env.name=retail", "env.retail={num_users: abc}"], "env.retail.num_users='abc': Input should be a valid integer"),
    (["env.name=retail", "env.retail={num_users: 0}"], "env.retail.num_users=0: Input should be greater than or equal to 1"),
    (["env.name=retail", "env.retail={max_orders_per_user: true}"], "env.retail.max_orders_per_user=True"),
    (["env.name=retail", "env.retail={task_kinds: [refund]}"], "env.retail.task_kinds=['refund']"),
])
def test_retail_knobs_schema(tmp_path, capsys, overrides, line):
    """Env knobs of the wrong type or range: one line naming the knob and the value (was "'<' not
    supported between instances of 'str' and 'int'"), at config load (--print-config too)."""
    err = _err(capsys, ["train", TINY_CFG, *overrides, f"run.dir={tmp_path / 'r'}", "--print-config"])
    assert line in err, err


def test_dataset_knobs_schema():
    """calculator's ``env.calculator.dataset_config``: reasoning-gym's own config dataclass is the schema."""
    from rollout.envs.calculator import check_dataset_config

    with pytest.raises(ValueError, match=r"env.calculator.dataset_config.chain_sum.min_terms='abc': Input should be a valid integer"):
        check_dataset_config("chain_sum", {"min_terms": "abc"})
    with pytest.raises(ValueError, match="did you mean 'env.calculator.dataset_config.chain_sum.min_terms'"):
        check_dataset_config("chain_sum", {"min_termz": 2})
    assert check_dataset_config("chain_sum", {"min_terms": 2, "max_terms": 3}) == {"min_terms": 2, "max_terms": 3}


# ---------------------------------------------------------------- smaller items
def test_sft_line_says_when_no_sft_ran():
    from jax_rl.runtime.loop import sft_line

    ev = {"success": 0.25}
    assert sft_line(load_config(TINY_CFG), ev).startswith("held-out success after SFT: 0.250")
    line = sft_line(load_config(TINY_CFG, ["sft.steps=0"]), ev)
    assert "after SFT" not in line and "sft.steps=0" in line and "0.250" in line


def test_resumed_run_keeps_one_final_eval_row(tmp_path):
    """A run resumed and extended: the earlier run's ``final`` row (its end, not the run's) becomes an
    ``eval`` row, so eval.jsonl holds one ``final`` row, the resumed run's."""
    from jax_rl.metrics import MetricsWriter, read_jsonl

    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write_eval(0, {"success": 0.1, "label": "after_sft"})
    w.write_eval(2, {"success": 0.2, "label": "final"})
    w.write_eval(3, {"success": 0.3, "label": "eval"})  # after the checkpoint at 2: dropped on resume
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    w.write_eval(4, {"success": 0.4, "label": "final"})
    w.close()
    rows = read_jsonl(tmp_path / "eval.jsonl")
    assert [(r["step"], r["label"]) for r in rows] == [(0, "after_sft"), (2, "eval"), (4, "final")]
    assert rows[1]["success"] == 0.2


def test_rollout_threads_under_ray_is_named(caplog):
    """``rollout.threads`` is the embedded engine count: under Ray a warning says it is ignored (the
    endpoint check then refuses the bad host, so no Ray starts)."""
    import logging

    from jax_rl.runtime.ray_runtime import run_train_ray

    cfg = load_config(TINY_CFG, ["runtime=ray", "rollout.threads=3", "runtime.bind_host=not.a.host"])
    with caplog.at_level(logging.WARNING, logger="jax_rl.runtime"), pytest.raises(ConfigError, match="bind_host"):
        run_train_ray(cfg)
    assert any("rollout.threads=3" in r.getMessage() and "ray_workers" in r.getMessage() for r in caplog.records)


def test_plot_group_by_a_misspelt_key_is_refused(tmp_path, capsys):
    """--group-by loss.corection would put every run in one "corection=?" group: refused by name."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    err = _err(capsys, ["plot", str(d), "--group-by", "loss.correction,loss.corection", "--out", str(tmp_path / "p")])
    assert err == "jax-rl: config error: --group-by loss.corection: not a config key; did you mean 'loss.correction'?"
    assert not (tmp_path / "p").exists()
    capsys.readouterr()
    assert main(["plot", str(d), "--group-by", "loss.correction,env.retail.num_users", "--out", str(tmp_path / "p")]) == 0


def test_plot_without_out_writes_nothing_into_the_run_dir(tmp_path, capsys, monkeypatch):
    """A reader never writes into a run dir (it may be a live run's): without --out the figures go under
    ./plots/<run dir name>, and the run dir's listing is unchanged."""
    d = tmp_path / "runs" / "r1"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n{"step": 2, "reward_mean": 0.6}\n')
    before = sorted(p.name for p in d.iterdir())
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["plot", str(d)]) == 0
    assert sorted(p.name for p in d.iterdir()) == before
    assert list((work / "plots" / "r1").glob("*.png"))


def test_export_to_a_file_says_so(tmp_path):
    from jax_rl.export import ExportError, _check_out_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        _check_out_dir(tmp_path / "f")


def test_compile_json_that_cannot_be_written_fails_before_compiling(tmp_path, capsys):
    """--json is written after minutes of compiling: a dir that does not exist, a directory, or a
    place nothing can be made (/proc) is one line naming --json, at once (no libtpu needed)."""
    for path, words in ((tmp_path / "no" / "r.json", "does not exist"), (tmp_path, "is a directory"),
                        (f"/proc/jax-rl-{os.getpid()}.json", "cannot write there")):
        if str(path).startswith("/proc") and not os.path.isdir("/proc/self"):
            continue
        err = _err(capsys, ["compile", TINY_CFG, "--topology", "v5e-8", "--json", str(path)])
        assert err.startswith(f"jax-rl: config error: --json {path}") and words in err, err


def test_finished_run_line(tmp_path):
    """A resume of a finished run is a no-op only when summary.json says it finished (final eval
    run: not interrupted, no failed rollout or Ray) at run.steps and the checkpoint is there too."""
    import json

    from jax_rl.runtime.loop import finished_run_line

    cfg = load_config(TINY_CFG, ["run.steps=4"])
    assert finished_run_line(cfg, tmp_path, 4) is None  # no summary.json
    done = {"rl_steps": 4, "interrupted": False, "final_success": 0.5}
    for summary, step, finished in ((done, 4, True), (done, 3, False), ({**done, "rl_steps": 2}, 4, False),
                                    ({**done, "interrupted": True}, 4, False),
                                    ({**done, "rollout_failed": "x"}, 4, False), ({**done, "ray_failed": "x"}, 4, False)):
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        line = finished_run_line(cfg, tmp_path, step)
        assert (line is not None) == finished, (summary, step, line)
    (tmp_path / "summary.json").write_text(json.dumps(done))
    assert "nothing to do; raise run.steps" in finished_run_line(cfg, tmp_path, 4)
    assert finished_run_line(load_config(TINY_CFG, ["run.steps=6"]), tmp_path, 4) is None  # extended: trains on
    (tmp_path / "summary.json").write_text("{trunc")
    assert finished_run_line(cfg, tmp_path, 4) is None


@pytest.mark.parametrize("argv", [["eval", "some/run"], ["train"], ["sft"], ["compile", "--topology", "v5e-8"]])
def test_a_missing_config_names_only_what_is_missing(capsys, argv):
    """Overrides are optional: argparse listed them as required beside the config
    ('the following arguments are required: config, overrides')."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.endswith("the following arguments are required: config"), err


def test_sft_into_an_existing_run_offers_no_resume_and_refuses_one(tmp_path, capsys):
    """`jax-rl sft` has no --resume: a run dir that holds a run is refused without suggesting it,
    and resume=true (which would run SFT from scratch over the run's checkpoint) is refused."""
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text("{}\n")
    err = _err(capsys, ["sft", TINY_CFG, f"run.dir={d}"])
    assert "already holds a run" in err and "--resume" not in err and "--overwrite" in err, err
    err = _err(capsys, ["sft", TINY_CFG, f"run.dir={d}", "resume=true"])
    assert "resume=true: `jax-rl sft` does not resume" in err, err
    assert sorted(p.name for p in d.iterdir()) == ["metrics.jsonl"]


def test_plot_out_that_is_a_file_or_under_one(tmp_path, capsys):
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (tmp_path / "f").write_text("x")
    err = _err(capsys, ["plot", str(d), "--out", str(tmp_path / "f")])
    assert err == f"jax-rl: config error: --out {tmp_path / 'f'}: is a file, not a directory"
    err = _err(capsys, ["plot", str(d), "--out", str(tmp_path / "f" / "sub")])
    assert err.startswith(f"jax-rl: config error: --out {tmp_path / 'f' / 'sub'}: cannot make the directory"), err
    assert (tmp_path / "f").read_text() == "x"


def test_sft_under_runtime_ray_says_it_runs_in_process(tmp_path, caplog, monkeypatch):
    """`jax-rl sft runtime=ray` starts no Ray (SFT has no rollout): a warning says so instead of
    ignoring the key silently. The context is stopped before it builds anything."""
    from jax_rl.runtime import train as T

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(T, "RunContext", stop)
    cfg = load_config(TINY_CFG, ["runtime=ray", f"run.dir={tmp_path / 'r'}", "sft.steps=1"])
    with caplog.at_level("WARNING", logger="jax_rl.runtime"), pytest.raises(Stop):
        T.run_sft(cfg)
    assert any("`jax-rl sft` runs SFT and its eval in this process" in r.message for r in caplog.records)
