"""Shared helpers for the learner tests: tiny configs and synthetic batches."""

from __future__ import annotations

import numpy as np

from jax_rl.config import Config


def make_cfg(correction: str = "ppo", preset: str = "tiny_dense", *, B: int = 8, T: int = 16, mesh=None,
             hf=None, **sections) -> Config:
    """A validated Config for tiny learner runs (algo.group_size 4, max_seq_len 32)."""
    d = {
        "model": {"preset": preset, "hf_overrides": dict(hf or {})},
        "loss": {"correction": correction},
        "optim": {"batch_size": B, "max_seq_len": 32, "lr": 1e-3},
        "algo": {"group_size": 4},
        "rollout": {"max_cache_len": 32},
        "mesh": dict(mesh or {"data": 1, "fsdp": -1, "tensor": 1, "expert": 1}),
        "run": {"steps": 10},
    }
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return Config.model_validate(d)


def make_batch(seed: int = 0, B: int = 8, T: int = 16, vocab: int = 384, version: int = 0,
               behav_offset: float = 0.0, prompt: int = 4) -> dict[str, np.ndarray]:
    """Random right-padded batch: a prompt of ``prompt`` tokens, then generated tokens.

    behav_logp is a plausible value (-log V + offset) on loss tokens; rows have different
    lengths; versions = ``version`` on loss tokens.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    lens = rng.integers(T // 2, T + 1, B)
    lens[0] = T
    am = np.arange(T)[None, :] < lens[:, None]
    lm = am & (np.arange(T)[None, :] >= prompt)
    behav = np.where(lm, -np.log(vocab) + behav_offset + 0.1 * rng.normal(size=(B, T)), 0.0).astype(np.float32)
    adv = np.repeat(rng.normal(size=(B, 1)), T, 1).astype(np.float32) * lm
    return {
        "tokens": tokens,
        "attention_mask": am,
        "loss_mask": lm,
        "behav_logp": behav,
        "versions": np.where(lm, version, -1).astype(np.int32),
        "turn_ids": np.where(lm, 0, -1).astype(np.int32),
        "advantages": adv.astype(np.float32),
    }


def trained_exact_learner():
    """A snapshot-route learner (``loss.correction=exact``, K=2) after 3 steps, its store holding
    versions 1, 2, 3, and a batch [B=8, T=16] whose rows mix versions 1..3; rows 0 (2 then 3) and
    5 (1 then 2) span two versions, as ``rollout.partial=continue`` rollouts do. Returns (learner,
    batch)."""
    from jax_rl.learner.learner import Learner

    cfg = make_cfg("exact", **{"async": {"max_staleness": 2}})
    lrn = Learner(cfg, init_params=init_params(cfg))
    for g in range(3):
        lrn.train_step(make_batch(10 + g, B=8, T=16, version=g))
    b = make_batch(20, B=8, T=16, version=3)
    lm = b["loss_mask"]
    b["versions"][0] = np.where(lm[0], np.where(np.arange(16) < 10, 2, 3), -1)
    b["versions"][1] = np.where(lm[1], 1, -1)
    b["versions"][2] = np.where(lm[2], 2, -1)
    b["versions"][5] = np.where(lm[5], np.where(np.arange(16) < 7, 1, 2), -1)
    return lrn, b


def host(tree):
    """numpy copy of a pytree of (possibly sharded) arrays."""
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


def max_abs_diff(a, b) -> float:
    import jax

    d = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) if np.size(x) else 0.0, a, b)
    return max(jax.tree.leaves(d) or [0.0])


_INIT_CACHE: dict = {}


def layer_leaf(tree, *path):
    """The first decoder layer's ``path`` subtree of a params tree (State or dict) in either
    layout: ``tree["layers"][0][*path]`` unrolled, ``tree["layers"][*path]`` (all layers on
    the leading axis) under ``model.scan_layers``."""
    node = tree["layers"]
    if 0 in node or "0" in node:
        node = node[0] if 0 in node else node["0"]
    for k in path:
        node = node[k]
    return node


def init_params(cfg: Config, seed: int = 0):
    """Cheap deterministic host init (numpy normal(0, 0.02), norms = 1) as a nested dict.

    Avoids the model's jitted random init (seconds of RNG compile per learner on this CPU).
    """
    import jax
    from flax import nnx

    from jax_rl.learner.learner import resolve_model_config
    from jax_rl.models.qwen3 import Qwen3ForCausalLM

    mc = resolve_model_config(cfg.model)
    key = (repr(mc), seed)
    if key not in _INIT_CACHE:
        abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))), nnx.Param))
        rng = np.random.default_rng(seed)
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        leaves = []
        for path, x in flat:
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            if "norm" in name:
                leaves.append(np.ones(x.shape, np.float32))
            else:
                leaves.append((0.02 * rng.standard_normal(x.shape)).astype(np.float32))
        _INIT_CACHE[key] = jax.tree.unflatten(treedef, leaves)
    return _INIT_CACHE[key]
