"""The engine's step programs: the device functions :class:`rollout.engine.Qwen3Engine` jits, and the
ONE table (:data:`PROGRAMS`) they are jitted from, with or without a mesh.

Every program is a method of :class:`StepPrograms`, closed over the static facts of one engine
(:class:`StepConfig`: slots B, cache capacity S, dtype, sampling, what it records) and its model
(params -> ``Qwen3ForCausalLM``). The decode state they carry is the dict of the table in
:mod:`rollout.engine.core`. A program returns the same structure whatever the engine's flags: an
output it does not compute is None (:class:`PrefixKV`, :class:`PrefillRows`, :class:`StepOutput`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

from jax_rl.models import qwen3 as _q
from jax_rl.sharding import logical_to_pspec
from jax_rl.models.bitwise import behav_logp
from rollout.engine.sampler import StepOutput, pack_result, sample_tokens

__all__ = ["StepConfig", "StepPrograms", "PrefixKV", "PrefillRows", "ProgramDef", "PROGRAMS", "build_programs",
           "program_shardings", "replace_cache", "CACHE_NAMES", "CACHE_K_LAYER_NAMES"]

# logical names of the KV cache (jax_rl.sharding.LOGICAL_RULES): stacked k/v [L,B,K,S,H] (a prefix
# [L,1,K,P,H]); one layer's v [B,K,S,H] is CACHE_NAMES[1:]; one layer's key-transposed k [B,K,H,S]
CACHE_NAMES = ("cache_layers", "cache_batch", "cache_kv_heads", "cache_sequence", "cache_head_dim")
CACHE_K_LAYER_NAMES = ("cache_batch", "cache_kv_heads", "cache_head_dim", "cache_sequence")


def replace_cache(cache: Any, **kw: Any) -> Any:
    """Functional update of a KVCache (dataclass / flax struct / NamedTuple)."""
    if hasattr(cache, "replace"):
        return cache.replace(**kw)
    if hasattr(cache, "_replace"):
        return cache._replace(**kw)
    return dataclasses.replace(cache, **kw)


class PrefixKV(NamedTuple):
    """What the batch-1 ``prefill`` program returns (JetStream's prefix, the prefix cache's entries).

    Attributes:
      k, v: [L, 1, Hkv, P, Dh] the compute dtype: the prompt's K/V, positions ``>= n`` zeroed.
      routes: None, or int32 [P, n_moe_layers, k] (``record_routes``): the prompt positions' routes.
      moe_dropped: None, or int32 [] (``counts_moe_drops``): the prompt's MoE copies dropped for capacity.
    """

    k: Any
    v: Any
    routes: Any = None
    moe_dropped: Any = None


class PrefillRows(NamedTuple):
    """The per-row extras of ``prefill_slots`` / ``append_prefill`` (next to the new state).

    Attributes:
      routes: None, or int32 [n, P, n_moe_layers, k] (``record_routes``).
      moe_dropped: None, or int32 [n] (``counts_moe_drops``): each row's MoE copies dropped for capacity.
    """

    routes: Any = None
    moe_dropped: Any = None


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static facts a step program closes over (one engine's).

    Attributes:
      slots: B. max_cache_len: S. dtype: compute / K/V dtype.
      top_k, top_p: the engine's truncation (static: :func:`rollout.engine.sampler.sample_tokens`).
      sampler: ``sample_tokens``' ``impl`` (``rollout.sampler``).
      record_routes: programs return the MoE routes. counts_moe_drops: and the dropped copies.
      per_layer_cache: the cache is L per-layer buffers (``KVCache.per_layer``), not stacked.
      decode_valid: the decode step tells the model which slots are active (capacity-dropping MoE).
    """

    slots: int
    max_cache_len: int
    dtype: Any
    top_k: int = 0
    top_p: float = 1.0
    sampler: str = "auto"
    record_routes: bool = False
    counts_moe_drops: bool = False
    per_layer_cache: bool = False
    decode_valid: bool = False


