"""End-to-end RL steps, jax-rl vs Tunix 0.1.7's GRPOLearner: same weights, task, batch, optimizer.

    /work/bench-venv/bin/python bench/e2e_rl.py [--steps 40] [--warmup 3] [--rounds 2]
        [--arms jaxrl_k0 tunix jaxrl_k2 roles_k0 roles_k2 jaxrl_k0_paged ...] [--eval-tasks 64] [--eval-k 4]
        [--sft-steps 300] [--out runs/e2e_rl] [--json docs/results/e2e_rl_<date>.json]
        [--jax-rl-python .venv/bin/python] [--src DIR]

Runs in the bench venv (``bench/_tunix.py`` says how to build it; it holds tunix AND jax_rl). The
jax-rl arms run ``jax-rl train`` in subprocesses (``--jax-rl-python``, default the main
``.venv``); the Tunix arm runs ``tunix.rl.grpo.grpo_learner.GRPOLearner.train`` in a subprocess
of the bench venv. Every arm is its own process, run one after the other in the order printed,
``--rounds`` times (A B C ... A B C ...), with ``os.getloadavg()`` before and after each.

The task (``bench/e2e_rl.yaml``): ``make train``'s tiny dense Qwen3 (2 layers, d=64, vocab 640,
BPE tokenizer) on the calculator env's reasoning-gym chain_sum (here 2 terms of 1 digit: the yaml
says why), made SINGLE-TURN: Tunix 0.1.7's GRPOLearner is prompt -> one completion -> reward, so one assistant
turn answers ``<answer>N</answer>`` (a ``<tool_call>`` scores 0, as jax-rl's ``max_turns=1``
does). The start point is shared: ``prepare`` runs jax-rl's own SFT (``run_sft``, 300 steps) on
direct-answer demos (the env's reference solution with the tool call left out) and exports ONE HF
checkpoint folder (weights + ``tokenizer.json``) that every arm loads: jax-rl by
``model.checkpoint`` / ``model.tokenizer``, Tunix by its safetensors loader
(:func:`_tunix.load_model`) and a tokenizer adapter over the same ``tokenizer.json``
(:class:`_tunix.ChatTokenizerAdapter`). Prompts are the env's chat rendered by that tokenizer
(the same ids on both sides: checked), 64 trajectories per step in 8 groups of 8, at most 40 new
tokens, temperature 1, top_p 1, stop at ``<|im_end|>``/``<|endoftext|>``; optimizer
``chain(clip_by_global_norm(1.0), adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0))`` constant lr;
loss: PPO clip 0.2 against the behaviour log-probs, token-mean (jax-rl ``loss.correction=ppo``,
``loss.agg=token_mean``; Tunix ``GRPOConfig(beta=0, num_iterations=1, epsilon=0.2,
loss_agg_mode="token-mean")``); GRPO advantages (group mean, std-normalised) on both. The reward
is the env's own ``score`` (reasoning-gym ``score_answer``) on both sides (:func:`score`).
Differences left: jax-rl trains the stop token, Tunix does not (its completions end before EOS);
Tunix's training prompts are seeds 0, 1, 2, ... in order, jax-rl's its own task order (both below
the held-out seeds); the rollout of the jax-rl arms is its continuous-batching engine with 64
slots, Tunix's ``vanilla`` rollout (its ``Sampler``) on the whole batch.

Arms: ``jaxrl_k0`` / ``jaxrl_k2``: ``jax-rl train`` colocated (``runtime=embedded``: learner and
rollout threads in one process sharing both cores) with ``async.max_staleness`` 0 / 2;
``roles_k0`` / ``roles_k2``: the same with the roles on separate cores (``runtime=ray
runtime.ray_workers=1 runtime.learner_cpus=[0] runtime.rollout_cpus=[1]``, docs/placement.md);
``tunix``: GRPOLearner colocated (one mesh for actor and rollout: the rollout shares the actor's
params, synchronous, as Tunix runs whenever actor and rollout share a mesh). An arm ending in ``_paged``
(``jaxrl_k0_paged``, ``jaxrl_k2_paged``, ``agentic_k0_paged``, ``agentic_k2_paged``) is the arm without the
suffix with the engine on pages (``rollout.kv_layout=paged``, the pool at its default size: the contiguous
layout's memory); every other jax-rl arm runs the default contiguous layout. Each run and arm summary records
its ``kv_layout`` (None for Tunix); a paged arm's ratio is taken against Tunix (:data:`REFERENCE`) and, round
by round, against its contiguous twin (:data:`CONTIGUOUS`: ``ratio_vs_contiguous``, contiguous s/step / paged).

Per RL step (one optimizer update on 64 trajectories): ``wall_s`` (jax-rl: ``metrics.jsonl``
``wall_s`` differences; Tunix: the end of one ``update_actor`` to the end of the next),
generated tokens (completion tokens of the step's batch: jax-rl ``valid_tokens``, Tunix the
``RolloutOutput`` tokens), trained tokens (prompt + completion tokens of the batch, padding
excluded: jax-rl ``tokens``, Tunix the TrainExample masks), and tokens/s = those / ``wall_s``.
Figures are medians over the steps after ``--warmup`` (the first steps hold the compiles) of every
round. Ratio = jax-rl / Tunix (tokens/s), Tunix wall / jax-rl wall (s per step): > 1 = jax-rl
faster.

Stage breakdown, measured on both sides: Tunix wraps its own methods with timers
(``RLCluster.generate`` = generation, ``GRPOLearner._compute_rewards`` = scoring,
``RLCluster.update_actor`` = update, ``RLCluster.sync_weights`` = weight sync; host work = the
rest of the step: advantages, padding, the data queue, metric buffering); jax-rl from
``metrics.jsonl``: ``wait_s`` (the learner waiting for the batch: generation + scoring at K=0),
``step_time_s`` (update, incl. batch assembly), ``publish_s`` (weight sync); host work = the
rest of the step (metrics row, advantages, polling).

Held-out success (avg@``--eval-k`` over ``--eval-tasks`` held-out seeds from 1,000,000, the
env's score) of the shared start point and of every arm's final params, by ONE evaluator
(:func:`heldout_success`: Tunix's ``Sampler`` at temperature 1 on an fp32 Tunix Qwen3; a jax-rl
arm's final checkpoint goes through ``jax-rl export`` first), so both sides are scored by the
same code; ``gain_per_100s`` = (final - start) / the arm's RL wall seconds (all its steps,
compiles included) * 100.

Agentic arms (issue 36; ``--arms agentic_k0 tunix_agentic_k0 agentic_k2 tunix_agentic_k2``): the
calculator env's own 2-turn tool task (a ``calculate`` call, the tool's result, then
``<answer>N</answer>``; ``rollout.max_turns=2``, at most 80 generated tokens per episode), from a
second start point SFT'd on the env's tool-using reference solutions. ``agentic_k0`` / ``agentic_k2``:
``jax-rl train`` colocated at ``async.max_staleness`` 0 / 2; ``tunix_agentic_k0`` / ``tunix_agentic_k2``:
Tunix's own agentic learner (``tunix.rl.agentic.agentic_grpo_learner.GRPOLearner``,
``off_policy_steps`` 0 / 2) with its ``ToolAgent`` / ``ToolEnvironment``, the jax-rl env's tool and
conversation (:func:`tunix_agentic_parts`) and the shared tokenizer's chat rendering (:class:`_ChatParser`),
8 groups of 8, the same optimizer and loss. Each arm's ratio is against its own reference
(:data:`REFERENCE`: single-turn arms against ``tunix``, agentic ones against the Tunix agentic arm of the
same K), per round (:func:`round_ratios`: median over ``--rounds`` with min-max). Tunix's agentic stage
timer ``gen_s`` sums its concurrent per-episode ``generate`` calls (it is not wall time). Left as Tunix
0.1.7 runs it: its agentic learner calls ``generate`` once per episode turn with batch 1, and its
``vanilla`` rollout samples every call with the same key (``RolloutConfig.seed`` None -> ``PRNGKey(0)``),
so the 8 samples of a group are identical (the same lengths; zero GRPO advantages).

``--size small``: bench/learner_step.py's ``small`` Qwen3 (d=256, 4 layers, 8/4 heads, ff 768) with the
tool schemas rendered into the system prompt (:data:`SIZES`), for every arm, the SFT and Tunix (which
loads the exported folder). ``--no-eval`` skips the held-out evaluations (timing only).

A generation probe (:func:`gen_probe`) then splits the generation stage into prefill and decode
on both sides, and gives the prefill figure: prompts/s of one prefill + 1 token call for 64 prompts
laid out as a GRPO batch (8 distinct prompts x 8 samples), jax-rl's generator against Tunix's
``Sampler`` (one batched prefill) at the same shape. At the defaults the whole bench takes about 13 minutes on the 2-core host. When the
working tree is mid-edit, run the arms from an export: ``git archive HEAD | tar -x -C DIR``, then
``--src DIR`` (the script's own ``bench/`` files copied in), with ``BENCH_GIT_COMMIT`` set for the
record.

The task, its start point and the one evaluator live in ``bench/e2e_task.py``, the Tunix arms in
``bench/e2e_tunix.py``; this script runs the arms and reports. Writes a JSON record (date, load, machine,
args, commit, every step) to ``--json``. No assertion: figures depend on the machine's load. The issue's
target: jax-rl >= 1.5x Tunix per RL step at K=0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _record import add_platform_arg, environment, select_platform  # noqa: E402

select_platform()  # --platform cpu|gpu|tpu: JAX_PLATFORMS of this process and of every arm's process (default cpu)
PAGED = "_paged"  # suffix of a jax-rl arm run with rollout.kv_layout=paged (the arm without it: contiguous)
ARMS = ("jaxrl_k0", "tunix", "jaxrl_k2", "roles_k0", "roles_k2", "jaxrl_k0_paged", "jaxrl_k2_paged",
        "agentic_k0", "tunix_agentic_k0", "agentic_k2", "tunix_agentic_k2", "agentic_k0_paged", "agentic_k2_paged")
SINGLE_TURN_ARMS = tuple(x for x in ARMS if not x.startswith(("agentic", "tunix_agentic")))
# the arm each arm's ratio is taken against (jax-rl / Tunix per RL step)
REFERENCE = {"jaxrl_k0": "tunix", "jaxrl_k2": "tunix", "roles_k0": "tunix", "roles_k2": "tunix", "tunix": "tunix",
             "agentic_k0": "tunix_agentic_k0", "agentic_k2": "tunix_agentic_k2",
             "tunix_agentic_k0": "tunix_agentic_k0", "tunix_agentic_k2": "tunix_agentic_k2"}
REFERENCE.update({x: REFERENCE[x.removesuffix(PAGED)] for x in ARMS if x.endswith(PAGED)})
# each paged arm's contiguous twin (the second ratio of a paged arm: contiguous s/step / paged s/step)
CONTIGUOUS = {x: x.removesuffix(PAGED) for x in ARMS if x.endswith(PAGED)}
from e2e_task import (AGENTIC_MAX_TOKENS, AGENTIC_OVERRIDES, AGENTIC_TURNS, BATCH, GROUP,  # noqa: E402,F401
                      HELDOUT_SEED, MAX_NEW, SIZE_ENV, SIZES, Task, _src_path, direct_answer_demo, eval_hf,
                      heldout_success, load_cfg, prepare, size_overrides)
from e2e_tunix import question_text, tunix_agentic_parts, tunix_agentic_run, tunix_run  # noqa: E402,F401


# ---------------------------------------------------------------------------- the jax-rl arms


def jaxrl_steps(run_dir: Path) -> list[dict]:
    """Per-step figures of a finished ``jax-rl train`` run dir (its ``metrics.jsonl``)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    out, prev = [], None
    for r in rows:
        start = r["wall_s"] - r["wait_s"] - r["step_time_s"] - r.get("publish_s", 0.0) if prev is None else prev
        wall = r["wall_s"] - start
        prev = r["wall_s"]
        out.append({"step": int(r["step"]), "wall_s": wall, "gen_tokens": int(r["valid_tokens"]),
                    "trained_tokens": int(r["tokens"]), "wait_s": r["wait_s"], "update_s": r["step_time_s"],
                    "sync_s": r.get("publish_s", 0.0),
                    "host_s": wall - r["wait_s"] - r["step_time_s"] - r.get("publish_s", 0.0),
                    "reward_mean": r.get("reward_mean"), "staleness_mean": r.get("staleness_mean")})
    return out


