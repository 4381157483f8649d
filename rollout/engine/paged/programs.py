"""The paged layout's device side (``kv_layout="paged"``, :mod:`rollout.engine.paged` for what the layout
does): :class:`PagedStepPrograms`, the step programs over a :class:`jax_rl.models.qwen3.paged.PagedKVCache`;
:data:`PAGED_PROGRAMS`, their jit table; the pool's and the decode state's shardings on a mesh
(:func:`paged_pool_spec`, :func:`paged_state_shardings`). The host side, which pages a slot holds, is
:class:`rollout.engine.paged.PagedLayout`."""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_rl.models.backend_target import current_target_backend
from jax_rl.models.paged_attention import pages_for, pool_head_spec, pool_page_axes
from jax_rl.models.qwen3.paged import (copy_pages, gather_window, init_paged_cache, paged_decode_step, paged_extend,
                                       write_prefix, write_window)
from rollout.engine.programs import ProgramDef, StepPrograms
from rollout.engine.sampler import StepOutput

__all__ = ["PagedStepPrograms", "PAGED_PROGRAMS", "paged_state_shardings", "paged_pool_spec"]


class PagedStepPrograms(StepPrograms):
    """:class:`StepPrograms` over a :class:`PagedKVCache` (``page_size`` positions a page,
    ``num_pages`` pages; the table spans ``max_cache_len``)."""

    def __init__(self, cfg, model, dequantized, *, page_size: int, num_pages: int, pool_spec: Any = None) -> None:
        super().__init__(cfg, model, dequantized)
        self.page_size, self.num_pages, self.pool_spec = int(page_size), int(num_pages), pool_spec
        self.max_pages = pages_for(cfg.max_cache_len, page_size)

    def init_state(self, params: Any) -> dict:
        c = self.cfg
        cache = init_paged_cache(self._model(params), c.slots, self.num_pages, self.page_size, self.max_pages,
                                 dtype=c.dtype, per_layer=c.per_layer_cache, pool_spec=self.pool_spec)
        B = c.slots
        return {"cache": cache, "tokens": jnp.zeros((B,), jnp.int32), "active": jnp.zeros((B,), bool),
                "keys": jnp.zeros((B, 2), jnp.uint32), "temperature": jnp.ones((B,), jnp.float32),
                "generated": jnp.zeros((B,), jnp.int32)}

    @staticmethod
    def set_table(state: dict, table: jax.Array) -> dict:
        """The host's page table [B, M] int32 into the state."""
        return {**state, "cache": state["cache"].replace(page_table=table)}

    @staticmethod
    def copy_pages(state: dict, src: jax.Array, dst: jax.Array) -> dict:
        """Copy-on-write: pages src [n] -> dst [n] (-1: padding) in every layer (split over D shards of
        pages: n / D a shard, its page ids: ``jax_rl.models.qwen3.paged.copy_pages``)."""
        return {**state, "cache": copy_pages(state["cache"], src, dst)}

    def copy_slot(self, state, src, dst, pending, seed, temperature) -> dict:
        """Slots ``dst`` [n] int32 take the lengths of slots ``src`` [n] (their pages are shared in the table
        by the host) and are armed with ``pending`` [n] int32, ``seed`` [n] uint32, ``temperature`` [n] f32: a
        GRPO group's samples in one program. A ``dst`` of B (padding) changes nothing; the lengths read are
        the input state's (a ``src`` is never also a ``dst``)."""
        B = self.cfg.slots
        cache = state["cache"]
        cache = cache.replace(lengths=cache.lengths.at[dst].set(cache.lengths[jnp.minimum(src, B - 1)], mode="drop"))
        sel, spread = self.rows_at(dst)
        return self.arm(state, cache, sel, spread(pending, 0), spread(seed, 0), spread(temperature, 1.0))

    def insert(self, k, v, n, token, seed, temperature, state, slot) -> dict:
        """JetStream's ``insert`` on pages: a :class:`PrefixKV`'s k/v [L,1,K,P,H] (positions ``< n``) into the
        pages slot ``slot``'s table row names (the host took them and pushed the table first:
        :meth:`rollout.engine.paged.PagedLayout.insert`), its length ``n``, armed with ``token`` / ``seed`` /
        ``temperature`` (scalars), as :meth:`StepPrograms.insert` arms a contiguous row."""
        B = self.cfg.slots
        cache = write_prefix(state["cache"], k, v, n, slot)
        cache = cache.replace(lengths=cache.lengths.at[slot].set(n))
        fill = lambda x: jnp.full((B,), x)  # noqa: E731
        return self.arm(state, cache, jnp.arange(B) == slot, fill(token), fill(seed), fill(temperature))

    def model_step(self, model: Any, tokens: jax.Array, cache: Any, active: jax.Array,
                   num_pages: Optional[int] = None) -> Any:
        """:meth:`StepPrograms.model_step` over the pages (``num_pages``: the XLA path's static bucket;
        only ``active`` slots write: :func:`jax_rl.models.qwen3.paged.paged_decode_step`)."""
        c = self.cfg
        return paged_decode_step(model, tokens, cache, num_pages=num_pages, write=active,
                                 return_expert_ids=c.record_routes, return_moe_drops=c.counts_moe_drops,
                                 valid=active if c.decode_valid else None)

    def decode_steps(self, params: Any, state: dict, n: int, version: Any = 0,
                     num_pages: Optional[int] = None) -> tuple[dict, StepOutput]:
        """:meth:`StepPrograms.decode_steps` over the pages. On XLA:CPU with a page bucket (and a pool not
        split over pages) the call gathers each row's ``num_pages`` pages once into a contiguous window
        (:func:`jax_rl.models.qwen3.paged.gather_window`), runs the decode step with the contiguous model
        call on it (:meth:`StepPrograms.model_step`: the window is at most the contiguous cache's size) and
        writes the call's new entries back through the table (``write_window``): the same values as n steps
        of :meth:`decode`, whose per-step, per-layer page gathers cost more than the steps themselves on
        XLA:CPU at short contexts (``docs/performance.md``). Elsewhere (the TPU kernel, the GPU's XLA
        path, whose memory the window would raise) n steps of :meth:`decode`."""
        cache = state["cache"]
        if num_pages is None or cache.page_axes is not None or current_target_backend() != "cpu":
            return super().decode_steps(params, state, n, version, num_pages=num_pages)
        params = self._dequantized(params)
        window = {**state, "cache": gather_window(cache, num_pages)}
        contiguous = functools.partial(StepPrograms.model_step, self)
        window, out = jax.lax.scan(lambda st, _: self.decode_with(contiguous, params, st, version), window, None,
                                   length=n)
        return {**window, "cache": write_window(cache, window["cache"], cache.lengths, n)}, out

    def extend_slots(self, params, state, tokens, starts, lengths, slots, pending, seeds, temps,
                     num_pages: Optional[int] = None) -> tuple[dict, Any]:
        """Prefill (``starts`` 0 or a prefix hit) or append-prefill rows into their slots' pages:
        tokens [n, T], starts/lengths/slots/pending/seeds/temps [n] (a slot of B: a padding row,
        writing nowhere); the filled slots are armed."""
        c = self.cfg
        B = c.slots
        cache = state["cache"]
        real = slots < B
        table = jnp.where(real[:, None], cache.page_table[jnp.minimum(slots, B - 1)], -1)
        out = paged_extend(self._model(params), tokens, starts, lengths,
                           cache.replace(page_table=table, lengths=starts), num_pages=num_pages,
                           return_expert_ids=c.record_routes, return_moe_drops=c.counts_moe_drops)
        sel, spread = self.rows_at(slots)
        new_cache = cache.replace(kv=out.cache.kv, lengths=jnp.where(sel, spread(starts + lengths, 0), cache.lengths))
        return (self.arm(state, new_cache, sel, spread(pending, 0), spread(seeds, 0), spread(temps, 1.0)),
                self._rows_extras(out))

    def unsupported(self, *a, **k):
        """The contiguous layout's batched ``prefill_slots`` program has no paged form (the paged layout's
        :meth:`rollout.engine.paged.PagedLayout.prefill_slots` runs ``append_prefill``)."""
        raise ValueError("the contiguous prefill_slots program has no paged form: the paged layout prefills "
                         "through append_prefill (PagedLayout.prefill_slots)")


