"""Agent loop with scripted "models" (a fake generator returning done futures) on both envs."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future
from typing import Callable

import numpy as np
import pytest

from jax_rl.config import RolloutConfig
from jax_rl.models.tokenizer import compact_tokenizer, format_tool_call
from rollout.agent import AgentLoop, build_sft_example, parse_tool_calls, sft_example
from rollout.envs import CalculatorEnv, RetailEnv, make_env
from rollout.types import Completion, Trajectory

TOK = compact_tokenizer()
CFG = RolloutConfig(max_turns=5, max_new_tokens_per_turn=512, max_tokens_per_episode=2048, max_cache_len=8192,
                    episode_timeout_s=30.0, slots=4)


class ScriptedGenerator:
    """``submit`` returns a done Future; the completion is ``script(prompt_text, turn)`` + ``<|im_end|>``.

    Logps are -0.01 * (request_no + 1) per token and versions the request number, so the
    placement of every generated token in the trajectory can be checked.
    """

    def __init__(self, script: Callable[[str, int], str], stop: bool = True):
        self.script = script
        self.stop = stop
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def submit(self, prompt_ids, *, max_new_tokens, seed, stop_ids):
        text = TOK.decode(prompt_ids)
        turn = text.count("<|im_start|>assistant\n") - 1
        out = self.script(text, turn)
        ids = TOK.encode(out) + ([TOK.im_end_id] if self.stop else [])
        finish = "stop"
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        with self.lock:
            n = len(self.requests)
            self.requests.append({"prompt": list(prompt_ids), "out": ids, "seed": seed, "max_new": max_new_tokens})
        f: Future = Future()
        f.set_result(Completion(request_id=n, tokens=ids, behav_logp=[-0.01 * (n + 1)] * len(ids), versions=[n] * len(ids),
                                finish_reason=finish))
        return f


def reference_script(env_name: str, **env_kw) -> Callable[[str, int], str]:
    """A model that replays the env's reference solution for whatever task is in the prompt."""
    cache: dict[str, list[dict]] = {}

    def script(prompt: str, turn: int) -> str:
        key = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        if key not in cache:
            for seed in range(200):
                env = make_env(env_name, **env_kw)
                msgs, _ = env.reset(seed)
                if msgs[1]["content"] == key:
                    cache[key] = [m for m in env.reference_solution(seed) if m["role"] == "assistant"]
                    break
        m = cache[key][turn]
        parts = [m["content"]] if m["content"] else []
        parts += [format_tool_call(c) for c in m.get("tool_calls", [])]
        return "\n".join(parts)

    return script


def check_layout(traj: Trajectory, gen: ScriptedGenerator) -> None:
    """Every prompt the generator saw is a prefix of the trajectory, followed by what it generated."""
    toks = traj.tokens.tolist()
    reqs = [r for r in gen.requests if toks[: len(r["prompt"])] == r["prompt"]
            and toks[len(r["prompt"]): len(r["prompt"]) + len(r["out"])] == r["out"]]
    assert len(reqs) == traj.info["turns"] >= 1
    assert [len(r["prompt"]) for r in reqs] == traj.info["turn_starts"]
    covered = np.zeros(len(toks), bool)
    for k, r in enumerate(reqs):
        s, e = len(r["prompt"]), len(r["prompt"]) + len(r["out"])
        covered[s:e] = True
        assert traj.loss_mask[s:e].all() and (traj.turn_ids[s:e] == k).all()
        assert (traj.versions[s:e] == gen.requests.index(r)).all()
        np.testing.assert_allclose(traj.behav_logp[s:e], -0.01 * (gen.requests.index(r) + 1), rtol=1e-6)
    assert (traj.loss_mask == covered).all()
    assert (traj.versions[~covered] == -1).all() and (traj.turn_ids[~covered] == -1).all()
    assert (traj.behav_logp[~covered] == 0).all()


def run_one(gen, env_name="calculator", seed=0, cfg=CFG, env_kw=None) -> Trajectory:
    loop = AgentLoop(gen, TOK, lambda: make_env(env_name, **(env_kw or {})), cfg)
    try:
        return loop.run_episode(seed, group_id=3, sample_idx=0)
    finally:
        loop.close()


# ------------------------------------------------------------------ parsing


def test_parse_tool_calls():
    calls, errs = parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                                   '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert calls == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": 2}}] and not errs
    for bad in ['<tool_call>{"name": "a", </tool_call>', "<tool_call>[1, 2]</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
                '<tool_call>{"name": "a"}']:
        calls, errs = parse_tool_calls(bad)
        assert not calls and len(errs) == 1 and errs[0].startswith("malformed tool call")
    # never evaluated as Python
    calls, errs = parse_tool_calls('<tool_call>__import__("os").system("echo hi")</tool_call>')
    assert not calls and errs


