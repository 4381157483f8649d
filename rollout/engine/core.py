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
  :meth:`Qwen3Engine.generate_steps` runs ``n`` such steps in one ``lax.scan`` (one dispatch, one
  host transfer; ``rollout.decode_steps``). :meth:`Qwen3Engine.free_slots` deactivates the slots
  whose request ended or that are held for a session's next turn: an inactive slot neither emits
  tokens nor touches its cached K/V. Compiled shapes are bounded: row buckets are powers of two
  up to ``slots``, length buckets powers of two from 16 up to ``max_cache_len``
  (docs/interfaces.md, "The RL engine's prefill"); every program is in :attr:`Qwen3Engine.programs`
  for AOT compiles.
* **JetStream 0.2.2's** ``engine_api.Engine`` (MaxText ``MaxEngine`` style), an adapter for its
  Driver and ``jax-rl serve``: ``prefill(tokens)`` writes the KV cache of ``tokens[:-1]``
  (bucketed, batch 1) and keeps the last token pending (0.2.2's API samples nothing there);
  ``insert(prefix, state, slot)`` copies it into row ``slot`` and arms the slot (seed,
  temperature, pending token); ``generate(params, state)`` is :meth:`Qwen3Engine.decode` packed
  into JetStream's ``ResultTokens`` (bit-cast int32 columns, below).

Decode state (a dict pytree, leading dim = slots B, cache capacity S = ``max_cache_len``):

=============  ==================  ===========================================================
key            shape / dtype       meaning
=============  ==================  ===========================================================
cache          KVCache             ``k``/``v`` [L,B,Hkv,S,Dh] compute dtype, ``lengths`` [B] i32;
                                   off a TPU (``kv_per_layer``: unrolled layers) k/v are
                                   tuples of L buffers, k [B,Hkv,Dh,S] (key-transposed), v
                                   [B,Hkv,S,Dh] (``KVCache.per_layer``: each layer's attention
                                   reads its own buffer in place, no copy)
tokens         [B] int32           pending token (in no cache yet) per slot
active         [B] bool            slot is generating
keys           [B,2] uint32        per-request PRNG key (from the request seed)
temperature    [B] float32         per-request temperature; ``<= 0`` means greedy
generated      [B] int32           tokens emitted so far in this slot
=============  ==================  ===========================================================

Sampling (``sample_tokens``): logits are fp32; ``logits / temperature``; optional top-k then
top-p (HF warper order) truncation; one uniform per token drawn from its key, inverted through
the running sum of the probabilities (``inverse_cdf_index``). The reported ``behav_logp`` is the
log-prob of the sampled token under the distribution actually sampled from (renormalised over
the kept set); the learner reproduces the truncation from its own logits (``jax_rl.sampling``:
``logp = log_softmax(logits/T)[tok] - log(kept_mass)``), so no kept mass leaves the engine.
Greedy slots (temperature <= 0) report the log-prob of the argmax under T = 1. The key of the
token sampled at absolute position ``p`` is ``fold_in(PRNGKey(seed), p)``: reproducible from the
seed regardless of slot, batch composition, or whether the KV cache was recomputed.

JetStream's ``ResultTokens.data`` (the adapter only) is int32 [B, 4]: columns token | valid |
n_generated | behav_logp bits (float32 bit-cast to int32; JetStream's Driver reads only the
first three), then the route columns; :func:`unpack_result` reads it back in one host transfer.

Routing replay (``record_routes=True``, MoE models; ``moe.routing_replay`` r2/r3): the engine
also records the top-k expert ids each MoE layer chose for each token it ran through the model.
``prefill_slots`` / ``prefill`` return them for the positions they ran (``PrefillResult.routes``,
``prefix["routes"]`` int32 [n, n_moe_layers, k], position-aligned), and each decode step gives the
ids of the fed (pending) token, i.e. of position ``lengths[b]`` (``StepOutput.route`` [B,
n_moe_layers, k]; in the adapter's rows ``n_moe_layers * k`` more int32 columns). The last sampled
token of a request is never fed, so it has no route (:data:`jax_rl.models.qwen3.ROUTE_MISSING`).

MoE capacity drops (``counts_moe_drops``: an MoE model built with a ``moe_capacity_factor``, e.g.
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
import dataclasses
import functools
import itertools
import threading
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_rl.models import qwen3 as _q
from jax_rl.sampling import kept_set, log_kept_mass, truncates
from jax_rl.sharding import logical_to_pspec, state_shardings
from rollout import jetstream_compat as _jc
from rollout.quantize import QUANTIZE_MODES, dequantize_params, quantize_params, quantized_shardings

_engine_api = _jc.engine_api()
_tokenizer_api = _jc.tokenizer_api()
_tokenizer_pb2 = _jc.tokenizer_pb2()
_token_utils = _jc.token_utils()

Engine = _engine_api.Engine
ResultTokens = _engine_api.ResultTokens

__all__ = [
    "Qwen3Engine",
    "JetStreamTokenizer",
    "sample_tokens",
    "inverse_cdf_index",
    "unpack_result",
    "pack_result",
    "StepOutput",
    "prefill_bucket",
    "SlotPrefill",
    "PrefillResult",
    "NO_BOS",
]

NO_BOS = -1
"""BOS placeholder id given to JetStream (Qwen3 has no BOS); prefill drops leading negative ids."""

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "bf16": jnp.bfloat16, "fp32": jnp.float32}
# logical names of the KV cache (jax_rl.sharding.LOGICAL_RULES): stacked k/v [L,B,K,S,H] (a prefix
# [L,1,K,P,H]); one layer's v [B,K,S,H] is _CACHE_NAMES[1:]; one layer's key-transposed k [B,K,H,S]
_CACHE_NAMES = ("cache_layers", "cache_batch", "cache_kv_heads", "cache_sequence", "cache_head_dim")
_CACHE_K_LAYER_NAMES = ("cache_batch", "cache_kv_heads", "cache_head_dim", "cache_sequence")
_MIN_BUCKET = 16


def _resolve_dtype(dtype: Union[str, Any]) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown rollout dtype {dtype!r}; expected 'bfloat16' or 'float32'")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type


def prefill_bucket(n: int, max_cache_len: int) -> int:
    """Power-of-two bucket (>= 16, <= max_cache_len) holding ``n`` cache positions."""
    b = _MIN_BUCKET
    while b < n:
        b *= 2
    return min(b, max_cache_len)


# ---------------------------------------------------------------------------- sampling


def _cdf_block(V: int, block: int) -> int:
    """Largest power of two <= ``block`` dividing ``V`` (no padding copy of the row), or
    ``block`` when that is below 8 (the row is padded with zeros then)."""
    b = block
    while b >= 8 and V % b:
        b //= 2
    return b if b >= 8 else block


def inverse_cdf_index(p: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
    """Inverse-CDF draw: for each row the first index whose running mass exceeds ``u`` times
    the row's total mass.

    Two levels, so the row is read about once (a full-length ``cumsum`` costs ~log2(V) passes over
    [B, V] on a TPU, where libtpu counted +8% bytes per Qwen3-4B decode step for it): the sums of
    ``block``-wide blocks, their running sum, the block holding the draw, then the running sum
    inside that one block.

    Args:
      p: [B, V] float32 non-negative (unnormalised) probabilities; each row has a positive entry.
      u: [B] float32 in [0, 1).
      block: block width (a power of two; 128 = a TPU lane row).

    Returns:
      [B] int32 indices, always of a positive entry of ``p``: zero-mass entries (truncated
      tokens) are never returned, also when fp32 rounding puts ``u * total`` at or past a
      block's or the row's total (the draw is then clamped to the last positive entry of the
      block / row). With ``u`` uniform this is an exact categorical draw up to the fp32 rounding
      of the sums.
    """
    B, V = p.shape
    b = _cdf_block(V, block)
    pad = (-V) % b
    if pad:
        p = jnp.pad(p, ((0, 0), (0, pad)))
    n = p.shape[1] // b
    pb = p.reshape(B, n, b)
    s = jnp.sum(pb, axis=-1)  # [B, n] block masses
    cdf = jnp.cumsum(s, axis=-1)
    x = u * cdf[:, -1]
    last_blk = n - 1 - jnp.argmax((s > 0)[:, ::-1], axis=-1)
    blk = jnp.minimum(jnp.sum(cdf <= x[:, None], axis=-1), last_blk)  # the first block with cdf > x
    prev = jnp.where(blk > 0, jnp.take_along_axis(cdf, jnp.maximum(blk - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    row = jnp.take_along_axis(pb, blk[:, None, None], axis=1)[:, 0]  # [B, b]
    inner = prev[:, None] + jnp.cumsum(row, axis=-1)
    last_in = b - 1 - jnp.argmax((row > 0)[:, ::-1], axis=-1)
    i = jnp.minimum(jnp.sum(inner <= x[:, None], axis=-1), last_in)
    return (blk * b + i).astype(jnp.int32)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample one token per row and return its log-prob under the sampling distribution.

    Args:
      logits: [B, V] (any float dtype; computed in float32).
      keys: [B, 2] uint32 raw PRNG keys, one per row.
      temperature: [B] float32; rows with ``temperature <= 0`` take the argmax (greedy) and
        report the log-prob under temperature 1.
      top_k: static; 0 = off. Applied first (HF order).
      top_p: static; 1.0 = off. Nucleus over the (top-k renormalised) distribution; the token
        that crosses ``top_p`` is kept. The kept set is :func:`jax_rl.sampling.kept_set`, the
        rule the learner's log-prob forward reproduces (``rollout.top_k`` / ``rollout.top_p``).

    Returns:
      ``(tokens [B] int32, logp [B] float32, kept_mass [B] float32)``. ``logp`` is the log-prob
      of the sampled token under the truncated, renormalised, tempered distribution;
      ``kept_mass`` is the tempered full-softmax mass of the kept set (1.0 when no truncation).
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    logp_full = jax.nn.log_softmax(logits / t[:, None], axis=-1)
    if truncates(top_k, top_p):
        # the learner's log-prob forward reproduces this with the same kept_set / log_kept_mass
        kept = kept_set(logp_full, top_k, top_p)
        lkm = log_kept_mass(logp_full, kept)
        kept_mass = jnp.exp(lkm)
        logp_s = jnp.where(kept, logp_full - lkm[:, None], -jnp.inf)
    else:
        kept_mass = jnp.ones(logits.shape[:1], jnp.float32)
        logp_s = logp_full
    # one uniform per row and an inverse-CDF lookup, not jax.random.categorical's V Gumbel draws
    # per row (threefry over [B, V] bits was ~1 ms of a ~13 ms 32-slot decode step on the CPU)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    sampled = inverse_cdf_index(jnp.exp(logp_s), u)
    tokens = jnp.where(greedy, jnp.argmax(logp_s, axis=-1), sampled).astype(jnp.int32)
    logp = jnp.take_along_axis(logp_s, tokens[:, None], axis=-1)[:, 0]
    return tokens, logp.astype(jnp.float32), kept_mass.astype(jnp.float32)


class StepOutput(NamedTuple):
    """What one decode step gives the RL path, per slot: the engine's typed output.

    :meth:`Qwen3Engine.decode` returns one ([B] leaves), :meth:`Qwen3Engine.generate_steps` one
    per step stacked on a leading axis ([n, B] leaves). Device arrays as the engine returns them;
    ``jax.device_get(out)`` brings the whole record to the host in one transfer (the generator does
    so once per engine call) and :meth:`at` picks one step of a stacked record. The names are the
    ones the :class:`rollout.types.Completion` and the Trajectory carry on (``behav_logp``,
    ``versions``, ``routes``), so the behaviour log-prob has one name from engine to loss.

    Attributes:
      token: int32 [B]: the token sampled this step (the slot's new pending token).
      valid: bool [B]: the slot was active and had room in its cache, i.e. ``token`` is real; an
        inactive slot (free, finished, held for its session's next turn) or a full one is False and
        its other fields are meaningless.
      generated: int32 [B]: tokens the slot has emitted since it was armed (this one included).
      behav_logp: float32 [B]: log mu of ``token`` under the distribution it was sampled from
        (temperature, then top-k / top-p truncation renormalised: :func:`sample_tokens`); the
        learner reproduces a truncation itself (:mod:`jax_rl.sampling`), so no kept mass travels.
      version: int32 [B]: the policy version of the params that produced ``token`` (the
        ``version`` the caller passed with those params), -1 where not ``valid``.
      route: None, or int32 [B, n_moe_layers, k] (``record_routes``): the experts each MoE layer
        chose for the token this step FED (the slot's previous pending token, at position
        ``length`` before the step), not for ``token``.
      moe_dropped: None, or int32 [B] (``counts_moe_drops``): the MoE token copies dropped for
        capacity on the token this step FED (summed over the MoE layers; 0 where not ``valid``).
    """

    token: Any
    valid: Any
    generated: Any
    behav_logp: Any
    version: Any
    route: Any = None
    moe_dropped: Any = None

    def at(self, i: int) -> "StepOutput":
        """Step ``i`` of a record stacked over steps (``generate_steps``): every leaf ``x[i]``."""
        return StepOutput(*(None if x is None else x[i] for x in self))


_RESULT_COLS = 4  # token | valid | n_generated | behav_logp bits (then the route columns)


def pack_result(out: StepOutput) -> jax.Array:
    """JetStream's ``ResultTokens.data`` of one step (traceable; :meth:`Qwen3Engine.generate`):
    int32 [B, 4 (+ n_moe_layers * k)]: token | valid | n_generated | behav_logp (float32 bit-cast
    to int32) | the fed token's route ids. JetStream's Driver reads the first three columns."""
    cols = [out.token.astype(jnp.int32), out.valid.astype(jnp.int32), out.generated.astype(jnp.int32),
            jax.lax.bitcast_convert_type(out.behav_logp.astype(jnp.float32), jnp.int32)]
    data = jnp.stack(cols, axis=1)
    if out.route is not None:
        data = jnp.concatenate([data, out.route.reshape(out.route.shape[0], -1).astype(jnp.int32)], axis=1)
    return data


def unpack_result(result: Any) -> dict[str, np.ndarray]:
    """One host transfer of a JetStream-adapter result (:meth:`Qwen3Engine.generate`'s
    ``ResultTokens`` or its ``data`` array) for ``jax-rl serve`` and tests of the adapter; the RL
    path reads :class:`StepOutput` instead.

    Returns a dict of numpy arrays [B]: ``tokens`` int32, ``valid`` bool, ``lengths`` int32
    (tokens generated so far in the slot), ``behav_logp`` float32; and ``routes`` int32
    [B, n_moe_layers * k] when the engine records routes (``record_routes``).
    """
    data = np.asarray(getattr(result, "data", result))  # a ResultTokens or its data array
    out = {
        "tokens": data[:, 0].astype(np.int32),
        "valid": data[:, 1].astype(bool),
        "lengths": data[:, 2].astype(np.int32),
        "behav_logp": np.ascontiguousarray(data[:, 3]).view(np.float32),
    }
    if data.shape[1] > _RESULT_COLS:
        out["routes"] = data[:, _RESULT_COLS:].astype(np.int32)
    return out


# ---------------------------------------------------------------------------- tokenizer glue


class JetStreamTokenizer(_tokenizer_api.Tokenizer):
    """Our ``ChatTokenizer`` behind JetStream's ``tokenizer_api.Tokenizer`` (for the Driver).

    ``bos_id`` is :data:`NO_BOS` (-1): JetStream prepends it to token requests; the engine's
    prefill drops it. ``stop_tokens`` = {<|im_end|>, <|endoftext|>}.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def encode(self, s: str, **kwargs: Any) -> tuple[Union[jax.Array, np.ndarray], int]:
        ids = np.asarray(self._tok.encode(s), dtype=np.int32)
        return _token_utils.pad_tokens(
            ids,
            NO_BOS,
            self.pad_id,
            is_bos=False,
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True),
        )

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return self._tok.decode([int(t) for t in token_ids if int(t) >= 0])

    @property
    def pad_id(self) -> int:
        return int(self._tok.pad_id)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_id)

    @property
    def bos_id(self) -> int:
        return NO_BOS

    @property
    def stop_tokens(self) -> set[int]:
        return {int(self._tok.im_end_id), int(self._tok.eos_id)}


# ---------------------------------------------------------------------------- engine


class Qwen3Engine(Engine):
    """JetStream ``Engine`` over ``jax_rl.models.qwen3.Qwen3ForCausalLM`` with log-probs.

    Args:
      model_config: ``Qwen3Config``.
      params: the model's params (an ``nnx.State`` as from ``nnx.split(model, nnx.Param)`` /
        ``Learner.get_params()``, fp32 or any float dtype). Cast to ``dtype`` by
        :meth:`load_params`; ``None`` = load later.
      slots: concurrent decode slots B (``max_concurrent_decodes``).
      max_cache_len: KV positions per slot S; a sequence (prompt + generated) holds at most S
        tokens in cache.
      max_prefill_length: advertised to JetStream's Driver (rounded up to a power of two
        >= 16, as JetStream's padding requires). Our own prefill accepts up to S - 1 cached
        tokens (+1 pending), bucketed to powers of two.
      dtype: compute + param + KV dtype, ``"bfloat16"`` (default) or ``"float32"``. Logits and
        sampling are always float32.
      temperature, top_p, top_k: default sampling; per-request temperature may override
        (``prefill(..., temperature=)``). top_p/top_k are engine-wide (static in the jit).
      mesh: optional ``('data','fsdp','tensor','expert')`` ``jax.sharding.Mesh``
        (:func:`jax_rl.sharding.make_mesh`; ``placement.rollout`` / ``rollout.mesh``): the engine
        runs sharded on it by the learner's logical rules (:data:`jax_rl.sharding.LOGICAL_RULES`):
        params by :func:`jax_rl.sharding.state_shardings` (dense: heads / MLP / vocab over
        ``tensor``; MoE experts over ``expert``), the KV cache [.., B, Hkv, ..] slots over
        ``data`` (and ``fsdp``) and kv heads over ``tensor`` (an axis that does not divide a
        dim is dropped, i.e. replicated: 1 kv head on ``tensor=2`` keeps a whole cache copy per
        tensor shard), the per-slot vectors over ``data``; every jitted step is traced under
        ``jax.set_mesh(mesh)`` (the model's activation constraints apply; ``moe_dispatch=
        "ragged"`` with ``expert`` > 1 takes the expert-parallel path,
        :mod:`jax_rl.models.expert_parallel`) with the decode state's shardings as
        out_shardings, so the donated state aliases. ``None`` (default): everything on
        ``jax.devices()[0]``, no ambient mesh (the colocated engine; its programs are unchanged).
      tokenizer: optional ``ChatTokenizer`` (needed only for JetStream serving / Driver).
      model_kwargs: extra kwargs to ``Qwen3ForCausalLM`` (e.g. ``moe_dispatch``).
      kv_per_layer: keep the decode cache as L per-layer buffers (``KVCache.per_layer``) and run
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
      record_routes: also return the expert ids every MoE layer chose (module docstring,
        "Routing replay"); ignored (False) for a dense model.
      quantize: ``rollout.quantize``: ``"none"`` (default: every float param cast to ``dtype``, no
        quantised program), or ``"int8"`` / ``"fp8"`` / ``"int4"``: weight-only per-output-channel
        quantisation of the decoder layers' matmul weights at every :meth:`load_params` (the weight
        sync), from the values as given (the learner's fp32 master weights). The engine stores them
        quantised (``qwix.QArray``: int8 / float8_e4m3fn / int4 values + float32 scales) and
        dequantises them to ``dtype`` inside each jitted program; embedding, LM head, router and
        norms stay in ``dtype``. :mod:`rollout.quantize` has the scheme, its error bound and what
        the memory saving is and is not.
    """

    def __init__(
        self,
        model_config: Any,
        params: Any = None,
        *,
        slots: int = 16,
        max_cache_len: int = 512,
        max_prefill_length: int = 256,
        dtype: Union[str, Any] = "bfloat16",
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        mesh: Optional[jax.sharding.Mesh] = None,
        tokenizer: Any = None,
        model_kwargs: Optional[dict] = None,
        kv_per_layer: Optional[bool] = None,
        record_routes: bool = False,
        quantize: str = "none",
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if max_cache_len < 2:
            raise ValueError(f"max_cache_len must be >= 2, got {max_cache_len}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if quantize not in QUANTIZE_MODES:
            raise ValueError(f"rollout.quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
        self.quantize = quantize
        """``rollout.quantize`` of this engine's weights (``"none"``: cast only)."""
        self.config = model_config
        self.dtype = _resolve_dtype(dtype)
        self._slots = int(slots)
        self.max_cache_len = int(max_cache_len)
        mp = _MIN_BUCKET
        while mp < max_prefill_length:
            mp *= 2
        self._max_prefill_length = mp
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self._mesh = mesh
        self.tokenizer = tokenizer
        self._seed_counter = itertools.count(1)
        self._lock = threading.Lock()
        self.record_routes = bool(record_routes) and bool(model_config.is_moe)
        self.route_shape = ((len(model_config.moe_layers), int(model_config.num_experts_per_tok))
                            if self.record_routes else None)
        """(n_moe_layers, k) of a recorded route, or None when the engine records none."""
        self.route_dtype = _q.route_dtype(model_config.num_experts) if self.record_routes else None
        """Compact host dtype of recorded expert ids (``jax_rl.models.qwen3.route_dtype``)."""

        kw = dict(model_kwargs or {})
        dt = self.dtype
        # a model that drops MoE token copies on its local path (rollout.moe_capacity_factor): the
        # decode step tells it which slots are active, so an idle slot takes no expert capacity
        self._decode_valid = bool(model_config.is_moe and kw.get("moe_capacity_all_paths")
                                  and kw.get("moe_capacity_factor") is not None)
        self.counts_moe_drops = bool(model_config.is_moe and kw.get("moe_capacity_factor") is not None)
        """The model can drop MoE token copies for capacity, and every program counts them per row
        (module doc, "MoE capacity drops")."""
        self.moe_copies_per_token = (len(model_config.moe_layers) * int(model_config.num_experts_per_tok)
                                     if model_config.is_moe else 0)
        """Token copies one token routes (MoE layers x k): the denominator of the drop fraction."""

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
            self._engine_abstract = jax.eval_shape(lambda p: quantize_params(p, quantize, dt), self._abstract_params)
            if self._param_shardings is not None:
                self._engine_shardings = quantized_shardings(self._engine_abstract, self._param_shardings)
        self._rest = jax.device_put(
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._abstract_rest), self._sharding
        )
        self._build_jits()
        self.params = self.load_params(params) if params is not None else None

    # ------------------------------------------------------------------ model plumbing
    def _model(self, params: Any) -> Any:
        return nnx.merge(self._graphdef, self._dequantized(params), self._rest)

    def _dequantized(self, params: Any) -> Any:
        """The model's params tree from the engine's (quantised weights dequantised to the compute
        dtype, in the calling program; a no-op when nothing is quantised)."""
        if self.quantize == "none":
            return params
        return dequantize_params(params, self.dtype)

    def _build_jits(self) -> None:
        S, B, dt = self.max_cache_len, self._slots, self.dtype
        top_k, top_p = self.top_k, self.top_p
        record = self.record_routes
        count = self.counts_moe_drops

        def prefill_fn(params, tokens, n):
            # tokens [1, P] int32, n int32 scalar: cache positions to fill (0 <= n <= P).
            model = self._model(params)
            P = tokens.shape[1]
            cache = model.init_cache(1, P, dtype=dt)
            out = model.prefill(tokens, jnp.reshape(n, (1,)).astype(jnp.int32), cache, return_expert_ids=record,
                                return_moe_drops=count)
            cache = out.cache
            keep = (jnp.arange(P) < n)[None, None, None, :, None]  # cache [L,1,K,P,H]
            # Zero the padded rows (jnp.where, not *, so NaNs from all-masked rows vanish too).
            k = jnp.where(keep, cache.k, jnp.zeros((), cache.k.dtype))
            v = jnp.where(keep, cache.v, jnp.zeros((), cache.v.dtype))
            res = (k, v)
            if record:  # [P, n_moe_layers, k] int32: the prompt positions' routes
                res += (_q.stack_routes(out.expert_ids)[0].astype(jnp.int32),)
            if count:  # int32 []: the prompt's MoE copies dropped for capacity
                res += (out.moe_drops.per_row[0],)
            return res

        per_layer = self._per_layer_cache

        def init_state_fn(params):
            model = self._model(params)
            cache = model.init_cache(B, S, dtype=dt)
            if per_layer:
                cache = cache.per_layer()
            return {
                "cache": cache,
                "tokens": jnp.zeros((B,), jnp.int32),
                "active": jnp.zeros((B,), bool),
                "keys": jnp.zeros((B, 2), jnp.uint32),
                "temperature": jnp.ones((B,), jnp.float32),
                "generated": jnp.zeros((B,), jnp.int32),
            }

        def insert_fn(k, v, n, token, seed, temperature, state, slot):
            cache = state["cache"]
            zero = jnp.zeros((), jnp.int32)
            if per_layer:  # prefix k/v [L,1,K,P,H] into each layer's k [B,K,H,S] / v [B,K,S,H] buffer
                idx = (slot, zero, zero, zero)
                new_k = tuple(jax.lax.dynamic_update_slice(c, k[i].swapaxes(2, 3).astype(c.dtype), idx)
                              for i, c in enumerate(cache.k))
                new_v = tuple(jax.lax.dynamic_update_slice(c, v[i].astype(c.dtype), idx)
                              for i, c in enumerate(cache.v))
            else:
                idx = (zero, slot, zero, zero, zero)
                new_k = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), idx)
                new_v = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), idx)
            new_cache = _replace_cache(cache, k=new_k, v=new_v, lengths=cache.lengths.at[slot].set(n))
            return {
                "cache": new_cache,
                "tokens": state["tokens"].at[slot].set(token),
                "active": state["active"].at[slot].set(True),
                "keys": state["keys"].at[slot].set(jax.random.PRNGKey(seed)),
                "temperature": state["temperature"].at[slot].set(temperature),
                "generated": state["generated"].at[slot].set(0),
            }

        def copy_slot_fn(state, src, dst, pending, seed, temperature):
            # slot dst takes slot src's cache row and length, armed with its own pending/seed/temperature
            cache = state["cache"]
            if per_layer:
                new_k = tuple(c.at[dst].set(c[src]) for c in cache.k)
                new_v = tuple(c.at[dst].set(c[src]) for c in cache.v)
            else:
                new_k, new_v = cache.k.at[:, dst].set(cache.k[:, src]), cache.v.at[:, dst].set(cache.v[:, src])
            cache = _replace_cache(cache, k=new_k, v=new_v, lengths=cache.lengths.at[dst].set(cache.lengths[src]))
            sel = jnp.arange(B) == dst
            fill = lambda x: jnp.full((B,), x)  # noqa: E731
            return arm(state, cache, sel, fill(pending), fill(seed), fill(temperature))

        def deactivate_fn(state, mask):
            # mask [B] bool: the slots to stop (their cache and lengths are left as they are)
            new = dict(state)
            new["active"] = state["active"] & ~mask
            return new

        def generate_fn(params, state, version=0):
            # one decode step for all slots -> (state, StepOutput); ``version`` (int32 scalar) tags
            # the step's tokens. An inactive slot (free, finished or held for its session's next
            # turn) feeds its pending token at min(length, S - 1), a position past every cached
            # token it holds, and keeps its length: its cached K/V (a held context) stay intact.
            model = self._model(params)
            cache = state["cache"]
            active = state["active"] & (cache.lengths < S)  # room to write the pending token
            lengths_in = jnp.minimum(cache.lengths, S - 1)
            dec = model.decode_step(state["tokens"], _replace_cache(cache, lengths=lengths_in),
                                    return_expert_ids=record, return_moe_drops=count,
                                    **({"valid": active} if self._decode_valid else {}))
            logits, cache = dec.logits, dec.cache
            pos = lengths_in + 1  # absolute position of the token being sampled
            keys = jax.vmap(jax.random.fold_in)(state["keys"], pos.astype(jnp.uint32))
            tok, logp, _kept = sample_tokens(logits, keys, state["temperature"], top_k=top_k, top_p=top_p)
            generated = state["generated"] + active.astype(jnp.int32)
            cache = _replace_cache(cache, lengths=jnp.where(active, lengths_in + 1, state["cache"].lengths))
            new_state = {
                "cache": cache,
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
                route=_q.stack_routes(dec.expert_ids).astype(jnp.int32) if record else None,  # [B, n_moe, k]
                # the fed token's MoE copies dropped for capacity [B] (0 if inactive)
                moe_dropped=jnp.where(active, dec.moe_drops.per_row, 0).astype(jnp.int32) if count else None,
            )
            return new_state, out

        def result_fn(params, state):
            # JetStream's adapter (``generate``): the typed step packed into ResultTokens' int32 rows
            new_state, out = generate_fn(params, state)
            return new_state, pack_result(out)

        def generate_steps_fn(params, state, n, version=0):
            # n steps of generate_fn in one on-device loop; every StepOutput leaf ([B, ...]) is
            # stacked on a new leading axis [n, ...]; quantised weights are dequantised once per
            # call, not once per step
            params = self._dequantized(params)
            return jax.lax.scan(lambda st, _: generate_fn(params, st, version), state, None, length=n)

        def arm(state, cache, sel, pending, seeds, temps):
            # the per-slot fields of the slots in ``sel`` [B] bool: pending token, key, temperature
            keys = jax.vmap(jax.random.PRNGKey)(seeds)
            return {
                "cache": cache,
                "tokens": jnp.where(sel, pending, state["tokens"]),
                "active": state["active"] | sel,
                "keys": jnp.where(sel[:, None], keys, state["keys"]),
                "temperature": jnp.where(sel, temps, state["temperature"]),
                "generated": jnp.where(sel, 0, state["generated"]),
            }

        def prefill_slots_fn(params, tokens, lengths, state, dest, pending, seeds, temps):
            # batched fresh prefill + bulk insert (prefill_slots): tokens [n, P], lengths [n] cache
            # positions per row; dest [B] int32: the row whose K/V slot b takes (-1: untouched), so
            # one row (a GRPO group's prompt) can fill several slots; pending/seeds/temps [B]
            model = self._model(params)
            n, P = tokens.shape
            out = model.prefill(tokens, lengths, model.init_cache(n, P, dtype=dt), return_expert_ids=record,
                                return_moe_drops=count)
            keep = (jnp.arange(P)[None, :] < lengths[:, None])[None, :, None, :, None]  # [1,n,1,P,1]
            k = jnp.where(keep, out.cache.k, jnp.zeros((), out.cache.k.dtype))  # padding zeroed (no NaN)
            v = jnp.where(keep, out.cache.v, jnp.zeros((), out.cache.v.dtype))
            sel = dest >= 0
            rows = jnp.maximum(dest, 0)
            kg, vg = k[:, rows], v[:, rows]  # [L,B,K,P,H]
            cache = state["cache"]
            if per_layer:
                s5 = sel[:, None, None, None]
                new_k = tuple(c.at[..., :P].set(jnp.where(s5, kg[i].swapaxes(2, 3).astype(c.dtype), c[..., :P]))
                              for i, c in enumerate(cache.k))
                new_v = tuple(c.at[:, :, :P].set(jnp.where(s5, vg[i].astype(c.dtype), c[:, :, :P]))
                              for i, c in enumerate(cache.v))
            else:
                s5 = sel[None, :, None, None, None]
                new_k = cache.k.at[:, :, :, :P].set(jnp.where(s5, kg.astype(cache.k.dtype), cache.k[:, :, :, :P]))
                new_v = cache.v.at[:, :, :, :P].set(jnp.where(s5, vg.astype(cache.v.dtype), cache.v[:, :, :, :P]))
            cache = _replace_cache(cache, k=new_k, v=new_v, lengths=jnp.where(sel, lengths[rows], cache.lengths))
            routes = _q.stack_routes(out.expert_ids).astype(jnp.int32) if record else None  # [n,P,n_moe,k]
            return arm(state, cache, sel, pending, seeds, temps), (routes, out.moe_drops.per_row if count else None)

        def extend_slots_fn(params, state, tokens, starts, lengths, slots, pending, seeds, temps, window=None):
            # append-prefill into the slots' own cached rows: tokens [n, T] at positions starts + t,
            # lengths [n]; slots [n] (B for a padding row: read clamped, written nowhere). window
            # (static; None = S): only cache positions [0, window) are read, attended to and written
            # back (starts + lengths <= window; the positions past it are left as they are)
            model = self._model(params)
            cache = state["cache"]
            W = S if window is None else int(window)
            src = jnp.minimum(slots, B - 1)
            if per_layer:
                rk = jnp.stack([c[src][..., :W].swapaxes(2, 3) for c in cache.k])  # [L,n,K,W,H]
                rv = jnp.stack([c[src][:, :, :W] for c in cache.v])
            else:
                rk, rv = cache.k[:, src, :, :W], cache.v[:, src, :, :W]
            out = model.extend(tokens, starts, lengths, _q.StackedKVCache(k=rk, v=rv, lengths=starts),
                               return_expert_ids=record, return_moe_drops=count)
            nk, nv = out.cache.k, out.cache.v
            if per_layer:
                new_k = tuple(c.at[slots, :, :, :W].set(nk[i].swapaxes(2, 3).astype(c.dtype), mode="drop")
                              for i, c in enumerate(cache.k))
                new_v = tuple(c.at[slots, :, :W].set(nv[i].astype(c.dtype), mode="drop")
                              for i, c in enumerate(cache.v))
            else:
                new_k = cache.k.at[:, slots, :, :W].set(nk.astype(cache.k.dtype), mode="drop")
                new_v = cache.v.at[:, slots, :, :W].set(nv.astype(cache.v.dtype), mode="drop")
            sel = jnp.zeros((B,), bool).at[slots].set(True, mode="drop")
            spread = lambda x, fill: jnp.full((B,), fill, x.dtype).at[slots].set(x, mode="drop")  # noqa: E731
            cache = _replace_cache(cache, k=new_k, v=new_v,
                                   lengths=jnp.where(sel, spread(starts + lengths, 0), cache.lengths))
            routes = _q.stack_routes(out.expert_ids).astype(jnp.int32) if record else None  # [n,T,n_moe,k]
            return (arm(state, cache, sel, spread(pending, 0), spread(seeds, 0), spread(temps, 1.0)),
                    (routes, out.moe_drops.per_row if count else None))

        if not self._sharded:  # the colocated single-device engine: programs as they always were
            self._prefill_slots_jit = jax.jit(prefill_slots_fn, donate_argnums=(3,))
            self._extend_slots_jit = jax.jit(extend_slots_fn, donate_argnums=(1,), static_argnames=("window",))
            self._prefill_jit = jax.jit(prefill_fn)
            self._init_state_jit = jax.jit(init_state_fn)
            self._insert_jit = jax.jit(insert_fn, donate_argnums=(6,))
            self._deactivate_jit = jax.jit(deactivate_fn, donate_argnums=(0,))
            self._copy_slot_jit = jax.jit(copy_slot_fn, donate_argnums=(0,))
            self._decode_jit = jax.jit(generate_fn, donate_argnums=(1,))
            self._generate_jit = jax.jit(result_fn, donate_argnums=(1,))
            self._generate_steps_jit = jax.jit(generate_steps_fn, static_argnums=(2,), donate_argnums=(1,))
            return
        # sharded: explicit out_shardings (the decode state keeps its layout step after step, so
        # the donated state aliases the new one); inputs come committed (params / state / prefix)
        rep = self._sharding
        with jax.set_mesh(self._mesh):
            st = self.state_shardings = self._decode_state_shardings(jax.eval_shape(init_state_fn, self._abstract_params))
        kv = self._named(_CACHE_NAMES, (self.config.num_hidden_layers, 1, self.config.num_key_value_heads,
                                        self.max_cache_len, self.config.head_dim))
        self._prefill_jit = jax.jit(prefill_fn, out_shardings=(kv, kv) + (rep,) * (int(record) + int(count)))
        self._init_state_jit = jax.jit(init_state_fn, out_shardings=st)
        self._insert_jit = jax.jit(insert_fn, donate_argnums=(6,), out_shardings=st)
        self._deactivate_jit = jax.jit(deactivate_fn, donate_argnums=(0,), out_shardings=st)
        self._copy_slot_jit = jax.jit(copy_slot_fn, donate_argnums=(0,), out_shardings=st)
        self._decode_jit = jax.jit(generate_fn, donate_argnums=(1,), out_shardings=(st, rep))
        self._generate_jit = jax.jit(result_fn, donate_argnums=(1,), out_shardings=(st, rep))
        self._generate_steps_jit = jax.jit(generate_steps_fn, static_argnums=(2,), donate_argnums=(1,),
                                           out_shardings=(st, rep))
        self._prefill_slots_jit = jax.jit(prefill_slots_fn, donate_argnums=(3,), out_shardings=(st, rep))
        self._extend_slots_jit = jax.jit(extend_slots_fn, donate_argnums=(1,), static_argnames=("window",),
                                         out_shardings=(st, rep))

    def _named(self, names: Sequence[Optional[str]], shape: Sequence[int]) -> Any:
        """NamedSharding on the engine's mesh of an array ``shape`` with logical ``names``."""
        return jax.sharding.NamedSharding(self._mesh, logical_to_pspec(names, shape=shape, mesh=self._mesh))

    def _decode_state_shardings(self, abstract_state: dict) -> dict:
        """Shardings of the decode state (module docstring table) on the engine's mesh: k/v by
        the ``cache_*`` logical names (slots over ``data``/``fsdp``, kv heads over ``tensor``),
        every per-slot vector [B, ...] by ``cache_batch``."""
        cache = abstract_state["cache"]
        if cache.is_per_layer:
            k = tuple(self._named(_CACHE_K_LAYER_NAMES, a.shape) for a in cache.k)
            v = tuple(self._named(_CACHE_NAMES[1:], a.shape) for a in cache.v)
        else:
            k, v = self._named(_CACHE_NAMES, cache.k.shape), self._named(_CACHE_NAMES, cache.v.shape)
        out = {key: self._named(("cache_batch",) + (None,) * (a.ndim - 1), a.shape)
               for key, a in abstract_state.items() if key != "cache"}
        out["cache"] = _replace_cache(cache, k=k, v=v, lengths=self._named(("cache_batch",), cache.lengths.shape))
        return out

    def _in_mesh(self) -> Any:
        """``jax.set_mesh(mesh)`` for a sharded engine (thread-local; each engine's thread its own), a
        no-op context for the colocated one."""
        return jax.set_mesh(self._mesh) if self._sharded else contextlib.nullcontext()

    # ------------------------------------------------------------------ Engine API
    def load_params(self, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Cast float leaves of ``params`` to the compute dtype and place them on the device(s).

        ``params``: an ``nnx.State`` (or matching pytree, e.g. the pure dict of numpy leaves the Ray
        runtime ships) of the model's ``nnx.Param``s, in the engine's or the learner's layer layout
        (stacked ``[L, ...]`` layers are unstacked for a ``kv_per_layer`` engine); with no argument,
        returns the engine's current params.

        The weight sync of a publish (``Generator.update_params`` -> here; ``weight_sync_cast_s``):

        * colocated engine (no ``mesh``): an eager cast, then ``jax.device_put`` to
          ``jax.devices()[0]`` (unchanged).
        * sharded engine (``mesh``), device params (``jax.Array`` leaves, e.g. the learner's on its
          mesh): ONE jitted program, built once and reused every publish (jit caches it by the
          input's tree and shardings), casts to ``dtype`` and re-lays the layers where the params
          ARE (the learner's devices: the learner's mesh does the cast, each device its own shard,
          so the bytes that travel are already ``rollout.dtype``); then ``jax.device_put`` to the
          engine's param shardings (:attr:`param_shardings`) moves each shard to the engine's
          devices. Two steps because a ``jit`` runs on one device set: its out_shardings cannot
          name the engine's devices when they are not the learner's (XLA would refuse the
          mismatched device assignment); ``device_put`` between device sets is a device-to-device
          copy (ICI on a TPU slice), and on the same devices a reshard.
        * sharded engine, host params (numpy leaves): cast on the host, then ``device_put``.

        Multi-host (what runs where): every process runs its own engines on its own devices
        (``Roles.local_engines``), and this method runs in the process that owns the engine. With
        a learner mesh that spans processes its params are not fully addressable: the jitted cast
        is an SPMD program every process must run (they do: each publishes after the same train
        step), but in jax 0.10.2 ``device_put`` of a non-addressable array onto another device set
        is only supported as a "cross-host transfer" (``jax._src.dispatch``:
        same HLO sharding on both sides, a backend with ``supports_cross_host_transfers`` or the
        ``jax_cross_host_transfer_socket_address`` DCN flags), and ``jax.experimental.transfer``
        (a ``TransferServer`` that ``pull``s a pytree by id over DCN) is the general tool. The
        multi-process runtime therefore does the cross-process part before this method:
        :mod:`jax_rl.weight_sync` reshards and casts on the learner's devices into this engine's layout and
        ``device_put``s each shard across processes, and a tree that arrives already in this engine's
        tree, dtypes and shardings is taken as is (no copy). Other non-addressable params raise
        ValueError; host params (``Learner.get_params(host=True)``, the Ray path) work on every host.

        Raises:
            ValueError: a tree or leaf-shape mismatch; a sharded engine given device params that this
                process cannot address in full.
        """
        if params is None:
            if self.params is None:
                raise ValueError("Qwen3Engine has no params; pass them to load_params(params)")
            return self.params
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        if self._already_placed(params):  # laid out, cast and placed by the sender (jax_rl.weight_sync)
            return params
        dt = self.dtype
        if self.quantize != "none":  # one jitted re-layout + quantisation where the params are
            out = self._cast_jit(params)
            return self._place(out) if self._sharded else jax.device_put(out, self._sharding)
        if not self._sharded:
            def cast(x):
                x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
                return x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x

            return jax.device_put(self._layout(jax.tree.map(cast, params)), self._sharding)
        leaves = jax.tree.leaves(params)
        if leaves and all(isinstance(x, jax.Array) for x in leaves):
            far = [x for x in leaves if not x.is_fully_addressable]
            if far:
                raise ValueError(
                    f"params live on devices of other processes ({far[0].sharding}); a sharded rollout engine "
                    "takes device params this process addresses in full, or host params (multi-host weight sync "
                    "is not implemented yet)")
            out = self._cast_jit(params)
        else:
            out = self._layout(jax.tree.map(
                lambda x: (lambda a: a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a)(np.asarray(x)),
                params))
        return self._place(out)

    def _already_placed(self, params: Any) -> bool:
        """True when ``params`` already are this engine's tree, leaf for leaf with its shapes, dtypes and
        shardings (a multi-process publish, :mod:`jax_rl.weight_sync`, sends them so): taken as is."""
        want = self._engine_abstract
        if jax.tree.structure(params) != jax.tree.structure(want):
            return False
        sh = (jax.tree.leaves(self._engine_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
              if self._sharded else None)
        for i, (x, a) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(want))):
            if not isinstance(x, jax.Array) or x.shape != a.shape or x.dtype != a.dtype:
                return False
            if not (x.sharding == sh[i] if sh is not None else x.sharding.device_set == self._sharding.device_set):
                return False
        return True

    def _place(self, tree: Any) -> Any:
        """``device_put`` of a tree shaped like the engine's params to :attr:`param_shardings`."""
        placed = jax.device_put(jax.tree.leaves(tree), jax.tree.leaves(self._engine_shardings))
        return jax.tree.unflatten(jax.tree.structure(self._engine_abstract), placed)

    @property
    def param_shardings(self) -> Any:
        """The engine's param shardings (an ``nnx.State`` of NamedShardings like its params);
        ``None`` for the colocated engine (one device)."""
        return self._param_shardings

    @property
    def abstract_params(self) -> Any:
        """The params its programs read, as ``jax.ShapeDtypeStruct`` (nothing allocated): the
        model's param tree, with quantised leaves under ``quantize``. For AOT lowering
        (:func:`jax_rl.tpu.compile_rollout`, tests)."""
        return self._engine_abstract

    @property
    def programs(self) -> dict[str, Any]:
        """The engine's jitted programs by name, for AOT ``lower(...).compile()`` (``jax-rl compile``,
        :func:`jax_rl.tpu.compile_rollout`); ``state`` is the decode state (donated where it is an
        argument), B = ``slots``, S = ``max_cache_len``:

        * ``init_state`` ``(params) -> state``;
        * ``generate`` ``(params, state[, version int32]) -> (state, StepOutput)``: the RL path's
          decode step (:meth:`decode`); ``decode_steps`` ``(params, state, n static[, version])``
          its ``n``-step scan (:meth:`generate_steps`); ``generate_result`` the same step packed
          into JetStream's rows (:meth:`generate`, the serving adapter);
        * ``prefill_slots`` ``(params, tokens int32 [n, P], lengths int32 [n], state, dest int32
          [B], pending int32 [B], seeds uint32 [B], temps float32 [B]) -> (state, (routes,
          moe_dropped))``: the batched fresh prefill + bulk insert (:meth:`prefill_slots`; each of
          routes / moe_dropped None unless ``record_routes`` / ``counts_moe_drops``);
        * ``append_prefill`` ``(params, state, tokens int32 [n, T], starts int32 [n], lengths int32
          [n], slots int32 [n], pending int32 [n], seeds uint32 [n], temps float32 [n], *, window
          static int = None) -> (state, (routes, moe_dropped))``: the append-prefill of new tokens
          onto slots' kept K/V (an episode's next turn), reading and writing only cache positions
          ``[0, window)`` (``starts + lengths <= window``; None: all S, the largest program);
        * ``copy_slot`` ``(state, src, dst, pending, seed, temperature) -> state``; ``insert``
          ``(k, v, n, token, seed, temperature, state, slot) -> state``; ``free_slots`` ``(state,
          mask bool [B]) -> state``;
        * ``prefill`` ``(params, tokens int32 [1, P], n int32) -> KV rows (+ routes)``: batch-1
          prefill (JetStream's API, the prefix cache's entries).
        :func:`jax_rl.tpu.compile_rollout` lowers ``prefill``, ``append_prefill`` and ``generate``."""
        return {"prefill": self._prefill_jit, "init_state": self._init_state_jit, "generate": self._decode_jit,
                "decode_steps": self._generate_steps_jit, "generate_result": self._generate_jit,
                "prefill_slots": self._prefill_slots_jit, "append_prefill": self._extend_slots_jit,
                "copy_slot": self._copy_slot_jit, "insert": self._insert_jit, "free_slots": self._deactivate_jit}

    @functools.cached_property
    def _cast_jit(self) -> Any:
        """The sharded engine's compiled cast + layer re-layout (built once, reused every publish);
        for a quantising engine (either kind) the re-layout then the quantisation
        (:func:`rollout.quantize.quantize_params` of the values as given)."""
        dt = self.dtype
        if self.quantize != "none":
            mode = self.quantize
            return jax.jit(lambda params: quantize_params(self._layout(params), mode, dt))

        def cast_layout(params):
            return self._layout(jax.tree.map(
                lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params))

        return jax.jit(cast_layout)

    def _layout(self, out: Any) -> Any:
        """(Already cast) params ``out`` in the engine's tree: stacked layers unstacked when it runs
        unrolled ones, State-vs-dict containers matched. Raises ValueError on a tree or shape
        mismatch. Traceable (the sharded engine jits it with the cast)."""
        want = jax.tree.structure(self._abstract_params)
        if self._unstack_layers and jax.tree.structure(out) != want:
            out = self._unstacked(out)
        if jax.tree.structure(out) != want:
            try:  # tolerate State-vs-pure-dict containers with the same leaves
                out = jax.tree.unflatten(want, jax.tree.leaves(out))
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"params do not match the model's structure: {e}") from e
        for got, exp in zip(jax.tree.leaves(out), jax.tree.leaves(self._abstract_params)):
            if got.shape != exp.shape:
                raise ValueError(f"param shape {got.shape} != model's {exp.shape}")
        return out

    def _unstacked(self, params: Any) -> Any:
        """Stacked ``[L, ...]`` layer params (scan_layers layout) -> the engine's unrolled State."""
        pure = params.to_pure_dict() if isinstance(params, nnx.State) else params
        if not isinstance(pure, dict) or "layers" not in pure:
            return params  # not the stacked layout: the structure check below reports it
        target = jax.tree.map(lambda a: a, self._abstract_params)
        target.replace_by_pure_dict(_q.unstack_layer_params(pure, self._unstack_layers))
        return target

    def init_decode_state(self, *args: Any, **kwargs: Any) -> dict:
        """Empty decode state for all slots (see module docstring for its layout)."""
        params = kwargs.get("params", self.params)
        if params is None:
            params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self._engine_abstract)
            if self._sharded:
                params = self._place(params)
        with self._in_mesh():
            return self._init_state_jit(params)

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Optional[Any] = None,
        padded_tokens: Union[jax.Array, np.ndarray, Sequence[int]],
        true_length: int,
        seed: Optional[int] = None,
        temperature: Optional[float] = None,
    ) -> dict:
        """KV cache of ``padded_tokens[:true_length][:-1]``; the last token stays pending.

        Leading negative ids (JetStream's BOS placeholder :data:`NO_BOS`) are dropped.

        Args:
          params: engine params (from :meth:`load_params`).
          padded_tokens: [T] int token ids (padding after ``true_length`` is ignored).
          true_length: number of real tokens.
          seed: sampling seed of this request (default: a fresh engine-local counter value).
          temperature: per-request temperature (default: the engine's; <= 0 = greedy).

        Returns:
          Prefix dict: ``k``, ``v`` [L,1,Hkv,P,Dh] (P = power-of-two bucket), ``length`` int,
          ``token`` int (pending), ``seed`` int, ``temperature`` float; with ``record_routes``
          ``routes`` int32 [length, n_moe_layers, k] (numpy); with ``counts_moe_drops``
          ``moe_dropped`` int (the prompt's MoE copies dropped for capacity).

        Raises:
          NotImplementedError: ``existing_prefix`` given. ValueError: empty prompt or prompt
          longer than ``max_cache_len``.
        """
        if existing_prefix is not None:
            raise NotImplementedError("existing_prefix (chunked prefill) is not supported")
        toks = np.asarray(padded_tokens).reshape(-1)[: int(true_length)].astype(np.int64)
        start = 0
        while start < len(toks) and toks[start] < 0:
            start += 1
        toks = toks[start:]
        n_tok = len(toks)
        if n_tok == 0:
            raise ValueError("prefill needs at least one token")
        if n_tok > self.max_cache_len:
            raise ValueError(f"prompt of {n_tok} tokens exceeds max_cache_len={self.max_cache_len}")
        n = n_tok - 1
        P = prefill_bucket(max(n, 1), self.max_cache_len)
        buf = np.zeros((1, P), np.int32)
        buf[0, :n] = toks[:n]
        with self._in_mesh():
            res = self._prefill_jit(params, jnp.asarray(buf), jnp.int32(n))
        k, v = res[0], res[1]
        if seed is None:
            with self._lock:
                seed = next(self._seed_counter)
        prefix = {
            "k": k,
            "v": v,
            "length": n,
            "token": int(toks[-1]),
            "seed": int(seed) & 0xFFFFFFFF,
            "temperature": float(self.temperature if temperature is None else temperature),
        }
        if self.record_routes:
            prefix["routes"] = np.asarray(res[2])[:n]  # [n, n_moe_layers, k] int32
        if self.counts_moe_drops:
            prefix["moe_dropped"] = int(res[-1])
        return prefix

    def insert(self, prefix: dict, decode_state: dict, slot: int) -> dict:
        """Copy ``prefix`` into row ``slot`` of ``decode_state`` (donated) and arm the slot."""
        if not 0 <= int(slot) < self._slots:
            raise ValueError(f"slot {slot} out of range [0, {self._slots})")
        args = (prefix["k"], prefix["v"], jnp.int32(prefix["length"]), jnp.int32(prefix["token"]),
                jnp.uint32(prefix["seed"]), jnp.float32(prefix["temperature"]), decode_state, jnp.int32(slot))
        with self._in_mesh():
            return self._insert_jit(*args)

    def prefill_slots(self, params: Any, decode_state: dict, rows: Sequence["SlotPrefill"]
                      ) -> tuple[dict, list["PrefillResult"]]:
        """Prefill many requests into their slots: the RL path's batched prefill + insert.

        Rows with ``start == 0`` (fresh) are grouped by length bucket P
        (:func:`prefill_bucket` of their cache positions) and each group runs ONE jitted program:
        a prefill over ``[n, P]`` rows with per-row lengths, then a bulk insert that copies each
        row's K/V into its slots. Fresh rows with the same tokens (the G samples of a GRPO group)
        are prefilled once and their K/V copied into every one of their slots, each slot armed
        with its own seed and temperature (a token's key depends on its seed and position only,
        so the samples equal G separate prefills). Rows with ``start > 0`` (append-prefill: the
        slot already holds the K/V of ``tokens[:start]``, e.g. an episode's earlier turns) are
        grouped by the bucket T of their new positions and the bucket W of their own end position
        ``len(tokens) - 1`` and run through :meth:`Qwen3ForCausalLM.extend` on a window of the
        slots' own rows, one program per group: only cache positions ``[0, W)`` are read, attended
        to and written back (the rest of the row is left as it is), so an append costs in
        proportion to the row's live length, not to ``max_cache_len``. W is the row's own (not the
        longest row's of the call), so a row's numerics do not depend on what shares its call.

        Compiled shapes: (row bucket n, length bucket) per program, n a power of two capped at
        ``slots`` and the length bucket a power of two >= 16 capped at ``max_cache_len``, so at most
        ``ceil(log2 slots) + 1`` times ``log2(max_cache_len / 16) + 1`` fresh programs; the
        append-prefill has one program per (T, W) pair with T <= W, both buckets of that set, so
        at most k (k + 1) / 2 for the k length buckets. The
        append-prefill always runs ``slots`` rows: its per-row
        values changed at fp32 rounding with the row count on XLA:CPU, and which requests share a
        call depends on thread timing, so a row's K/V and log-probs are its own only that way
        (bit-identical whatever shares the call; a resumed run reproduces the straight one). A
        capacity-dropping MoE engine (``counts_moe_drops``) keeps the row bucket there: its rows
        share the experts' capacity anyway. Padding rows and positions are inert (no slot written,
        no MoE capacity taken).

        Args:
          params: engine params (from :meth:`load_params`).
          decode_state: the decode state (donated).
          rows: :class:`SlotPrefill` rows; distinct slots; ``1 <= len(tokens) <= max_cache_len``
            and ``start < len(tokens)``.

        Returns:
          ``(new_state, results)``: one :class:`PrefillResult` per row, in order (its
          ``moe_dropped`` an int with ``counts_moe_drops``, else None).

        Raises:
          ValueError: a slot out of range or used twice, an empty or too long row, a bad start.
        """
        rows = list(rows)
        used: set[int] = set()
        for r in rows:
            n_tok, slot = len(r.tokens), int(r.slot)
            if not 0 <= slot < self._slots or slot in used:
                raise ValueError(f"prefill_slots: slot {slot} out of range [0, {self._slots}) or used twice")
            used.add(slot)
            if not 1 <= n_tok <= self.max_cache_len:
                raise ValueError(f"prefill_slots: a row of {n_tok} tokens (1..max_cache_len={self.max_cache_len})")
            if not 0 <= int(r.start) < n_tok:
                raise ValueError(f"prefill_slots: start={r.start} outside [0, {n_tok}) tokens")
        results: list[dict] = [dict(prefill_tokens=0, shared=False) for _ in rows]
        fresh: dict[int, list[int]] = {}
        ext: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(rows):
            m = len(r.tokens) - 1 - int(r.start)
            bucket = prefill_bucket(max(m, 1), self.max_cache_len)
            if int(r.start) == 0:
                fresh.setdefault(bucket, []).append(i)
            else:  # (new-token bucket T, window W: the bucket of the row's own end position)
                ext.setdefault((bucket, prefill_bucket(len(r.tokens) - 1, self.max_cache_len)), []).append(i)
        state = decode_state
        for P, idx in sorted(fresh.items()):
            state = self._prefill_group(params, state, rows, idx, P, results)
        for (T, W), idx in sorted(ext.items()):
            state = self._extend_group(params, state, rows, idx, T, results, window=W)
        return state, [PrefillResult(int(r["prefill_tokens"]), bool(r["shared"]), r.get("routes"), r.get("moe_dropped"))
                       for r in results]

    def copy_slot(self, decode_state: dict, src: int, dst: int, *, token: int, seed: int,
                  temperature: Optional[float] = None) -> dict:
        """Slot ``dst`` takes slot ``src``'s K/V row and length (one device copy of a slot's row),
        armed with its own pending ``token``, ``seed`` and ``temperature`` (None: the engine's):
        the G samples of a group whose first sample was just prefilled into ``src``. Donates the
        state. Raises ValueError for a slot out of range or ``src == dst``."""
        src, dst = int(src), int(dst)
        if not (0 <= src < self._slots and 0 <= dst < self._slots) or src == dst:
            raise ValueError(f"copy_slot: slots {src} -> {dst} (range [0, {self._slots}), distinct)")
        t = self.temperature if temperature is None else float(temperature)
        with self._in_mesh():
            return self._copy_slot_jit(decode_state, jnp.int32(src), jnp.int32(dst), jnp.int32(token),
                                       jnp.uint32(int(seed) & 0xFFFFFFFF), jnp.float32(t))

    def _row_bucket(self, n: int) -> int:
        b = 1
        while b < n:
            b *= 2
        return min(b, self._slots)

    def _prefill_group(self, params: Any, state: dict, rows: list, idx: list[int], P: int,
                       results: list[dict]) -> dict:
        uniq: dict[tuple, int] = {}  # tokens -> its row among the program's rows
        owner: list[int] = []
        B = self._slots
        dest = np.full((B,), -1, np.int32)
        pending = np.zeros((B,), np.int32)
        seeds = np.zeros((B,), np.uint32)
        temps = np.ones((B,), np.float32)
        for i in idx:
            r = rows[i]
            key = tuple(int(t) for t in r.tokens)
            j = uniq.get(key)
            if j is None:
                j = uniq[key] = len(owner)
                owner.append(i)
                results[i]["prefill_tokens"] = len(key) - 1
            else:
                results[i]["shared"] = True
            slot = int(r.slot)
            dest[slot], pending[slot] = j, key[-1]
            seeds[slot] = int(r.seed) & 0xFFFFFFFF
            temps[slot] = self.temperature if r.temperature is None else float(r.temperature)
        n = len(owner)
        nb = self._row_bucket(n)
        buf = np.zeros((nb, P), np.int32)
        lens = np.zeros((nb,), np.int32)
        for j, i in enumerate(owner):
            t = rows[i].tokens
            lens[j] = len(t) - 1
            buf[j, : lens[j]] = np.asarray(t[:-1], np.int32)
        with self._in_mesh():
            state, (routes, drops) = self._prefill_slots_jit(params, jnp.asarray(buf), jnp.asarray(lens), state,
                                                             jnp.asarray(dest), jnp.asarray(pending),
                                                             jnp.asarray(seeds), jnp.asarray(temps))
        if self.counts_moe_drops:
            drops = np.asarray(drops)
            for i in idx:
                results[i]["moe_dropped"] = 0 if results[i]["shared"] else int(drops[int(dest[int(rows[i].slot)])])
        if self.record_routes:
            routes = np.asarray(routes)
            for i in idx:
                j = int(dest[int(rows[i].slot)])
                results[i]["routes"] = routes[j, : int(lens[j])]
        return state

    def _extend_group(self, params: Any, state: dict, rows: list, idx: list[int], T: int,
                      results: list[dict], window: Optional[int] = None) -> dict:
        B = self._slots
        # B rows (padding rows write nowhere), not the row bucket of len(idx): on XLA:CPU an
        # append-prefill row's values changed at fp32 rounding with the call's row count, and which
        # requests share a call depends on when they reached the generator (thread timing), so a
        # request's K/V and log-probs depended on its neighbours (a resumed K=0 run differed from the
        # straight one). One program per T bucket; a row's numerics are its own (test_prefill.py,
        # test_a_rows_prefill_is_bit_identical_whatever_shares_its_call). Except with MoE capacity
        # drops (counts_moe_drops): there the rows of a call share the experts' capacity, which the
        # program's shape sets (module doc), so a row's result depends on its call whatever the
        # padding, and B padding rows would only raise the capacity: the row bucket stays.
        nb = self._row_bucket(len(idx)) if self.counts_moe_drops else B
        buf = np.zeros((nb, T), np.int32)
        starts = np.zeros((nb,), np.int32)
        lens = np.zeros((nb,), np.int32)
        slots = np.full((nb,), B, np.int32)  # padding rows write nowhere
        pending = np.zeros((nb,), np.int32)
        seeds = np.zeros((nb,), np.uint32)
        temps = np.ones((nb,), np.float32)
        for j, i in enumerate(idx):
            r = rows[i]
            st = int(r.start)
            new = np.asarray(r.tokens[st:-1], np.int32)
            starts[j], lens[j], slots[j], pending[j] = st, len(new), int(r.slot), int(r.tokens[-1])
            buf[j, : len(new)] = new
            seeds[j] = int(r.seed) & 0xFFFFFFFF
            temps[j] = self.temperature if r.temperature is None else float(r.temperature)
            results[i]["prefill_tokens"] = len(new)
        with self._in_mesh():
            state, (routes, drops) = self._extend_slots_jit(params, state, jnp.asarray(buf), jnp.asarray(starts),
                                                            jnp.asarray(lens), jnp.asarray(slots), jnp.asarray(pending),
                                                            jnp.asarray(seeds), jnp.asarray(temps),
                                                            window=None if window == self.max_cache_len else window)
        if self.counts_moe_drops:
            drops = np.asarray(drops)
            for j, i in enumerate(idx):
                results[i]["moe_dropped"] = int(drops[j])
        if self.record_routes:
            routes = np.asarray(routes)
            for j, i in enumerate(idx):
                results[i]["routes"] = routes[j, : int(lens[j])]
        return state

    def free_slot(self, decode_state: dict, slot: int) -> dict:
        """Deactivate ``slot`` (not part of the 0.2.2 API). Donates state."""
        return self.free_slots(decode_state, [int(slot)])

    def free_slots(self, decode_state: dict, slots: Sequence[int]) -> dict:
        """Deactivate ``slots`` in one call (the generator's finished and held slots): they stop
        decoding, and their cached K/V and lengths stay as they are (an inactive slot's decode
        writes only past its cached positions: :class:`StepOutput`, module docstring). Donates
        the state. Raises ValueError for a slot out of range."""
        mask = np.zeros((self._slots,), bool)
        for s_ in slots:
            if not 0 <= int(s_) < self._slots:
                raise ValueError(f"slot {s_} out of range [0, {self._slots})")
            mask[int(s_)] = True
        with self._in_mesh():
            return self._deactivate_jit(decode_state, jnp.asarray(mask))

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
        with self._in_mesh():
            return self._decode_jit(params, decode_state, jnp.int32(version))

    def generate(self, params: Any, decode_state: dict) -> tuple[dict, Any]:
        """JetStream 0.2.2's ``generate``: :meth:`decode` packed into ``ResultTokens`` (the adapter
        for JetStream's Driver and ``jax-rl serve``; ``data`` int32 [B, 4 (+ route columns)], see
        :func:`pack_result` / :func:`unpack_result`). Donates ``decode_state``."""
        with self._in_mesh():
            state, data = self._generate_jit(params, decode_state)
        return state, ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1)

    def generate_steps(self, params: Any, decode_state: dict, n: int, *, version: int = 0) -> tuple[dict, StepOutput]:
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
            raise ValueError(f"generate_steps needs n >= 1, got {n}")
        with self._in_mesh():
            return self._generate_steps_jit(params, decode_state, n, jnp.int32(version))

    def get_prefix_destination_sharding(self) -> Any:
        return self._sharding

    def get_tokenizer(self) -> Any:
        name = getattr(self.tokenizer, "name", "") if self.tokenizer is not None else ""
        return _tokenizer_pb2.TokenizerParameters(path=str(name), extra_ids=0)

    def build_tokenizer(self, metadata: Any) -> JetStreamTokenizer:
        """Our tokenizer behind JetStream's Tokenizer API. Raises ValueError without one."""
        if self.tokenizer is None:
            raise ValueError("Qwen3Engine was built without a tokenizer")
        return JetStreamTokenizer(self.tokenizer)

    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> jax.sharding.Mesh:
        if self._mesh is None:
            self._mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    # ------------------------------------------------------------------ conveniences
    def prefill_tokens(self, params: Any, tokens: Sequence[int], *, seed: Optional[int] = None,
                       temperature: Optional[float] = None) -> dict:
        """:meth:`prefill` of an unpadded token list."""
        toks = np.asarray(list(tokens), np.int32)
        return self.prefill(params=params, padded_tokens=toks, true_length=len(toks), seed=seed, temperature=temperature)