PAGED_PROGRAMS: dict[str, ProgramDef] = {
    "init_state": ProgramDef("init_state", (), {}, "state"),
    "set_table": ProgramDef("set_table", (0,), {}, "state"),
    "copy_pages": ProgramDef("copy_pages", (0,), {}, "state"),
    "copy_slot": ProgramDef("copy_slot", (0,), {}, "state"),
    "free_slots": ProgramDef("deactivate", (0,), {}, "state"),
    "decode": ProgramDef("decode", (1,), {"static_argnames": ("num_pages",)}),
    "decode_steps": ProgramDef("decode_steps", (1,), {"static_argnums": (2,), "static_argnames": ("num_pages",)}),
    "append_prefill": ProgramDef("extend_slots", (1,), {"static_argnames": ("num_pages",)}),
    "prefill": ProgramDef("prefill", (), {}, "prefix"),
    "insert": ProgramDef("insert", (6,), {}, "state"),
    "decode_result": ProgramDef("result", (1,), {"static_argnames": ("num_pages",)}),
    "prefill_slots": ProgramDef("unsupported", (), {}, None),
}
"""The paged engine's programs for :func:`rollout.engine.programs.build_programs` (the contiguous
``prefill_slots`` has no paged form; ``prefill`` is the batch-1 PrefixKV prefill, layout-free; ``insert``
writes its K/V into a slot's pages and ``decode_result`` is the decode step packed into JetStream's rows,
taking the decode's ``num_pages``)."""