# ------------------------------------------------------------------ calculator


def test_calculator_correct_tool_call_and_answer():
    gen = ScriptedGenerator(reference_script("calculator"))
    traj = run_one(gen, seed=4)
    assert traj.reward == 1.0 and traj.info["answered"] and traj.info["turns"] == 2
    assert traj.info["tool_calls"] == 1 and traj.info["tool_errors"] == []
    assert traj.group_id == 3 and traj.env == "calculator" and traj.seed == 4
    check_layout(traj, gen)
    # ends with the generated <|im_end|>; tool response tokens are not in the loss
    assert traj.tokens[-1] == TOK.im_end_id and traj.loss_mask[-1]
    text = TOK.decode(traj.tokens)
    assert "<tool_response>\n" in text
    resp_start = text.index("<tool_response>")
    masked_text = TOK.decode(traj.tokens[traj.loss_mask])
    assert "<tool_response>" not in masked_text and masked_text.count("<|im_end|>") == 2
    assert resp_start > 0
    # identical layout to the SFT example built from the reference solution
    sft = build_sft_example(CalculatorEnv(), 4, TOK)
    np.testing.assert_array_equal(sft["tokens"], traj.tokens)
    np.testing.assert_array_equal(sft["loss_mask"], traj.loss_mask)
    toks, mask = sft_example(CalculatorEnv(), TOK, 4)
    np.testing.assert_array_equal(toks, traj.tokens)
    np.testing.assert_array_equal(mask, traj.loss_mask)
    # JSON round trip
    t2 = Trajectory.from_json(traj.to_json())
    np.testing.assert_array_equal(t2.behav_logp, traj.behav_logp)
    assert t2.info == json.loads(json.dumps(traj.info))


def _answer_from_prompt(prompt: str) -> str:
    return prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]


def test_malformed_json_then_recovery():
    env = CalculatorEnv()
    env.reset(0)
    expr = env.entry["metadata"]["expression"]

    def script(prompt, turn):
        if turn == 0:
            return '<tool_call>\n{"name": "calculate", "arguments": {"expression": \n</tool_call>'
        if turn == 1:
            assert "Error: malformed tool call" in prompt
            return format_tool_call({"name": "calculate", "arguments": {"expression": expr}})
        return f"<answer>{_answer_from_prompt(prompt)}</answer>"

    gen = ScriptedGenerator(script)
    traj = run_one(gen, seed=0)
    assert traj.reward == 1.0 and traj.info["turns"] == 3
    assert len(traj.info["tool_errors"]) == 1 and "malformed" in traj.info["tool_errors"][0]
    check_layout(traj, gen)


def test_unknown_tool_is_an_error_observation():
    def script(prompt, turn):
        if turn == 0:
            return format_tool_call({"name": "python", "arguments": {"code": "print(1)"}})
        assert "Error: unknown tool 'python'" in prompt
        return "<answer>0</answer>"

    gen = ScriptedGenerator(script)
    traj = run_one(gen, seed=1)
    assert traj.info["answered"] and traj.info["tool_calls"] == 1
    assert traj.info["tool_errors"] == ["unknown tool 'python'"]
    check_layout(traj, gen)


def test_bad_expression_is_an_error_observation():
    def script(prompt, turn):
        if turn == 0:
            return format_tool_call({"name": "calculate", "arguments": {"expression": "().__class__"}})
        assert "Error: attribute access is not allowed" in prompt
        return "<answer>1</answer>"

    traj = run_one(ScriptedGenerator(script), seed=1)
    assert traj.info["answered"] and traj.info["tool_errors"] == ["attribute access is not allowed"]


def test_no_final_answer_within_turn_budget():
    script = lambda p, t: format_tool_call({"name": "calculate", "arguments": {"expression": "1 + 1"}})
    gen = ScriptedGenerator(script)
    traj = run_one(gen, seed=2, cfg=CFG.model_copy(update={"max_turns": 3}))
    assert traj.reward == 0.0 and not traj.info["answered"] and traj.info["truncated"] == "max_turns"
    assert traj.info["turns"] == 3 and len(gen.requests) == 3
    assert traj.tokens[-1] == TOK.im_end_id  # ends at the last generated turn
    check_layout(traj, gen)


