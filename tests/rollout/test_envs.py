"""Environments: calculator (reasoning-gym tasks, safe evaluator) and retail (procedural DB)."""

from __future__ import annotations

import json
import time
from fractions import Fraction

import pytest

from jax_rl.config import EnvConfig, RolloutConfig
from rollout.envs import CalculatorEnv, Env, RetailEnv, ToolError, env_factory_from_config, make_env, safe_eval
from rollout.envs.calculator import CalcError, format_number

# ------------------------------------------------------------------ evaluator


@pytest.mark.parametrize(
    "expr,want",
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("-(-3 * 4)", 12),
        ("2 - -1", 3),
        ("( ( -9 - 6 ) - -( -3 * 4 ) ) * 2 / 2", -27),
        ("7 / 2", Fraction(7, 2)),
        ("0.1 + 0.2", Fraction(3, 10)),
        ("+5", 5),
        ("  12  ", 12),
    ],
)
def test_safe_eval_accepts_arithmetic(expr, want):
    assert safe_eval(expr) == want


@pytest.mark.parametrize(
    "expr,why",
    [
        ("().__class__", "attribute"),
        ("(1).real", "attribute"),
        ("x + 1", "names"),
        ("__import__('os')", "calls"),
        ("abs(-1)", "calls"),
        ("2 ** 10", "exponentiation"),
        ("9 ** 9 ** 9", "exponentiation"),
        ("10 ** 100000", "exponentiation"),
        ("1e308 * 10", "too large"),
        ("1e400", "out of range"),
        ("99999999999999999999999", "too large"),
        ("10000000000 * 10000000000", "too large"),
        ("1 / 0", "division by zero"),
        ("1" + " / 3" * 30, "precise"),
        ("'a' * 3", "only numbers"),
        ("[1, 2]", "not allowed"),
        ("1 < 2", "not allowed"),
        ("7 // 2", "not allowed"),
        ("7 % 2", "not allowed"),
        ("1 ^ 2", "not allowed"),
        ("True + 1", "only numbers"),
        ("1 +", "invalid expression"),
        ("", "empty"),
        ("1+" * 200 + "1", "too long"),
        ("-(" * 40 + "1" + ")" * 40, "deeply"),
        ("+".join(["1"] * 100), "too large"),
        ("lambda: 1", "not allowed"),
    ],
)
def test_safe_eval_rejects(expr, why):
    with pytest.raises(CalcError) as ei:
        safe_eval(expr)
    assert why in str(ei.value)
    assert isinstance(ei.value, ToolError)


@pytest.mark.parametrize("exc", [SystemError("AST constructor recursion depth mismatch (before=3, after=4)"),
                                 RecursionError("maximum recursion depth exceeded during ast construction"),
                                 MemoryError()])
def test_safe_eval_parser_failure_is_the_calls_error(monkeypatch, exc):
    # CPython 3.11's AST constructor can fail with SystemError when threads parse at once (cpython#106905): the
    # tool call gets an error message; the episode, and the run, go on
    import rollout.envs.calculator as calc

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(calc.ast, "parse", boom)
    with pytest.raises(CalcError, match="could not be parsed"):
        safe_eval("1 + 2")


def test_format_number():
    assert format_number(Fraction(-42)) == "-42"
    assert format_number(Fraction(7, 2)) == "3.5"
    assert format_number(Fraction(1, 3)) == "0.3333333333"


# ------------------------------------------------------------------ calculator env


def test_calculator_protocol_and_reference():
    env = make_env("calculator")
    assert isinstance(env, Env)
    datasets = set()
    for seed in range(12):
        msgs, tools = env.reset(seed)
        assert [m["role"] for m in msgs] == ["system", "user"]
        assert tools[0]["function"]["name"] == "calculate"
        demo = env.reference_solution(seed)
        assert demo[0]["tool_calls"][0]["name"] == "calculate"
        assert demo[1]["role"] == "tool"
        assert demo[1]["content"] == env.entry["answer"]  # evaluator agrees with reasoning-gym
        r, info = env.score(demo[-1]["content"])
        assert r == 1.0, (seed, info)
        datasets.add(info["dataset"])
    assert datasets == {"chain_sum", "basic_arithmetic"}


