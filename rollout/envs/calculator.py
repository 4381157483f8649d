"""``calculator``: reasoning-gym arithmetic tasks with a ``calculate(expression)`` tool.

Task of seed s: dataset ``datasets[s % n]``, item ``s // n`` of ``reasoning_gym.create_dataset(
name, size=10**9, seed=dataset_seed, **dataset_config[name])`` (items are generated lazily, so
the size costs nothing). The model may call ``calculate`` and then answers with
``<answer>N</answer>``; the reward is reasoning-gym's own ``score_answer`` on the extracted
answer (``reasoning_gym.utils.extract_answer``).

The tool evaluates with :func:`safe_eval`, an AST walker over exact fractions that accepts only
numbers, ``+ - * /``, parentheses and unary minus/plus, within size bounds. There is no eval.
"""

from __future__ import annotations

import ast
import json
import threading
from fractions import Fraction
from typing import Any, Optional

from .base import BaseEnv, EnvSpec, ToolError, tool_schema

__all__ = ["CalculatorEnv", "safe_eval", "format_number", "CalcError"]

MAX_EXPR_CHARS = 256
MAX_NODES = 128
MAX_DEPTH = 32
MAX_ABS = Fraction(10) ** 18
MAX_DENOMINATOR = 10**12


class CalcError(ToolError):
    """The expression is not allowed or cannot be evaluated."""


# CPython 3.11-3.12 keep the AST constructor's recursion counter in per-interpreter state, so two threads
# building ASTs at once (rollout threads each running a tool call) can trip
# ``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905). One parse at a time.
_PARSE_LOCK = threading.Lock()

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def safe_eval(expr: str) -> Fraction:
    """Evaluate an arithmetic expression exactly.

    Allowed: int/float literals, binary ``+ - * /``, unary ``-``/``+``, parentheses.
    Bounds: at most 256 characters, 128 AST nodes, nesting depth 32; every literal and
    intermediate value must satisfy ``|x| <= 1e18`` and keep a denominator ``<= 1e12``.

    Returns:
        The exact value as a ``fractions.Fraction``.

    Raises:
        CalcError: syntax error, a disallowed construct (``**``, names, attribute access,
            calls, subscripts, comparisons, strings, ...), a bound exceeded, division by zero.
    """
    if not isinstance(expr, str):
        raise CalcError(f"expression must be a string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression too long ({len(expr)} > {MAX_EXPR_CHARS} characters)")
    if not expr.strip():
        raise CalcError("empty expression")
    try:
        with _PARSE_LOCK:
            tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalcError(f"invalid expression: {e.msg if isinstance(e, SyntaxError) else e}") from None
    except (SystemError, RecursionError, MemoryError) as e:  # the parser itself failed: the call's error, not the run's
        raise CalcError(f"the expression could not be parsed ({type(e).__name__}: {e})") from None
    n_nodes = sum(1 for _ in ast.walk(tree))
    if n_nodes > MAX_NODES:
        raise CalcError(f"expression too large ({n_nodes} > {MAX_NODES} nodes)")

    def check(x: Fraction) -> Fraction:
        if abs(x) > MAX_ABS:
            raise CalcError("number too large (|x| > 1e18)")
        if x.denominator > MAX_DENOMINATOR:
            raise CalcError("result too precise (denominator > 1e12)")
        return x

    def ev(node: ast.AST, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalcError(f"expression nested too deeply (> {MAX_DEPTH})")
        if isinstance(node, ast.Expression):
            return ev(node.body, depth + 1)
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalcError(f"only numbers are allowed, got {type(v).__name__} {v!r}")
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                raise CalcError("number out of range")
            if isinstance(v, int) and v.bit_length() > 64:
                raise CalcError("number too large (|x| > 1e18)")
            return check(Fraction(repr(v)) if isinstance(v, float) else Fraction(v))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            x = ev(node.operand, depth + 1)
            return -x if isinstance(node.op, ast.USub) else x
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow):
                raise CalcError("exponentiation (**) is not allowed")
            if isinstance(node.op, ast.Div):
                a, b = ev(node.left, depth + 1), ev(node.right, depth + 1)
                if b == 0:
                    raise CalcError("division by zero")
                return check(a / b)
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise CalcError(f"operator {type(node.op).__name__} is not allowed (use + - * /)")
            return check(op(ev(node.left, depth + 1), ev(node.right, depth + 1)))
        if isinstance(node, ast.Name):
            raise CalcError(f"names are not allowed ({node.id!r})")
        if isinstance(node, ast.Attribute):
            raise CalcError("attribute access is not allowed")
        if isinstance(node, ast.Call):
            raise CalcError("function calls are not allowed")
        raise CalcError(f"{type(node).__name__} is not allowed (numbers, + - * /, parentheses only)")

    return ev(tree, 0)