class StepPrograms:
    """The device functions of one engine (traceable; jitted by :func:`build_programs`).

    Args:
      cfg: the engine's :class:`StepConfig`.
      model: params -> the model (``nnx.merge`` of the engine's graph, dequantised params, rest).
      dequantized: params -> the model's params tree (quantised weights dequantised; else identity).
    """

    def __init__(self, cfg: StepConfig, model: Callable[[Any], Any], dequantized: Callable[[Any], Any]) -> None:
        self.cfg = cfg
        self._model = model
        self._dequantized = dequantized

    # ------------------------------------------------------------------ state
    def init_state(self, params: Any) -> dict:
        """The empty decode state (params give the model; no slot active)."""
        c = self.cfg
        B = c.slots
        cache = self._model(params).init_cache(B, c.max_cache_len, dtype=c.dtype, backend_storage=True)
        if c.per_layer_cache:
            cache = cache.per_layer()
        return {
            "cache": cache,
            "tokens": jnp.zeros((B,), jnp.int32),
            "active": jnp.zeros((B,), bool),
            "keys": jnp.zeros((B, 2), jnp.uint32),
            "temperature": jnp.ones((B,), jnp.float32),
            "generated": jnp.zeros((B,), jnp.int32),
        }

    def rows_at(self, slots: jax.Array) -> tuple[jax.Array, Callable[[jax.Array, Any], jax.Array]]:
        """Rows of a program placed at their slots ``slots`` [n] int32 (a slot >= B: a padding row, dropped):
        ``(sel, spread)``, ``sel`` [B] bool the slots written and ``spread(x, fill)`` the rows' values x [n] at
        their slots, ``fill`` elsewhere ([B], x's dtype)."""
        B = self.cfg.slots
        sel = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")
        return sel, lambda x, fill: jnp.full((B,), fill, x.dtype).at[slots].set(x, mode="drop")

    @staticmethod
    def arm(state: dict, cache: Any, sel: jax.Array, pending: jax.Array, seeds: jax.Array, temps: jax.Array) -> dict:
        """The per-slot fields of the slots in ``sel`` [B] bool: pending token, key, temperature."""
        keys = jax.vmap(jax.random.PRNGKey)(seeds)
        return {
            "cache": cache,
            "tokens": jnp.where(sel, pending, state["tokens"]),
            "active": state["active"] | sel,
            "keys": jnp.where(sel[:, None], keys, state["keys"]),
            "temperature": jnp.where(sel, temps, state["temperature"]),
            "generated": jnp.where(sel, 0, state["generated"]),
        }

    def insert(self, k, v, n, token, seed, temperature, state, slot) -> dict:
        """A :class:`PrefixKV`'s k/v [L,1,K,P,H] into row ``slot``, armed (JetStream's ``insert``)."""
        cache = state["cache"]
        zero = jnp.zeros((), jnp.int32)
        if self.cfg.per_layer_cache:  # into each layer's k [B,K,H,S] / v [B,K,S,H] buffer
            idx = (slot, zero, zero, zero)
            new_k = tuple(jax.lax.dynamic_update_slice(c, cache.store(k[i].swapaxes(2, 3)), idx)
                          for i, c in enumerate(cache.k))
            new_v = tuple(jax.lax.dynamic_update_slice(c, cache.store(v[i]), idx) for i, c in enumerate(cache.v))
        else:
            idx = (zero, slot, zero, zero, zero)
            new_k = jax.lax.dynamic_update_slice(cache.k, cache.store(k), idx)
            new_v = jax.lax.dynamic_update_slice(cache.v, cache.store(v), idx)
        new_cache = replace_cache(cache, k=new_k, v=new_v, lengths=cache.lengths.at[slot].set(n))
        return {
            "cache": new_cache,
            "tokens": state["tokens"].at[slot].set(token),
            "active": state["active"].at[slot].set(True),
            "keys": state["keys"].at[slot].set(jax.random.PRNGKey(seed)),
            "temperature": state["temperature"].at[slot].set(temperature),
            "generated": state["generated"].at[slot].set(0),
        }

    def copy_slot(self, state, src, dst, pending, seed, temperature) -> dict:
        """Slot ``dst`` takes slot ``src``'s cache row and length, armed with its own pending/seed/temperature."""
        B = self.cfg.slots
        cache = state["cache"]
        if self.cfg.per_layer_cache:
            new_k = tuple(c.at[dst].set(c[src]) for c in cache.k)
            new_v = tuple(c.at[dst].set(c[src]) for c in cache.v)
        else:
            new_k, new_v = cache.k.at[:, dst].set(cache.k[:, src]), cache.v.at[:, dst].set(cache.v[:, src])
        cache = replace_cache(cache, k=new_k, v=new_v, lengths=cache.lengths.at[dst].set(cache.lengths[src]))
        sel = jnp.arange(B) == dst
        fill = lambda x: jnp.full((B,), x)  # noqa: E731
        return self.arm(state, cache, sel, fill(pending), fill(seed), fill(temperature))

    @staticmethod
    def deactivate(state: dict, mask: jax.Array) -> dict:
        """mask [B] bool: the slots to stop (their cache and lengths are left as they are)."""
        new = dict(state)
        new["active"] = state["active"] & ~mask
        return new

    # ------------------------------------------------------------------ decode
    def model_step(self, model: Any, tokens: jax.Array, cache: Any, active: jax.Array) -> Any:
        """The decode step's one hook: the model over the pending ``tokens`` [B] at ``cache.lengths`` ->
        ``DecodeOutput`` (logits [B, V] float32, the new cache, expert ids / dropped copies where asked).
        ``active`` [B] bool: the slots that write (a capacity-dropping MoE model is told them). A layout's
        programs override this and nothing else of the step (the paged one: :meth:`PagedStepPrograms.model_step`)."""
        c = self.cfg
        return model.decode_step(tokens, cache, return_expert_ids=c.record_routes, return_moe_drops=c.counts_moe_drops,
                                 **({"valid": active} if c.decode_valid else {}))

    def decode(self, params: Any, state: dict, version: Any = 0, **step_kw: Any) -> tuple[dict, StepOutput]:
        """One decode step for all slots -> (state, StepOutput); ``version`` (int32 scalar) tags the
        step's tokens. An inactive slot (free, finished or held for its session's next turn) feeds its
        pending token at min(length, S - 1), a position past every cached token it holds, and keeps
        its length: its cached K/V (a held context) stay intact. ``step_kw``: the layout's static
        arguments of :meth:`model_step` (the paged layout's ``num_pages``)."""
        return self.decode_with(self.model_step, params, state, version, **step_kw)

    def decode_with(self, model_step: Callable[..., Any], params: Any, state: dict, version: Any = 0,
                    **step_kw: Any) -> tuple[dict, StepOutput]:
        """:meth:`decode` with ``model_step`` as its model call (the paged layout's window runs the
        contiguous one)."""
        c = self.cfg
        S = c.max_cache_len
        model = self._model(params)
        cache = state["cache"]
        active = state["active"] & (cache.lengths < S)  # room to write the pending token
        lengths_in = jnp.minimum(cache.lengths, S - 1)
        dec = model_step(model, state["tokens"], replace_cache(cache, lengths=lengths_in), active, **step_kw)
        pos = lengths_in + 1  # absolute position of the token being sampled
        keys = jax.vmap(jax.random.fold_in)(state["keys"], pos.astype(jnp.uint32))
        tok, logp, _kept = sample_tokens(dec.logits, keys, state["temperature"], top_k=c.top_k, top_p=c.top_p,
                                         impl=c.sampler)
        logp = behav_logp(model, dec.logits, tok, state["temperature"], logp)  # the bitwise mode: the learner's
        generated = state["generated"] + active.astype(jnp.int32)
        new_cache = replace_cache(dec.cache, lengths=jnp.where(active, lengths_in + 1, cache.lengths))
        new_state = {
            "cache": new_cache,
            "tokens": jnp.where(active, tok, state["tokens"]),
            "active": active,
            "keys": state["keys"],
            "temperature": state["temperature"],
            "generated": generated,
        }
        out = StepOutput(
            token=tok,
            valid=active,
            generated=generated,
            behav_logp=logp,
            version=jnp.where(active, jnp.asarray(version, jnp.int32), -1),
            route=_q.stack_routes(dec.expert_ids).astype(jnp.int32) if c.record_routes else None,  # [B, n_moe, k]
            # the fed token's MoE copies dropped for capacity [B] (0 if inactive)
            moe_dropped=jnp.where(active, dec.moe_drops.per_row, 0).astype(jnp.int32) if c.counts_moe_drops else None,
        )
        return new_state, out

    def result(self, params: Any, state: dict, **step_kw: Any) -> tuple[dict, jax.Array]:
        """JetStream's adapter (``generate``): the typed step packed into ResultTokens' int32 rows (``step_kw``:
        the layout's static arguments of the decode step, as :meth:`decode`)."""
        new_state, out = self.decode(params, state, **step_kw)
        return new_state, pack_result(out)

    def decode_steps(self, params: Any, state: dict, n: int, version: Any = 0, **step_kw: Any
                     ) -> tuple[dict, StepOutput]:
        """``n`` steps of :meth:`decode` in one on-device loop; every StepOutput leaf ([B, ...]) is
        stacked on a new leading axis [n, ...]; quantised weights are dequantised once per call, not
        once per step."""
        params = self._dequantized(params)
        return jax.lax.scan(lambda st, _: self.decode(params, st, version, **step_kw), state, None, length=n)

    # ------------------------------------------------------------------ prefill
    def prefill(self, params: Any, tokens: jax.Array, n: jax.Array) -> PrefixKV:
        """Batch-1 prefill: tokens [1, P] int32, n int32 scalar: cache positions to fill (0 <= n <= P)."""
        c = self.cfg
        model = self._model(params)
        P = tokens.shape[1]
        cache = model.init_cache(1, P, dtype=c.dtype)
        out = model.prefill(tokens, jnp.reshape(n, (1,)).astype(jnp.int32), cache,
                            return_expert_ids=c.record_routes, return_moe_drops=c.counts_moe_drops)
        cache = out.cache
        keep = (jnp.arange(P) < n)[None, None, None, :, None]  # cache [L,1,K,P,H]
        # Zero the padded rows (jnp.where, not *, so NaNs from all-masked rows vanish too).
        k = jnp.where(keep, cache.k, jnp.zeros((), cache.k.dtype))
        v = jnp.where(keep, cache.v, jnp.zeros((), cache.v.dtype))
        return PrefixKV(
            k, v,
            routes=_q.stack_routes(out.expert_ids)[0].astype(jnp.int32) if c.record_routes else None,
            moe_dropped=out.moe_drops.per_row[0] if c.counts_moe_drops else None)

    def prefill_slots(self, params, tokens, lengths, state, dest, pending, seeds, temps) -> tuple[dict, PrefillRows]:
        """Batched fresh prefill + bulk insert (``prefill_slots``): tokens [n, P], lengths [n] cache
        positions per row; dest [B] int32: the row whose K/V slot b takes (-1: untouched), so one row
        (a GRPO group's prompt) can fill several slots; pending/seeds/temps [B]."""
        c = self.cfg
        model = self._model(params)
        n, P = tokens.shape
        out = model.prefill(tokens, lengths, model.init_cache(n, P, dtype=c.dtype),
                            return_expert_ids=c.record_routes, return_moe_drops=c.counts_moe_drops)
        keep = (jnp.arange(P)[None, :] < lengths[:, None])[None, :, None, :, None]  # [1,n,1,P,1]
        k = jnp.where(keep, out.cache.k, jnp.zeros((), out.cache.k.dtype))  # padding zeroed (no NaN)
        v = jnp.where(keep, out.cache.v, jnp.zeros((), out.cache.v.dtype))
        sel = dest >= 0
        rows = jnp.maximum(dest, 0)
        cache = state["cache"]
        kg, vg = (cache.adopt(out.cache, x[:, rows]) for x in (k, v))  # [L,B,K,P,H] as the state stores them
        if c.per_layer_cache:
            s5 = sel[:, None, None, None]
            new_k = tuple(x.at[..., :P].set(jnp.where(s5, kg[i].swapaxes(2, 3), x[..., :P]))
                          for i, x in enumerate(cache.k))
            new_v = tuple(x.at[:, :, :P].set(jnp.where(s5, vg[i], x[:, :, :P])) for i, x in enumerate(cache.v))
        else:
            s5 = sel[None, :, None, None, None]
            new_k = cache.k.at[:, :, :, :P].set(jnp.where(s5, kg, cache.k[:, :, :, :P]))
            new_v = cache.v.at[:, :, :, :P].set(jnp.where(s5, vg, cache.v[:, :, :, :P]))
        cache = replace_cache(cache, k=new_k, v=new_v, lengths=jnp.where(sel, lengths[rows], cache.lengths))
        return self.arm(state, cache, sel, pending, seeds, temps), self._rows_extras(out)

    def _rows_extras(self, out: Any) -> PrefillRows:
        """A batched prefill's per-row routes [n, T, n_moe, k] and dropped copies [n] (None where not kept)."""
        c = self.cfg
        return PrefillRows(routes=_q.stack_routes(out.expert_ids).astype(jnp.int32) if c.record_routes else None,
                           moe_dropped=out.moe_drops.per_row if c.counts_moe_drops else None)

    def extend_slots(self, params, state, tokens, starts, lengths, slots, pending, seeds, temps,
                     window=None) -> tuple[dict, PrefillRows]:
        """Append-prefill into the slots' own cached rows: tokens [n, T] at positions starts + t,
        lengths [n]; slots [n] (B for a padding row: read clamped, written nowhere). window (static;
        None = S): only cache positions [0, window) are read, attended to and written back
        (starts + lengths <= window; the positions past it are left as they are)."""
        c = self.cfg
        B = c.slots
        model = self._model(params)
        cache = state["cache"]
        W = c.max_cache_len if window is None else int(window)
        src = jnp.minimum(slots, B - 1)
        if c.per_layer_cache:
            rk = jnp.stack([x[src][..., :W].swapaxes(2, 3) for x in cache.k])  # [L,n,K,W,H]
            rv = jnp.stack([x[src][:, :, :W] for x in cache.v])
        else:
            rk, rv = cache.k[:, src, :, :W], cache.v[:, src, :, :W]
        out = model.extend(tokens, starts, lengths, _q.StackedKVCache(k=rk, v=rv, lengths=starts, dtype=cache.dtype),
                           return_expert_ids=c.record_routes, return_moe_drops=c.counts_moe_drops)
        nk, nv = out.cache.k, out.cache.v
        if c.per_layer_cache:
            new_k = tuple(x.at[slots, :, :, :W].set(nk[i].swapaxes(2, 3), mode="drop") for i, x in enumerate(cache.k))
            new_v = tuple(x.at[slots, :, :W].set(nv[i], mode="drop") for i, x in enumerate(cache.v))
        else:
            new_k = cache.k.at[:, slots, :, :W].set(nk, mode="drop")
            new_v = cache.v.at[:, slots, :, :W].set(nv, mode="drop")
        sel, spread = self.rows_at(slots)
        cache = replace_cache(cache, k=new_k, v=new_v,
                              lengths=jnp.where(sel, spread(starts + lengths, 0), cache.lengths))
        return (self.arm(state, cache, sel, spread(pending, 0), spread(seeds, 0), spread(temps, 1.0)),
                self._rows_extras(out))


