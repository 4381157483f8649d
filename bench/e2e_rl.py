"""End-to-end RL steps, jax-rl vs Tunix 0.1.7's GRPOLearner: same weights, task, batch, optimizer.

    /work/bench-venv/bin/python bench/e2e_rl.py [--steps 40] [--warmup 3] [--rounds 2]
        [--arms jaxrl_k0 tunix jaxrl_k2 roles_k0 roles_k2] [--eval-tasks 64] [--eval-k 4]
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
params, synchronous, as Tunix runs whenever actor and rollout share a mesh).

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

Writes a JSON record (date, load, machine, args, commit, every step) to ``--json``. No
assertion: figures depend on the machine's load. The issue's target: jax-rl >= 1.5x Tunix per RL
step at K=0.
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
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _record import add_platform_arg, environment, select_platform  # noqa: E402

select_platform()  # --platform cpu|gpu|tpu: JAX_PLATFORMS of this process and of every arm's process (default cpu)
CONFIG = ROOT / "bench" / "e2e_rl.yaml"
ARMS = ("jaxrl_k0", "tunix", "jaxrl_k2", "roles_k0", "roles_k2", "agentic_k0", "tunix_agentic_k0", "agentic_k2",
        "tunix_agentic_k2")
SINGLE_TURN_ARMS = ARMS[:5]
# the arm each arm's ratio is taken against (jax-rl / Tunix per RL step)
REFERENCE = {"jaxrl_k0": "tunix", "jaxrl_k2": "tunix", "roles_k0": "tunix", "roles_k2": "tunix", "tunix": "tunix",
             "agentic_k0": "tunix_agentic_k0", "agentic_k2": "tunix_agentic_k2",
             "tunix_agentic_k0": "tunix_agentic_k0", "tunix_agentic_k2": "tunix_agentic_k2"}
SIZE_ENV = "E2E_RL_SIZE"  # the model size every worker process builds (set by main from --size)
# --size: jax-rl config overrides on top of bench/e2e_rl.yaml, the same for SFT, every arm and Tunix
# (Tunix loads the exported HF folder, so it gets the same model). ``small`` is bench/learner_step.py's
# `small` Qwen3 (d=256, 4 layers, 8/4 heads of 32, ff 768) with the tool schemas rendered in the
# system prompt (prompts ~3x longer), where compute rather than dispatch dominates a step.
SIZES = {
    "tiny": [],
    # every hf_overrides key is set (an override replaces the yaml's dict): vocab 640 (the BPE), rope 1e6 (Tunix)
    "small": ["model.hf_overrides.vocab_size=640", "model.hf_overrides.rope_theta=1000000.0",
              "model.hf_overrides.hidden_size=256",
              "model.hf_overrides.intermediate_size=768",
              "model.hf_overrides.num_hidden_layers=4", "model.hf_overrides.num_attention_heads=8",
              "model.hf_overrides.num_key_value_heads=4", "model.hf_overrides.head_dim=32",
              "rollout.render_tools=true", "rollout.max_prefill_length=320", "rollout.max_cache_len=400",
              "optim.max_seq_len=400"],
}
HELDOUT_SEED = 1_000_000
MAX_NEW = 40
GROUP = 8
BATCH = 64


# ---------------------------------------------------------------------------- the task (both sides)


def _src_path(src: Path) -> None:
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))


def size_overrides(size: Optional[str] = None) -> list[str]:
    """The jax-rl overrides of model size ``size`` (default: ``$E2E_RL_SIZE`` or ``tiny``; :data:`SIZES`)."""
    size = size or os.environ.get(SIZE_ENV, "tiny")
    if size not in SIZES:
        raise ValueError(f"--size {size!r}: one of {sorted(SIZES)}")
    return list(SIZES[size])


def load_cfg(src: Path, overrides: Optional[list] = None):
    """The bench's jax-rl Config (``bench/e2e_rl.yaml`` of ``src``, at the size :func:`size_overrides` says)."""
    _src_path(src)
    from jax_rl.config import load_config

    return load_config(src / "bench" / "e2e_rl.yaml", size_overrides() + list(overrides or []))


def direct_answer_demo(env: Any, seed: int) -> list[dict]:
    """The single-turn reference solution: ``<answer>{the task's answer}</answer>`` (no tool call)."""
    env.reset(seed)
    return [{"role": "assistant", "content": f"<answer>{env.entry['answer']}</answer>"}]


