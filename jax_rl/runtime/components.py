"""Build the pieces of a run from a :class:`~jax_rl.config.Config`.

Shared by the embedded and Ray runtimes, ``jax-rl sft`` and ``jax-rl eval``. Nothing here
starts threads; the runtimes own those.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jax_rl.config import Config, ConfigError
from jax_rl.config.schema import BPE_CORPUS_DEMOS  # the bpe tokenizer's demos (the held-out guard counts them)
from jax_rl.routing_replay import RoutingReplay

log = logging.getLogger("jax_rl.runtime")

__all__ = [
    "resolve_run_dir",
    "delete_earlier_run",
    "build_tokenizer",
    "build_model_config",
    "build_env_factory",
    "Tau2UserModel",
    "start_tau2_user_model",
    "check_mesh",
    "check_kv_cache",
    "kv_cache_bytes",
    "engine_memory_bytes",
    "build_generator",
    "engine_mesh",
    "build_engine",
    "synced_generators",
    "adopt_checkpoint_layer_layout",
    "sft_examples",
    "compute_advantages",
    "pad_examples",
    "learner_batch",
    "local_groups_per_step",
    "rollout_rank",
    "split_processes",
    "exchange_groups",
    "step_row",
    "rollout_preflight",
    "EpisodeGuard",
]


def resolve_run_dir(cfg: Config, *, create: bool = True, check_fresh: bool = False) -> Path:
    """``run.dir`` or ``runs/<name>-<UTC timestamp>``; with ``resume`` and no ``run.dir``, the
    newest existing ``runs/<name>-*`` dir.

    Raises:
        ConfigError: ``resume=true`` and no earlier run dir exists; ``check_fresh`` (a new train or
            SFT run) and ``run.dir`` already holds a run, finished or not (any of :data:`RUN_FILES`
            or a checkpoint), without ``resume`` or ``run.overwrite`` (then
            :func:`delete_earlier_run` clears it once the new run has passed its checks).
    """
    name = cfg.run.name or "run"
    if cfg.run.dir:
        d = Path(cfg.run.dir)
    elif cfg.resume:
        cands = sorted(Path("runs").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
        if not cands:
            raise ConfigError(f"resume=true but no earlier run dir runs/{name}-* exists; set run.dir")
        d = cands[-1]
    else:
        ts = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        d = Path("runs") / f"{name}-{ts}"
    if cfg.resume and not d.exists():
        raise ConfigError(f"resume=true but run.dir={str(d)!r} does not exist")
    if check_fresh and not cfg.resume and d.is_dir():
        found = [n for n in RUN_FILES if (d / n).exists()] + (["checkpoints/"] if any((d / "checkpoints").glob("*"))
                                                              else [])
        if found and not cfg.run.overwrite:
            raise ConfigError(f"run.dir={str(d)!r} already holds a run, finished or not ({', '.join(found)}); pass "
                              "--resume (resume=true) to continue it, --overwrite (run.overwrite=true) to delete it "
                              "and start over, or choose another run.dir")
    if create:
        d.mkdir(parents=True, exist_ok=True)
    cfg.run.dir = str(d)
    return d


# What a run writes into its dir (besides checkpoints/): a fresh run refuses a dir holding any of
# them, and ``run.overwrite`` deletes exactly these (nothing else the dir may hold).
RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "sft.jsonl", "summary.json", "tokenizer.json")
RUN_DIRS = ("checkpoints", "tb", "plots", "ray", "ray_tmp")


def delete_earlier_run(cfg: Config, run_dir: Path, *, primary: bool = True) -> None:
    """With ``run.overwrite`` (a fresh run, once every check has passed, before it writes anything):
    delete the earlier run's :data:`RUN_FILES` and :data:`RUN_DIRS` from ``run_dir``, nothing else.
    Then ``run.overwrite`` is reset, so the new run's config.yaml does not carry it. Only the
    ``primary`` process deletes (the others only reset the key)."""
    import shutil

    if not cfg.run.overwrite:
        return
    cfg.run.overwrite = False
    d = Path(run_dir)
    if cfg.resume or not primary or not d.is_dir():
        return
    for n in RUN_FILES:
        (d / n).unlink(missing_ok=True)
    for n in RUN_DIRS:
        if (d / n).is_dir():
            shutil.rmtree(d / n)
    log.warning("run.overwrite: deleted the earlier run in %s", d)


def build_tokenizer(cfg: Config, env_factory: Optional[Callable[[], Any]] = None):
    """The :class:`~jax_rl.models.tokenizer.ChatTokenizer` of ``model.tokenizer``.

    ``bpe`` trains :func:`~jax_rl.models.tokenizer.train_bpe_tokenizer` (vocab at most
    ``model.bpe_vocab_size``) on the chat transcripts of :data:`BPE_CORPUS_DEMOS` reference
    demonstrations from training seeds, so held-out eval seeds never shape the vocabulary. It is
    deterministic, so every process (Ray workers, ``jax-rl eval``) rebuilds the same one.

    Raises:
        ConfigError: naming ``model.tokenizer``: no tokenizer.json at the path, a file that is not a
            tokenizer.json, or a tokenizer without the Qwen3 chat tokens.
    """
    from jax_rl.models.tokenizer import load_tokenizer

    if cfg.model.tokenizer != "bpe":
        try:
            return load_tokenizer(cfg.model.tokenizer)
        except FileNotFoundError as e:
            raise ConfigError(
                f"model.tokenizer={cfg.model.tokenizer!r}: {e}; point it at a checkpoint's tokenizer.json "
                "(or use 'compact' / 'bpe')"
            ) from None
        except ValueError as e:  # not a tokenizer.json, or one without the Qwen3 chat tokens
            raise ConfigError(f"model.tokenizer={cfg.model.tokenizer!r}: {e}") from None
    key = (cfg.env.model_dump_json(), cfg.rollout.render_tools, cfg.model.bpe_vocab_size)
    tok = _BPE_CACHE.get(key)
    if tok is None:
        tok = _BPE_CACHE[key] = _train_bpe(cfg, env_factory or build_env_factory(cfg))
    return tok


# One trained ``bpe`` tokenizer per (env config, render_tools, vocab) in this process: tests and
# ``jax-rl eval`` build several RunContexts from one config.
_BPE_CACHE: dict[tuple, Any] = {}


def _train_bpe(cfg: Config, env_factory: Callable[[], Any]):
    from jax_rl.models.tokenizer import render_chat_text, train_bpe_tokenizer
    from rollout.agent import demo_chat

    env = env_factory()
    texts = [render_chat_text(*demo_chat(env, cfg.env.train_seed_offset + i, cfg.rollout.render_tools),
                              preserve_thinking=True)
             for i in range(BPE_CORPUS_DEMOS)]
    return train_bpe_tokenizer(texts, cfg.model.bpe_vocab_size, name="bpe")


def build_model_config(cfg: Config, tokenizer=None):
    """The run's Qwen3Config (:func:`jax_rl.model_builder.resolve_model_config`, the one resolver:
    ``model.checkpoint``'s config.json, else ``model.preset``, with ``model.hf_overrides``; with a
    checkpoint the safetensors headers are checked against it too, no tensor data read), then the
    run's own checks: a resume's model, the tokenizer's vocabulary, the keys that need a model
    property (:func:`_check_model_fits_config`). So a bad model is refused here, before a run dir exists.

    Raises:
        ConfigError: unknown preset, bad override, a vocab smaller than the tokenizer's; for
            ``model.checkpoint`` (message naming the file): a missing dir or config.json, a
            config.json that is not a JSON object or lacks :data:`jax_rl.model_builder.HF_REQUIRED_FIELDS`, or
            safetensors that are missing, truncated or do not match the config.
    """
    from jax_rl.model_builder import resolve_model_config

    mc = resolve_model_config(cfg.model, check_tensors=True)
    _check_resumed_model(cfg, mc)
    if tokenizer is not None and tokenizer.vocab_size > mc.vocab_size:
        raise ConfigError(
            f"model.vocab_size={mc.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, model.tokenizer={cfg.model.tokenizer!r})"
        )
    _check_model_fits_config(cfg, mc)
    return mc


def _check_resumed_model(cfg: Config, mc) -> None:
    """On a resume, the model of the run being resumed (its config.yaml, a preset model) against
    this config's, before anything else can name a symptom (the vocabulary, a param shape).
    The checkpoint's own metadata is checked again at restore (``check_compatible``)."""
    if not cfg.resume or not cfg.run.dir or not (Path(cfg.run.dir) / "config.yaml").is_file():
        return
    from jax_rl.models.qwen3 import get_preset

    try:
        import yaml

        m = yaml.safe_load((Path(cfg.run.dir) / "config.yaml").read_text(encoding="utf-8"))["model"]
        if m.get("checkpoint"):
            return
        saved = get_preset(m["preset"], **(m.get("hf_overrides") or {}))
    except Exception:  # noqa: BLE001 - unreadable: the restore's own checks report the checkpoint
        return
    if saved.to_hf() == mc.to_hf():
        return
    from jax_rl.checkpoint import describe_model, model_name

    raise ConfigError(
        f"resume: the run in run.dir={cfg.run.dir!r} was written for "
        f"{describe_model(saved.to_hf(), model_name(m['preset'], None))} but this config asks for "
        f"{describe_model(mc.to_hf(), model_name(cfg.model.preset, cfg.model.checkpoint))}; resume with the model "
        "the run was started with, or start a fresh run dir")


