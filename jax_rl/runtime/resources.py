"""What a run needs of this machine, checked at its start: the learner's mesh and the roles' devices
fit, and the rollout engines' KV caches and weights fit in memory. Each refusal is one line naming the
keys to change."""

from __future__ import annotations

import os
from typing import Optional

import jax

from jax_rl.config import Config, ConfigError
from jax_rl.models.qwen3 import count_params
from jax_rl.placement import resolve_roles
from rollout.engine.layouts import KV_LAYOUTS

__all__ = ["check_mesh", "check_kv_cache", "kv_cache_bytes", "kv_page_bytes", "kv_pool_pages", "engine_memory_bytes",
           "available_memory_bytes"]


def check_mesh(cfg: Config, n_devices: Optional[int] = None) -> dict[str, int]:
    """The mesh axis sizes ``mesh.*`` resolve to on ``n_devices`` (default: ``jax.device_count()``).

    With ``placement.*`` the learner's devices are the ones :func:`jax_rl.placement.resolve_roles` gives
    it (the rollout's and the scorer's are validated on the way).

    Raises:
        ConfigError: naming every ``mesh.*`` key and the device count, when their product does
            not equal the device count (or, with a -1 axis, does not divide it); naming the
            ``placement.*`` / ``rollout.mesh.*`` key when the roles do not fit the devices.
    """
    if n_devices is None:
        n_devices = jax.device_count()
    left = ""
    pl = cfg.placement
    placed = pl.learner is not None or pl.rollout is not None or pl.scorer is not None or pl.user is not None
    if placed or cfg.rollout.mesh.fixed_product() > 1:
        try:
            roles = resolve_roles(cfg, jax.devices()[:n_devices])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if placed:
            given = " ".join(f"placement.{k}={v}" for k, v in pl.model_dump().items() if v is not None)
            left = f" given to the learner by {given}"
            n_devices = len(roles.learner)
    sizes = cfg.mesh.resolve(n_devices)
    if sizes is None:
        known, wild = cfg.mesh.fixed_product(), -1 in cfg.mesh.sizes().values()
        shown = " ".join(f"mesh.{k}={v}" for k, v in cfg.mesh.sizes().items())
        rule = (f"the product of the other axes ({known}) must divide it" if wild
                else f"their product ({known}) must equal it; set one axis to -1 to take the remaining devices")
        raise ConfigError(f"{shown} does not fit the {n_devices} available device(s){left}: {rule}")
    return sizes


def kv_cache_bytes(cfg: Config, model_config, slots: Optional[int] = None) -> int:
    """Bytes of one rollout engine's KV cache: layers x slots x max_cache_len x kv_heads x head_dim
    x 2 (K and V) x the byte size of ``rollout.dtype``."""
    itemsize = 2 if cfg.rollout.dtype == "bfloat16" else 4
    mc = model_config
    return (int(mc.num_hidden_layers) * int(slots or cfg.rollout.slots) * int(cfg.rollout.max_cache_len)
            * int(mc.num_key_value_heads) * int(mc.head_dim) * 2 * itemsize)


def kv_page_bytes(cfg: Config, model_config) -> int:
    """Bytes of one K/V page of a paged engine (``rollout.kv_layout=paged``): ``rollout.kv_page_size``
    positions x layers x KV heads x head_dim x 2 (K and V) x the byte size of ``rollout.dtype``."""
    return kv_cache_bytes(cfg, model_config, slots=1) // int(cfg.rollout.max_cache_len) * int(cfg.rollout.kv_page_size)