def test_calculator_scoring_and_determinism():
    env = CalculatorEnv()
    m1, _ = env.reset(5)
    ans = env.entry["answer"]
    assert CalculatorEnv().reset(5)[0] == m1
    assert env.score(f"The result is <answer>{ans}</answer>")[0] == 1.0
    assert env.score(f"<answer>{int(ans) + 1}</answer>")[0] == 0.0
    r, info = env.score(f"{ans}")  # no <answer> tag
    assert r == 0.0 and info["reason"] == "no <answer> tag"
    r, info = env.score("<answer>" + "1" * 500 + "</answer>")
    assert r == 0.0 and info["reason"] == "answer too long"
    assert env.step({"name": "calculate", "arguments": {"expression": "6 * 7"}}) == "42"
    with pytest.raises(ToolError):
        env.step({"name": "calculate", "arguments": {"expression": "().__class__"}})
    with pytest.raises(ToolError, match="unknown tool"):
        env.step({"name": "python", "arguments": {}})
    with pytest.raises(ToolError, match="bad arguments"):
        env.step({"name": "calculate", "arguments": {"expr": "1"}})


def test_calculator_dataset_config_knobs():
    env = CalculatorEnv(datasets=["chain_sum"], dataset_config={"chain_sum": {"min_terms": 2, "max_terms": 2,
                                                                               "min_digits": 1, "max_digits": 1}})
    for seed in range(10):
        env.reset(seed)
        assert env.entry["metadata"]["num_terms"] == 2
        assert len(env.entry["metadata"]["expression"].split()) == 3
    with pytest.raises(ValueError):
        CalculatorEnv(datasets=["chain_sum"], dataset_config={"products": {}})


def test_env_factory_from_config_and_latency():
    f = env_factory_from_config(EnvConfig(calculator={"datasets": ["chain_sum"]}), RolloutConfig(tool_latency_s=0.05))
    env = f()
    assert isinstance(env, CalculatorEnv) and env.datasets == ["chain_sum"]
    env.reset(0)
    t = time.monotonic()
    env.step({"name": "calculate", "arguments": {"expression": "1+1"}})
    assert time.monotonic() - t >= 0.045
    env = make_env("calculator", tool_latency_s=0.02, tool_latency_dist="lognormal")
    env.reset(1)
    t = time.monotonic()
    for _ in range(5):
        env.step({"name": "calculate", "arguments": {"expression": "1+1"}})
    assert 0.0 < time.monotonic() - t < 1.0
    r = env_factory_from_config(EnvConfig(name="retail", retail={"num_users": 2}))()
    assert isinstance(r, RetailEnv) and r.num_users == 2
    with pytest.raises(ValueError, match="unknown env"):
        make_env("nope")


# ------------------------------------------------------------------ retail env


def test_retail_reference_solutions_score_one_and_kinds():
    env = make_env("retail")
    kinds = set()
    for seed in range(30):
        msgs, tools = env.reset(seed)
        assert {t["function"]["name"] for t in tools} >= {"get_user", "get_order", "cancel_order", "exchange_item"}
        demo = env.reference_solution(seed)
        r, info = env.score(demo[-1]["content"])
        assert r == 1.0, (seed, info)
        kinds.add(info["kind"])
        n_turns = sum(1 for m in demo if m["role"] == "assistant")
        assert n_turns <= 4
    assert kinds == {"cancel", "exchange", "find_pending"}