class ProgramDef(NamedTuple):
    """One row of :data:`PROGRAMS`.

    Attributes:
      method: the :class:`StepPrograms` method it jits.
      donate: ``donate_argnums`` (the decode state's position, where it is an argument).
      static: ``static_argnums`` / ``static_argnames`` of the jit.
      out: its outputs' shardings on a mesh (:func:`program_shardings`): ``"state"`` (the state),
        ``"state_rep"`` ((state, replicated)) or ``"prefix"`` (a :class:`PrefixKV`); None: no
        out_shardings (a program that only raises, e.g. the paged layout's ``insert``).
    """

    method: str
    donate: tuple = ()
    static: Optional[dict] = None
    out: Optional[str] = "state_rep"


PROGRAMS: dict[str, ProgramDef] = {
    "prefill": ProgramDef("prefill", (), {}, "prefix"),
    "init_state": ProgramDef("init_state", (), {}, "state"),
    "insert": ProgramDef("insert", (6,), {}, "state"),
    "free_slots": ProgramDef("deactivate", (0,), {}, "state"),
    "copy_slot": ProgramDef("copy_slot", (0,), {}, "state"),
    "decode": ProgramDef("decode", (1,)),
    "decode_result": ProgramDef("result", (1,)),
    "decode_steps": ProgramDef("decode_steps", (1,), {"static_argnums": (2,)}),
    "prefill_slots": ProgramDef("prefill_slots", (3,)),
    "append_prefill": ProgramDef("extend_slots", (1,), {"static_argnames": ("window",)}),
}
"""Every program of an engine by its :attr:`rollout.engine.Qwen3Engine.programs` name (the
signatures are documented there)."""