def kv_layout(arm: str) -> Optional[str]:
    """``rollout.kv_layout`` of a jax-rl ``arm`` (``paged`` for a ``_paged`` arm, else ``contiguous``); None for
    a Tunix arm."""
    return None if arm.startswith("tunix") else ("paged" if arm.endswith(PAGED) else "contiguous")


def jaxrl_overrides(arm: str) -> list[str]:
    """The ``jax-rl train`` overrides that make a jax-rl ``arm`` what its name says, on top of ``bench/e2e_rl.yaml``
    and the size: ``async.max_staleness`` (``k0``/``k2``), the agentic task, the roles placement (``roles_*``:
    learner on the first core of this process's affinity, rollout on the second) and the K/V layout
    (:func:`kv_layout`). Raises ValueError for an arm not in :data:`ARMS` or a Tunix arm."""
    if arm not in ARMS or kv_layout(arm) is None:
        raise ValueError(f"{arm!r} is not a jax-rl arm (one of {[x for x in ARMS if not x.startswith('tunix')]})")
    base = arm.removesuffix(PAGED)
    out = [f"async.max_staleness={2 if base.endswith('k2') else 0}", f"rollout.kv_layout={kv_layout(arm)}"]
    if base.startswith("agentic"):
        out += AGENTIC_OVERRIDES
    if base.startswith("roles"):
        cpus = sorted(os.sched_getaffinity(0))
        out += ["runtime=ray", "runtime.ray_workers=1", f"runtime.learner_cpus=[{cpus[0]}]",
                f"runtime.rollout_cpus=[{cpus[1 % len(cpus)]}]"]
    return out