class Task:
    """Prompts and scoring of the bench task, from jax-rl's env and the shared tokenizer.

    ``prompt(seed)`` -> (token ids, rendered text) of the env's chat with the generation prompt;
    ``score(text, seed, ended)`` -> reward in [0, 1]: 0 when the turn did not end with a stop id
    (``ended`` False) or is a tool call, else the env's ``score`` (reasoning-gym ``score_answer``),
    as jax-rl's agent loop scores a one-turn episode.
    """

    def __init__(self, cfg: Any, tokenizer: Any):
        from jax_rl.runtime.envs import build_env_factory

        self.cfg, self.tok = cfg, tokenizer
        self.env_factory = build_env_factory(cfg)
        self._env = self.env_factory()

    def prompt(self, seed: int) -> tuple[list[int], str]:
        messages, tools = self._env.reset(int(seed))
        shown = tools if self.cfg.rollout.render_tools else None
        ids, _ = self.tok.render_chat(messages, shown, add_generation_prompt=True)
        return list(ids), self.tok.render_text(messages, shown, add_generation_prompt=True)

    def score(self, text: str, seed: int, ended: bool = True) -> float:
        if not ended or "<tool_call>" in text:
            return 0.0
        self._env.reset(int(seed))
        r, _ = self._env.score(text)
        return float(min(1.0, max(0.0, r)))


def prepare(out: Path, src: Path, sft_steps: int, agentic: bool = False) -> Path:
    """jax-rl SFT on direct-answer demos (``run_sft``), exported to ``out/hf`` (weights + tokenizer).
    ``agentic``: on the env's own tool-using demos (a ``calculate`` call, its result, the answer), the
    start point of the 2-turn arms."""
    _src_path(src)
    from rollout.envs.calculator import CalculatorEnv

    if not agentic:
        CalculatorEnv.reference_solution = direct_answer_demo  # this process only: demos without the tool
    from jax_rl.export import export_checkpoint
    from jax_rl.runtime.train import run_sft

    cfg = load_cfg(src, [f"run.dir={out / 'sft'}", f"sft.steps={sft_steps}"] + (AGENTIC_OVERRIDES if agentic else []))
    run_sft(cfg)
    export_checkpoint(out / "sft", out / "hf")
    return out / "hf"


# ---------------------------------------------------------------------------- one evaluator for both


def heldout_success(model: Any, task: Task, qcfg: Any, n_tasks: int, k: int, seed: int = 0) -> dict:
    """avg@k held-out success of a Tunix Qwen3 ``model`` (Tunix ``Sampler``, temperature 1, top_p 1,
    at most ``MAX_NEW`` tokens, stop ids of the tokenizer) on seeds ``HELDOUT_SEED + i``, scored
    by :meth:`Task.score`. Returns {"success", "n", "eval_s"}."""
    import _tunix as T

    t = time.perf_counter()
    seeds = [HELDOUT_SEED + i for i in range(n_tasks) for _ in range(k)]
    prompts = [task.prompt(s) for s in seeds]
    P = max(len(p[0]) for p in prompts)
    sampler = T.make_chat_sampler(model, qcfg, task.tok, cache_size=P + MAX_NEW + 8)
    stop = list(task.tok.stop_ids)
    out = sampler([p[1] for p in prompts], max_generation_steps=MAX_NEW, max_prompt_length=P, temperature=1.0,
                  top_p=1.0, top_k=None, eos_tokens=stop, seed=seed)
    rewards = [task.score(text, s, ended=len(toks) < MAX_NEW)
               for text, toks, s in zip(out.text, out.tokens, seeds)]
    return {"success": sum(rewards) / len(rewards), "n": len(rewards), "eval_s": time.perf_counter() - t}


def eval_hf(hf_dir: Path, src: Path, n_tasks: int, k: int) -> dict:
    """:func:`heldout_success` of an HF checkpoint folder (weights + tokenizer.json)."""
    import _tunix as T
    from jax_rl.models import hf_io
    from jax_rl.models.tokenizer import load_tokenizer

    cfg = load_cfg(src)
    tok = load_tokenizer(str(hf_dir / "tokenizer.json"))
    qcfg = hf_io.load_config(hf_dir)
    return heldout_success(T.load_model(str(hf_dir), qcfg), Task(cfg, tok), qcfg, n_tasks, k)


