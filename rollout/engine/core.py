"""``Qwen3Engine``: the rollout engine over our Qwen3, with per-token log-probs, versions and routes.

Two interfaces over the same jitted programs:

* **The RL path** (:class:`rollout.generator.Generator`), typed. :meth:`Qwen3Engine.prefill_slots`
  prefills every request admitted in a generator step in one call, one jitted program per length
  bucket (fresh prompts batched ``[n, bucket]`` with per-row lengths, a GRPO group's identical
  prompts prefilled once and copied into each slot, and append-prefills of new tokens on a slot's
  kept K/V), each row answered by a :class:`PrefillResult`; :meth:`Qwen3Engine.copy_slot` copies
  one slot's row into another; :meth:`Qwen3Engine.decode` runs ONE step for all slots: feed each
  active slot's pending token at position ``lengths[b]`` (``decode_step``), sample the next token
  from the resulting logits, and return a :class:`StepOutput` (token, valid, generated,
  ``behav_logp``, version, route per slot); the sampled token becomes the new pending token, so
  weights swapped between two calls take effect on the very next token (no one-step lag).
  :meth:`Qwen3Engine.decode_steps` runs ``n`` such steps in one ``lax.scan`` (one dispatch, one
  host transfer; ``rollout.decode_steps``). :meth:`Qwen3Engine.free_slots` deactivates the slots
  whose request ended or that are held for a session's next turn: an inactive slot neither emits
  tokens nor touches its cached K/V. Compiled shapes are bounded: row buckets are powers of two
  up to ``slots``, length buckets powers of two from 16 up to ``max_cache_len``
  (docs/interfaces.md, "The RL engine's prefill"); every program is in :attr:`Qwen3Engine.programs`
  for AOT compiles.
* **JetStream 0.2.2's** ``engine_api.Engine`` (MaxText ``MaxEngine`` style), an adapter for its
  Driver and ``jax-rl serve``: ``prefill(tokens)`` writes the KV cache of ``tokens[:-1]``
  (bucketed, batch 1) and keeps the last token pending (0.2.2's API samples nothing there);
  ``insert(prefix, state, slot)`` puts it into slot ``slot`` (the layout's: a contiguous row, or
  the slot's new pages) and arms the slot (seed, temperature, pending token); ``generate(params,
  state)`` is :meth:`Qwen3Engine.decode` packed into JetStream's ``ResultTokens`` (bit-cast int32
  columns, :func:`pack_result`).

Decode state (a dict pytree, leading dim = slots B, cache capacity S = ``max_cache_len``):

=============  ==================  ===========================================================
key            shape / dtype       meaning
=============  ==================  ===========================================================
cache          KVCache             ``k``/``v`` [L,B,Hkv,S,Dh] compute dtype, ``lengths`` [B] i32;
                                   off a TPU (``kv_per_layer``: unrolled layers) k/v are
                                   tuples of L buffers, k [B,Hkv,Dh,S] (key-transposed), v
                                   [B,Hkv,S,Dh] (``KVCache.per_layer``: each layer's attention
                                   reads its own buffer in place, no copy); on XLA:CPU a
                                   bf16 cache holds its uint16 bits (``KVCache.dtype`` bf16,
                                   ``jax_rl.models.kv_storage``)
tokens         [B] int32           pending token (in no cache yet) per slot
active         [B] bool            slot is generating
keys           [B,2] uint32        per-request PRNG key (from the request seed)
temperature    [B] float32         per-request temperature; ``<= 0`` means greedy
generated      [B] int32           tokens emitted so far in this slot
=============  ==================  ===========================================================

Sampling and the JetStream rows: :mod:`rollout.engine.sampler`. Where each part lives:
:mod:`~rollout.engine.programs` (the device programs, one table), :mod:`~rollout.engine.slots`
(slot-state management, buckets), :mod:`~rollout.engine.weights` (load_params, the weight sync),
:mod:`~rollout.engine.jetstream` (the JetStream adapter), :mod:`~rollout.engine.sampler`.

Routing replay (``record_routes=True``, MoE models; ``moe.routing_replay`` r2/r3): the engine
also records the top-k expert ids each MoE layer chose for each token it ran through the model.
``prefill_slots`` / ``prefill`` return them for the positions they ran (``PrefillResult.routes``,
``prefix["routes"]`` int32 [n, n_moe_layers, k], position-aligned), and each decode step gives the
ids of the fed (pending) token, i.e. of position ``lengths[b]`` (``StepOutput.route`` [B,
n_moe_layers, k]; in the adapter's rows ``n_moe_layers * k`` more int32 columns). The last sampled
token of a request is never fed, so it has no route (:data:`jax_rl.models.qwen3.ROUTE_MISSING`).

MoE capacity drops (``counts_moe_drops``: an MoE model built with a ``moe.capacity_factor``, e.g.
``rollout.moe_capacity_factor``): every program that runs tokens through the model also counts,
per row, the token copies its MoE layers dropped for capacity (int32, summed over the row's
tokens and the MoE layers): ``PrefillResult.moe_dropped`` per ``prefill_slots`` row,
``prefix["moe_dropped"]`` (``prefill``) and, per decode step, ``StepOutput.moe_dropped`` [B] (the
fed token's dropped copies, 0 for an inactive slot); an engine that does not count leaves them
None. JetStream's adapter rows do not carry them. The generator adds them up per request
(``Completion.info["moe_dropped_copies"]`` against ``moe_copies``, the copies its tokens routed)
and the runtimes log their step sums as ``rollout/moe_dropped_copies``, ``rollout/moe_copies`` and
``rollout/moe_dropped_frac``.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_rl.models import bitwise
from jax_rl.models import qwen3 as _q
from jax_rl.sharding import state_shardings
from rollout.engine.jetstream import JetStreamAdapter
from rollout.engine.layout import LayoutFacts
from rollout.engine.layouts import kv_layout_class
from rollout.engine.programs import StepConfig, build_programs, program_shardings
from rollout.engine.sampler import StepOutput
from rollout.engine.slots import MIN_BUCKET, PrefillResult, SlotPrefill
from rollout.engine.spec import EngineSpec
from rollout.engine.weights import EngineWeights, resolve_dtype
from rollout.quantize import dequantize_params, quantize_params, quantized_shardings

__all__ = ["Qwen3Engine"]


class Qwen3Engine(EngineWeights, JetStreamAdapter):
    """JetStream ``Engine`` over ``jax_rl.models.qwen3.Qwen3ForCausalLM`` with log-probs.

    The engine holds its K/V layout as an object, :attr:`kv` (:class:`rollout.engine.layout.KVLayout`, chosen
    once from :data:`rollout.engine.layouts.KV_LAYOUTS` by ``spec.kv_layout``): the layout's host operations
    (prefill, copy, free, before a decode call, admission budget, stats) and its step programs. The engine's
    own methods are the same for every layout.

    Args:
      model_config: ``Qwen3Config``.
      params: the model's params (an ``nnx.State`` as from ``nnx.split(model, nnx.Param)`` /
        ``Learner.get_params()``, fp32 or any float dtype). Cast to ``spec.dtype`` by
        :meth:`load_params`; ``None`` = load later.
      spec: the :class:`rollout.engine.spec.EngineSpec` (slots, cache length, dtype, sampling, K/V layout,
        quantisation, ...). None: an ``EngineSpec(**fields)`` of the keyword ``fields`` given instead (a
        shorthand for tests and scripts: ``Qwen3Engine(cfg, params, slots=4, kv_layout="paged")``).
      mesh: optional ``('data','fsdp','tensor','expert')`` ``jax.sharding.Mesh``
        (:func:`jax_rl.sharding.make_mesh`; ``placement.rollout`` / ``rollout.mesh``): the engine
        runs sharded on it by the learner's logical rules (:data:`jax_rl.sharding.LOGICAL_RULES`):
        params by :func:`jax_rl.sharding.state_shardings` (dense: heads / MLP / vocab over
        ``tensor``; MoE experts over ``expert``), the KV cache [.., B, Hkv, ..] slots over
        ``data`` (and ``fsdp``) and kv heads over ``tensor`` (an axis that does not divide a
        dim is dropped, i.e. replicated: 1 kv head on ``tensor=2`` keeps a whole cache copy per
        tensor shard), the per-slot vectors over ``data``; every jitted step is traced under
        ``jax.set_mesh(mesh)`` (the model's activation constraints apply; ``moe.dispatch=
        "ragged"`` with ``expert`` > 1 takes the expert-parallel path,
        :mod:`jax_rl.models.expert_parallel`) with the decode state's shardings as
        out_shardings, so the donated state aliases. ``None`` (default): everything on
        ``jax.devices()[0]``, no ambient mesh (the colocated engine; its programs are unchanged).
      tokenizer: optional ``ChatTokenizer`` (needed only for JetStream serving / Driver).

    What some spec fields do here:

    * ``kv_per_layer``: keep the decode cache as L per-layer buffers (``KVCache.per_layer``) and run
      the layers unrolled: with ``scan_layers`` the engine's own copy of the weights is
      unstacked by :meth:`load_params` (which still takes the stacked learner/checkpoint
      layout), so every layer reads its own cache buffer in place. ``None`` (default): on for
      every backend but a TPU. Where a dot is a library call on buffers (XLA:CPU; a GPU's
      cuBLAS), XLA copies each layer's cache out of the stacked buffer, and a scan each
      layer's params, per token: the compiled Qwen3-0.6B step at 64 slots x 384 moves 3.1x
      its params + cache stacked and scanned, 1.16x per layer (XLA:CPU, fp32,
      ``bench/decode_hlo.py``; 1.37x decode tokens/s measured at 32 slots on the CPU). A TPU
      fuses those slices into its dots, so programs for a TPU (a TPU backend; AOT compiles in
      ``jax_rl.tpu``, ``bench/decode_compile.py`` pass False) keep ``scan_layers`` as given:
      libtpu counted more bytes per decode step with the per-layer form (2.40x vs 1.67x params
      + cache, 2-layer Qwen3-0.6B, 32 x 1024, v5e).
    * ``record_routes``: also return the expert ids every MoE layer chose (module docstring,
      "Routing replay"); ignored (False) for a dense model.
    * ``quantize``: ``"none"`` (every float param cast to ``dtype``, no quantised program), or
      ``"int8"`` / ``"fp8"`` / ``"int4"``: weight-only per-output-channel quantisation of the decoder
      layers' matmul weights at every :meth:`load_params` (the weight sync), from the values as given
      (the learner's fp32 master weights). The engine stores them quantised (``qwix.QArray``: int8 /
      float8_e4m3fn / int4 values + float32 scales) and dequantises them to ``dtype`` inside each jitted
      program; embedding, LM head, router and norms stay in ``dtype``. :mod:`rollout.quantize` has the
      scheme, its error bound and what the memory saving is and is not.
    * ``kv_layout``, ``kv_page_size``, ``kv_pages``, ``prefill_chunk_size``: the layout
      (:mod:`rollout.engine.layouts`); the paged one's pool, sharding over a mesh and chunked prefill are
      :mod:`rollout.engine.paged`'s (ValueError when the pool, or each shard's sub-pool, holds fewer than
      ``max_cache_len`` positions).

    Raises:
      ValueError: a spec field out of range (:class:`EngineSpec`), an unknown ``kv_layout``, a pool too small.
      TypeError: both ``spec`` and keyword fields.
    """

    def __init__(self, model_config: Any, params: Any = None, spec: Optional[EngineSpec] = None, *,
                 mesh: Optional[jax.sharding.Mesh] = None, tokenizer: Any = None, **fields: Any) -> None:
        if spec is None:
            spec = EngineSpec(**fields)
        elif fields:
            raise TypeError(f"Qwen3Engine: give an EngineSpec or its fields, not both (got {sorted(fields)})")
        self.spec = spec
        """The :class:`EngineSpec` this engine was built from."""
        self.sampler = spec.sampler
        self.quantize = spec.quantize
        """``rollout.quantize`` of this engine's weights (``"none"``: cast only)."""
        self.config = model_config
        self.dtype = resolve_dtype(spec.dtype)
        self._slots = int(spec.slots)
        self.max_cache_len = int(spec.max_cache_len)
        mp = MIN_BUCKET
        while mp < spec.max_prefill_length:
            mp *= 2
        self._max_prefill_length = mp
        self.temperature = float(spec.temperature)
        self.top_p = float(spec.top_p)
        self.top_k = int(spec.top_k)
        self._mesh = mesh
        self.tokenizer = tokenizer
        self._seed_counter = itertools.count(1)
        self._lock = threading.Lock()
        self._bitwise = bitwise.enabled(spec.model_kw)  # the bitwise mode's programs
        self._init_moe(model_config, spec.record_routes, spec.model_kw)
        self._init_model(model_config, spec.model_kw, spec.kv_per_layer)
        self._init_placement(mesh, spec.quantize)
        self.kv = kv_layout_class(spec.kv_layout)(spec, LayoutFacts(
            record_routes=self.record_routes, counts_moe_drops=self.counts_moe_drops, mesh=mesh,
            model_config=model_config))
        """The K/V layout (:class:`rollout.engine.layout.KVLayout`): host operations and step programs."""
        self._build_programs()
        self.params = self.load_params(params) if params is not None else None

    def _init_moe(self, model_config: Any, record_routes: bool, kw: dict) -> None:
        """What the engine records of an MoE model: routes (``record_routes``) and capacity drops."""
        self.record_routes = bool(record_routes) and bool(model_config.is_moe)
        self.route_shape = ((len(model_config.moe_layers), int(model_config.num_experts_per_tok))
                            if self.record_routes else None)
        """(n_moe_layers, k) of a recorded route, or None when the engine records none."""
        self.route_dtype = _q.route_dtype(model_config.num_experts) if self.record_routes else None
        """Compact host dtype of recorded expert ids (``jax_rl.models.qwen3.route_dtype``)."""
        # a model that drops MoE token copies on its local path (rollout.moe_capacity_factor): the
        # decode step tells it which slots are active, so an idle slot takes no expert capacity
        moe = kw.get("moe", _q.MoEOptions())
        self._decode_valid = bool(model_config.is_moe and moe.capacity_all_paths and moe.capacity_factor is not None)
        self.counts_moe_drops = bool(model_config.is_moe and moe.capacity_factor is not None)
        """The model can drop MoE token copies for capacity, and every program counts them per row
        (module doc, "MoE capacity drops")."""
        self.moe_copies_per_token = (len(model_config.moe_layers) * int(model_config.num_experts_per_tok)
                                     if model_config.is_moe else 0)
        """Token copies one token routes (MoE layers x k): the denominator of the drop fraction."""

    def _init_model(self, model_config: Any, kw: dict, kv_per_layer: Optional[bool]) -> None:
        """The abstract model: graph, abstract params and rest, the layer layout (``kv_per_layer``)."""
        dt = self.dtype

        def build(**extra):
            return nnx.eval_shape(lambda: _q.Qwen3ForCausalLM(
                model_config, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt, **{**kw, **extra}))

        abstract = build()
        if kv_per_layer is None:
            kv_per_layer = jax.default_backend() != "tpu"
        self._unstack_layers = 0
        if kv_per_layer and abstract.scan_layers:
            # the engine's own copy of the weights runs unrolled; stacked params (the learner's /
            # checkpoint's scan_layers layout) are unstacked by load_params
            self._unstack_layers = model_config.num_hidden_layers
            abstract = build(scan_layers=False)
        self._graphdef, self._abstract_params, self._abstract_rest = nnx.split(abstract, nnx.Param, ...)
        self._per_layer_cache = bool(kv_per_layer) and not abstract.scan_layers  # see the decode-state table

    def _init_placement(self, mesh: Optional[jax.sharding.Mesh], quantize: str) -> None:
        """Where the engine's params and state live (one device, or ``mesh``) and the tree it holds."""
        self._sharded = mesh is not None  # (the ``mesh`` property fills ``_mesh`` in lazily)
        self._param_shardings = None
        if mesh is not None:
            # replicated: the model's non-param state, prefill tokens, the per-step result rows
            self._sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._param_shardings = state_shardings(self._abstract_params, mesh)
        else:
            self._sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # = jax.devices()[0] in one process
        # the tree the engine holds (= the model's params unless quantised: QArray leaves then)
        self._engine_abstract, self._engine_shardings = self._abstract_params, self._param_shardings
        if quantize != "none":
            dt = self.dtype
            self._engine_abstract = jax.eval_shape(lambda p: quantize_params(p, quantize, dt), self._abstract_params)
            if self._param_shardings is not None:
                self._engine_shardings = quantized_shardings(self._engine_abstract, self._param_shardings)
        self._rest = jax.device_put(
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._abstract_rest), self._sharding
        )

    def _build_programs(self) -> None:
        """The layout's jitted step programs (its :attr:`KVLayout.table`), with the sharded engine's
        out_shardings (the decode state keeps its layout step after step, so the donated state aliases the
        new one; inputs come committed) and :attr:`state_shardings`; handed to the layout."""
        cfg = StepConfig(slots=self._slots, max_cache_len=self.max_cache_len, dtype=self.dtype, top_k=self.top_k,
                         top_p=self.top_p, sampler=self.sampler, record_routes=self.record_routes,
                         counts_moe_drops=self.counts_moe_drops, per_layer_cache=self._per_layer_cache,
                         decode_valid=self._decode_valid)
        steps = self.kv.step_programs(cfg, self._model, self._dequantized)
        outs = None
        if self._sharded:
            self.state_shardings, outs = program_shardings(steps, self._mesh, self._abstract_params, self.config,
                                                           self._sharding, self.kv.state_shardings)
        self._jits = build_programs(steps, outs, self.kv.table,
                                    bitwise.compiler_options() if self._bitwise else None)
        self.kv.bind(self._jits)

    # ------------------------------------------------------------------ model plumbing
    def _model(self, params: Any) -> Any:
        return nnx.merge(self._graphdef, self._dequantized(params), self._rest)

    def _dequantized(self, params: Any) -> Any:
        """The model's params tree from the engine's (quantised weights dequantised to the compute
        dtype, in the calling program; a no-op when nothing is quantised)."""
        if self.quantize == "none":
            return params
        return dequantize_params(params, self.dtype)

    def _in_mesh(self) -> Any:
        """``jax.set_mesh(mesh)`` for a sharded engine (thread-local; each engine's thread its own), a
        no-op context for the colocated one."""
        return jax.set_mesh(self._mesh) if self._sharded else contextlib.nullcontext()

    @property
    def programs(self) -> dict[str, Any]:
        """The engine's jitted programs by name, for AOT ``lower(...).compile()`` (``jax-rl compile``,
        :func:`jax_rl.tpu.compile_rollout`); ``state`` is the decode state (donated where it is an
        argument), B = ``slots``, S = ``max_cache_len``:

        * ``init_state`` ``(params) -> state``;
        * ``decode`` ``(params, state[, version int32][, num_pages static]) -> (state, StepOutput)``: the
          RL path's decode step (:meth:`decode`; ``num_pages``: the paged layout's page bucket);
          ``decode_steps`` ``(params, state, n static[, version][, num_pages])`` its ``n``-step scan
          (:meth:`decode_steps`); ``decode_result`` the same step packed into JetStream's rows
          (:meth:`generate`, the serving adapter);
        * ``prefill_slots`` ``(params, tokens int32 [n, P], lengths int32 [n], state, dest int32
          [B], pending int32 [B], seeds uint32 [B], temps float32 [B]) -> (state, PrefillRows(routes,
          moe_dropped))``: the batched fresh prefill + bulk insert (:meth:`prefill_slots`; each of
          routes / moe_dropped None unless ``record_routes`` / ``counts_moe_drops``);
        * ``append_prefill`` ``(params, state, tokens int32 [n, T], starts int32 [n], lengths int32
          [n], slots int32 [n], pending int32 [n], seeds uint32 [n], temps float32 [n], *, window
          static int = None) -> (state, PrefillRows(routes, moe_dropped))``: the append-prefill of new tokens
          onto slots' kept K/V (an episode's next turn), reading and writing only cache positions
          ``[0, window)`` (``starts + lengths <= window``; None: all S, the largest program);
        * ``copy_slot`` ``(state, src, dst, pending, seed, temperature) -> state``; ``insert``
          ``(k, v, n, token, seed, temperature, state, slot) -> state``; ``free_slots`` ``(state,
          mask bool [B]) -> state``;
        * ``prefill`` ``(params, tokens int32 [1, P], n int32) -> PrefixKV`` (k, v, routes,
          moe_dropped; None where the engine does not record them): batch-1 prefill (JetStream's
          API, the prefix cache's entries).
        Built from the layout's table (:attr:`rollout.engine.layout.KVLayout.table`: the contiguous
        :data:`rollout.engine.programs.PROGRAMS`, the paged :data:`rollout.engine.paged.programs.PAGED_PROGRAMS`,
        whose ``append_prefill`` takes ``num_pages`` instead of ``window`` and which adds ``set_table`` /
        ``copy_pages``). :func:`jax_rl.tpu.compile_rollout` lowers ``prefill``, ``append_prefill`` and ``decode``."""
        return dict(self._jits)

    def init_decode_state(self, *args: Any, **kwargs: Any) -> dict:
        """Empty decode state for all slots (see module docstring for its layout). On pages the host pool
        starts afresh with it (no slot holds pages, no prefix page is cached: the new device pool holds no
        K/V), so the old state must not be used again."""
        self.kv.reset()
        params = kwargs.get("params", self.params)
        if params is None:
            params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._engine_abstract)
            if self._sharded:
                params = self._place(params)
        with self._in_mesh():
            return self._jits["init_state"](params)

    def prefill_slots(self, params: Any, decode_state: dict, rows: Sequence[SlotPrefill]
                      ) -> tuple[dict, list[PrefillResult]]:
        """Prefill many requests into their slots (the RL path's batched prefill + insert; ``decode_state``
        donated): one :class:`PrefillResult` per :class:`SlotPrefill` row, in order. How rows share programs
        is the layout's (:meth:`rollout.engine.contiguous.ContiguousLayout.prefill_slots`,
        :meth:`rollout.engine.paged.PagedLayout.prefill_slots`).

        Raises:
          ValueError: a slot out of range or used twice, an empty or too long row, a bad start.
          rollout.engine.paged.pool.PoolExhausted: (paged) no pages left for the rows; their slots hold nothing after it.
        """
        return self.kv.prefill_slots(params, decode_state, rows)

    def copy_slot(self, decode_state: dict, src: int, dst: int, *, token: int, seed: int,
                  temperature: Optional[float] = None) -> dict:
        """Slot ``dst`` takes slot ``src``'s K/V and length, armed with its own pending ``token``, ``seed``
        and ``temperature`` (None: the engine's): a group's samples. Donates the state. Raises ValueError
        for a slot out of range or ``src == dst``."""
        return self.kv.copy_slot(decode_state, src, dst, token=token, seed=seed, temperature=temperature)

    def free_slots(self, decode_state: dict, slots: Sequence[int]) -> dict:
        """Deactivate ``slots`` in one call (the generator's finished and held slots): they stop
        decoding, and their cached K/V and lengths stay as they are (an inactive slot's decode
        writes only past its cached positions). Donates the state. Raises ValueError for a slot out of
        range."""
        return self.kv.free_slots(decode_state, slots)

    def free_slot(self, decode_state: dict, slot: int) -> dict:
        """Deactivate ``slot`` (not part of the 0.2.2 API). Donates state."""
        return self.free_slots(decode_state, [int(slot)])

    def decode(self, params: Any, decode_state: dict, *, version: int = 0) -> tuple[dict, StepOutput]:
        """One decode step for all slots, the RL path's typed step (``decode_state`` is donated).

        Each active slot feeds its pending token at position ``lengths[b]``, samples the next one
        from the resulting logits (its key: ``fold_in(PRNGKey(seed), lengths[b] + 1)``) and keeps it
        pending. A slot whose cache is full, or that is inactive, is reported ``valid = False`` and
        left inactive, its cache untouched.

        Args:
          params: engine params (from :meth:`load_params`).
          decode_state: the decode state (module docstring).
          version: the policy version of ``params``; the step's valid tokens carry it.

        Returns:
          ``(new_state, StepOutput)`` with [B] device arrays.
        """
        state, step_kw = self.kv.before_decode(decode_state, 1)
        with self._in_mesh():
            state, out = self._jits["decode"](params, state, jnp.int32(version), **step_kw)
        return self.kv.after_call(state), out

    def decode_steps(self, params: Any, decode_state: dict, n: int, *, version: int = 0) -> tuple[dict, StepOutput]:
        """``n`` decode steps for all slots in ONE jitted call (``decode_state`` is donated).

        A ``jax.lax.scan`` of the very step :meth:`decode` runs, carrying the decode state
        (the cache written in place at each slot's position, as one step does): the same tokens,
        log-probs and keys as ``n`` :meth:`decode` calls (a token's key depends only on its
        request seed and absolute position), with one dispatch and one host transfer instead of
        ``n``. The caller cannot act between the ``n`` steps: a slot keeps decoding after a stop
        token or its budget (the caller discards those tokens; its cache positions past the kept
        tokens are masked and overwritten before they are read), and a slot whose cache fills
        mid-chunk turns inactive (``valid = False``) for the rest of the chunk, as it would
        across calls. All ``n`` tokens are produced by ``params``. ``n`` is static: each value
        compiles its own program.

        Args:
          params: engine params (from :meth:`load_params`).
          decode_state: the state from :meth:`init_decode_state` / :meth:`prefill_slots` / a previous call.
          n: steps, >= 1.
          version: the policy version of ``params`` (every valid token carries it).

        Returns:
          ``(new_state, StepOutput)`` with leaves [n, B, ...]; ``out.at(i)`` is step ``i``.

        Raises:
          ValueError: ``n < 1``.
        """
        n = int(n)
        if n < 1:
            raise ValueError(f"decode_steps needs n >= 1, got {n}")
        state, step_kw = self.kv.before_decode(decode_state, n)
        with self._in_mesh():
            state, out = self._jits["decode_steps"](params, state, n, jnp.int32(version), **step_kw)
        return self.kv.after_call(state), out

    @property
    def mesh(self) -> jax.sharding.Mesh:
        if self._mesh is None:
            self._mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
        return self._mesh
