"""One way to register a named implementation: a table keyed by the config value that selects it
(Tunix's ``function_registry``, in the small). A module owns its table and makes its decorator here::

    ROUTES: dict[str, type[Route]] = {}
    register_route = registrar(ROUTES)  # @register_route("snapshot") class SnapshotRoute(Route): ...

A leaf: it imports nothing of the project, so every registry (corrections, old-logit routes, advantage
estimators) can use it without an import from a lower level up.
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["registrar"]

T = TypeVar("T")


def registrar(table: dict) -> Callable[[str], Callable[[T], T]]:
    """The decorator factory of ``table``: ``register(name)(obj)`` stores ``obj`` under ``name`` and returns it
    unchanged but for a class's ``name`` attribute, which is set to ``name`` (a function keeps its own).

    Args:
        table: the registry (``{name: class or function}``), owned by the module that selects from it.

    Returns:
        ``register(name)``, a class or function decorator."""

    def register(name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if isinstance(obj, type):
                obj.name = name
            table[name] = obj
            return obj

        return deco

    return register