def _check_model_fits_config(cfg: Config, mc) -> None:
    """The config keys that need a property of the model (before anything is built)."""
    model = f"model.checkpoint={cfg.model.checkpoint!r}" if cfg.model.checkpoint else f"model.preset={cfg.model.preset}"
    RoutingReplay.from_config(cfg, mc)  # routing replay on a dense model: refused, naming the key
    ep = int(cfg.mesh.expert)
    if mc.is_moe and ep > 1 and mc.num_experts % ep:
        raise ConfigError(f"mesh.expert={ep}: the model's num_experts={mc.num_experts} ({model}) must divide by "
                          f"mesh.expert (the experts are split evenly over the expert axis); set mesh.expert to a "
                          f"divisor of {mc.num_experts}")
    rep = int(cfg.rollout.mesh.expert)
    if mc.is_moe and rep > 1 and mc.num_experts % rep:
        raise ConfigError(f"rollout.mesh.expert={rep}: the model's num_experts={mc.num_experts} ({model}) must divide "
                          f"by it (each engine splits the experts evenly); set a divisor of {mc.num_experts}")
    r = cfg.rollout
    if not mc.is_moe and r.moe_router_dtype != "float32":
        raise ConfigError(f"rollout.moe_router_dtype={r.moe_router_dtype} sets the engine's MoE router; the model "
                          f"({model}) has no MoE layer: set rollout.moe_router_dtype=float32")
    if not mc.is_moe and r.moe_capacity_factor is not None:
        raise ConfigError(f"rollout.moe_capacity_factor={r.moe_capacity_factor} drops the engine's MoE token copies; "
                          f"the model ({model}) has no MoE layer: set rollout.moe_capacity_factor=null")


