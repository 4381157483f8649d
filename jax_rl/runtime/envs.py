"""The task side of a run: the environment factory (``env.name``, with tau²'s user model when it is a
model), the tokenizer (``model.tokenizer``; ``bpe`` is trained on the env's reference demonstrations),
the start-of-run check that the env's prompts fit the rollout's cache, and the SFT warm start's data
(:func:`sft_examples`: the env's reference demonstrations as token rows; :func:`pad_examples`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jax_rl.config import Config, ConfigError
from jax_rl.config.schema import BPE_CORPUS_DEMOS  # the bpe tokenizer's demos (the held-out guard counts them)
from jax_rl.model_builder import resolve_model_config
from jax_rl.models.tokenizer import load_tokenizer, render_chat_text, train_bpe_tokenizer
from jax_rl.runtime.engines import build_generator, user_model_mesh
from rollout.agent import demo_chat, sft_example
from rollout.envs import env_factory_from_config, env_spec
from rollout.envs.tau2 import ModelUser, TicketUser

log = logging.getLogger("jax_rl.runtime")

__all__ = ["build_tokenizer", "build_env_factory", "Tau2UserModel", "start_tau2_user_model", "PREFLIGHT_SEEDS",
           "rollout_preflight"]

# One trained ``bpe`` tokenizer per (env config, render_tools, vocab) in this process: tests and
# ``jax-rl eval`` build several RunContexts from one config.
_BPE_CACHE: dict[tuple, Any] = {}


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


def _train_bpe(cfg: Config, env_factory: Callable[[], Any]):
    env = env_factory()
    texts = [render_chat_text(*demo_chat(env, cfg.env.train_seed_offset + i, cfg.rollout.render_tools),
                              preserve_thinking=True)
             for i in range(BPE_CORPUS_DEMOS)]
    return train_bpe_tokenizer(texts, cfg.model.bpe_vocab_size, name="bpe")


def build_env_factory(cfg: Config, user_simulator_factory: Optional[Callable[[], Any]] = None) -> Callable[[], Any]:
    """A zero-argument env factory for ``env``, checked by the env's own run-start checks
    (:class:`rollout.envs.EnvSpec` ``check``: e.g. ``calculator``'s reasoning-gym datasets) and by building one
    env. An env whose user simulator is a served model (``env.tau2.user=model``) gets a
    :class:`Tau2UserModel` handle (the factory's ``user_model`` attribute) unless ``user_simulator_factory``
    is given; its seeds split at ``eval.seed_offset``.

    Raises:
        ConfigError: naming the key: an unregistered ``env.calculator.datasets`` entry, bad
            ``env.calculator.dataset_config`` kwargs, an unknown or bad ``env.retail`` knob, a tau2 domain that does not load,
            ``eval.num_tasks`` above a fixed held-out split (tau2's test split).
    """
    try:
        spec = env_spec(cfg.env.name)
        if spec.check is not None:
            spec.check(cfg.env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_eval_tasks(cfg, spec)
    handle = None
    if spec.user_model(cfg.env) and user_simulator_factory is None:
        user_simulator_factory = handle = Tau2UserModel(cfg)
    try:
        factory = env_factory_from_config(cfg.env, cfg.rollout, eval_seed_offset=cfg.eval.seed_offset,
                                          user_simulator_factory=user_simulator_factory)
        factory()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"env.{spec.section}: {e}") from None
    if handle is not None:
        factory.user_model = handle
    return factory


def _check_eval_tasks(cfg: Config, spec: Any) -> None:
    """``eval.num_tasks`` within an env's fixed held-out split (``EnvSpec.held_out_tasks``: tau2's test split),
    for ``jax-rl train`` (its in-training eval) and ``jax-rl eval`` alike: more would evaluate some tasks twice
    and weight them unevenly in avg@k / pass@k.

    Raises:
        ConfigError: ``eval.num_tasks`` above the split."""
    if spec.held_out_tasks is None:
        return
    held_out, where = spec.held_out_tasks(cfg.env)
    if cfg.eval.num_tasks > held_out:
        raise ConfigError(f"eval.num_tasks={cfg.eval.num_tasks}: {where} has "
                          f"{held_out} held-out tasks (its test split); more would evaluate some of them twice and "
                          f"weight them unevenly in avg@k / pass@k: set eval.num_tasks<={held_out} "
                          "(eval.k samples each)")


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
        if self.generator is None:
            return TicketUser()
        um = self.cfg.env.tau2.user_model
        # the user model's engine has the policy's rollout.max_cache_len
        return ModelUser(self.generator, self.tokenizer, max_new_tokens=um.max_new_tokens,
                         max_context=min(um.max_context, self.cfg.rollout.max_cache_len),
                         timeout_s=self.cfg.rollout.episode_timeout_s, max_tool_calls=um.max_tool_calls)


def start_tau2_user_model(cfg: Config, env_factory: Any, tokenizer: Any, model_config: Any, publisher: Any,
                          load_params: Optional[Callable[[Config, Any], tuple]] = None) -> Any:
    """Build and bind the user model of ``env.tau2.user=model`` (else None): a started generator over
    frozen params, ``env.tau2.user_model.checkpoint`` (an HF Qwen3 checkpoint, read like
    ``model.checkpoint``) or a copy of the policy's params at this call (the run's starting weights).
    It runs on ``placement.user``'s devices (:func:`jax_rl.runtime.engines.user_model_mesh`) or, by default,
    on the eval engine's (the first rollout engine's mesh), at ``algo.temperature``, with ``rollout.slots``
    slots, and never receives a publish. The caller stops it. ``load_params(cfg,
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
        params = publisher.params()
    gen = build_generator(cfg, mc, params, version=0, mesh=user_model_mesh(cfg))
    handle.bind(gen, tokenizer)
    return gen


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


def sft_examples(cfg: Config, tokenizer, env_factory, n: int, seed_offset: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Reference-solver demonstrations rendered with the chat template: (tokens, loss_mask) pairs,
    assistant tokens only in the mask. Seeds are training seeds (below ``eval.seed_offset``)."""
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