def build_programs(steps: StepPrograms, outs: Optional[dict[str, Any]] = None,
                   table: Optional[dict[str, ProgramDef]] = None, compiler_options: Optional[dict] = None
                   ) -> dict[str, Any]:
    """``jax.jit`` of every row of ``table`` (default :data:`PROGRAMS`; the paged layout's:
    :data:`rollout.engine.paged.programs.PAGED_PROGRAMS`) over ``steps``. ``outs``: the out_shardings of each
    ``out`` kind (a sharded engine, :func:`program_shardings`); None: no out_shardings (the colocated
    single-device engine, whose programs are as they always were). ``compiler_options``: XLA options of every
    program (the bitwise mode's, :func:`jax_rl.models.bitwise.compiler_options`; None: the defaults)."""
    return {name: jax.jit(getattr(steps, d.method), donate_argnums=d.donate, **(d.static or {}),
                          **({"compiler_options": compiler_options} if compiler_options else {}),
                          **({} if outs is None or d.out is None else {"out_shardings": outs[d.out]}))
            for name, d in (PROGRAMS if table is None else table).items()}


def _named(mesh: jax.sharding.Mesh, names: Sequence[Optional[str]], shape: Sequence[int]) -> Any:
    """NamedSharding on ``mesh`` of an array ``shape`` with logical ``names``."""
    return jax.sharding.NamedSharding(mesh, logical_to_pspec(names, shape=shape, mesh=mesh))