def check_mesh(cfg: Config, n_devices: Optional[int] = None) -> dict[str, int]:
    """The mesh axis sizes ``mesh.*`` resolve to on ``n_devices`` (default: ``jax.device_count()``).

    With ``placement.*`` the learner's devices are the ones :func:`jax_rl.placement.resolve_roles` gives
    it (the rollout's and the scorer's are validated on the way).

    Raises:
        ConfigError: naming every ``mesh.*`` key and the device count, when their product does
            not equal the device count (or, with a -1 axis, does not divide it); naming the
            ``placement.*`` / ``rollout.mesh.*`` key when the roles do not fit the devices.
    """
    import jax

    from jax_rl.placement import resolve_roles

    if n_devices is None:
        n_devices = jax.device_count()
    left = ""
    pl = cfg.placement
    placed = pl.learner is not None or pl.rollout is not None or pl.scorer is not None
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


def available_memory_bytes() -> tuple[int, str]:
    """(bytes, where): free host RAM on the CPU backend, else the summed ``bytes_limit`` minus
    ``bytes_in_use`` of the local accelerators (host RAM when the backend reports no stats)."""
    import jax

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
    * ``kv_cache``: :func:`kv_cache_bytes`;
    * ``state``: the rest of the decode state, per slot the pending token, active flag, PRNG key,
      temperature, generated count and cache length (int32 / bool / uint32 x 2 / float32);
    * ``decode_temp``: the decode step's working buffers, the larger of (a) on the CPU backend
      with a bf16/fp16 rollout, the KV cache converted to float32 (XLA's CPU dot upcasts its bf16
      operand: measured, the step's temp is 2.0x the bf16 cache) and (b) the sampling buffers
      over the vocabulary, float32 [slots, vocab] x 2 (logits, log-softmax; x 4 with top-k /
      top-p: the sort and its indices); plus per slot one layer's activations (attention scores
      [heads, max_cache_len] and the MLP's hidden units, float32). XLA reuses (a)'s buffers
      for (b), as measured (``memory_analysis()`` of ``generate`` / ``generate_steps`` on tiny
      models: within 4% of this figure, never above it);
    * ``per_slot``: the bytes each slot adds (everything but ``params``), ``total``.
    """
    import jax

    from jax_rl.models.qwen3 import count_params

    r, mc = cfg.rollout, model_config
    B = int(slots or r.slots)
    itemsize = 2 if r.dtype == "bfloat16" else 4
    kv_slot = kv_cache_bytes(cfg, mc, slots=1)
    state_slot = 4 + 1 + 8 + 4 + 4 + 4
    upcast = kv_slot * 4 // itemsize if itemsize < 4 and jax.default_backend() == "cpu" else 0
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
    per_slot = kv_slot + state_slot + temp_slot
    params = count_params(mc) * itemsize
    return {"params": params, "kv_cache": kv_slot * B, "state": state_slot * B, "decode_temp": temp_slot * B,
            "per_slot": per_slot, "total": params + per_slot * B}


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
    kv = kv_cache_bytes(cfg, model_config) * engines
    mem = engine_memory_bytes(cfg, model_config)
    need = mem["total"] * engines
    have, where = available_memory_bytes()
    if need > have:
        r, mc = cfg.rollout, model_config
        fit = max(0, (have // engines - mem["params"]) // mem["per_slot"])
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def build_env_factory(cfg: Config, user_simulator_factory: Optional[Callable[[], Any]] = None) -> Callable[[], Any]:
    """A zero-argument env factory for ``env``, checked by building one env (and, for
    ``calculator``, each reasoning-gym dataset with its ``env.dataset_config``).

    Raises:
        ConfigError: naming the key: an unregistered ``env.datasets`` entry, bad
            ``env.dataset_config`` kwargs, an unknown or bad ``env.retail`` knob.
    """
    from rollout.envs import env_factory_from_config

    _check_env(cfg)
    if cfg.env.name == "tau2":
        return _tau2_env_factory(cfg, user_simulator_factory)
    factory = env_factory_from_config(cfg.env, cfg.rollout)
    try:
        factory()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"env.{'retail' if cfg.env.name == 'retail' else 'dataset_config'}: {e}") from None
    return factory


class Tau2UserModel:
    """``env.tau2.user=model``: the user simulator's served model, bound late.

    The env factory exists before the learner (the tokenizer and the prompt checks need it), so the
    factory holds this handle and :func:`start_tau2_user_model` binds the user model's generator once
    the policy's model is built. Until then (BPE corpus, SFT demonstrations, prompt checks: no episode
    runs) each env gets a :class:`rollout.envs.tau2.TicketUser` (the ticket / scenario as the opening);
    after :meth:`bind`, a :class:`rollout.envs.tau2.ModelUser` over the bound generator.
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.generator: Any = None
        self.tokenizer: Any = None

    def bind(self, generator: Any, tokenizer: Any) -> None:
        self.generator, self.tokenizer = generator, tokenizer

    def __call__(self) -> Any:
        from rollout.envs.tau2 import ModelUser, TicketUser

        if self.generator is None:
            return TicketUser()
        um = self.cfg.env.tau2.user_model
        # the user model's engine has the policy's rollout.max_cache_len
        return ModelUser(self.generator, self.tokenizer, max_new_tokens=um.max_new_tokens,
                         max_context=min(um.max_context, self.cfg.rollout.max_cache_len),
                         timeout_s=self.cfg.rollout.episode_timeout_s)


