"""The backend a program is traced for: :func:`target_backend` / :func:`current_target_backend`.

An AOT compile for a TPU topology from a CPU host (``jax-rl compile``, :func:`jax_rl.tpu.compile_rollout`)
traces the TPU programs and state, not the CPU ones JAX's default backend would pick. Who asks: the paged
attention (its kernel: :mod:`jax_rl.models.paged_attention`), the rollout sampler (its Pallas kernel:
:mod:`rollout.engine.sampler`), the paged decode call's window (:mod:`rollout.engine.paged.programs`) and the
K/V storage dtype (:mod:`jax_rl.models.kv_storage`).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

__all__ = ["target_backend", "current_target_backend"]

_TARGET_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("target_backend", default=None)


@contextlib.contextmanager
def target_backend(backend: str):
    """Within it, programs traced (and K/V buffers built) without a backend of their own take ``backend``'s
    path: the paged attention's kernel, the sampler's, the K/V storage dtype (:func:`jax_rl.models.kv_storage.storage_dtype`)."""
    token = _TARGET_BACKEND.set(backend)
    try:
        yield
    finally:
        _TARGET_BACKEND.reset(token)


def current_target_backend() -> str:
    """The backend whose path a traced program takes: the :func:`target_backend` in effect, else JAX's
    default backend (the paged attention, the rollout sampler and the K/V storage choose by it)."""
    return _TARGET_BACKEND.get() or jax.default_backend()