def test_token_budget_and_context_budget():
    script = lambda p, t: format_tool_call({"name": "calculate", "arguments": {"expression": "1 + 1"}})
    gen = ScriptedGenerator(script)
    traj = run_one(gen, seed=2, cfg=CFG.model_copy(update={"max_tokens_per_episode": 100}))
    assert traj.info["truncated"] in ("token_budget", "turn_length")
    assert traj.num_generated <= 100
    assert all(r["max_new"] <= 100 for r in gen.requests)
    gen = ScriptedGenerator(script)
    traj = run_one(gen, seed=2, cfg=CFG.model_copy(update={"max_cache_len": 900}))
    assert traj.info["truncated"] in ("context", "turn_length") and len(traj) <= 900


def test_answer_too_long():
    # (a) the turn runs past max_new_tokens without a stop token
    gen = ScriptedGenerator(lambda p, t: "<answer>" + "9" * 400 + "</answer>")
    traj = run_one(gen, seed=3, cfg=CFG.model_copy(update={"max_new_tokens_per_turn": 64}))
    assert traj.info["truncated"] == "turn_length" and traj.reward == 0.0 and not traj.info["answered"]
    assert traj.num_generated == 64 and traj.info["finish_reasons"] == ["length"]
    assert traj.tokens[-1] != TOK.im_end_id
    check_layout(traj, gen)
    # (b) a complete answer whose content is too long scores 0
    gen = ScriptedGenerator(lambda p, t: "<answer>" + "9" * 200 + "</answer>")
    traj = run_one(gen, seed=3)
    assert traj.info["answered"] and traj.reward == 0.0 and traj.info["score"]["reason"] == "answer too long"


def test_timeout_budget():
    class Never:
        def submit(self, prompt_ids, **kw):
            return Future()  # never completes

    traj = run_one(Never(), seed=0, cfg=CFG.model_copy(update={"episode_timeout_s": 0.2}))
    assert traj.info["truncated"] == "time" and traj.reward == 0.0 and traj.num_generated == 0


def test_no_timeout_when_episode_timeout_is_null():
    gen = ScriptedGenerator(reference_script("calculator"))
    traj = run_one(gen, seed=0, cfg=CFG.model_copy(update={"episode_timeout_s": None}))
    assert traj.reward == 1.0 and traj.info["answered"] and traj.info["turns"] == 2


class ExplodingEnv(CalculatorEnv):
    def _calculate(self, expression):
        raise RuntimeError("database down")


def test_overlong_prompt_is_dropped_not_generated():
    # issue 16 item 4: a prompt that fills the cache became a prompt-only trajectory longer than
    # optim.max_seq_len, and the learner's collate raised BatchError for the whole run
    gen = ScriptedGenerator(reference_script("calculator"))
    loop = AgentLoop(gen, TOK, CalculatorEnv, CFG.model_copy(update={"max_cache_len": 64}))
    traj = loop.run_episode(0, group_id=1)
    loop.close()
    assert traj.overlong and not traj.failed and traj.info["overlong"] == "prompt"
    assert "rollout.max_cache_len=64" in traj.info["drop_reason"] and traj.num_generated == 0
    assert gen.requests == [] and traj.reward == 0.0
    assert loop.stats["overlong"] == 1 and loop.stats["failed"] == 0


def test_env_exception_fails_only_that_episode():
    script = reference_script("calculator")
    gen = ScriptedGenerator(script)
    n = [0]
    lock = threading.Lock()

    def factory():
        with lock:
            n[0] += 1
            return ExplodingEnv() if n[0] % 2 == 0 else CalculatorEnv()

    loop = AgentLoop(gen, TOK, factory, CFG, max_workers=4)
    trajs = [loop.submit_episode(s, group_id=s).result() for s in range(4)]
    loop.close()
    failed = [t for t in trajs if t.failed]
    assert len(failed) == 2 and all("database down" in t.info["fail_reason"] for t in failed)
    assert all(t.reward == 1.0 for t in trajs if not t.failed)
    assert loop.stats["failed"] == 2 and loop.stats["episodes"] == 4 and loop.stats["answered"] == 2


# ------------------------------------------------------------------ retail


@pytest.mark.parametrize("kind", ["cancel", "exchange", "find_pending"])
def test_retail_reference_policy(kind):
    kw = {"task_kinds": (kind,), "tool_latency_s": 0.005}
    gen = ScriptedGenerator(reference_script("retail", **kw))
    traj = run_one(gen, env_name="retail", seed=5, env_kw=kw)
    assert traj.reward == 1.0, traj.info
    assert traj.info["score"]["db_match"] and traj.info["score"]["answer_match"]
    check_layout(traj, gen)
    sft = build_sft_example(RetailEnv(**kw), 5, TOK)
    np.testing.assert_array_equal(sft["tokens"], traj.tokens)
    np.testing.assert_array_equal(sft["loss_mask"], traj.loss_mask)