def test_retail_deterministic_and_rewards_need_db_and_answer():
    a, b = RetailEnv(), RetailEnv()
    assert a.reset(7) == b.reset(7) and a.db == b.db
    # find a cancel task
    env = RetailEnv(task_kinds=("cancel",))
    env.reset(3)
    t = env.task
    # right answer, DB untouched -> 0
    r, info = env.score(f"<answer>{t['answer']}</answer>")
    assert r == 0.0 and not info["db_match"] and info["answer_match"]
    env.step({"name": "cancel_order", "arguments": {"order_id": t["order_id"], "reason": "no longer needed"}})
    r, info = env.score(f"<answer>{t['answer']}</answer>")
    assert r == 1.0
    assert env.score(f"<answer>${t['answer']}</answer>")[0] == 1.0
    assert env.score("<answer>0.01</answer>")[0] == 0.0
    # rule violations are tool errors and leave the DB alone
    with pytest.raises(ToolError, match="only pending"):
        env.step({"name": "cancel_order", "arguments": {"order_id": t["order_id"], "reason": "no longer needed"}})
    with pytest.raises(ToolError, match="not found"):
        env.step({"name": "get_order", "arguments": {"order_id": "#W0"}})
    with pytest.raises(ToolError, match="not found"):
        env.step({"name": "get_user", "arguments": {"user_id": "nobody"}})
    # extra harmful action -> 0
    env2 = RetailEnv(task_kinds=("find_pending",))
    env2.reset(3)
    t2 = env2.task
    assert env2.score(f"<answer>{t2['order_id']}</answer>")[0] == 1.0
    assert env2.score(f"<answer>{t2['order_id'].lstrip('#')}</answer>")[0] == 1.0
    env2.step({"name": "cancel_order", "arguments": {"order_id": t2["order_id"], "reason": "ordered by mistake"}})
    r, info = env2.score(f"<answer>{t2['order_id']}</answer>")
    assert r == 0.0 and not info["db_match"]


def test_retail_exchange_rules():
    env = RetailEnv(task_kinds=("exchange",))
    env.reset(11)
    t = env.task
    order = json.loads(env.step({"name": "get_order", "arguments": {"order_id": t["order_id"]}}))
    assert order["status"] == "delivered"
    with pytest.raises(ToolError, match="not in order"):
        env.step({"name": "exchange_item", "arguments": {"order_id": t["order_id"], "item_id": "1", "new_item_id": "2"}})
    with pytest.raises(ToolError, match="not a variant"):
        env.step({"name": "exchange_item", "arguments": {"order_id": t["order_id"], "item_id": t["item_id"],
                                                         "new_item_id": "123"}})
    env.step({"name": "exchange_item", "arguments": {"order_id": t["order_id"], "item_id": t["item_id"],
                                                     "new_item_id": t["new_item_id"]}})
    assert env.score(f"<answer>{t['answer']}</answer>")[0] == 1.0
    r, info = env.score("no tags")
    assert r == 0.0 and info["reason"] == "no <answer> tag"


# ------------------------------------------------------------------ tool latency (issue 16 item 6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, 1e9])
def test_tool_latency_must_be_finite_and_in_range(bad):
    # time.sleep(inf) raised OverflowError inside a rollout thread
    for cls in (CalculatorEnv, RetailEnv):
        with pytest.raises(ValueError, match="tool_latency_s must be a finite number"):
            cls(tool_latency_s=bad)


def test_demonstrations_skip_the_simulated_tool_latency():
    # SFT demos and the bpe corpus play reference solutions through step(): with a latency they slept
    from jax_rl.models.tokenizer import compact_tokenizer
    from rollout.agent import build_sft_example

    env = CalculatorEnv(tool_latency_s=2.0)
    env.reset(0)  # build the reasoning-gym dataset outside the timed part
    t = time.perf_counter()
    ex = build_sft_example(env, 0, compact_tokenizer())
    assert time.perf_counter() - t < 1.0 and ex["loss_mask"].any()
    assert env._latency_on  # latency is back on for episodes