def paged_pool_spec(slots: int, mesh: jax.sharding.Mesh, *, num_q_heads: int,
                    num_kv_heads: int) -> jax.sharding.PartitionSpec:
    """One layer's pool [P, page_size, 2K, H] on ``mesh``: pages over the axes that split the slots
    (:func:`jax_rl.models.paged_attention.pool_page_axes`; None where none does), the combined head axis
    over the axis that splits the kv heads in the contiguous engine's cache (``tensor``), in whole kv
    heads (:func:`jax_rl.models.paged_attention.pool_head_spec`: replicated where the q heads and the K
    kv heads do not split alike, as the contiguous cache drops an axis that does not divide K)."""
    head = pool_head_spec(num_q_heads, num_kv_heads, mesh)[1]
    return jax.sharding.PartitionSpec(pool_page_axes(slots, mesh), None, head, None)


def paged_state_shardings(abstract_state: dict, mesh: jax.sharding.Mesh) -> dict:
    """The paged decode state's shardings on ``mesh`` (a sharded engine): every layer's pool
    [P, page_size, 2K, H] (stacked: [L, P, page_size, 2K, H]) as the cache's ``pool_spec``
    (:func:`paged_pool_spec`). The page table, the lengths and every per-slot vector are replicated
    (the host rewrites the table before each call)."""
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cache = abstract_state["cache"]

    def pool(a):
        spec = cache.pool_spec or jax.sharding.PartitionSpec(None, None, None, None)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(None,) * (a.ndim - 4), *spec))

    kv = tuple(pool(a) for a in cache.kv) if isinstance(cache.kv, tuple) else pool(cache.kv)
    out = {key: rep for key in abstract_state if key != "cache"}
    out["cache"] = cache.replace(kv=kv, page_table=rep, lengths=rep)
    return out
