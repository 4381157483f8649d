"""The JetStream 0.2.2 adapter of :class:`rollout.engine.Qwen3Engine`: its ``engine_api.Engine``
methods (MaxText ``MaxEngine`` style) for JetStream's Driver and ``jax-rl serve``, and our tokenizer
behind JetStream's ``tokenizer_api.Tokenizer``. :mod:`rollout.jetstream_compat` stays the only module
that imports JetStream, and only when a JetStream piece is used (``jax-rl serve``, the Driver): importing this
module (every engine, ``train`` included) imports no JetStream, so a wheel without google-jetstream trains. The
two classes are registered as virtual subclasses of JetStream's ``Engine`` / ``Tokenizer`` ABCs when
:mod:`rollout.jetstream_compat` first loads those (:func:`rollout.jetstream_compat.register_adapter`).

``prefill(tokens)`` writes the KV cache of ``tokens[:-1]`` (bucketed, batch 1) and keeps the last
token pending (0.2.2's API samples nothing there); ``insert(prefix, state, slot)`` puts its K/V into slot
``slot`` (the engine's K/V layout's :meth:`~rollout.engine.layout.KVLayout.insert`: a contiguous row, or the
slot's new pages) and arms the slot (seed, temperature, pending token); ``generate(params, state)`` is
:meth:`Qwen3Engine.decode` packed into JetStream's ``ResultTokens`` (bit-cast int32 columns,
:func:`rollout.engine.sampler.pack_result`). Both layouts serve (``jax-rl serve --kv-layout``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from rollout import jetstream_compat as _jc
from rollout.engine.slots import prefill_bucket

__all__ = ["JetStreamTokenizer", "JetStreamAdapter", "NO_BOS"]

NO_BOS = -1
"""BOS placeholder id given to JetStream (Qwen3 has no BOS); prefill drops leading negative ids."""


class JetStreamTokenizer:
    """Our ``ChatTokenizer`` behind JetStream's ``tokenizer_api.Tokenizer`` (for the Driver).

    ``bos_id`` is :data:`NO_BOS` (-1): JetStream prepends it to token requests; the engine's
    prefill drops it. ``stop_tokens`` = {<|im_end|>, <|endoftext|>}.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def encode(self, s: str, **kwargs: Any) -> tuple[Union[jax.Array, np.ndarray], int]:
        ids = np.asarray(self._tok.encode(s), dtype=np.int32)
        return _jc.token_utils().pad_tokens(
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



class JetStreamAdapter:
    """JetStream's ``Engine`` API over the engine's step programs (a base of
    :class:`rollout.engine.Qwen3Engine`, which holds the state these methods read: ``_jits``,
    ``_slots``, ``_in_mesh``, the K/V layout ``kv``, the sampling defaults and the tokenizer)."""

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
          ``token`` int (pending), ``seed`` int, ``temperature`` float, ``routes`` (None, or with
          ``record_routes`` int32 [length, n_moe_layers, k] numpy) and ``moe_dropped`` (None, or
          with ``counts_moe_drops`` an int: the prompt's MoE copies dropped for capacity). The
          same keys whatever the engine's flags.

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
            res = self._jits["prefill"](params, jnp.asarray(buf), jnp.int32(n))
        if seed is None:
            with self._lock:
                seed = next(self._seed_counter)
        return {
            "k": res.k,
            "v": res.v,
            "length": n,
            "token": int(toks[-1]),
            "seed": int(seed) & 0xFFFFFFFF,
            "temperature": float(self.temperature if temperature is None else temperature),
            "routes": None if res.routes is None else np.asarray(res.routes)[:n],  # [n, n_moe_layers, k] int32
            "moe_dropped": None if res.moe_dropped is None else int(res.moe_dropped),
        }

    def insert(self, prefix: dict, decode_state: dict, slot: int) -> dict:
        """``prefix`` (from :meth:`prefill`) into slot ``slot`` of ``decode_state`` (donated), armed: the
        layout's :meth:`rollout.engine.layout.KVLayout.insert` (contiguous: copied into the slot's row; paged:
        the slot's pages freed, ``ceil(length / kv_page_size)`` new ones written).

        Raises:
          ValueError: ``slot`` out of range. rollout.engine.paged.pool.PoolExhausted: (paged) no pages for
          the prefix (a pool smaller than the default; the slot then holds none).
        """
        return self.kv.insert(decode_state, prefix, slot)

    def generate(self, params: Any, decode_state: dict) -> tuple[dict, Any]:
        """JetStream 0.2.2's ``generate``: one decode step of every slot (:meth:`decode`, with the layout's
        :meth:`~rollout.engine.layout.KVLayout.before_decode`: paged, a slot crossing a page boundary takes its
        next page) packed into ``ResultTokens`` (the adapter for JetStream's Driver and ``jax-rl serve``;
        ``data`` int32 [B, 4 (+ route columns)], see :func:`pack_result` / :func:`unpack_result`). Donates
        ``decode_state``. Raises rollout.engine.paged.pool.PoolExhausted (paged) where a pool smaller than the
        default has no page for a slot's next position."""
        state, step_kw = self.kv.before_decode(decode_state, 1)
        with self._in_mesh():
            state, data = self._jits["decode_result"](params, state, **step_kw)
        return self.kv.after_call(state), _jc.engine_api().ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                                                        length_idx=(2, 3), samples_per_slot=1)

    def get_prefix_destination_sharding(self) -> Any:
        return self._sharding

    def get_tokenizer(self) -> Any:
        name = getattr(self.tokenizer, "name", "") if self.tokenizer is not None else ""
        return _jc.tokenizer_pb2().TokenizerParameters(path=str(name), extra_ids=0)

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
    def colocated_cpus(self) -> None:
        return None

    def prefill_tokens(self, params: Any, tokens: Sequence[int], *, seed: Optional[int] = None,
                       temperature: Optional[float] = None) -> dict:
        """:meth:`prefill` of an unpadded token list."""
        toks = np.asarray(list(tokens), np.int32)
        return self.prefill(params=params, padded_tokens=toks, true_length=len(toks), seed=seed, temperature=temperature)


_jc.register_adapter("Engine", JetStreamAdapter)
_jc.register_adapter("Tokenizer", JetStreamTokenizer)