def test_retail_malformed_unknown_and_rule_violation():
    kw = {"task_kinds": ("find_pending",)}

    def script(prompt, turn):
        if turn == 0:
            return "<tool_call>\nnot json\n</tool_call>"
        if turn == 1:
            assert "Error: malformed tool call" in prompt
            return format_tool_call({"name": "refund_everything", "arguments": {}})
        if turn == 2:
            assert "Error: unknown tool 'refund_everything'" in prompt
            return format_tool_call({"name": "exchange_item", "arguments": {"order_id": "#W1", "item_id": "1",
                                                                            "new_item_id": "2"}})
        assert "Error: order '#W1' not found" in prompt
        return "I don't know."

    gen = ScriptedGenerator(script)
    traj = run_one(gen, env_name="retail", seed=0, env_kw=kw)
    assert traj.info["answered"] and traj.reward == 0.0 and traj.info["score"]["reason"] == "no <answer> tag"
    assert len(traj.info["tool_errors"]) == 3
    check_layout(traj, gen)


def test_groups_run_concurrently_with_tool_latency():
    kw = {"tool_latency_s": 0.02, "tool_latency_dist": "lognormal"}
    gen = ScriptedGenerator(reference_script("retail", **kw))
    loop = AgentLoop(gen, TOK, lambda: RetailEnv(**kw), CFG, group_size=3, max_workers=12)
    groups = loop.run_groups([0, 1, 2, 3], first_group_id=10)
    loop.close()
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    for gi, g in enumerate(groups):
        assert {t.group_id for t in g} == {10 + gi} and {t.seed for t in g} == {gi}
        assert [t.info["sample_idx"] for t in g] == [0, 1, 2]
        assert all(t.reward == 1.0 for t in g)
    seeds = {r["seed"] for r in gen.requests}
    assert len(seeds) == len(gen.requests)  # every request has its own sampling seed


class SessionGenerator(ScriptedGenerator):
    """A scripted generator with sessions (``release_session``) reporting ``info["prefill_tokens"]``
    as a kept-K/V generator would: the first turn its prompt, later turns only the new tokens."""

    def __init__(self, script):
        super().__init__(script)
        self.sessions: list = []
        self.released: list = []
        self.held: dict = {}
        self.prefix_lens: list = []

    def submit(self, prompt_ids, *, max_new_tokens, seed, stop_ids, session=None, prefix_len=0):
        f = super().submit(prompt_ids, max_new_tokens=max_new_tokens, seed=seed, stop_ids=stop_ids)
        c = f.result()
        with self.lock:
            self.sessions.append(session)
            self.prefix_lens.append(prefix_len)
            start = self.held.get(session, 0)
            c.info["prefill_tokens"] = len(prompt_ids) - 1 - start
            self.held[session] = len(prompt_ids) + len(c.tokens) - 1
        return f

    def release_session(self, session):
        with self.lock:
            self.released.append(session)


def test_agent_keeps_one_session_per_episode_and_sums_prefill_tokens():
    """Every turn of an episode goes to the generator under the episode's own session key; the
    session is released once at the end; ``info["prefill_tokens"]`` sums the turns' prefill work."""
    kw = {"task_kinds": ("exchange",)}
    gen = SessionGenerator(reference_script("retail", **kw))
    loop = AgentLoop(gen, TOK, lambda: make_env("retail", **kw), CFG)
    trajs = loop.run_groups([5], group_size=2)[0]
    loop.close()
    assert all(t.reward == 1.0 for t in trajs) and min(t.info["turns"] for t in trajs) >= 3
    keys = set(gen.sessions)
    # the shared prefix: the rendered system message (policy + tool schemas), the same for every episode
    env = make_env("retail", **kw)
    msgs, tools = env.reset(5)
    sys_ids, _ = TOK.render_chat(msgs[:1], tools)
    assert set(gen.prefix_lens) == {len(sys_ids)}
    assert None not in keys and len(keys) == 2 and sorted(gen.released, key=str) == sorted(keys, key=str)
    for t in trajs:
        gen_toks = int(t.loss_mask.sum())
        # kept K/V: turn k > 0 prefills the previous turn's last token + its observation but the
        # observation's last token (pending), i.e. as many as the observation: every token the model
        # did not generate, but the prompt's last one, was prefilled once
        assert t.info["prefill_tokens"] == len(t) - gen_toks - 1
