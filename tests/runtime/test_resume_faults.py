"""Resume under faults, through the CLI (issue 16 items 1, 3, 7, 8, 11).

- SIGTERM -> ``--resume`` -> ``kill -9`` -> ``--resume``: the run ends at exactly ``run.steps``,
  each step logged once in metrics.jsonl and in TensorBoard, counters consistent;
- a refused ``--resume`` changes nothing in the run dir; a corrupt latest checkpoint falls back
  to the newest good one; ``--resume --step N`` and ``jax-rl eval RUN/checkpoints/N``;
- a full disk (a real one: a small tmpfs in a user+mount namespace) ends in one line with the
  last good checkpoint intact;
- exit codes: 143 after SIGTERM, 2 for a bad input, 1 for a failed run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR
from jax_rl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# the TINY run of test_train.py, plus one checkpoint per step and no periodic eval
TINY = [
    "sft.steps=2", "sft.batch_size=4", "sft.num_demos=8", "optim.batch_size=4", "algo.group_size=2",
    "rollout.slots=4", "rollout.max_new_tokens_per_turn=24", "rollout.max_tokens_per_episode=48",
    "rollout.max_turns=2", "eval.num_tasks=2", "eval.k=2", "logging.progress=false", "rollout.dtype=float32",
    "eval.every=0", "checkpoint.every=1", "checkpoint.max_to_keep=10",
]


def _cmd(*args):
    return [PY, "-m", "jax_rl.cli", *args]


def _train(d, *extra):
    return _cmd("train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, f"run.dir={d}", *extra)


def _run(args, timeout=600):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _run_until(args, d, rows: int, sig: int, timeout=400, committed: bool = False):
    """Start ``args``; once metrics.jsonl has ``rows`` rows (and, ``committed``, a checkpoint is committed: a
    step-named dir under checkpoints/, what an async save renames its temporary dir to) send ``sig``; return
    (rc, output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ck = Path(d) / "checkpoints"
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            saved = not committed or (ck.is_dir() and any(x.name.isdigit() for x in ck.iterdir()))
            if saved and len(read_jsonl(Path(d) / "metrics.jsonl")) >= rows:
                break
            if p.poll() is not None:
                pytest.fail("train exited early:\n" + p.stdout.read()[-3000:])
            time.sleep(0.2)
        else:
            pytest.fail(f"fewer than {rows} steps within {timeout} s")
        p.send_signal(sig)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out


def _tb_scalars(tb_dir: Path) -> dict[str, list[int]]:
    """{tag: [steps]} as TensorBoard shows them: event files read in name (= time) order, and a
    ``SessionLog.START`` at step s discards the earlier events at steps >= s (TensorBoard's purge
    rule, which tensorboardX's ``purge_step`` relies on). Records are TFRecord-framed."""
    from tensorboardX.proto import event_pb2

    seen: dict[str, list[int]] = {}
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, i = f.read_bytes(), 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            rec = data[i + 12:i + 12 + n]
            if len(rec) < n:  # a record cut by kill -9
                break
            i += 12 + n + 4
            ev = event_pb2.Event.FromString(rec)
            if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START:
                seen = {t: [s for s in v if s < ev.step] for t, v in seen.items()}
            for v in ev.summary.value:
                seen.setdefault(v.tag, []).append(ev.step)
    return seen


def _ckpt_meta(d: Path, step: int) -> dict:
    return json.loads((d / "checkpoints" / str(step) / "metadata" / "metadata").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("updates", [[], ["optim.ppo_epochs=2", "optim.minibatches=2"]],
                         ids=["1update", "4updates"])
def test_sigterm_resume_kill9_resume_exact_steps(tmp_path, updates):
    steps = 6
    d = tmp_path / "run"
    args = _train(d, f"run.steps={steps}", "logging.tensorboard=true", *updates)
    rc, out = _run_until(args, d, 2, signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    s1 = len(read_jsonl(d / "metrics.jsonl"))
    assert _ckpt_meta(d, s1)["rl_step"] == s1

    rc, out = _run_until(args + ["--resume"], d, 4, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert f"at RL step {s1} " in out, out[-3000:]

    r = _run(args + ["--resume"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = read_jsonl(d / "metrics.jsonl")
    assert [x["step"] for x in rows] == list(range(1, steps + 1))  # each once, none skipped
    per_step = rows[0]["version"]
    assert [x["version"] for x in rows] == [per_step * s for s in range(1, steps + 1)]
    summary = json.loads((d / "summary.json").read_text())
    meta = _ckpt_meta(d, steps)
    n_up = 4 if updates else 1
    assert summary["rl_steps"] == meta["rl_step"] == steps
    assert summary["version"] == meta["version"] == per_step * steps
    assert meta["opt_step"] == summary["opt_step"] == steps * n_up
    # the buffer's counters agree with the steps trained: 4 trajectories per step, none twice
    assert summary["buffer_consumed"] == 4 * steps
    assert summary["buffer_produced"] == summary["buffer_consumed"] + summary["buffer_dropped_stale"] + \
        summary["buffer_pending"]
    ids = [g for x in rows for g in x.get("group_ids", [])]
    assert len(ids) == len(set(ids)) == 2 * steps
    tb = _tb_scalars(d / "tb")
    assert sorted(tb["reward_mean"]) == list(range(1, steps + 1)), tb["reward_mean"]


def _straight_killed_resumed(tmp_path, common: list[str], on_resume: list[str], *, timeout: float):
    """A run never stopped (``straight``) and the same run killed with SIGKILL after its second metrics row (and a
    committed checkpoint) and resumed with ``on_resume`` added (``killed``): (straight rows, killed rows, the
    resume's stdout + stderr)."""
    a, b = tmp_path / "straight", tmp_path / "killed"
    r = _run(_train(a, *common), timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    args = _train(b, *common)
    # a kill before the first async save committed leaves nothing to resume (2026-12-07, load 11: two rows, no
    # checkpoint): wait for one
    rc, out = _run_until(args, b, 2, signal.SIGKILL, timeout=timeout, committed=True)
    assert rc == -signal.SIGKILL, out[-3000:]
    r = _run(args + on_resume + ["--resume"], timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl"), r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_paged_kill9_resume_k0_identical(tmp_path):
    """rollout.kv_layout=paged (issue 46): a K=0 run killed with SIGKILL after its second step and resumed
    logs the rows of a run never stopped, bit for bit (tokens, rewards, losses, ratios, versions,
    ``prefill_tokens``...), K/V pool counters aside (``kv_*``: the engine's, per process, so a resumed
    process starts them from 0). ``prefill_tokens`` once differed (86 straight vs 54 resumed at step 3,
    2026-12-05): the straight run admitted two groups sharing prefix pages in one prefill call, the resumed
    one in two, and rows of one call did not share pages; they do now
    (``test_rows_of_one_call_share_prefix_pages_as_rows_of_separate_calls``)."""
    from tests.runtime.test_train import _strip

    common = ["run.steps=4", "async.max_staleness=0", "loss.correction=ppo_ewma", "run.seed=3",
              "rollout.kv_layout=paged"]
    ra, rb, out = _straight_killed_resumed(tmp_path, common, [], timeout=1200)
    assert "at RL step " in out
    assert [x["step"] for x in rb] == [1, 2, 3, 4]
    assert all("kv_pages_in_use" in x for x in ra + rb)
    same = lambda row: {k: v for k, v in _strip(row).items()  # noqa: E731
                        if not k.startswith("kv_")}
    for x, y in zip(ra, rb):
        assert same(x) == same(y), x["step"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_refused_and_corrupt_resume_and_step(tmp_path):
    d = tmp_path / "run"
    r = _run(_train(d, "run.steps=3", "logging.tensorboard=false"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ck = d / "checkpoints"
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [1, 2, 3]  # named by RL step

    # item 3: a refused --resume changes nothing (config.yaml, metrics, checkpoints)
    def snapshot():
        return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}

    before = snapshot()
    r = _run(_train(d, "run.steps=4", "loss.correction=ppo", "--resume"))
    assert r.returncode == 2 and "loss.correction" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot() == before

    # item 7: a corrupt latest step is reported in one line and the newest good one is used
    shutil.rmtree(ck / "3" / "ewma")
    (ck / "2" / "metadata" / "metadata").write_text("{not json")
    before = snapshot()
    # an explicit bad step: one line, exit 2, nothing changed
    r = _run(_train(d, "run.steps=4", "--resume", "--step", "3"))
    assert r.returncode == 2 and "missing item(s) ewma" in r.stderr, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert snapshot() == before

    # eval of one step dir works (and evaluates that step)
    r = _run(_cmd("eval", str(ck / "1"), str(CONFIG_DIR / "tiny_cpu.yaml"), "eval.num_tasks=2", "eval.k=2"))
    assert r.returncode == 0 and "RL step 1" in r.stderr, (r.stdout + r.stderr)[-3000:]
    assert "pass@2" in json.loads(r.stdout[r.stdout.index("{"):])

    r = _run(_train(d, "run.steps=4", "--resume"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    warn = [ln for ln in r.stderr.splitlines() if "trying an older step" in ln]
    assert len(warn) == 2 and "missing item(s) ewma" in warn[0] and "unreadable metadata" in warn[1], r.stderr
    assert "at RL step 1 " in r.stdout
    assert [x["step"] for x in read_jsonl(d / "metrics.jsonl")] == [1, 2, 3, 4]
    assert _ckpt_meta(d, 4)["rl_step"] == 4 and "Traceback" not in r.stderr

    # --resume --step N: continue from an older good step; the newer ones are superseded
    r = _run(_train(d, "run.steps=3", "--resume", "--step", "2"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "at RL step 2 " in r.stdout and "removed checkpoint" in r.stdout
    assert [x["step"] for x in read_jsonl(d / "metrics.jsonl")] == [1, 2, 3]
    assert max(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == 3


def _unshare_ok() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /tmp"],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_disk_full_one_line_last_checkpoint_intact(tmp_path):
    """A real full disk: the run dir is on a small tmpfs (user + mount namespace); once two steps
    are checkpointed (``checkpoints/2`` committed) a filler file takes the remaining space."""
    if not _unshare_ok():
        pytest.skip("needs unshare -rm and tmpfs mounts (user namespaces)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    d = mnt / "run"
    train = " ".join(_train(d, "run.steps=50", "logging.tensorboard=false"))
    check = (f"{PY} -c \"from jax_rl.learner.learner import Learner; from jax_rl.config import load_config; "
             f"lrn = Learner(load_config('{d}/config.yaml')); m = lrn.checkpoints.restore('{d}/checkpoints'); "
             f"print('RESTORED', m['checkpoint_step'], m['rl_step']); lrn.close()\"")
    script = f"""
set -u
mount -t tmpfs -o size=64m tmpfs {mnt}
{train} > {tmp_path}/out.txt 2> {tmp_path}/err.txt &
pid=$!
while [ ! -d {d}/checkpoints/2 ]; do   # step 2 committed (Orbax renames its tmp dir)
  kill -0 $pid 2>/dev/null || break; sleep 0.2; done
fallocate -l $(( $(stat -f -c '%a*%S' {mnt}) - 65536 )) {mnt}/filler 2>/dev/null || \
  dd if=/dev/zero of={mnt}/filler bs=64k 2>/dev/null
wait $pid; echo "RC=$?"
ls {d}/checkpoints
rm {mnt}/filler
{check}
"""
    r = subprocess.run(["unshare", "-rm", "bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=800, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    err = (tmp_path / "err.txt").read_text()
    assert "RC=1" in r.stdout, (r.stdout, r.stderr, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("jax-rl: error: run dir ") and "disk full" in lines[-1], err[-3000:]
    assert "needs ~" in lines[-1] and "last good checkpoint" in lines[-1]
    assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err, err[-3000:]
    assert "orbax-checkpoint-tmp" not in r.stdout  # no half-written step left behind
    restored = [ln for ln in r.stdout.splitlines() if ln.startswith("RESTORED")]
    assert restored, (r.stdout, r.stderr[-3000:])
    step = int(restored[0].split()[1])
    assert step >= 2 and str(d / "checkpoints" / str(step)) in lines[-1]


# ----------------------------------------------------------------------------- fast tests


def test_resumed_writer_drops_rows_after_the_restored_step(tmp_path):
    """metrics.jsonl / eval.jsonl keep rows <= the restored step (a torn last line dropped too)
    and TensorBoard purges the earlier session's events after it: each step shows once."""
    from jax_rl.metrics import MetricsWriter

    d = tmp_path / "run"
    with MetricsWriter(d) as w:
        w.write_eval(0, {"success": 0.5})
        for s in range(1, 6):
            w.write(s, {"loss": float(s)})
        w.write_eval(5, {"success": 0.7})
    with (d / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "loss"')  # cut by kill -9
    with MetricsWriter(d, resume_step=3) as w:
        for s in range(4, 7):
            w.write(s, {"loss": 10.0 + s})
    rows = read_jsonl(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows[3:]] == [14.0, 15.0, 16.0]
    assert [r["step"] for r in read_jsonl(d / "eval.jsonl")] == [0]
    tb = _tb_scalars(d / "tb")
    assert sorted(tb["loss"]) == [1, 2, 3, 4, 5, 6] and tb["eval/success"] == [0]


def test_step_needs_resume_exit_2(tmp_path):
    r = _run(_cmd("train", str(CONFIG_DIR / "tiny_cpu.yaml"), f"run.dir={tmp_path / 'r'}", "--step", "3"))
    assert r.returncode == 2 and "resume_step" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "r").exists()


def test_checkpointer_disk_full_precheck_one_line(tmp_path, monkeypatch):
    """The pre-check (array bytes vs free space) refuses the save before Orbax writes; the older
    step is intact. Here free space is faked; the tmpfs tests below fill a real disk."""
    import jax.numpy as jnp

    import jax_rl.checkpoint as C

    with C.Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, state={"w": jnp.ones((256, 256))}, metadata={"version": 1})
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
        with pytest.raises(C.CheckpointDiskFullError) as e:
            ck.save(2, state={"w": jnp.ones((256, 256))}, metadata={"version": 2})
        monkeypatch.undo()
        msg = str(e.value)
        assert "\n" not in msg and str(tmp_path / "ck") in msg and "needs ~" in msg and "1000 free" in msg
        assert f"last good checkpoint: {tmp_path / 'ck' / '1'}" in msg
        assert ck.all_steps() == [1] and ck.restore_metadata() == {"version": 1}


_ORBAX_ENOSPC = """
import sys, shutil, jax, jax.numpy as jnp
import jax_rl.checkpoint as C
ck = C.Checkpointer(sys.argv[1], max_to_keep=5)
ck.save(1, state={"w": jax.random.normal(jax.random.key(0), (64, 64))}, metadata={"version": 1})
ck.wait()
shutil.disk_usage = lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40)  # let it past the pre-check
try:
    ck.save(2, state={"w": jax.random.normal(jax.random.key(1), (1024, 1024))}, metadata={"version": 2})
    ck.wait()
except C.CheckpointDiskFullError as e:
    print("ERR", e)
ck.close()
import os; print("LS", sorted(os.listdir(sys.argv[1])))
print("META", C.Checkpointer(sys.argv[1]).restore_metadata())
"""


def test_checkpointer_enospc_in_orbax_one_line(tmp_path):
    """A real ENOSPC inside Orbax's background write (1 MiB tmpfs, 4 MiB array): one line, no
    absl tracebacks, no tmp dir left, the older step restores."""
    if not _unshare_ok():
        pytest.skip("needs unshare -rm and tmpfs mounts (user namespaces)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "s.py").write_text(_ORBAX_ENOSPC)
    r = subprocess.run(["unshare", "-rm", "bash", "-c",
                        f"mount -t tmpfs -o size=1m tmpfs {mnt} && {PY} {tmp_path / 's.py'} {mnt / 'ck'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out = r.stdout
    assert "ERR disk full" in out and "needs ~" in out, (out, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "No space left" not in r.stderr, r.stderr[-3000:]
    assert "LS ['1']" in out and "META {'version': 1}" in out, out


# model.bitwise on pages, multi-turn: SFT long enough that the model calls the calculator tool (2 turns: the
# call, then the answer after the tool's output) on 2-term 1-digit sums (some right answers: the loss moves the
# params); the learner and the engine both fp32 (TINY's rollout.dtype)
BITWISE = ["model.bitwise=true", "rollout.kv_layout=paged", "sft.steps=80", "sft.batch_size=8", "sft.num_demos=64",
           "optim.batch_size=8", "algo.group_size=4", "rollout.slots=8", "rollout.max_new_tokens_per_turn=32",
           "env.calculator.dataset_config={chain_sum: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}",
           "run.seed=3", "run.steps=4", "async.max_staleness=0", "loss.correction=ppo_ewma"]
# the restart batches differently: one decode step per engine call (up to 4 before) and one request admitted per
# generator step while slots decode (4 x max_prefill_length tokens before); neither is in the checkpoint's identity
REBATCH = ["rollout.decode_steps=1", "rollout.prefill_tokens_per_step=1"]


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_bitwise_paged_multiturn_kill9_resume_rebatched_identical(tmp_path):
    """Issue 62 item 5: a multi-turn paged K=0 run in the bitwise mode killed with SIGKILL after its second step
    and resumed with other batching (:data:`REBATCH`) logs the rows of a run never stopped, bit for bit, in
    every column but the wall-clock ones (``_strip``: seconds, rates, ``rollout_idle_frac``), the buffer's
    ``buffer/*`` counters and the per-process K/V pool counters (``kv_*``): episode lengths and tokens,
    rewards, losses, grad norms, ratios, versions, the train-infer figures of behav_logp and the prefill work.

    Two gaps closed (2026-12-06 -> 2026-12-07): the straight run had behav_logp an ulp off the learner's on some
    token (kl_train_infer_k1 1.2e-8, is_weight_max 1 + 1.1e-6 each step; XLA:CPU's YNNPACK fusions in calls of
    >= 1,024 rows, off in the mode: bitwise.CPU_COMPILER_OPTIONS), and the rebatched run prefilled 30 more
    positions per step (207 vs 177, 181 vs 151, 285 vs 255): under a 1-token prefill budget a GRPO gang's copies
    waited a step each and re-ran the prompt's partial last page (rollout.generator, a copy now comes past the
    budget; tests/rollout/test_admission.py::test_a_gang_admitted_past_the_prefill_budget_prefills_as_without_it).
    Measured 2026-12-07 (4 steps, two runs, load 10-11, 507 and 594 s): every row equal, prefill_tokens
    231 / 177 / 151 / 255, kl_train_infer_k1 0.0 and is_weight_max 1.0 in both runs."""
    from tests.runtime.test_train import _strip

    ra, rb, _ = _straight_killed_resumed(tmp_path, BITWISE, REBATCH, timeout=1500)
    assert [x["step"] for x in rb] == [1, 2, 3, 4]
    # multi-turn: with K/V kept between turns a step prefills each group's prompt once and each tool turn, so
    # G x prefill_tokens - (episode_tokens - generated) = (G - 1) x tool-turn tokens - G x prompt pages shared
    # across groups: > 0 only if some episode took a second turn. And a loss that moves the params.
    assert all(4 * x["prefill_tokens"] > x["episode_tokens"] - 8 * x["gen_tokens_mean"] for x in ra), ra
    assert max(x["grad_norm"] for x in ra) > 0, ra
    # the mode's claim on the straight run itself: behav_logp is the learner's log-prob, bit for bit
    assert all(x["kl_train_infer_k1"] == 0.0 and x["is_weight_max"] == 1.0 for x in ra), ra
    same = lambda row: {k: v for k, v in _strip(row).items() if not k.startswith("kv_")}  # noqa: E731
    diff = {x["step"]: {k: (v, same(y).get(k)) for k, v in same(x).items() if same(y).get(k) != v}
            for x, y in zip(ra, rb)}
    assert diff == {s: {} for s in diff}, diff