def _tau2_env_factory(cfg: Config, user_simulator_factory: Optional[Callable[[], Any]]) -> Callable[[], Any]:
    """``env.name=tau2``: seeds split at ``eval.seed_offset``; ``user=model``: a :class:`Tau2UserModel`
    handle (the factory's ``user_model`` attribute) unless one is given."""
    from rollout.envs import env_factory_from_config
    from rollout.envs.tau2 import load_domain

    try:
        load_domain(cfg.env.tau2.domain)
    except ImportError as e:
        raise ConfigError(f"env.name=tau2: {e}") from None
    handle = None
    if cfg.env.tau2.user == "model":
        if cfg.runtime.kind == "ray":
            raise ConfigError("env.tau2.user=model runs its user model in the embedded runtime only; use runtime=embedded "
                              "or env.tau2.user=ticket")
        if user_simulator_factory is None:
            user_simulator_factory = handle = Tau2UserModel(cfg)
    try:
        factory = env_factory_from_config(cfg.env, cfg.rollout, eval_seed_offset=cfg.eval.seed_offset,
                                          user_simulator_factory=user_simulator_factory)
        factory()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"env.tau2: {e}") from None
    if handle is not None:
        factory.user_model = handle
    return factory


def start_tau2_user_model(cfg: Config, env_factory: Any, tokenizer: Any, model_config: Any, learner: Any,
                          load_params: Optional[Callable[[Config, Any], tuple]] = None) -> Any:
    """Build and bind the user model of ``env.tau2.user=model`` (else None): a started generator over
    frozen params, ``env.tau2.user_model.checkpoint`` (an HF Qwen3 checkpoint, read like
    ``model.checkpoint``) or a copy of the policy's params at this call (the run's starting weights).
    It runs on the eval engine's devices (the first rollout engine's mesh), at ``rollout.temperature``,
    with ``rollout.slots`` slots, and never receives a publish. The caller stops it. ``load_params(cfg,
    model_config) -> (params, mesh)`` reads ``cfg.model.checkpoint`` (the run context's HF loader).

    Raises:
        ConfigError: the checkpoint does not load, or its vocabulary is smaller than the tokenizer's.
    """
    handle = getattr(env_factory, "user_model", None)
    if handle is None:
        return None
    um = cfg.env.tau2.user_model
    mc, params = model_config, None
    if um.checkpoint:
        from jax_rl.model_builder import resolve_model_config

        if load_params is None:
            raise ValueError("start_tau2_user_model: env.tau2.user_model.checkpoint needs load_params")
        ucfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"checkpoint": um.checkpoint,
                                                                             "hf_overrides": {}})})
        try:
            mc = resolve_model_config(ucfg.model, check_tensors=True)
        except Exception as e:
            raise ConfigError(f"env.tau2.user_model.checkpoint={um.checkpoint!r}: {e}") from None
        if mc.vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"env.tau2.user_model.checkpoint={um.checkpoint!r}: vocab_size {mc.vocab_size} < the "
                              f"tokenizer's {tokenizer.vocab_size} (the user model shares the policy's tokenizer)")
        params, _ = load_params(ucfg, mc)
    else:
        params = learner.rollout_params()
    gen = build_generator(cfg, mc, params, version=0)
    handle.bind(gen, tokenizer)
    return gen


def _check_env(cfg: Config) -> None:
    import difflib
    import inspect

    def hint(name: str, known, prefix: str = "") -> str:
        m = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
        return f"; did you mean '{prefix}{m[0]}'?" if m else ""

    env = cfg.env
    if env.name == "tau2":  # its knobs are checked by its schema and by building one env
        return
    if env.name == "retail":
        from rollout.envs import RetailEnv
        from rollout.envs.base import BaseEnv

        known = {n for c in (RetailEnv, BaseEnv) for n, prm in inspect.signature(c.__init__).parameters.items()
                 if n != "self" and prm.kind is prm.POSITIONAL_OR_KEYWORD} - {"tool_latency_s", "tool_latency_dist"}
        for k in env.retail:
            if k not in known:
                raise ConfigError(f"unknown config key 'env.retail.{k}'{hint(k, known, 'env.retail.')} (env.retail takes "
                                  f"{sorted(known)})")
        return
    import reasoning_gym.factory as rg
    from rollout.envs.calculator import _get_dataset

    for name in env.datasets:
        if name not in rg.DATASETS:
            raise ConfigError(f"env.datasets: {name!r} is not a reasoning-gym dataset{hint(name, rg.DATASETS)}")
    for name in env.dataset_config:
        if name not in env.datasets:
            raise ConfigError(f"env.dataset_config.{name} names a dataset not in env.datasets={env.datasets}")
    from rollout.envs.calculator import check_dataset_config

    for name in env.datasets:
        try:  # the dataset's own knob schema (reasoning-gym's config dataclass): names the knob and value
            check_dataset_config(name, env.dataset_config.get(name, {}))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            _get_dataset(name, 0, dict(env.dataset_config.get(name, {})))
        except Exception as e:  # reasoning-gym raises TypeError / AssertionError / ValueError
            raise ConfigError(f"env.dataset_config.{name}={env.dataset_config.get(name, {})}: "
                              f"{type(e).__name__}: {' '.join(str(e).split())}") from None