def kv_pool_pages(cfg: Config, model_config, slots: Optional[int] = None) -> Optional[int]:
    """The pages of a paged engine's K/V pool: ``rollout.kv_pages``, else ``floor(rollout.kv_pool_gib x 2**30 /``
    :func:`kv_page_bytes` ``)``, else ``slots`` (default ``rollout.slots``) ``x ceil(max_cache_len /
    kv_page_size)`` (the contiguous layout's memory). None for the contiguous layout.

    Raises:
        ConfigError: the pool holds fewer positions than one ``rollout.max_cache_len`` sequence (one line
            naming ``rollout.kv_pool_gib`` or ``rollout.kv_pages``, the pages and the least that would do).
    """
    r = cfg.rollout
    if not KV_LAYOUTS[r.kv_layout].pooled:
        return None
    least = -(-int(r.max_cache_len) // int(r.kv_page_size))
    if r.kv_pages is not None:
        pages, key = int(r.kv_pages), f"rollout.kv_pages={r.kv_pages}"
    elif r.kv_pool_gib is not None:
        per = kv_page_bytes(cfg, model_config)
        pages, key = int(float(r.kv_pool_gib) * 2**30 // per), f"rollout.kv_pool_gib={r.kv_pool_gib}"
        key += f" ({pages} pages of {per:,} bytes)"
    else:
        return int(slots or r.slots) * least
    if pages < least:
        raise ConfigError(f"{key}: the K/V pool holds {pages * int(r.kv_page_size)} positions < rollout.max_cache_len="
                          f"{r.max_cache_len}: it cannot hold one sequence (at least {least} pages of "
                          f"rollout.kv_page_size={r.kv_page_size})")
    return pages


def available_memory_bytes() -> tuple[int, str]:
    """(bytes, where): free host RAM on the CPU backend, else the summed ``bytes_limit`` minus
    ``bytes_in_use`` of the local accelerators (host RAM when the backend reports no stats)."""
    if jax.default_backend() != "cpu":
        total = 0
        for d in jax.local_devices():
            st = (d.memory_stats() or {}) if hasattr(d, "memory_stats") else {}
            if "bytes_limit" in st:
                total += int(st["bytes_limit"]) - int(st.get("bytes_in_use", 0))
        if total > 0:
            return total, f"free memory on {jax.local_device_count()} {jax.default_backend()} device(s)"
    try:
        import psutil

        return int(psutil.virtual_memory().available), "available host RAM"
    except ImportError:  # pragma: no cover - psutil ships with ray
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")), "available host RAM"


def engine_memory_bytes(cfg: Config, model_config, slots: Optional[int] = None) -> dict[str, int]:
    """What one rollout engine allocates, from the config alone (nothing is built or compiled).

    * ``params``: the engine's own copy of the weights in ``rollout.dtype``;
    * ``kv_cache``: :func:`kv_cache_bytes`; with ``rollout.kv_layout=paged`` the pool instead
      (:func:`kv_pool_pages` x :func:`kv_page_bytes`, whatever the slots);
    * ``state``: the rest of the decode state, per slot the pending token, active flag, PRNG key,
      temperature, generated count and cache length (int32 / bool / uint32 x 2 / float32);
    * ``decode_temp``: the decode step's working buffers, the larger of (a) on the CPU backend
      with a bf16/fp16 rollout, one layer's K/V as float32 (XLA's CPU dot upcasts its bf16 operand;
      the cache itself is kept as its uint16 bits, ``jax_rl.models.kv_storage``, so no whole-cache
      f32 copy: measured, the step's temp is the keys' bf16 copy and the values' f32 one of the layer
      being read, 1.4-1.5x one layer's bf16 K/V, reused layer after layer) and (b) the sampling buffers
      over the vocabulary, float32 [slots, vocab] x 2 (logits, log-softmax; x 4 with top-k /
      top-p: the sort and its indices); plus per slot one layer's activations (attention scores
      [heads, max_cache_len] and the MLP's hidden units, float32). XLA reuses (a)'s buffers
      for (b), as measured (``memory_analysis()`` of ``generate`` / ``decode_steps`` on tiny
      models: within 4% of this figure, never above it);
    * ``per_slot``: the bytes each slot adds (everything but ``params`` and a paged pool), ``total``.
    """
    r, mc = cfg.rollout, model_config
    B = int(slots or r.slots)
    itemsize = 2 if r.dtype == "bfloat16" else 4
    kv_slot = kv_cache_bytes(cfg, mc, slots=1)
    state_slot = 4 + 1 + 8 + 4 + 4 + 4
    layer_kv = kv_slot // int(mc.num_hidden_layers)
    upcast = layer_kv * 4 // itemsize if itemsize < 4 and jax.default_backend() == "cpu" else 0
    truncates = int(r.top_k) > 0 or float(r.top_p) < 1.0
    vocab = (4 if truncates else 2) * int(mc.vocab_size) * 4
    if mc.is_moe:
        dense_dispatch = getattr(cfg.model, "moe_dispatch", "dense") == "dense"
        ffn = int(mc.moe_intermediate_size) * int(mc.num_experts if dense_dispatch else mc.num_experts_per_tok)
        ffn = max(ffn, int(mc.intermediate_size) if len(mc.moe_layers) < mc.num_hidden_layers else 0)
    else:
        ffn = int(mc.intermediate_size)
    act = 4 * (4 * int(mc.hidden_size) + 3 * ffn + 2 * int(mc.num_attention_heads) * int(r.max_cache_len))
    temp_slot = max(upcast, vocab) + act
    pages = kv_pool_pages(cfg, mc, slots=B)
    pool = 0 if pages is None else pages * kv_page_bytes(cfg, mc)
    per_slot = (kv_slot if pages is None else 0) + state_slot + temp_slot
    params = count_params(mc) * itemsize
    return {"params": params, "kv_cache": kv_slot * B if pages is None else pool, "state": state_slot * B,
            "decode_temp": temp_slot * B, "per_slot": per_slot, "total": params + pool + per_slot * B}


def check_kv_cache(cfg: Config, model_config, engines: Optional[int] = None) -> int:
    """Refuse rollout engines that cannot fit, before any is allocated: each engine's whole
    allocation (:func:`engine_memory_bytes`: params copy, KV cache, decode state and the decode
    step's buffers) times the number of engines, against :func:`available_memory_bytes`.

    ``engines`` defaults to ``rollout.threads`` plus the eval engine. Returns the total KV-cache
    bytes (all engines).

    Raises:
        ConfigError: naming ``rollout.slots`` (and ``rollout.max_cache_len``), the bytes needed
            and available and the most slots that would fit.
    """
    engines = engines if engines is not None else cfg.rollout.threads + 1
    mem = engine_memory_bytes(cfg, model_config)  # a paged pool too small for one sequence: ConfigError here
    kv = mem["kv_cache"] * engines
    need = mem["total"] * engines
    have, where = available_memory_bytes()
    if need > have:
        r, mc = cfg.rollout, model_config
        pooled = KV_LAYOUTS[r.kv_layout].pooled  # the K/V is one pool, whatever the slots
        fit = max(0, (have // engines - mem["params"] - (mem["kv_cache"] if pooled else 0)) // mem["per_slot"])
        if pooled:
            raise ConfigError(_paged_does_not_fit(cfg, mc, mem, engines, need, have, where, fit))
        raise ConfigError(
            f"rollout.slots={r.slots}: the rollout engines need {need:,} bytes ({_gib(need)}) but only {have:,} bytes "
            f"({_gib(have)}) of {where}: {engines} engine(s) x (params {_gib(mem['params'])} + rollout.slots={r.slots} x "
            f"{mem['per_slot']:,} bytes per slot: KV cache, decode state and decode buffers); the KV cache alone is "
            f"{kv:,} bytes (rollout.max_cache_len={r.max_cache_len} x {mc.num_hidden_layers} layers x "
            f"{mc.num_key_value_heads} kv heads x head_dim {mc.head_dim} x 2 (K, V) x "
            f"{2 if r.dtype == 'bfloat16' else 4} bytes, rollout.dtype={r.dtype}); at most {fit} slot(s) fit: "
            "lower rollout.slots or rollout.max_cache_len"
        )
    return kv


def _paged_does_not_fit(cfg: Config, mc, mem: dict, engines: int, need: int, have: int, where: str, fit: int) -> str:
    """:func:`check_kv_cache`'s one line for a paged engine: the pool is its own term (pages x page bytes,
    whatever the slots), so the message names what sets it (rollout.kv_pages / kv_pool_gib, or their default
    slots x max_cache_len) and how many pages would fit beside the slots."""
    r = cfg.rollout
    pages, per = kv_pool_pages(cfg, mc), kv_page_bytes(cfg, mc)
    set_by = (f"rollout.kv_pages={r.kv_pages}" if r.kv_pages is not None else f"rollout.kv_pool_gib={r.kv_pool_gib}"
              if r.kv_pool_gib is not None else f"the default rollout.slots x rollout.max_cache_len={r.max_cache_len}")
    room = have // engines - mem["params"] - mem["per_slot"] * int(r.slots)
    fit_pages = max(0, room // per)
    least = -(-int(r.max_cache_len) // int(r.kv_page_size))
    return (f"rollout.kv_layout=paged: the rollout engines need {need:,} bytes ({_gib(need)}) but only {have:,} bytes "
            f"({_gib(have)}) of {where}: {engines} engine(s) x (params {_gib(mem['params'])} + a K/V pool of {pages} "
            f"pages x {per:,} bytes ({_gib(mem['kv_cache'])}, set by {set_by}) + rollout.slots={r.slots} x "
            f"{mem['per_slot']:,} bytes per slot: decode state and decode buffers); at most {fit_pages} pages fit beside "
            f"{r.slots} slots (one sequence needs {least}), or {fit} slot(s) beside this pool: lower rollout.kv_pages / "
            "rollout.kv_pool_gib or rollout.slots")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