def format_number(x: Fraction) -> str:
    """Integers as ``'-42'``; other values as a decimal with up to 10 significant digits."""
    if x.denominator == 1:
        return str(x.numerator)
    return format(float(x), ".10g")


SYSTEM_PROMPT = "Use calculate for arithmetic. Answer as <answer>N</answer>."

_DATASETS: dict[str, Any] = {}
_DATASETS_LOCK = threading.Lock()


def check_dataset_config(name: str, knobs: Any, prefix: str = "env.calculator.dataset_config") -> dict:
    """``knobs`` checked against reasoning-gym's own config dataclass of dataset ``name`` (its field
    names and types, via pydantic), before the dataset is built; returns them as given.

    Raises:
        ValueError: one line naming the knob and its value (``env.calculator.dataset_config.chain_sum.min_terms='abc':
            Input should be a valid integer``), or an unknown knob with the known ones.
    """
    import dataclasses
    import difflib

    import pydantic
    import reasoning_gym.factory as rg

    where = f"{prefix}.{name}"
    if not isinstance(knobs, dict):
        raise ValueError(f"{where}={knobs!r}: must be a mapping of the dataset's knobs")
    cfg_cls = rg.DATASETS[name][1]
    fields = [f.name for f in dataclasses.fields(cfg_cls) if f.name not in ("seed", "size")]
    for k in knobs:
        if k not in fields:
            m = difflib.get_close_matches(str(k), fields, n=1, cutoff=0.6)
            hint = f"; did you mean '{where}.{m[0]}'?" if m else ""
            raise ValueError(f"unknown knob '{where}.{k}'{hint} (reasoning-gym's {name} takes {sorted(fields)})")
    try:
        pydantic.TypeAdapter(cfg_cls).validate_python(dict(knobs))
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        raise ValueError(f"{where}.{key}={knobs.get(key)!r}: {err['msg']}") from None
    return dict(knobs)


def _get_dataset(name: str, seed: int, cfg: dict) -> Any:
    key = json.dumps([name, seed, cfg], sort_keys=True)
    with _DATASETS_LOCK:
        ds = _DATASETS.get(key)
        if ds is None:
            import reasoning_gym

            ds = reasoning_gym.create_dataset(name, size=10**9, seed=seed, **cfg)
            _DATASETS[key] = ds
        return ds