@dataclasses.dataclass(frozen=True)
class SlotPrefill:
    """One row of :meth:`Qwen3Engine.prefill_slots`.

    Attributes:
      tokens: the request's whole context (int ids, ``1 <= len <= max_cache_len``); its last token
        stays pending (fed by the first decode step), the others end up in the slot's cache.
      slot: the decode slot it fills.
      seed: sampling seed (the token at absolute position p uses ``fold_in(PRNGKey(seed), p)``).
      temperature: per-request temperature (None: the engine's; <= 0: greedy).
      start: cache positions ``[0, start)`` of ``slot`` already hold ``tokens[:start]``'s K/V
        (an episode's earlier turns): only ``tokens[start:-1]`` are run (append-prefill). 0: fresh.
    """

    tokens: Sequence[int]
    slot: int
    seed: int = 0
    temperature: Optional[float] = None
    start: int = 0


class PrefillResult(NamedTuple):
    """What :meth:`Qwen3Engine.prefill_slots` reports for one :class:`SlotPrefill` row.

    Attributes:
      prefill_tokens: cache positions this row's program computed (0 for a row that shared another
        row's prefill: a GRPO group's later samples).
      shared: the row's K/V were copied from another row's prefill.
      routes: None, or int32 [len(tokens) - 1 - start, n_moe_layers, k] (``record_routes``): the
        routes of the positions ``start .. len(tokens) - 2`` the row ran.
      moe_dropped: None, or int (``counts_moe_drops``): the MoE token copies this row's program
        dropped for capacity, summed over its positions and the MoE layers (0 for a shared row).
    """

    prefill_tokens: int
    shared: bool
    routes: Optional[np.ndarray] = None
    moe_dropped: Optional[int] = None


def _replace_cache(cache: Any, **kw: Any) -> Any:
    """Functional update of a KVCache (dataclass / flax struct / NamedTuple)."""
    if hasattr(cache, "replace"):
        return cache.replace(**kw)
    if hasattr(cache, "_replace"):
        return cache._replace(**kw)
    return dataclasses.replace(cache, **kw)