def decode_state_shardings(abstract_state: dict, mesh: jax.sharding.Mesh) -> dict:
    """Shardings of the decode state (:mod:`rollout.engine.core` table) on ``mesh``: k/v by the
    ``cache_*`` logical names (slots over ``data``/``fsdp``, kv heads over ``tensor``), every per-slot
    vector [B, ...] by ``cache_batch``."""
    cache = abstract_state["cache"]
    if cache.is_per_layer:
        k = tuple(_named(mesh, CACHE_K_LAYER_NAMES, a.shape) for a in cache.k)
        v = tuple(_named(mesh, CACHE_NAMES[1:], a.shape) for a in cache.v)
    else:
        k, v = _named(mesh, CACHE_NAMES, cache.k.shape), _named(mesh, CACHE_NAMES, cache.v.shape)
    out = {key: _named(mesh, ("cache_batch",) + (None,) * (a.ndim - 1), a.shape)
           for key, a in abstract_state.items() if key != "cache"}
    out["cache"] = replace_cache(cache, k=k, v=v, lengths=_named(mesh, ("cache_batch",), cache.lengths.shape))
    return out


def program_shardings(steps: StepPrograms, mesh: jax.sharding.Mesh, abstract_params: Any, model_config: Any,
                      replicated: Any, state_fn: Callable[[dict, Any], dict] = decode_state_shardings
                      ) -> tuple[dict, dict[str, Any]]:
    """``(state_shardings, outs)`` of a sharded engine: the decode state's shardings (``state_fn`` of the
    abstract state and the mesh; the state keeps its layout step after step, so a donated state aliases
    the new one) and the out_shardings of each :class:`ProgramDef` ``out`` kind for :func:`build_programs`."""
    with jax.set_mesh(mesh):
        st = state_fn(jax.eval_shape(steps.init_state, abstract_params), mesh)
    kv = _named(mesh, CACHE_NAMES, (model_config.num_hidden_layers, 1, model_config.num_key_value_heads,
                                    steps.cfg.max_cache_len, model_config.head_dim))
    c = steps.cfg
    prefix = PrefixKV(kv, kv, replicated if c.record_routes else None, replicated if c.counts_moe_drops else None)
    return st, {"state": st, "state_rep": (st, replicated), "prefix": prefix}