class CalculatorEnv(BaseEnv):
    """Arithmetic tasks from reasoning-gym with a ``calculate`` tool.

    Args:
        datasets: reasoning-gym dataset names (default ``chain_sum``, ``basic_arithmetic``).
        dataset_config: per-dataset kwargs (difficulty knobs), e.g.
            ``{"chain_sum": {"min_terms": 2, "max_terms": 3}}``.
        dataset_seed: reasoning-gym dataset seed (tasks = f(dataset_seed, seed)).
        system_prompt: the system message.
        tool_latency_s, tool_latency_dist, max_answer_chars: see :class:`BaseEnv`.
    """

    name = "calculator"
    TOOLS = [
        tool_schema(
            "calculate",
            "Evaluate numbers with + - * / and parentheses.",
            {"expression": {"type": "string"}},
        )
    ]

    def __init__(
        self,
        datasets: Optional[list[str]] = None,
        dataset_config: Optional[dict[str, dict]] = None,
        dataset_seed: int = 0,
        system_prompt: str = SYSTEM_PROMPT,
        **base_kw: Any,
    ):
        super().__init__(**base_kw)
        self.datasets = list(datasets or ["chain_sum", "basic_arithmetic"])
        if not self.datasets:
            raise ValueError("calculator needs at least one reasoning-gym dataset")
        self.dataset_config = {k: dict(v) for k, v in (dataset_config or {}).items()}
        unknown = set(self.dataset_config) - set(self.datasets)
        if unknown:
            raise ValueError(f"dataset_config names datasets not in datasets={self.datasets}: {sorted(unknown)}")
        self.dataset_seed = int(dataset_seed)
        self.system_prompt = system_prompt
        self._entry: Optional[dict] = None
        self._ds: Any = None
        self.seed: Optional[int] = None

    def _task(self, seed: int) -> tuple[Any, dict]:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        n = len(self.datasets)
        name = self.datasets[seed % n]
        ds = _get_dataset(name, self.dataset_seed, self.dataset_config.get(name, {}))
        return ds, ds[seed // n]

    def reset(self, seed: int) -> tuple[list[dict], list[dict]]:
        """Messages ``[system, user(question)]`` and the ``calculate`` tool schema."""
        self.seed = int(seed)
        self._seed_latency(self.seed)
        self._ds, self._entry = self._task(self.seed)
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self._entry["question"]},
        ]
        return messages, [dict(t) for t in self.TOOLS]

    def _tools(self) -> dict[str, Any]:
        return {"calculate": self._calculate}

    def _calculate(self, expression: str) -> str:
        return format_number(safe_eval(expression))

    @property
    def entry(self) -> dict:
        if self._entry is None:
            raise RuntimeError("call reset(seed) first")
        return self._entry

    def score(self, final_answer: str) -> tuple[float, dict]:
        """reasoning-gym ``score_answer`` on ``extract_answer(final_answer)``; 0 if none or too long."""
        from reasoning_gym.utils import extract_answer

        entry = self.entry
        ans = extract_answer(final_answer or "")
        info: dict[str, Any] = {"answer": ans, "expected": entry["answer"], "dataset": entry["metadata"].get("source_dataset")}
        if ans is None:
            info["reason"] = "no <answer> tag"
            return 0.0, info
        if len(ans) > self.max_answer_chars:
            info["answer"] = ans[: self.max_answer_chars]
            info["reason"] = "answer too long"
            return 0.0, info
        r = float(self._ds.score_answer(answer=ans, entry=entry))
        return min(1.0, max(0.0, r)), info

    def reference_solution(self, seed: int) -> list[dict]:
        """``calculate(<the task's expression>)``, its result, then ``<answer>result</answer>``."""
        self.reset(seed)
        expr = self.entry["metadata"].get("expression")
        if expr is None:
            return [{"role": "assistant", "content": f"<answer>{self.entry['answer']}</answer>"}]
        call = {"name": "calculate", "arguments": {"expression": expr}}
        obs = self.step(call)
        return [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": obs},
            {"role": "assistant", "content": f"<answer>{obs}</answer>"},
        ]


def check_config(env_cfg: Any) -> None:
    """``env.calculator`` (``jax_rl.config.CalculatorConfig``: ``datasets``, ``dataset_config``) checked at the
    start of a run: each dataset is a reasoning-gym one, each ``dataset_config`` entry names one of them, its
    knobs pass the dataset's own schema (:func:`check_dataset_config`) and the dataset builds with them.

    Raises:
        ValueError: one line naming the key (``env.calculator.datasets``, ``env.calculator.dataset_config.<name>...``).
    """
    import difflib

    import reasoning_gym.factory as rg

    def hint(name: str) -> str:
        m = difflib.get_close_matches(name, list(rg.DATASETS), n=1, cutoff=0.6)
        return f"; did you mean '{m[0]}'?" if m else ""

    c = env_cfg.calculator
    for name in c.datasets:
        if name not in rg.DATASETS:
            raise ValueError(f"env.calculator.datasets: {name!r} is not a reasoning-gym dataset{hint(name)}")
    for name in c.dataset_config:
        if name not in c.datasets:
            raise ValueError(f"env.calculator.dataset_config.{name} names a dataset not in "
                             f"env.calculator.datasets={c.datasets}")
    for name in c.datasets:
        knobs = c.dataset_config.get(name, {})
        check_dataset_config(name, knobs)  # the dataset's own knob schema: names the knob and value
        try:
            _get_dataset(name, 0, dict(knobs))
        except Exception as e:  # reasoning-gym raises TypeError / AssertionError / ValueError
            raise ValueError(f"env.calculator.dataset_config.{name}={knobs}: {type(e).__name__}: "
                             f"{' '.join(str(e).split())}") from None


SPEC = EnvSpec(make=CalculatorEnv, section="calculator",
               kwargs=lambda env_cfg: {"datasets": list(env_cfg.calculator.datasets),
                                       "dataset_config": dict(env_cfg.calculator.dataset_config)},
               check=check_config)
"""``env.name=calculator`` in :data:`rollout.envs.ENVS`: its knobs are ``env.calculator``."""