def jaxrl_run(arm: str, hf_dir: Path, src: Path, run_dir: Path, steps: int, py: str, seed: int,
              timeout: float) -> dict:
    """One ``jax-rl train`` subprocess of ``arm`` (:func:`jaxrl_overrides`); returns its steps, RL wall seconds and
    ``kv_layout``."""
    cmd = [py, "-m", "jax_rl.cli", "train", str(src / "bench" / "e2e_rl.yaml"), f"model.checkpoint={hf_dir}",
           f"model.tokenizer={hf_dir / 'tokenizer.json'}", "sft.steps=0", f"run.steps={steps}",
           f"run.seed={seed}", f"run.dir={run_dir}", *size_overrides(), *jaxrl_overrides(arm)]
    env = {**os.environ, "PYTHONPATH": str(src), "RAY_AUTH_MODE": "disabled"}  # JAX_PLATFORMS: --platform
    t = time.perf_counter()
    with open(str(run_dir) + ".log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=src, timeout=timeout).returncode
    if rc != 0:
        raise RuntimeError(f"{arm}: jax-rl train exited {rc}; log {run_dir}.log")
    st = jaxrl_steps(run_dir)
    return {"steps": st, "rl_wall_s": sum(s["wall_s"] for s in st), "process_s": time.perf_counter() - t,
            "kv_layout": kv_layout(arm)}


def gen_probe(hf_dir: Path, src: Path, prompt_len: int, rounds: int = 5) -> dict:
    """The generation stage split into prefill and decode at the bench's shape, both sides:
    ``bench/rollout_decode.py``'s runners (jax-rl ``Generator(Qwen3Engine(64 slots))`` fp32 with
    ``rollout.decode_steps``, each prompt prefilled alone and inserted; Tunix ``Sampler`` fp32, one
    batched prefill) on the bench checkpoint, 64 random prompts of ``prompt_len`` tokens, 1 and 8
    new tokens (no early stop), interleaved ``rounds`` times. Returns the median seconds per call
    for each (side, new tokens), and per side prefill_s (~ the 1-token call) and decode_s_per_token
    ((t8 - t1) / 7)."""
    cfg = load_cfg(src)  # jax_rl and rollout from src first: rollout_decode puts its own root on sys.path
    import _tunix as T
    from jax_rl.models import hf_io
    from jax_rl.runtime.serve import config_and_params

    import rollout_decode as RD
    qcfg = hf_io.load_config(hf_dir)
    ours_model, _ = hf_io.load_pretrained(str(hf_dir), scan_layers=cfg.model.scan_layers)
    _, params = config_and_params(ours_model)
    tmodel = T.load_model(str(hf_dir), qcfg)
    runners, calls = {}, {}
    for n in (1, 8):
        ours = RD.ours_runner(qcfg, params, BATCH, prompt_len, n, cfg.rollout.dtype, cfg.model.scan_layers,
                              cfg.rollout.decode_steps)
        tx = RD.tunix_runner(tmodel, qcfg, BATCH, prompt_len, n)
        runners[f"jaxrl_{n}"] = ours
        runners[f"tunix_{n}"] = tx
        calls[f"jaxrl_{n}"] = calls[f"tunix_{n}"] = BATCH * n
    # the prefill figure: a GRPO batch, 8 distinct prompts x 8 samples, prefill + 1 token (prompts/s)
    runners["jaxrl_grouped"] = RD.ours_runner(qcfg, params, BATCH, prompt_len, 1, cfg.rollout.dtype,
                                              cfg.model.scan_layers, cfg.rollout.decode_steps, groups=BATCH // GROUP)
    runners["tunix_grouped"] = RD.tunix_runner(tmodel, qcfg, BATCH, prompt_len, 1, groups=BATCH // GROUP)
    calls["jaxrl_grouped"] = calls["tunix_grouped"] = BATCH
    res = T.interleaved(runners, rounds, warmup=2)
    out: dict = {k: statistics.median(calls[k] / v for v in vs) for k, vs in res.items()}  # tok/s -> s per call
    for side in ("jaxrl", "tunix"):
        out[f"{side}_prefill_s"] = out[f"{side}_1"]
        out[f"{side}_decode_s_per_token"] = (out[f"{side}_8"] - out[f"{side}_1"]) / 7
        pps = sorted(res[f"{side}_grouped"])  # 1 new token per prompt: tokens/s = prompts/s
        out[f"{side}_prefill_prompts_per_s"] = statistics.median(pps)
        out[f"{side}_prefill_prompts_per_s_range"] = [pps[0], pps[-1]]
    out["prefill_ratio"] = out["jaxrl_prefill_prompts_per_s"] / out["tunix_prefill_prompts_per_s"]
    out["prompt_len"] = prompt_len
    return out


# ---------------------------------------------------------------------------- orchestration


def _sub(args: list[str], timeout: float, log: Path) -> dict:
    """Run this script's worker mode in a fresh bench-venv process; its last stdout line is JSON."""
    env = dict(os.environ)  # JAX_PLATFORMS as --platform set it (select_platform)
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], stdout=subprocess.PIPE,
                           stderr=f, env=env, timeout=timeout, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} exited {p.returncode}; log {log}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def attempt(fn, *args, **kw) -> dict:
    """``fn(*args, **kw)``, a run's record; a run that fails (an exit code, a signal such as Tunix's agentic
    learner's SIGSEGV, a timeout) gives ``{"steps": [], "rl_wall_s": 0.0, "error": "<type>: <message>"}``
    instead of raising, so one crashed run costs that run and not the bench's other rounds and record.
    The summaries leave such runs out (:func:`arm_summary`, :func:`round_ratios`); the record keeps them."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 (recorded, not swallowed: the record and the log name it)
        return {"steps": [], "rl_wall_s": 0.0, "error": f"{type(e).__name__}: {e}"}


def med(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def arm_summary(runs: list[dict], warmup: int) -> dict:
    """Medians over the steps after ``warmup`` of every run of one arm (failed runs, no steps, left out)."""
    runs = [r for r in runs if r["steps"]]
    st = [s for r in runs for s in r["steps"][warmup:]]
    out = {"timed_steps": len(st), "wall_s": med([s["wall_s"] for s in st]),
           "gen_tok_s": med([s["gen_tokens"] / s["wall_s"] for s in st]),
           "trained_tok_s": med([s["trained_tokens"] / s["wall_s"] for s in st]),
           "gen_tokens": med([s["gen_tokens"] for s in st]), "trained_tokens": med([s["trained_tokens"] for s in st])}
    for key in ("gen_s", "score_s", "wait_s", "update_s", "sync_s", "host_s"):
        v = [s[key] for s in st if key in s]
        if v:
            out[key] = med(v)
    # compiles: steps over 5x the run's median (jax-rl compiles one learner program per 16-token
    # bucket of the batch's longest trajectory as it first meets it; Tunix pads to one length)
    slow = [s["wall_s"] for r in runs for s in r["steps"] if s["wall_s"] > 5 * med([x["wall_s"] for x in r["steps"]])]
    out["slow_steps_per_run"] = len(slow) / len(runs)
    out["slow_s_per_run"] = sum(slow) / len(runs)
    h = [r["heldout"]["success"] for r in runs if r.get("heldout")]
    out["heldout_final"] = sum(h) / len(h) if h else None
    out["rl_wall_s"] = sum(r["rl_wall_s"] for r in runs) / len(runs)
    return out


def round_ratios(runs: dict[str, list[dict]], warmup: int, reference: Optional[dict] = None) -> dict[str, dict]:
    """Per arm, the ratio to its reference arm (``reference``, default :data:`REFERENCE`: Tunix's learner of the
    same task; :data:`CONTIGUOUS` for the paged arms' second ratio) round by round: reference median s/step /
    the arm's median s/step over the steps after ``warmup``, of the runs of the same round (rounds interleave
    the arms, so a round's two runs saw about the same load). Returns ``{arm: {"rounds": [...], "median",
    "min", "max"}}`` for the arms whose reference ran."""
    reference = REFERENCE if reference is None else reference
    out: dict[str, dict] = {}
    for arm, rs in runs.items():
        ref = {r["round"]: r for r in runs.get(reference.get(arm, ""), [])}
        xs = []
        for r in rs:
            if r["round"] in ref:
                mine = med([s["wall_s"] for s in r["steps"][warmup:]])
                theirs = med([s["wall_s"] for s in ref[r["round"]]["steps"][warmup:]])
                if mine and theirs:
                    xs.append(theirs / mine)
        if xs:
            out[arm] = {"rounds": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The bench's command line (``--steps`` must exceed ``--warmup``; ``--platform`` as :mod:`_record` adds it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="RL steps per arm run")
    ap.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of the medians")
    ap.add_argument("--rounds", type=int, default=2, help="times the arm sequence is repeated")
    ap.add_argument("--arms", nargs="+", default=list(SINGLE_TURN_ARMS), choices=ARMS,
                    help="single-turn arms (default) and the agentic ones: agentic_k0/agentic_k2 (jax-rl, 2-turn "
                         "tool task) against tunix_agentic_k0/tunix_agentic_k2 (Tunix's agentic GRPO learner, "
                         "off_policy_steps 0/2)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES), help="model size (SIZES)")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations (timing only)")
    ap.add_argument("--eval-tasks", type=int, default=64)
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="work dir (default runs/e2e_rl-<UTC time>); a prepared "
                                              "<out>/base/hf is reused")
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / f"e2e_rl_{dt.date.today():%Y%m%d}.json"),
                    help="JSON list the record is appended to ('' = none)")
    ap.add_argument("--jax-rl-python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--src", default=str(ROOT), help="the jax-rl source tree the arms run (e.g. a `git archive` export)")
    ap.add_argument("--run-timeout", type=float, default=900.0)
    ap.add_argument("--gen-probe-rounds", type=int, default=5,
                    help="rounds of the generation-stage probe (prefill vs decode, both sides; 0 = skip)")
    add_platform_arg(ap)
    a = ap.parse_args(argv)
    if a.steps <= a.warmup:
        ap.error("--steps must exceed --warmup")
    return a


def prepare_start_points(a: argparse.Namespace, out: Path, src: Path, hf: Path, hf_agentic: Path) -> None:
    """The shared start points the chosen arms need (direct-answer ``hf``, agentic ``hf_agentic``), each SFT'd
    and exported in a worker process unless already there."""
    for want, d, kind in ((any(x in SINGLE_TURN_ARMS for x in a.arms), hf, "direct-answer"),
                          (any(x not in SINGLE_TURN_ARMS for x in a.arms), hf_agentic, "agentic")):
        if want and not (d / "model.safetensors").exists():
            t = time.perf_counter()
            _sub(["_prepare", str(d.parent), str(src), str(a.sft_steps), kind], a.run_timeout,
                 out / f"prepare_{kind}.log")
            print(f"prepared {d} (SFT {a.sft_steps} steps on {kind} demos) in {time.perf_counter() - t:.0f} s",
                  flush=True)


def run_arm(a: argparse.Namespace, arm: str, rd: Path, src: Path, hf: Path, hf_agentic: Path) -> dict:
    """One run of ``arm`` in run dir ``rd`` (a Tunix worker process or a ``jax-rl train`` subprocess), with the
    held-out evaluation of a single-turn jax-rl arm's final params; a failed run is a record with ``error``."""
    if arm == "tunix":
        return attempt(_sub, ["_tunix", str(hf), str(src), str(a.steps),
                              str(a.eval_tasks if not a.no_eval else 0), str(a.eval_k)],
                       a.run_timeout, Path(str(rd) + ".log"))
    if arm.startswith("tunix_agentic"):
        return attempt(_sub, ["_tunix_agentic", str(hf_agentic), str(src), str(a.steps),
                              "2" if arm.endswith("k2") else "0"], a.run_timeout, Path(str(rd) + ".log"))
    rec = attempt(jaxrl_run, arm, hf_agentic if arm.startswith("agentic") else hf, src, rd, a.steps,
                  a.jax_rl_python, a.seed, a.run_timeout)
    if not a.no_eval and arm in SINGLE_TURN_ARMS and "error" not in rec:
        rec["heldout"] = attempt(_sub, ["_evalrun", str(rd), str(src), str(a.eval_tasks),
                                        str(a.eval_k)], a.run_timeout, Path(str(rd) + ".eval.log"))
        if "error" in rec["heldout"]:
            rec["heldout"] = {"success": None, "error": rec["heldout"]["error"]}
    return rec


