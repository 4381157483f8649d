"""Environments: the :class:`Env` protocol, ``calculator`` and ``retail``.

``make_env(name, **cfg)`` builds one instance (one episode at a time);
``env_factory_from_config(env_cfg, rollout_cfg)`` returns a zero-argument factory the agent
loop calls once per episode.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

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

ENVS: dict[str, Callable[..., Env]] = {"calculator": CalculatorEnv, "retail": RetailEnv}


def make_env(name: str, **cfg: Any) -> Env:
    """Instantiate env ``name`` with keyword config.

    Raises:
        ValueError: unknown name (lists the known ones).
    """
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name](**cfg)


def env_factory_from_config(env_cfg: Any, rollout_cfg: Any = None) -> Callable[[], Env]:
    """A factory for ``jax_rl.config.EnvConfig`` (+ tool latency from ``RolloutConfig``)."""
    kw: dict[str, Any] = {}
    if rollout_cfg is not None:
        kw.update(tool_latency_s=rollout_cfg.tool_latency_s, tool_latency_dist=rollout_cfg.tool_latency_dist)
    if env_cfg.name == "calculator":
        kw.update(datasets=list(env_cfg.datasets), dataset_config=dict(env_cfg.dataset_config))
    elif env_cfg.name == "retail":
        kw.update(env_cfg.retail)
    return functools.partial(make_env, env_cfg.name, **kw)
