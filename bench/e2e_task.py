"""The task of ``bench/e2e_rl.py``, shared by both sides: the model sizes, jax-rl's config of the bench
(``bench/e2e_rl.yaml`` plus the size's overrides), the prompts and scoring (:class:`Task`, the env's own
``score``), the shared start point (:func:`prepare`: jax-rl SFT, exported as an HF folder), the agentic task's
overrides, and the one held-out evaluator both sides are scored by (:func:`heldout_success`, Tunix's
``Sampler``). Imports no jax at module level (the script chooses the platform first).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "bench" / "e2e_rl.yaml"
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


# jax-rl's side of the agentic task: the calculator env's own multi-turn episode, one tool call then the
# answer (two assistant turns), from a start point SFT'd on the env's tool-using reference solutions
AGENTIC_TURNS = 2
AGENTIC_MAX_TOKENS = 80  # generated tokens per episode, both turns together (Tunix: max_response_length)
AGENTIC_OVERRIDES = [f"rollout.max_turns={AGENTIC_TURNS}", f"rollout.max_tokens_per_episode={AGENTIC_MAX_TOKENS}"]


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