def run_rounds(a: argparse.Namespace, out: Path, src: Path, hf: Path, hf_agentic: Path, T) -> dict[str, list[dict]]:
    """``--rounds`` times every arm in order (:func:`run_arm`), each run printed with the load around it and
    ``out/runs.json`` rewritten after each (a bench killed later keeps the runs so far)."""
    runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    for rnd in range(a.rounds):
        print(f"round {rnd} start: {T.machine_load()}", flush=True)
        for arm in a.arms:
            load0 = os.getloadavg()
            rec = run_arm(a, arm, out / f"{arm}_r{rnd}", src, hf, hf_agentic)
            rec.update({"arm": arm, "round": rnd, "load_before": list(load0), "load_after": list(os.getloadavg())})
            runs[arm].append(rec)
            # every finished run on disk at once: a bench killed later keeps the runs so far
            (out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
            if "error" in rec:
                print(f"  round {rnd} {arm:16s} FAILED ({rec['error']}), load {load0[0]:.2f}->"
                      f"{os.getloadavg()[0]:.2f}; the other runs go on", flush=True)
                continue
            w = [s["wall_s"] for s in rec["steps"][a.warmup:]]
            ho = (rec.get("heldout") or {}).get("success")
            print(f"  round {rnd} {arm:16s} median {med(w):.3f} s/step over {len(w)} steps, RL wall "
                  f"{rec['rl_wall_s']:.1f} s, held-out {'-' if ho is None else f'{ho:.3f}'}, load "
                  f"{load0[0]:.2f}->{os.getloadavg()[0]:.2f}", flush=True)
        print(f"round {rnd} end: {T.machine_load()}", flush=True)
    return runs


def run_gen_probe(a: argparse.Namespace, runs: dict[str, list[dict]], out: Path, src: Path, hf: Path,
                  hf_agentic: Path) -> Optional[dict]:
    """The generation probe (:func:`gen_probe`, in a worker process) at the runs' longest prompt, printed;
    None with ``--gen-probe-rounds 0``."""
    probe = None
    if a.gen_probe_rounds > 0:
        P = max((r.get("prompt_len_max") for rs in runs.values() for r in rs if r.get("prompt_len_max")), default=48)
        probe_hf = hf if (hf / "model.safetensors").exists() else hf_agentic
        probe = attempt(_sub, ["_genprobe", str(probe_hf), str(src), str(P), str(a.gen_probe_rounds)],
                        a.run_timeout, out / "genprobe.log")
    if probe and "error" in probe:
        print(f"generation probe FAILED ({probe['error']})", flush=True)
    elif probe:
        print(f"generation probe (64 prompts of {P} tokens, s per call, median of {a.gen_probe_rounds}): "
              f"prefill+1 token jax-rl {probe['jaxrl_1']:.3f} / Tunix {probe['tunix_1']:.3f}; 8 tokens jax-rl "
              f"{probe['jaxrl_8']:.3f} / Tunix {probe['tunix_8']:.3f}; decode per token jax-rl "
              f"{probe['jaxrl_decode_s_per_token'] * 1e3:.1f} ms / Tunix {probe['tunix_decode_s_per_token'] * 1e3:.1f} ms",
              flush=True)
        jr, tr = probe["jaxrl_prefill_prompts_per_s_range"], probe["tunix_prefill_prompts_per_s_range"]
        print(f"prefill (64 prompts = {BATCH // GROUP} groups of {GROUP}, {P} tokens, prefill + 1 token, prompts/s, "
              f"median [min-max] of {a.gen_probe_rounds}): jax-rl {probe['jaxrl_prefill_prompts_per_s']:.0f} "
              f"[{jr[0]:.0f}-{jr[1]:.0f}] / Tunix batched prefill {probe['tunix_prefill_prompts_per_s']:.0f} "
              f"[{tr[0]:.0f}-{tr[1]:.0f}] = {probe['prefill_ratio']:.2f}x (target >= 1.5x)", flush=True)
    return probe


def summarize(runs: dict[str, list[dict]], base: dict, warmup: int) -> tuple[dict, dict]:
    """Per-arm summaries (:func:`arm_summary`, held-out gain per 100 s against the start point ``base``) and the
    per-round ratios (:func:`round_ratios`); failed runs listed."""
    summ = {arm: arm_summary(rs, warmup) for arm, rs in runs.items() if any(r["steps"] for r in rs)}
    for s in summ.values():
        if s.get("heldout_final") is not None and base.get("success") is not None:
            s["heldout_gain_per_100s"] = (s["heldout_final"] - base["success"]) / s["rl_wall_s"] * 100
    rr = round_ratios(runs, warmup)
    for arm, q in round_ratios(runs, warmup, CONTIGUOUS).items():  # paged arms against their contiguous twins
        if arm in summ:
            summ[arm]["ratio_vs_contiguous"] = q
    for arm, s in summ.items():
        s["kv_layout"] = kv_layout(arm)
    failed = [f"{r['arm']} r{r['round']}: {r['error']}" for rs in runs.values() for r in rs if "error" in r]
    if failed:
        print("failed runs (left out of the medians, kept in the record):\n  " + "\n  ".join(failed))
    return summ, rr


def print_table(summ: dict, rr: dict) -> None:
    """The per-arm table (s/step, tokens/s, ratio to the reference arm, stages, held-out) and the targets; also
    puts each arm's ratios into its summary."""
    print(f"\n{'arm':16s} {'s/step':>7s} {'gen tok/s':>9s} {'train tok/s':>11s} {'x ref (s/step)':>14s} "
          f"{'per round [min-max]':>20s} {'gen':>6s} {'score':>6s} {'wait':>6s} {'update':>6s} {'sync':>6s} "
          f"{'host':>6s} {'held-out':>8s}")
    for arm, s in summ.items():
        ref = summ.get(REFERENCE[arm])
        ratio = ref["wall_s"] / s["wall_s"] if ref else None
        s["reference"] = REFERENCE[arm]
        s["ratio_vs_tunix"] = ratio
        s["round_ratios"] = rr.get(arm)
        if ref:
            s["gen_tok_s_ratio"] = s["gen_tok_s"] / ref["gen_tok_s"]
            s["trained_tok_s_ratio"] = s["trained_tok_s"] / ref["trained_tok_s"]
        f = lambda key: f"{s[key]:6.3f}" if s.get(key) is not None else f"{'-':>6s}"  # noqa: E731
        q = rr.get(arm)
        per = f"{q['median']:.2f}x [{q['min']:.2f}-{q['max']:.2f}]" if q else "-"
        ho = s.get("heldout_final")
        print(f"{arm:16s} {s['wall_s']:7.3f} {s['gen_tok_s']:9.0f} {s['trained_tok_s']:11.0f} "
              f"{(f'{ratio:.2f}x' if ratio else '-'):>14s} {per:>20s} {f('gen_s')} {f('score_s')} {f('wait_s')} "
              f"{f('update_s')} {f('sync_s')} {f('host_s')} {('-' if ho is None else f'{ho:.3f}'):>8s}")
    for arm, target in (("jaxrl_k0", 1.5), ("agentic_k0", 1.5), ("agentic_k2", 2.0)):
        q = rr.get(arm)
        if q:
            print(f"{arm} / {REFERENCE[arm]} per RL step, median of {len(q['rounds'])} round(s): {q['median']:.2f}x "
                  f"[{q['min']:.2f}-{q['max']:.2f}] (target >= {target}x: "
                  f"{'met' if q['median'] >= target else 'missed'})")
    for arm, s in summ.items():
        q = s.get("ratio_vs_contiguous")
        if q:
            print(f"{arm} (paged) / {CONTIGUOUS[arm]} (contiguous) per RL step, median of {len(q['rounds'])} "
                  f"round(s): {q['median']:.2f}x [{q['min']:.2f}-{q['max']:.2f}] (> 1 = paged faster)")


def main(argv: Optional[list[str]] = None) -> int:
    """The bench (or, for an argument starting with ``_``, one worker mode: :func:`_worker`): start points, the
    held-out start figure, the rounds of arms, the generation probe, the table, the JSON record."""
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0].startswith("_"):  # worker modes (one fresh process each)
        return _worker(argv)
    a = parse_args(argv)
    src = Path(a.src).resolve()
    os.environ[SIZE_ENV] = a.size  # every worker and jax-rl arm builds this size
    stamp = dt.datetime.now(dt.timezone.utc)
    out = Path(a.out) if a.out else ROOT / "runs" / f"e2e_rl-{stamp:%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    import _tunix as T

    print(f"e2e RL {stamp:%Y-%m-%d %H:%M} UTC; {T.machine_load()}; src {src}; tunix {T.version()}; size {a.size}; "
          f"{a.steps} steps/run, warm-up {a.warmup}, {a.rounds} round(s): {' '.join(a.arms)}", flush=True)
    _src_path(src)  # the jax_rl of --src, as the workers import it
    env = environment()  # versions, backend, devices, chip: printed and in the record
    hf = out / "base" / "hf"
    hf_agentic = out / "base_agentic" / "hf"
    prepare_start_points(a, out, src, hf, hf_agentic)
    base = {"success": None}
    if not a.no_eval and any(x in SINGLE_TURN_ARMS for x in a.arms):
        base = _sub(["_eval", str(hf), str(src), str(a.eval_tasks), str(a.eval_k)], a.run_timeout,
                    out / "eval_base.log")
        print(f"start point held-out success {base['success']:.3f} (avg@{a.eval_k}, {a.eval_tasks} tasks)", flush=True)
    runs = run_rounds(a, out, src, hf, hf_agentic, T)
    probe = run_gen_probe(a, runs, out, src, hf, hf_agentic)
    summ, rr = summarize(runs, base, a.warmup)
    print_table(summ, rr)
    print(T.machine_load())
    record = {"timestamp": stamp.isoformat(timespec="seconds"), "env": env, "load_end": T.machine_load(),
              "cpu_count": os.cpu_count(), "git_commit": os.environ.get("BENCH_GIT_COMMIT") or _git(ROOT),
              "src": str(src), "tunix": T.version(), "args": vars(a), "start_heldout": base, "gen_probe": probe, "summary": summ,
              "runs": runs}
    if a.json:
        from async_speedup import append_record

        append_record(Path(a.json), record)
        print(f"appended to {a.json}")
    return 0