def engine_mesh(cfg: Config, index: Optional[int] = 0, roles: Any = None):
    """The mesh of rollout engine ``index`` (``placement.rollout`` / ``rollout.mesh``,
    :func:`jax_rl.placement.resolve_roles`): ``rollout.mesh`` over that engine's devices, or None
    for the colocated single-device engine (the default placement).

    Raises:
        ConfigError: (one line naming the key) the placement does not resolve, or ``index`` is not an
            engine of ``rollout.threads``.
    """
    import jax

    from jax_rl.placement import resolve_roles
    from jax_rl.sharding import make_mesh

    if roles is None:
        try:
            roles = resolve_roles(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if roles.engines is None:
        return None
    if index is None:  # the eval engine: the first engine this process runs (engine 0 in one process)
        local = roles.local_engines()
        if not local:
            raise ConfigError(f"placement.rollout={cfg.placement.rollout} gives process {jax.process_index()} no "
                              "rollout engine of its own: give every host whole engines")
        index = local[0][0]
    if not 0 <= index < len(roles.engines):
        raise ConfigError(f"rollout engine {index} does not exist: rollout.threads={cfg.rollout.threads}")
    return make_mesh(**roles.engine_mesh, devices=roles.engines[index])


def build_generator(cfg: Config, model_config, params, version: int, *, temperature: Optional[float] = None,
                    slots: Optional[int] = None, seed: int = 0, engine: Optional[int] = None, roles: Any = None):
    """A started :class:`rollout.generator.Generator` over a fresh :class:`Qwen3Engine`.

    The engine's model is built with :func:`jax_rl.model_builder.rollout_model_kwargs` (the
    learner's ``model.scan_layers`` / ``moe_dispatch``, ``attention`` for prefill), so ``params``
    and every later ``update_params`` take the learner's params tree as is. ``engine``: which of
    the ``rollout.threads`` engines this is; with ``placement.rollout`` / ``rollout.mesh`` it runs
    sharded on that engine's mesh (:func:`engine_mesh`; ``roles``: an already resolved
    :class:`jax_rl.placement.Roles`), else on this process's first device as always. The eval engine
    (``engine=None``) is on the mesh of the first engine this process runs (engine 0 in one process;
    multi-process: each host evaluates on its own engine's devices).
    """

    eng = build_engine(cfg, model_config, params, temperature=temperature, slots=slots, engine=engine, roles=roles)
    gen = new_generator(cfg, eng, version)
    gen.start()
    return gen


def new_generator(cfg: Config, eng, version: int):
    """An unstarted :class:`rollout.generator.Generator` over ``eng`` with the run's rollout knobs
    (``rollout.partial``, ``decode_steps``, ``keep_kv``, ``prefill_tokens_per_step``, ``prefix_cache``)."""
    from rollout.generator import Generator

    r = cfg.rollout
    return Generator(eng, partial=r.partial, version=version, decode_steps=r.decode_steps, keep_kv=r.keep_kv,
                     prefill_budget=r.prefill_tokens_per_step, prefix_cache=r.prefix_cache)


def build_engine(cfg: Config, model_config, params=None, *, temperature: Optional[float] = None,
                 slots: Optional[int] = None, engine: Optional[int] = None, roles: Any = None):
    """The :class:`Qwen3Engine` of :func:`build_generator` (same arguments), without a generator;
    ``params`` None leaves it empty (a multi-process publish fills it, :mod:`jax_rl.weight_sync`)."""
    from jax_rl.model_builder import rollout_model_kwargs
    from rollout.engine import Qwen3Engine

    r = cfg.rollout
    return Qwen3Engine(
        model_config,
        params,
        slots=slots or r.slots,
        max_cache_len=r.max_cache_len,
        max_prefill_length=r.max_prefill_length,
        dtype=r.dtype,
        temperature=temperature if temperature is not None else r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        model_kwargs=rollout_model_kwargs(cfg),
        record_routes=RoutingReplay.from_config(cfg, model_config).records,  # Trajectory.routes (r2/r3, MoE)
        mesh=engine_mesh(cfg, engine, roles),
        quantize=r.quantize,
    )


def synced_generators(cfg: Config, model_config, learner, indices: list, version: int, *,
                      temperature: Optional[float] = None, roles: Any = None, eval_only: bool = False):
    """Multi-process: engines ``indices`` of this process (None = the eval engine) built empty, then filled by
    ONE :class:`jax_rl.weight_sync.ShardedWeightSync` push of the learner's params (a collective: every
    process calls it at the same point). Returns ``(generators, sync, keys)``: started generators at
    ``version``, the sync for later publishes, and each generator's target key in ``sync.push``'s result."""
    import jax

    from jax_rl.placement import resolve_roles
    from jax_rl.weight_sync import ShardedWeightSync, SyncTarget, engine_targets

    roles = resolve_roles(cfg) if roles is None else roles
    engines = [build_engine(cfg, model_config, None, temperature=temperature, engine=i, roles=roles) for i in indices]
    keys = []
    for i in indices:
        m = engine_mesh(cfg, i, roles)
        keys.append(SyncTarget(mesh=m).key if m is not None else SyncTarget(device=jax.local_devices()[0]).key)
    # a process with no engine of its own (a learner-only host, disaggregated) still sends its learner shards:
    # its template is engine 0 built on the other host's devices (nothing is allocated here: jax runs a
    # program over another process's devices as a no-op on this one)
    template = engines[0] if engines else build_engine(cfg, model_config, None, temperature=temperature, engine=0,
                                                        roles=roles)
    sync = ShardedWeightSync(learner.mesh, engine_targets(cfg, roles, eval_only=eval_only), template._cast_jit,
                             template, timeout_s=cfg.runtime.peer_timeout_s)
    placed = sync.push(learner.params, int(version))
    gens = []
    for eng, k in zip(engines, keys):
        eng.params = eng.load_params(placed[k])  # already the engine's layout: taken as is
        g = new_generator(cfg, eng, version)
        g.start()
        gens.append(g)
    return gens, sync, keys


def adopt_checkpoint_layer_layout(cfg: Config, ckpt_dir: Any, step: Optional[int] = None,
                                  model_config: Any = None) -> Optional[str]:
    """For the readers of a finished checkpoint (``jax-rl eval``, ``jax-rl export``), where the
    layer layout changes no number: set ``cfg.model.scan_layers`` to the layout the checkpoint
    at ``ckpt_dir`` (``step``, default newest) was saved in, when the config would build the other
    one (e.g. a run saved before train honoured ``model.scan_layers``). Returns the one-line note
    to print, or None when nothing changed (same layout, or the layout cannot be read). A resume
    never adopts: :meth:`jax_rl.checkpoint.Checkpointer.check_layer_layout` refuses it."""
    from jax_rl.checkpoint import saved_layer_layout
    from jax_rl.model_builder import layers_stacked, resolve_model_config

    have = saved_layer_layout(ckpt_dir, step)
    if have is None:
        return None
    stacked = have == "stacked"
    try:
        mc = resolve_model_config(cfg.model, model_config)
        builds_stacked = layers_stacked(mc, cfg.model.scan_layers)
    except Exception:  # noqa: BLE001 - a bad model section is reported where the model is built
        builds_stacked = bool(cfg.model.scan_layers)
    if builds_stacked == stacked:
        return None
    cfg.model.scan_layers = stacked
    return (f"{ckpt_dir} stores the decoder layers {have}: reading it with "
            f"model.scan_layers={'true' if stacked else 'false'}")


def sft_examples(cfg: Config, tokenizer, env_factory, n: int, seed_offset: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Reference-solver demonstrations rendered with the chat template: (tokens, loss_mask) pairs,
    assistant tokens only in the mask. Seeds are training seeds (below ``eval.seed_offset``)."""
    from rollout.agent import sft_example

    env = env_factory()
    out = []
    for i in range(n):
        seed = cfg.env.train_seed_offset + seed_offset + i
        toks, mask = sft_example(env, tokenizer, seed, render_tools=cfg.rollout.render_tools)
        if len(toks) <= cfg.optim.max_seq_len:
            out.append((np.asarray(toks, np.int32), np.asarray(mask, bool)))
    if not out:
        raise ConfigError(f"no SFT demonstration fits optim.max_seq_len={cfg.optim.max_seq_len}")
    return out


def pad_examples(examples: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int = 0, multiple: int = 32) -> dict:
    """Right-pad (tokens, loss_mask) pairs to [B, T] with T a multiple of ``multiple``."""
    T = max(len(t) for t, _ in examples)
    T = ((T + multiple - 1) // multiple) * multiple
    B = len(examples)
    tokens = np.full((B, T), pad_id, np.int32)
    attn = np.zeros((B, T), bool)
    lm = np.zeros((B, T), bool)
    for i, (t, m) in enumerate(examples):
        tokens[i, : len(t)] = t
        attn[i, : len(t)] = True
        lm[i, : len(m)] = m
    return {"tokens": tokens, "attention_mask": attn, "loss_mask": lm}


def compute_advantages(cfg: Config, groups: Sequence[Sequence[Any]]) -> list[np.ndarray]:
    """Per-trajectory advantages per group (GRPO or RLOO), as a list of float32 [G] arrays."""
    from jax_rl.advantages import grpo_advantages, rloo_advantages

    rewards = np.concatenate([np.asarray([t.reward for t in g], np.float32) for g in groups])
    gids = np.concatenate([np.full(len(g), i, np.int32) for i, g in enumerate(groups)])
    if cfg.rollout.advantage == "grpo":
        adv = grpo_advantages(rewards, gids, normalize_std=cfg.rollout.advantage_std_normalize)
    else:
        adv = rloo_advantages(rewards, gids)
    adv = np.asarray(adv, np.float32)
    out, i = [], 0
    for g in groups:
        out.append(adv[i: i + len(g)])
        i += len(g)
    return out


def local_groups_per_step(cfg: Config) -> int:
    """GRPO groups this process contributes to each learner step: ``optim.batch_size /
    rollout.group_size`` over ``jax.process_count()`` (every process generates an equal share in a
    multi-process run; the run refuses a count that does not divide, ``RunContext``)."""
    import jax

    groups = cfg.optim.batch_size // cfg.rollout.group_size
    if jax.process_count() == 1:
        return groups
    rank, n = rollout_rank(cfg)
    return 0 if rank is None else groups // n


def rollout_rank(cfg: Config) -> tuple[Optional[int], int]:
    """``(rank, n)``: this process's index among the ``n`` processes that run rollout engines
    (:meth:`jax_rl.placement.Roles.rollout_processes`; colocated: every process, rank = process index), or
    ``(None, n)`` for a process that runs none (a learner-only host of a disaggregated run). Rollout process
    of rank r starts groups ``r, r + n, r + 2n, ...``."""
    import jax

    if jax.process_count() == 1:
        return 0, 1
    from jax_rl.placement import resolve_roles

    procs = resolve_roles(cfg).rollout_processes()
    me = jax.process_index()
    return (procs.index(me) if me in procs else None), len(procs)


def exchange_groups(cfg: Config, groups: Sequence[Sequence[Any]]) -> list:
    """Every process's groups of this step, in process order (a collective every process calls once per step of
    a disaggregated run, :func:`split_processes`): the rollout processes' trajectories reach the learner's.

    Through the ``jax.distributed`` key-value store as JSON (``Trajectory.to_dict``: float32 log-probs and int
    tokens round-trip exactly), not a device collective, so it never waits on devices busy decoding. A learner
    process waits at most ``runtime.peer_timeout_s`` for a rollout process's groups of one step.

    Raises:
        jax_rl.weight_sync.WeightSyncError: (one line) a peer did not hand in its groups in time (a lost host).
    """
    from jax_rl.weight_sync import allgather_json
    from rollout.types import Trajectory

    every = allgather_json([[t.to_dict() for t in g] for g in groups], timeout_s=cfg.runtime.peer_timeout_s,
                           what="rollout groups")
    return [[Trajectory.from_dict(d) for d in g] for part in every for g in part]


def split_processes(cfg: Config) -> bool:
    """True in a multi-process run where some process holds no learner device or no engine
    (:attr:`jax_rl.placement.Roles.split_processes`): the groups then cross to every process each step and
    the learner trains on the global batch (``jax_rl.runtime.loop``)."""
    import jax

    if jax.process_count() == 1:
        return False
    from jax_rl.placement import resolve_roles

    return resolve_roles(cfg).split_processes


def learner_batch(cfg: Config, groups: Sequence[Sequence[Any]], pad_id: int, *, global_batch: bool = False):
    """Turn GRPO groups from the buffer into a learner batch (``global_batch``: every process's groups of a
    disaggregated multi-process step, padded to the whole ``optim.batch_size``).

    Groups are sorted by ``group_id`` so the row order (hence fp32 summation order) does not
    depend on which rollout thread finished first.

    Returns:
        ``(groups, trajectories, batch)``: the sorted groups, their trajectories flattened, and
        the padded ``[B, T]`` batch of :func:`jax_rl.learner.collate` with per-trajectory
        advantages broadcast over each row. B is ``optim.batch_size`` (divided by the process count in a
        multi-process run: each process's share) whenever the groups hold
        fewer trajectories (a group short of failed / over-long members): inert rows
        (:func:`jax_rl.batch.pad_rows`, no loss tokens) fill it, so the batch always splits into
        ``minibatches x microbatches`` and one shape is compiled; ``step_row`` logs them as
        ``padded_rows``.

    Raises:
        jax_rl.learner.BatchError: a trajectory longer than ``optim.max_seq_len``.
    """
    from jax_rl.learner import collate

    groups = sorted(groups, key=lambda g: g[0].group_id)
    adv = compute_advantages(cfg, groups)
    trajs = [t for g in groups for t in g]
    batch = collate(trajs, np.concatenate(adv), cfg.optim.max_seq_len, pad_id=pad_id)
    # multi-process: this process's share; a disaggregated run's global batch: all of it
    rows = (cfg.optim.batch_size // cfg.rollout.group_size if global_batch else local_groups_per_step(cfg)) \
        * cfg.rollout.group_size
    if len(trajs) < rows:
        from jax_rl.batch import pad_rows

        batch = pad_rows(batch, rows, pad_id)
    return groups, trajs, batch


def step_row(cfg: Config, step: int, version: int, metrics: dict, batch: dict, groups, trajs,
             version_trained: int) -> dict:
    """The ``metrics.jsonl`` fields every runtime writes for one learner step.

    ``staleness_mean`` / ``staleness_max`` (versions) come from the learner's metrics; they are
    computed here from ``batch["versions"]`` against ``version_trained`` only when missing.
    """
    row = dict(metrics)
    row["padded_rows"] = int(batch["tokens"].shape[0]) - len(trajs)
    v = batch["versions"]
    m = batch["loss_mask"] & (v >= 0)
    s = (version_trained - v)[m]
    row.setdefault("staleness_mean", float(s.mean()) if s.size else 0.0)
    row.setdefault("staleness_max", int(s.max()) if s.size else 0)
    rewards = np.asarray([t.reward for t in trajs], np.float32)
    row.update({
        "step": step,
        "version": version,
        "group_ids": [int(g[0].group_id) for g in groups],
        "reward_mean": float(rewards.mean()),
        "success_rate": float((rewards >= 1.0 - 1e-6).mean()),
        "episode_len_mean": float(np.mean([len(t) for t in trajs])),
        # the engines' prefill work for these trajectories (re-prefills included; a GRPO group's shared
        # prompt counted once) against their own lengths: ~turns/2 when every turn re-prefills
        "prefill_tokens": int(sum(int(t.info.get("prefill_tokens", 0)) for t in trajs)),
        "episode_tokens": int(sum(len(t) for t in trajs)),
        "prefix_cache_hits": int(sum(int(t.info.get("prefix_hits", 0)) for t in trajs)),
        "gen_tokens_mean": float(np.mean([t.num_generated for t in trajs])),
    })
    if cfg.env.name == "tau2":  # the agentic workload's shape (issue 38): per-episode means over the batch
        row.update(tau2_episode_stats(trajs))
    return row


def tau2_episode_stats(trajs) -> dict:
    """Per-episode means over ``trajs`` (from ``Trajectory.info``): assistant turns, user turns, tool calls,
    tool errors, prompt tokens, submitted context tokens (the sum over turns of the context each turn was
    generated from: what the engine prefills without prefix or K/V reuse), and seconds waiting on the
    policy's generator (``gen_s``), in the env (tools + tau²'s evaluator, ``tool_s``) and on the user
    model (``user_s``). Episodes run concurrently: the seconds are per episode, not shares of a step."""
    infos = [t.info or {} for t in trajs]

    def mean(f) -> float:
        return float(np.mean([f(i) for i in infos])) if infos else 0.0

    return {
        "episode_turns_mean": mean(lambda i: i.get("turns", 0)),
        "episode_user_turns_mean": mean(lambda i: i.get("user_turns", 0)),
        "episode_tool_calls_mean": mean(lambda i: i.get("tool_calls", 0)),
        "episode_tool_errors_mean": mean(lambda i: len(i.get("tool_errors", []))),
        "episode_prompt_len_mean": mean(lambda i: i.get("prompt_len", 0)),
        "episode_submitted_tokens_mean": mean(lambda i: sum(i.get("turn_starts", []))),
        "episode_gen_s_mean": mean(lambda i: i.get("gen_s", 0.0)),
        "episode_env_s_mean": mean(lambda i: i.get("tool_s", 0.0)),
        "episode_user_s_mean": mean(lambda i: i.get("user_s", 0.0)),
    }


# Training seeds whose prompts :func:`rollout_preflight` renders at the start of a run.
PREFLIGHT_SEEDS = 32


def rollout_preflight(cfg: Config, tokenizer, env_factory, n_seeds: int = PREFLIGHT_SEEDS) -> list[str]:
    """Start-of-run checks of the rollout config; logs each warning once and returns them.

    * Renders the prompts of the first ``n_seeds`` training tasks: a prompt that fills
      ``rollout.max_cache_len`` cannot generate and its group is dropped (``dropped_overlong``);
      a warning gives the fraction and the lengths. When *every* sampled prompt is too long the
      run could never train: :class:`ConfigError` (before anything is built or written).

    Raises:
        ConfigError: no sampled prompt fits ``rollout.max_cache_len``.
    """
    r = cfg.rollout
    out: list[str] = []
    env = env_factory()
    lens = []
    for i in range(int(n_seeds)):
        messages, tools = env.reset(cfg.env.train_seed_offset + i)
        ids, _ = tokenizer.render_chat(messages, tools if r.render_tools else None, add_generation_prompt=True)
        lens.append(len(ids))
    lens_a = np.asarray(lens)
    over = int((lens_a >= r.max_cache_len).sum())
    fix = (f"raise rollout.max_cache_len (and optim.max_seq_len >= it) to at least "
           f"{int(lens_a.max()) + r.max_new_tokens_per_turn}, or shorten the prompts (rollout.render_tools=false, "
           f"model.tokenizer=bpe)")
    if over == len(lens):
        raise ConfigError(
            f"rollout.max_cache_len={r.max_cache_len}: every sampled prompt is too long "
            f"({int(lens_a.min())}..{int(lens_a.max())} tokens over {len(lens)} training tasks), nothing could "
            f"be generated or trained; {fix}")
    if over:
        out.append(f"{over}/{len(lens)} sampled prompts ({int(lens_a.min())}..{int(lens_a.max())} tokens) do not fit "
                   f"rollout.max_cache_len={r.max_cache_len}: their groups will be dropped and counted as "
                   f"dropped_overlong; {fix}")
    elif int(lens_a.max()) + r.max_new_tokens_per_turn > r.max_cache_len:
        out.append(f"prompts of up to {int(lens_a.max())} tokens leave less than rollout.max_new_tokens_per_turn="
                   f"{r.max_new_tokens_per_turn} tokens of rollout.max_cache_len={r.max_cache_len}: long episodes "
                   f"end truncated at the context (reward 0)")
    for w in out:
        log.warning("%s", w)
    return out


class EpisodeGuard:
    """Counts unusable episodes for a runtime and decides when a rollout is failing systematically.

    An episode is unusable when it failed (an env/tool exception, ``info["failed"]``; or its group's
    loop raised) or its prompt did not fit (``info["overlong"]``). Each is dropped and counted and the
    run goes on; ``rollout.max_consecutive_episode_errors`` of them in a row (no usable episode in
    between) set :attr:`fatal`, the message the runtime stops with. Thread-safe.

    Attributes:
        episode_errors: failed episodes so far (overlong ones are counted by the buffer).
        consecutive: unusable episodes since the last usable one.
        fatal: None, or the reason to stop.
    """

    def __init__(self, limit: int, episode_errors: int = 0):
        self.limit = int(limit)
        self.episode_errors = int(episode_errors)
        self.consecutive = 0
        self.last: str = ""
        self.fatal: Optional[str] = None
        self._lock = threading.Lock()

    @staticmethod
    def _info(t: Any) -> dict:
        return (t.get("info") if isinstance(t, dict) else getattr(t, "info", None)) or {}

    def record(self, trajectories: Sequence[Any]) -> None:
        """Account one finished group (Trajectory objects or their ``to_dict()``)."""
        with self._lock:
            for t in trajectories:
                info = self._info(t)
                if info.get("failed"):
                    self.episode_errors += 1
                    self.consecutive += 1
                    self.last = f"episode failed: {info.get('fail_reason', '?')}"
                elif info.get("overlong"):
                    self.consecutive += 1
                    self.last = f"over-long: {info.get('drop_reason', info.get('overlong'))}"
                else:
                    self.consecutive = 0
            self._check()

    def record_error(self, n_episodes: int, message: str) -> None:
        """Account ``n_episodes`` lost to an exception outside an episode (a group's loop)."""
        with self._lock:
            self.episode_errors += int(n_episodes)
            self.consecutive += int(n_episodes)
            self.last = message
            self._check()

    def _check(self) -> None:
        if self.limit and self.fatal is None and self.consecutive >= self.limit:
            self.fatal = (f"rollout failed: {self.consecutive} episodes in a row were unusable (env/tool errors or "
                          f"over-long prompts; rollout.max_consecutive_episode_errors={self.limit}); last: {self.last}")
