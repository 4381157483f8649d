"""The K/V layout registry: every layout an engine can hold, by its ``rollout.kv_layout`` name.

The engine looks its layout up here once (:func:`kv_layout_class`) and holds the object
(``Qwen3Engine.kv``); nothing outside this registry and the config compares a layout's name
(``tests/test_structure.py``, ``test_kv_layout_names_only_in_the_registry``): code asks the layout object
(or its class here, e.g. :attr:`rollout.engine.layout.KVLayout.pooled`). Adding a layout: a
:class:`rollout.engine.layout.KVLayout` subclass, its row below and its name in
``jax_rl.config.RolloutConfig.kv_layout`` (``tests/test_structure.py`` checks the two agree).
"""

from __future__ import annotations

from rollout.engine.contiguous import ContiguousLayout
from rollout.engine.layout import KVLayout
from rollout.engine.paged.layout import PagedLayout

__all__ = ["KV_LAYOUTS", "kv_layout_class"]

KV_LAYOUTS: dict[str, type[KVLayout]] = {cls.name: cls for cls in (ContiguousLayout, PagedLayout)}
"""``rollout.kv_layout`` name -> layout class."""


def kv_layout_class(name: str) -> type[KVLayout]:
    """The layout class called ``name``; ValueError (one line naming ``kv_layout``) for an unknown one."""
    try:
        return KV_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"kv_layout must be one of {sorted(KV_LAYOUTS)}, got {name!r}") from None