def _git(root: Path) -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except Exception:
        return None


def _worker(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "_prepare":
        prepare(Path(rest[0]), Path(rest[1]), int(rest[2]), agentic=len(rest) > 3 and rest[3] == "agentic")
        res: dict = {"ok": True}
    elif mode == "_tunix_agentic":
        _src_path(Path(rest[1]))
        res = tunix_agentic_run(Path(rest[0]), Path(rest[1]), int(rest[2]), int(rest[3]))
    elif mode == "_eval":
        _src_path(Path(rest[1]))
        res = eval_hf(Path(rest[0]), Path(rest[1]), int(rest[2]), int(rest[3]))
    elif mode == "_evalrun":  # a jax-rl run dir: export its final checkpoint, then evaluate
        src = Path(rest[1])
        _src_path(src)
        from jax_rl.export import export_checkpoint

        hf = Path(rest[0] + "_hf")
        if not (hf / "model.safetensors").exists():
            export_checkpoint(rest[0], hf)
        res = eval_hf(hf, src, int(rest[2]), int(rest[3]))
    elif mode == "_tunix":
        _src_path(Path(rest[1]))
        res = tunix_run(Path(rest[0]), Path(rest[1]), int(rest[2]), int(rest[3]), int(rest[4]))
    elif mode == "_genprobe":
        _src_path(Path(rest[1]))
        res = gen_probe(Path(rest[0]), Path(rest[1]), int(rest[2]), int(rest[3]))
    else:
        raise SystemExit(f"unknown worker mode {mode}")
    sys.stdout.flush()
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # _tunix, async_speedup
    sys.exit(main())