# ---------------------------------------------------------------------------- the Tunix arm


class _TunixMeter:
    """Per-RL-step figures of a Tunix learner, gathered by wrapping its cluster's ``generate``,
    ``update_actor`` and ``sync_weights`` (seconds in each, generated tokens, generate calls, trained
    tokens); one row per ``update_actor`` call. Thread-safe: Tunix's agentic learner generates from
    several threads. ``extra``: more accumulators (0 / 0.0) an arm fills through :meth:`timed`."""

    def __init__(self, cluster, **extra):
        import threading

        self.acc: dict = {"gen_s": 0.0, "update_s": 0.0, "sync_s": 0.0, "gen_tokens": 0, "trained_tokens": 0,
                          "gen_calls": 0, **extra}
        self.rows: list[dict] = []
        self.lock = threading.Lock()
        cluster.generate = self.timed("gen_s", cluster.generate, self._on_gen)
        cluster.update_actor = self.timed("update_s", cluster.update_actor, self._on_update)
        cluster.sync_weights = self.timed("sync_s", cluster.sync_weights)

    def timed(self, name: str, fn, after=None):
        """``fn`` wrapped to add its seconds to ``acc[name]`` and then call ``after(out, *args)``."""
        def w(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            with self.lock:
                self.acc[name] += time.perf_counter() - t
                if after:
                    after(out, *a, **kw)
            return out
        return w

    def _on_gen(self, out, *a, **kw):
        self.acc["gen_tokens"] += int(sum(len(t) for t in out.tokens))
        self.acc["gen_calls"] += 1

    def _on_update(self, out, train_ds, *a, **kw):
        import numpy as np

        exs = train_ds if isinstance(train_ds, list) else [train_ds]
        self.acc["trained_tokens"] += int(sum(int(np.sum(e.prompt_mask)) + int(np.sum(e.completion_mask))
                                              for e in exs))
        self.rows.append({"t_end": time.perf_counter(), **self.acc})
        for key in self.acc:
            self.acc[key] = 0 if isinstance(self.acc[key], int) else 0.0

    def walls(self, t0: float) -> list[tuple[float, dict]]:
        """``(wall seconds since the previous row, or since t0, row)`` per RL step."""
        out, prev = [], t0
        for r in self.rows:
            out.append((r["t_end"] - prev, r))
            prev = r["t_end"]
        return out


def tunix_cluster(cfg: Any, model: Any, tok: Any, prompt_len: int, max_tokens: int, steps: int, **rollout_kw) -> Any:
    """Tunix's ``RLCluster`` for both Tunix arms: actor, reference and rollout on one device, the
    optimizer jax-rl's (global-norm clip then AdamW, ``cfg.optim``), the vanilla rollout engine at
    ``cfg.algo.temperature`` with a KV cache of ``prompt_len + max_tokens + 8`` tokens (``rollout_kw``:
    more ``RolloutConfig`` fields, e.g. ``return_logprobs``)."""
    import jax
    import numpy as np
    import optax
    import _tunix as T
    from tunix.rl import rl_cluster as rlc
    from tunix.rl.rollout import base_rollout

    o = cfg.optim
    tx = optax.chain(optax.clip_by_global_norm(o.max_grad_norm),
                     optax.adamw(o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    rollout_cfg = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_tokens, temperature=cfg.algo.temperature, top_p=1.0, top_k=None,
        max_prompt_length=prompt_len, kv_cache_size=prompt_len + max_tokens + 8, eos_tokens=list(tok.stop_ids),
        seed=None, **rollout_kw)
    return rlc.RLCluster(
        actor=model, reference=None, tokenizer=T.ChatTokenizerAdapter(tok),
        cluster_config=rlc.ClusterConfig(
            role_to_mesh={rlc.Role.ACTOR: mesh, rlc.Role.REFERENCE: mesh, rlc.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False,
            training_config=rlc.RLTrainingConfig(actor_optimizer=tx, eval_every_n_steps=10**9, max_steps=steps),
            rollout_config=rollout_cfg))


def tunix_run(hf_dir: Path, src: Path, steps: int, n_tasks: int, k: int, seed: int = 0) -> dict:
    """``steps`` RL steps of Tunix's GRPOLearner (colocated, synchronous) from ``hf_dir``, timed
    per step by wrappers around its own methods (module doc); then :func:`heldout_success` of the
    trained actor."""
    import numpy as np
    import _tunix as T
    from jax_rl.models import hf_io
    from jax_rl.models.tokenizer import load_tokenizer
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner

    cfg = load_cfg(src)
    tok = load_tokenizer(str(hf_dir / "tokenizer.json"))
    task = Task(cfg, tok)
    qcfg = hf_io.load_config(hf_dir)
    model = T.load_model(str(hf_dir), qcfg)
    n_prompts = BATCH // GROUP
    train_seeds = [cfg.env.train_seed_offset + i for i in range(steps * n_prompts)]
    prompts = {s: task.prompt(s) for s in train_seeds}
    for s in train_seeds[:n_prompts]:  # the text Tunix encodes gives jax-rl's prompt ids
        ids, text = prompts[s]
        if tok.encode(text) != ids:
            raise RuntimeError(f"seed {s}: encode(render_text) != render_chat ids")
    P = max(len(p[0]) for p in prompts.values())
    cluster = tunix_cluster(cfg, model, tok, P, MAX_NEW, steps)

    def reward_fn(prompts, completions, seed, **_):
        # Tunix's completion text ends before the stop id; a 40-token completion had none
        return [task.score(str(c), int(s), ended=len(tok.encode(str(c))) < MAX_NEW)
                for c, s in zip(completions, seed)]

    learner = GRPOLearner(cluster, GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.0, epsilon=0.2,
                                              loss_agg_mode="token-mean"), reward_fns=reward_fn)
    meter = _TunixMeter(cluster, score_s=0.0, reward_sum=0.0, n=0)
    acc = meter.acc

    def on_rewards(r, *a, **kw):
        acc["reward_sum"] += float(np.sum(r))
        acc["n"] += len(r)

    learner._compute_rewards = meter.timed("score_s", learner._compute_rewards, on_rewards)

    def batches():
        for i in range(steps):
            ss = train_seeds[i * n_prompts:(i + 1) * n_prompts]
            # arrays: Tunix repeats every leaf G times (np.repeat); a list would be a tree of leaves
            yield {"prompts": np.array([prompts[s][1] for s in ss]), "seed": np.array(ss)}

    t0 = time.perf_counter()
    learner.train(batches())
    t_end = time.perf_counter()
    step_rows = []
    for i, (wall, r) in enumerate(meter.walls(t0)):
        step_rows.append({"step": i + 1, "wall_s": wall, "gen_tokens": r["gen_tokens"],
                          "trained_tokens": r["trained_tokens"], "gen_s": r["gen_s"], "score_s": r["score_s"],
                          "update_s": r["update_s"], "sync_s": r["sync_s"],
                          "host_s": wall - r["gen_s"] - r["score_s"] - r["update_s"] - r["sync_s"],
                          "reward_mean": r["reward_sum"] / max(r["n"], 1)})
    ev = heldout_success(cluster.actor_trainer.model, task, qcfg, n_tasks, k) if n_tasks > 0 else None
    return {"steps": step_rows, "rl_wall_s": t_end - t0, "heldout": ev,
            "should_sync_weights": bool(learner.should_sync_weights),
            "async_rollout": bool(learner.can_enable_async_rollout), "prompt_len_max": P}


# ---------------------------------------------------------------------------- the agentic arms (2-turn tool task)

# jax-rl's side of the agentic task: the calculator env's own multi-turn episode, one tool call then the
# answer (two assistant turns), from a start point SFT'd on the env's tool-using reference solutions
AGENTIC_TURNS = 2
AGENTIC_MAX_TOKENS = 80  # generated tokens per episode, both turns together (Tunix: max_response_length)
AGENTIC_OVERRIDES = [f"rollout.max_turns={AGENTIC_TURNS}", f"rollout.max_tokens_per_episode={AGENTIC_MAX_TOKENS}"]


def question_text(q: Any) -> str:
    """The text of one episode's ``question`` as Tunix's agentic learner passes it: a ``str``, or a numpy
    string array of one element (0-d or ``[1]``: the learner slices its batch into per-episode rows).
    Raises ValueError when it holds more or fewer than one string."""
    import numpy as np

    if isinstance(q, str):
        return str(q)
    a = np.asarray(q).reshape(-1)
    if a.size != 1:
        raise ValueError(f"question: expected one string, got {a.size} values")
    return str(a[0])


def tunix_agentic_parts(task: Task):
    """Tunix's agentic classes wired to the bench task (``tunix.rl.agentic``): a ``ToolAgent`` whose
    conversation is the jax-rl env's own (its system prompt and question, the tool result as a ``tool``
    message with the env's output, no "Tool returned result:" prefix) and a ``ToolEnvironment`` whose
    ``calculate`` tool is the jax-rl env's and whose reward is :meth:`Task.score` of the final answer.
    Returns (agent class, env class, env kwargs, tool class)."""
    from tunix.rl.agentic.agents.tool_agent import ToolAgent
    from tunix.rl.agentic.environments.tool_environment import ToolEnvironment
    from tunix.rl.agentic.tools import base_tool

    env0 = task.env_factory()

    class CalcTool(base_tool.BaseTool):
        def get_json_schema(self):
            return {"type": "function", "function": dict(env0.TOOLS[0]["function"])} \
                if "function" in env0.TOOLS[0] else dict(env0.TOOLS[0])

        def apply(self, **kwargs):
            try:
                return base_tool.ToolOutput(name=self.name, output=env0.step({"name": "calculate",
                                                                               "arguments": kwargs}))
            except Exception as e:  # a bad expression: the env's error text, as jax-rl's agent shows it
                return base_tool.ToolOutput(name=self.name, error=str(e))

    class EnvAgent(ToolAgent):
        def __init__(self, system_prompt: str = "", **kw):
            super().__init__(system_prompt=system_prompt, tool_parser_name="qwen",
                             tool_map={"calculate": CalcTool})
            self.tools_prompt = ""

        def _init_messages(self, system_prompt: str) -> None:
            self._messages = [{"role": "system", "content": system_prompt or ""}]

        def _observation_to_messages(self, observation, reward, done, info):
            if isinstance(observation, dict) and "tool_outputs" in observation:
                for call_id, out in observation["tool_outputs"].items():
                    self._messages.append({"role": "tool", "tool_call_id": call_id, "content": out or ""})
            elif isinstance(observation, dict) and "question" in observation:
                # the learner hands each episode its batch row's numpy values (an array, not a str), which
                # the chat rendering would show as an empty user turn (the model then never saw the task)
                self._messages.append({"role": "user", "content": question_text(observation["question"])})
            else:
                super()._observation_to_messages(observation, reward, done, info)

    import threading

    import numpy as np

    lock = threading.Lock()  # Task.score resets one shared env; Tunix steps episodes from several threads

    def reward_fn(task: dict, action: str) -> float:
        with lock:
            return task_obj.score(str(action), int(np.asarray(task["seed"]).reshape(-1)[0]))

    task_obj = task
    env_kwargs = {"tool_map": {"calculate": CalcTool}, "reward_fn": reward_fn,
                  "max_steps": AGENTIC_TURNS}
    return EnvAgent, ToolEnvironment, env_kwargs, CalcTool


class _ChatParser:
    """Tunix's chat-template parser interface over the shared tokenizer's own rendering (the same text
    jax-rl renders: :meth:`Task.prompt`), message by message as Tunix's trajectory engine asks."""

    def __init__(self, tok: Any, tools: Optional[list] = None):
        from tunix.rl.agentic.parser.chat_template_parser.parser import QwenChatTemplateParser

        class _T:  # the two attributes Qwen's parser reads
            bos_token, eos_token = "", "<|im_end|>"

        self._q = QwenChatTemplateParser(_T())
        self.tok, self.tools = tok, tools
        self.assistant_token = self._q.tokens.assistant_token

    def parse(self, messages, add_generation_prompt: bool = False, is_first_msg: bool = False) -> str:
        msgs = [dict(m, role="tool") if m.get("role") == "tool" else m for m in messages]
        if is_first_msg:
            return self.tok.render_text(msgs, self.tools, add_generation_prompt=add_generation_prompt)
        return self._q.parse(msgs, add_generation_prompt=add_generation_prompt, is_first_msg=False)


def tunix_agentic_run(hf_dir: Path, src: Path, steps: int, off_policy_steps: int, seed: int = 0) -> dict:
    """``steps`` RL steps of Tunix's agentic GRPO learner (``tunix.rl.agentic.agentic_grpo_learner``,
    ``off_policy_steps``) on the 2-turn calculator task from ``hf_dir``, colocated, timed per step like
    :func:`tunix_run` (``RLCluster.generate`` = generation, every turn's call; ``update_actor``; sync)."""
    import numpy as np
    import _tunix as T
    from jax_rl.models import hf_io
    from jax_rl.models.tokenizer import load_tokenizer
    from tunix.rl.agentic.agentic_grpo_learner import GRPOConfig, GRPOLearner

    cfg = load_cfg(src, AGENTIC_OVERRIDES)
    tok = load_tokenizer(str(hf_dir / "tokenizer.json"))
    task = Task(cfg, tok)
    qcfg = hf_io.load_config(hf_dir)
    model = T.load_model(str(hf_dir), qcfg)
    n_prompts = BATCH // GROUP
    train_seeds = [cfg.env.train_seed_offset + i for i in range(steps * n_prompts)]
    P = cfg.rollout.max_cache_len
    cluster = tunix_cluster(cfg, model, tok, P, AGENTIC_MAX_TOKENS, steps, return_logprobs=True)
    agent_cls, env_cls, env_kwargs, _ = tunix_agentic_parts(task)
    env0 = task.env_factory()
    (sys_msg, *_), tools = env0.reset(train_seeds[0])
    system = sys_msg["content"]
    # the tool schemas in the system turn exactly when jax-rl renders them (``rollout.render_tools``, the
    # small size): without them Tunix's episodes met a prompt the SFT never showed (one malformed turn)
    learner = GRPOLearner(
        cluster, GRPOConfig(num_generations=GROUP, num_iterations=1, beta=0.0, epsilon=0.2,
                            loss_agg_mode="token-mean", off_policy_steps=off_policy_steps,
                            max_response_length=AGENTIC_MAX_TOKENS, system_prompt=system, max_concurrency=BATCH),
        chat_parser=_ChatParser(tok, tools if cfg.rollout.render_tools else None), agent_class=agent_cls, env_class=env_cls, env_kwargs=env_kwargs)
    meter = _TunixMeter(cluster)

    def batches():
        for i in range(steps):
            ss = train_seeds[i * n_prompts:(i + 1) * n_prompts]
            qs = np.array([env0.reset(s)[0][1]["content"] for s in ss])
            yield {"prompts": qs, "question": qs, "seed": np.array(ss)}  # Tunix's learner reads "prompts"

    t0 = time.perf_counter()
    learner.train(batches())
    t_end = time.perf_counter()
    step_rows = []
    for i, (wall, r) in enumerate(meter.walls(t0)):
        step_rows.append({"step": i + 1, "wall_s": wall, "gen_tokens": r["gen_tokens"],
                          "trained_tokens": r["trained_tokens"], "gen_s": r["gen_s"], "update_s": r["update_s"],
                          "sync_s": r["sync_s"], "gen_calls": r["gen_calls"]})
    return {"steps": step_rows, "rl_wall_s": t_end - t0, "off_policy_steps": off_policy_steps}


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


def jaxrl_run(arm: str, hf_dir: Path, src: Path, run_dir: Path, steps: int, py: str, seed: int,
              timeout: float) -> dict:
    """One ``jax-rl train`` subprocess of ``arm``; returns its steps and RL wall seconds."""
    k = 2 if arm.endswith("k2") else 0
    extra = AGENTIC_OVERRIDES if arm.startswith("agentic") else []
    roles = []
    if arm.startswith("roles"):
        cpus = sorted(os.sched_getaffinity(0))
        roles = ["runtime=ray", "runtime.ray_workers=1", f"runtime.learner_cpus=[{cpus[0]}]",
                 f"runtime.rollout_cpus=[{cpus[1 % len(cpus)]}]"]
    cmd = [py, "-m", "jax_rl.cli", "train", str(src / "bench" / "e2e_rl.yaml"), f"model.checkpoint={hf_dir}",
           f"model.tokenizer={hf_dir / 'tokenizer.json'}", "sft.steps=0", f"run.steps={steps}",
           f"async.max_staleness={k}", f"run.seed={seed}", f"run.dir={run_dir}", *roles, *size_overrides(),
           *extra]
    env = {**os.environ, "PYTHONPATH": str(src), "RAY_AUTH_MODE": "disabled"}  # JAX_PLATFORMS: --platform
    t = time.perf_counter()
    with open(str(run_dir) + ".log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=src, timeout=timeout).returncode
    if rc != 0:
        raise RuntimeError(f"{arm}: jax-rl train exited {rc}; log {run_dir}.log")
    st = jaxrl_steps(run_dir)
    return {"steps": st, "rl_wall_s": sum(s["wall_s"] for s in st), "process_s": time.perf_counter() - t}


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


def round_ratios(runs: dict[str, list[dict]], warmup: int) -> dict[str, dict]:
    """Per arm, the ratio to its reference arm (:data:`REFERENCE`: Tunix's learner of the same task) round
    by round: reference median s/step / the arm's median s/step over the steps after ``warmup``, of the
    runs of the same round (rounds interleave the arms, so a round's two runs saw about the same load).
    Returns ``{arm: {"rounds": [...], "median", "min", "max"}}`` for the arms whose reference ran."""
    out: dict[str, dict] = {}
    for arm, rs in runs.items():
        ref = {r["round"]: r for r in runs.get(REFERENCE.get(arm, ""), [])}
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


def main(argv: Optional[list[str]] = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0].startswith("_"):  # worker modes (one fresh process each)
        return _worker(argv)
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
    for want, d, kind in ((any(x in SINGLE_TURN_ARMS for x in a.arms), hf, "direct-answer"),
                          (any(x not in SINGLE_TURN_ARMS for x in a.arms), hf_agentic, "agentic")):
        if want and not (d / "model.safetensors").exists():
            t = time.perf_counter()
            _sub(["_prepare", str(d.parent), str(src), str(a.sft_steps), kind], a.run_timeout,
                 out / f"prepare_{kind}.log")
            print(f"prepared {d} (SFT {a.sft_steps} steps on {kind} demos) in {time.perf_counter() - t:.0f} s",
                  flush=True)
    base = {"success": None}
    if not a.no_eval and any(x in SINGLE_TURN_ARMS for x in a.arms):
        base = _sub(["_eval", str(hf), str(src), str(a.eval_tasks), str(a.eval_k)], a.run_timeout,
                    out / "eval_base.log")
        print(f"start point held-out success {base['success']:.3f} (avg@{a.eval_k}, {a.eval_tasks} tasks)", flush=True)
    runs: dict[str, list[dict]] = {arm: [] for arm in a.arms}
    for rnd in range(a.rounds):
        print(f"round {rnd} start: {T.machine_load()}", flush=True)
        for arm in a.arms:
            load0 = os.getloadavg()
            rd = out / f"{arm}_r{rnd}"
            if arm == "tunix":
                rec = attempt(_sub, ["_tunix", str(hf), str(src), str(a.steps),
                                     str(a.eval_tasks if not a.no_eval else 0), str(a.eval_k)],
                              a.run_timeout, Path(str(rd) + ".log"))
            elif arm.startswith("tunix_agentic"):
                rec = attempt(_sub, ["_tunix_agentic", str(hf_agentic), str(src), str(a.steps),
                                     "2" if arm.endswith("k2") else "0"], a.run_timeout, Path(str(rd) + ".log"))
            else:
                rec = attempt(jaxrl_run, arm, hf_agentic if arm.startswith("agentic") else hf, src, rd, a.steps,
                              a.jax_rl_python, a.seed, a.run_timeout)
                if not a.no_eval and arm in SINGLE_TURN_ARMS and "error" not in rec:
                    rec["heldout"] = attempt(_sub, ["_evalrun", str(rd), str(src), str(a.eval_tasks),
                                                    str(a.eval_k)], a.run_timeout, Path(str(rd) + ".eval.log"))
                    if "error" in rec["heldout"]:
                        rec["heldout"] = {"success": None, "error": rec["heldout"]["error"]}
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
    summ = {arm: arm_summary(rs, a.warmup) for arm, rs in runs.items() if any(r["steps"] for r in rs)}
    for s in summ.values():
        if s.get("heldout_final") is not None and base.get("success") is not None:
            s["heldout_gain_per_100s"] = (s["heldout_final"] - base["success"]) / s["rl_wall_s"] * 100
    rr = round_ratios(runs, a.warmup)
    failed = [f"{r['arm']} r{r['round']}: {r['error']}" for rs in runs.values() for r in rs if "error" in r]
    if failed:
        print("failed runs (left out of the medians, kept in the record):\n  " + "\n  ".join(failed))
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
