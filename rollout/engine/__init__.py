"""The rollout engine (:class:`Qwen3Engine`); the module becomes a package (split in the next commit)."""

from rollout.engine.core import *  # noqa: F401,F403
from rollout.engine.core import __all__, _resolve_dtype  # noqa: F401
