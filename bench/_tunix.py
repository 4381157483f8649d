"""The Tunix (google-tunix 0.1.7) side of ``bench/rollout_decode.py`` and ``bench/learner_step.py``.

Nothing here imports tunix at module import time: :func:`import_error` says whether it can be
imported, and every other function imports it inside. The main venv (``make test``) never has
tunix; the bench venv does.

Bench venv (tunix cannot go into ``.venv``: its resolver pins pull transformers 5.24 -> 5.12.1
and safetensors 0.8.0 -> <0.8, and ``pip install -e .[bench]`` with ``google-tunix`` as a plain
requirement is refused outright: ``google-tunix 0.1.7 depends on safetensors<0.8``, ours pins
``safetensors==0.8.0``). So, like google-jetstream, the wheel goes in with ``--no-deps`` and the
``bench`` extra lists the few packages that its sampler, Qwen3 model, HF loader and GRPO trainer
import (``import tunix`` pulls in the whole package tree)::

    python3 -m venv /work/bench-venv
    /work/bench-venv/bin/pip install -e ".[bench]"
    /work/bench-venv/bin/pip install --no-deps google-jetstream==0.2.2 google-tunix==0.1.7

(torch comes from the machine's local CPU wheel, ``torch==2.13.0``, via the ``bench`` extra.)
Tunix's other declared deps (datasets, grain, tensorflow_datasets, kagglehub, numba, qwix,
omegaconf, ...) are not needed for these rows; ``pip check`` lists them as missing. That holds
for ``bench/e2e_rl.py`` too: its ``GRPOLearner`` + ``RLCluster`` (vanilla rollout) run with
nothing beyond the recipe above (built and run 2026-12-03).

Same weights on both sides: the bench writes ONE HF checkpoint folder (transformers'
``save_pretrained`` or our ``hf_io.save_pretrained``) and each side reads it with its own
loader: ours with ``jax_rl.models.hf_io.load_pretrained``, Tunix's with
``tunix.models.qwen3.params.create_model_from_safe_tensors`` (its regex key table).
:func:`max_logit_diff` checks they agree.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

TUNIX_VERSION = "0.1.7"
SKIP = "skipped: google-tunix not installed"


def import_error() -> Optional[str]:
    """None when tunix (its Qwen3, sampler and GRPO trainer) imports, else the reason."""
    try:
        import tunix  # noqa: F401
        from tunix.generate import sampler  # noqa: F401
        from tunix.models.qwen3 import model, params  # noqa: F401
        from tunix.rl import algo_core, common, trainer  # noqa: F401
    except ImportError as e:  # ModuleNotFoundError included
        return f"{SKIP} ({e})"
    return None


def version() -> str:
    """google-tunix's installed version, or "not installed" (a jax-rl-only bench run in the project venv)."""
    from importlib.metadata import PackageNotFoundError, version as v

    try:
        return v("google-tunix")
    except PackageNotFoundError:
        return "not installed"


# ---------------------------------------------------------------------------- model


def model_config(cfg: Any, dtype: str = "float32") -> Any:
    """Tunix ``qwen3.model.ModelConfig`` of our dense ``Qwen3Config`` (sampling sharding off:
    one CPU device; Tunix's ``shard()`` is a no-op on CPU anyway)."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as tm

    if cfg.is_moe:
        raise ValueError("the Tunix rows compare the dense Qwen3 only")
    if float(cfg.rope_theta) != 1_000_000.0:
        # tunix 0.1.7's Attention calls apply_rope without the config's theta (always 1e6)
        raise ValueError(f"Tunix's Qwen3 always uses rope_theta=1e6; this config has {cfg.rope_theta}")
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    return tm.ModelConfig(
        num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size, num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=bool(cfg.tie_word_embeddings), dtype=dt, param_dtype=dt,
    )


def load_model(ckpt_dir: str, cfg: Any, dtype: str = "float32") -> Any:
    """Tunix ``Qwen3`` from an HF checkpoint folder, by Tunix's own safetensors loader."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import params as tp

    tcfg = model_config(cfg, dtype)
    return tp.create_model_from_safe_tensors(str(ckpt_dir), tcfg, mesh=None,
                                             dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype])


def logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    """Full-sequence logits [B,T,V] of a Tunix Qwen3 (no padding, causal)."""
    import jax.numpy as jnp

    tok = jnp.asarray(tokens, jnp.int32)
    B, T = tok.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))
    out, _ = model(tok, pos, None, mask)
    return np.asarray(out)


def max_logit_diff(tunix_model: Any, our_model: Any, tokens: np.ndarray) -> float:
    """max |logits_tunix - logits_ours| over a token batch (same weights -> ~1e-5 in fp32)."""
    ours = np.asarray(our_model(np.asarray(tokens, np.int32)))
    return float(np.max(np.abs(logits(tunix_model, tokens) - ours)))


# ---------------------------------------------------------------------------- sampler


class IdTokenizer:
    """The tokenizer interface Tunix's ``Sampler`` asks for (encode/decode/bos/eos/pad), over
    space-separated token ids, so prompts are exact id lists. No BOS; pad = 0 (our prompts
    avoid id 0); EOS = -1, an id never sampled, so every row generates the full budget."""

    def encode(self, text: str, **_: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0  # falsy: Sampler.tokenize prepends nothing

    def eos_id(self) -> int:
        return -1

    def pad_id(self) -> int:
        return 0


def make_sampler(model: Any, cfg: Any, cache_size: int) -> Any:
    from tunix.generate import sampler as ts

    cc = ts.CacheConfig(cache_size=int(cache_size), num_layers=cfg.num_hidden_layers,
                        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    return ts.Sampler(model, IdTokenizer(), cc)


def sample(sampler: Any, prompts: Sequence[Sequence[int]], new_tokens: int, *, seed: int = 0,
           temperature: float = 1.0) -> tuple[int, Any]:
    """One ``Sampler.__call__`` (batched prefill + on-device while-loop decode) with log-probs
    on, top_p=1 (plain temperature sampling). Returns (generated tokens, SamplerOutput)."""
    P = max(len(p) for p in prompts)
    out = sampler([" ".join(str(int(t)) for t in p) for p in prompts], max_generation_steps=int(new_tokens),
                  max_prompt_length=P, temperature=float(temperature), top_p=1.0, top_k=None,
                  return_logprobs=True, eos_tokens=[-1], seed=int(seed))
    return sum(len(t) for t in out.tokens), out


class ChatTokenizerAdapter:
    """Tunix's tokenizer interface (encode/decode/bos/eos/pad) over one of our
    :class:`~jax_rl.models.tokenizer.ChatTokenizer` (a ``tokenizer.json``), for real text prompts
    (``bench/e2e_rl.py``). Special tokens in the text (``<|im_start|>`` ...) encode to their ids,
    so ``encode(render_text(chat)) == render_chat(chat)``; decode keeps them. No BOS (0, falsy:
    Tunix prepends nothing); EOS = the first stop id (``<|im_end|>``); pad = ``<|endoftext|>``
    (also a stop id, so a padded position is never a trained token)."""

    def __init__(self, tok: Any):
        self.tok = tok
        self._pad = tok.token_to_id("<|endoftext|>")
        if self._pad is None:
            raise ValueError("the tokenizer has no <|endoftext|> for Tunix's pad id")

    def encode(self, text: str, **_: Any) -> list[int]:
        return list(self.tok.encode(str(text)))

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return self.tok.decode([int(i) for i in ids])

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return int(self.tok.stop_ids[0])

    def pad_id(self) -> int:
        return int(self._pad)


def make_chat_sampler(model: Any, cfg: Any, tok: Any, cache_size: int) -> Any:
    """Tunix ``Sampler`` over ``model`` with :class:`ChatTokenizerAdapter` of ``tok``."""
    from tunix.generate import sampler as ts

    cc = ts.CacheConfig(cache_size=int(cache_size), num_layers=cfg.num_hidden_layers,
                        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    return ts.Sampler(model, ChatTokenizerAdapter(tok), cc)


# ---------------------------------------------------------------------------- GRPO train step


@dataclasses.dataclass
class GrpoStep:
    """Tunix's GRPO actor update (``tunix.rl.trainer.Trainer`` = ``PeftTrainer`` with
    ``algo_core.grpo_loss_fn``, wired as ``GRPOLearner.__init__`` wires it), one call = one
    optimizer update on a (prompt, completion) batch. Its jitted step compiles TWICE (the
    second call retraces: the jit cache holds 2 entries after it), so warm it up twice. ``beta=0`` (no reference model) and
    ``num_iterations=1`` (old log-probs = stop_gradient of the new ones), so the step is one
    forward + backward + AdamW, like jax-rl's ``loss.correction=ppo``."""

    trainer: Any
    step_fn: Callable
    example: Any

    def __call__(self) -> float:
        import jax

        loss, aux, gnorm = self.step_fn(self.example)
        loss, aux, gnorm = jax.device_get((loss, aux, gnorm))  # metrics to the host, as ours
        return float(loss)


def make_grpo_step(model: Any, batch: dict, prompt_len: int, *, lr: float = 1e-4,
                   max_grad_norm: Optional[float] = 1.0, weight_decay: float = 0.0,
                   temperature: float = 1.0, epsilon: float = 0.2) -> GrpoStep:
    """Build the step on ``batch`` (our learner batch dict: ``tokens`` [B,T] and
    ``advantages`` [B,T]); the first ``prompt_len`` columns are the prompt, the rest the
    completion. The optimizer is ``chain(clip_by_global_norm, adamw)`` like ours."""
    import jax.numpy as jnp
    import optax
    from tunix.rl import algo_core, common
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.grpo.grpo_learner import GRPOConfig
    from tunix.sft import peft_trainer

    algo = GRPOConfig(num_generations=2, num_iterations=1, beta=0.0, epsilon=epsilon)
    algo.temperature = temperature
    tx = optax.adamw(lr, weight_decay=weight_decay)
    if max_grad_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
    tr = rl_trainer.Trainer(model, tx, peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9),
                            custom_checkpoint_metadata_fn=lambda: {})
    pad_id, eos_id = IdTokenizer().pad_id(), IdTokenizer().eos_id()
    tr.with_loss_fn(lambda m, train_example, algo_config: algo_core.grpo_loss_fn(
        m, train_example, algo_config=algo, pad_id=pad_id, eos_id=eos_id), has_aux=True)
    tr.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    step_fn, _ = tr.jit_train_and_eval_step()
    tok = np.asarray(batch["tokens"], np.int32)
    if (tok == pad_id).any():
        tok = np.where(tok == pad_id, 1, tok)  # Tunix treats id 0 as padding
    p, c = tok[:, :prompt_len], tok[:, prompt_len:]
    adv = np.asarray(batch["advantages"], np.float32)[:, -1]
    ex = common.TrainExample(
        prompt_ids=jnp.asarray(p), prompt_mask=jnp.asarray(p != pad_id),
        completion_ids=jnp.asarray(c), completion_mask=jnp.asarray(c != pad_id),
        advantages=jnp.asarray(adv), ref_per_token_logps=None, old_per_token_logps=None)
    return GrpoStep(tr, step_fn, ex)


# ---------------------------------------------------------------------------- timing helpers


def interleaved(runners: dict[str, Callable[[], float]], rounds: int,
                warmup: int | dict[str, int] = 1) -> dict[str, list[float]]:
    """Warm each runner up ``warmup`` times (compiles; a dict gives it per runner), then
    ``rounds`` rounds of A B C ..., each runner once per round. A runner returns its figure
    (e.g. tokens/s or seconds)."""
    for k, fn in runners.items():
        for _ in range(warmup if isinstance(warmup, int) else warmup.get(k, 1)):
            fn()
    out: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for k, fn in runners.items():
            out[k].append(fn())
    return out


def summary(xs: Sequence[float]) -> str:
    """'median [min-max]' of a list."""
    return f"{statistics.median(xs):,.0f} [{min(xs):,.0f}-{max(xs):,.0f}]"


def machine_load() -> str:
    """1/5/15-min load averages, core count, and CPU busy % over 0.2 s (psutil when present)."""
    import os

    la = os.getloadavg()
    s = f"load avg {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} on {os.cpu_count()} cpus"
    try:
        import psutil

        s += f", cpu busy {psutil.cpu_percent(interval=0.2):.0f}%"
    except ImportError:
        pass
    return s


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
