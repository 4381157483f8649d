"""The Tunix side of ``bench/e2e_rl.py``: the single-turn arm (``tunix.rl.grpo.grpo_learner.GRPOLearner``)
and the agentic arm (``tunix.rl.agentic.agentic_grpo_learner.GRPOLearner`` with its ``ToolAgent`` /
``ToolEnvironment`` over the jax-rl env's tool and conversation), one ``RLCluster`` for both
(:func:`tunix_cluster`), timed per RL step by wrapping the cluster's methods (:class:`_TunixMeter`). Runs
in the bench venv (tunix installed); imports no jax at module level.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from e2e_task import (AGENTIC_MAX_TOKENS, AGENTIC_OVERRIDES, AGENTIC_TURNS, BATCH, GROUP, MAX_NEW, Task,
                      heldout_success, load_cfg)


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


def train_timed(learner: Any, meter: "_TunixMeter", batches: Any, keys: tuple, derive: Any = None) -> tuple[list, float]:
    """Run ``learner.train(batches)`` and return ``(step rows, RL wall seconds)``: per step its wall time (from
    ``meter``'s wrappers), the ``keys`` of the meter's accumulators and ``derive(wall, acc)``'s columns."""
    t0 = time.perf_counter()
    learner.train(batches)
    rl_wall = time.perf_counter() - t0
    rows = [{"step": i + 1, "wall_s": wall, **{k: r[k] for k in keys}, **(derive(wall, r) if derive else {})}
            for i, (wall, r) in enumerate(meter.walls(t0))]
    return rows, rl_wall


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

    step_rows, rl_wall = train_timed(
        learner, meter, batches(), ("gen_tokens", "trained_tokens", "gen_s", "score_s", "update_s", "sync_s"),
        lambda wall, r: {"host_s": wall - r["gen_s"] - r["score_s"] - r["update_s"] - r["sync_s"],
                         "reward_mean": r["reward_sum"] / max(r["n"], 1)})
    ev = heldout_success(cluster.actor_trainer.model, task, qcfg, n_tasks, k) if n_tasks > 0 else None
    return {"steps": step_rows, "rl_wall_s": rl_wall, "heldout": ev,
            "should_sync_weights": bool(learner.should_sync_weights),
            "async_rollout": bool(learner.can_enable_async_rollout), "prompt_len_max": P}


# ---------------------------------------------------------------------------- the agentic arms (2-turn tool task)


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

    step_rows, rl_wall = train_timed(
        learner, meter, batches(), ("gen_tokens", "trained_tokens", "gen_s", "update_s", "sync_s", "gen_calls"))
    return {"steps": step_rows, "rl_wall_s": rl_wall, "off_policy_steps": off_policy_steps}
