"""The SFT warm-start step (pure): mean cross-entropy over ``loss_mask`` tokens, with its own
optax chain (clip ``optim.max_grad_norm``, AdamW with ``sft.lr`` and ``sft.warmup_steps``,
constant). Its optimizer state lives outside the TrainState (not checkpointed).

:class:`SftRunner` is the host side the learner delegates ``Learner.sft_step`` to. When SFT
ends, the runtime calls ``Learner.reset_proximal()`` (the correction's state is re-anchored on
the SFT params and the current version re-snapshotted).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_rl.learner.batch import validate_batch
from jax_rl.config import Config
from jax_rl.learner.trees import tree_finite, tree_where
from jax_rl.learner.holder import LearnerProcesses, StateHolder
from jax_rl.learner.spec import make_sft_optimizer
from jax_rl.placement import BatchPlacement
from jax_rl.learner.train_step import make_logprob_fn, opt_state_shardings

__all__ = ["SFT_FIELDS", "make_sft_step", "SftRunner"]

SFT_FIELDS = ("tokens", "attention_mask", "loss_mask")


def make_sft_step(cfg: Config, graphdef, tx, schedule, mesh, *, rest: Any, param_shardings: Any,
                  opt_shardings: Any, batch_sharding: NamedSharding):
    """Jitted ``(params, opt_state, count, {tokens, attention_mask, loss_mask} [1,m,r,T]) ->
    (params, opt_state, metrics)`` (params and optimizer state donated). A non-finite loss,
    gradient or update is skipped (``nonfinite_updates`` = 1)."""
    logprobs = make_logprob_fn(graphdef, rest, float(cfg.algo.temperature), cfg.model.logits_chunk_tokens)

    def fn(params, opt_state, count, d):
        n = jnp.maximum(jnp.sum(d["loss_mask"].astype(jnp.float32)), 1.0)

        def mloss(p, x):
            lp = logprobs(p, x["tokens"], x["attention_mask"]).logp
            return -jnp.sum(jnp.where(x["loss_mask"], lp, 0.0)) / n

        vg = jax.value_and_grad(mloss)
        xs = {k: v[0] for k, v in d.items()}  # [m, r, T]

        def body(acc, x):
            l, gr = vg(params, x)
            return (jax.tree.map(jnp.add, acc[0], gr), acc[1] + l), None

        (grads, loss), _ = lax.scan(body, (jax.tree.map(jnp.zeros_like, params), jnp.float32(0)), xs)
        gnorm = optax.tree.norm(grads)
        upd, new_opt = tx.update(grads, opt_state, params)
        new_p = optax.apply_updates(params, upd)
        finite = jnp.isfinite(gnorm) & jnp.isfinite(loss) & tree_finite(new_p)
        return (tree_where(finite, new_p, params), tree_where(finite, new_opt, opt_state),
                {"sft_loss": loss, "grad_norm": gnorm, "lr": jnp.asarray(schedule(count), jnp.float32),
                 "nonfinite_updates": (~finite).astype(jnp.float32)})

    rep = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(param_shardings, opt_shardings, rep, {k: batch_sharding for k in SFT_FIELDS}),
                   out_shardings=(param_shardings, opt_shardings, rep), donate_argnums=(0, 1))


class SftRunner:
    """Host side of SFT for one learner: the SFT optimizer state, its update count, the jitted
    step per row layout. Built from the learner's pieces (it holds no learner).

    Args:
        cfg: the run config (``sft``, ``optim.max_seq_len`` / ``microbatches``, ``algo.temperature``, ``model``).
        held: the learner's :class:`~jax_rl.learner.holder.StateHolder` (its params are trained; the new params
            are written back there, the rest of the train state unchanged).
        graphdef, rest: the model split (``nnx.split``: the graph and its non-param state).
        mesh: the learner's mesh; ``param_shardings``: the params' shardings on it.
        placement: the learner's :class:`~jax_rl.placement.BatchPlacement` (host batch -> [1, m, r, T] arrays).
        vocab_size: the model's vocabulary (token ids are checked against it).
        processes: the processes holding the learner (:class:`~jax_rl.learner.holder.LearnerProcesses`: the
            step's metrics reach the others through it).
    """

    def __init__(self, cfg: Config, held: StateHolder, *, graphdef: Any, rest: Any, mesh: Any, param_shardings: Any,
                 placement: BatchPlacement, vocab_size: int, processes: LearnerProcesses):
        self.cfg, self.held, self.graphdef, self.rest, self.mesh = cfg, held, graphdef, rest, mesh
        self.param_shardings, self.placement, self.vocab_size, self.procs = param_shardings, placement, vocab_size, processes
        self.microbatches = int(cfg.optim.microbatches)
        self.tx, self.schedule = make_sft_optimizer(cfg)
        self.opt_state = None
        self.count = 0
        self._steps: dict[int, Any] = {}

    def step(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One SFT step on the learner's params (``Learner.sft_step``)."""
        t0 = time.perf_counter()
        B, T = np.shape(batch["tokens"])
        full = {k: batch[k] for k in SFT_FIELDS}
        full.update(behav_logp=np.zeros((B, T), np.float32), versions=np.full((B, T), -1, np.int32),
                    turn_ids=np.full((B, T), -1, np.int32), advantages=np.zeros((B, T), np.float32))
        b = validate_batch(full, max_seq_len=self.cfg.optim.max_seq_len, vocab_size=self.vocab_size,
                           row_divisor=self.microbatches)
        n_loss = int(b["loss_mask"].sum())
        if n_loss == 0:
            return {"skipped": 1.0, "sft_loss": 0.0, "sft_tokens": 0.0, "step_time_s": time.perf_counter() - t0}
        params = self.held.state.params
        if self.opt_state is None:
            self.opt_sh = opt_state_shardings(self.tx, params, self.param_shardings, self.mesh)
            with jax.set_mesh(self.mesh):
                self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_sh)(params)
        dev, r = self.placement.device_batch({k: b[k] for k in SFT_FIELDS}, process_local=False, U=1,
                                             m=self.microbatches)
        if r not in self._steps:
            self._steps[r] = make_sft_step(self.cfg, self.graphdef, self.tx, self.schedule, self.mesh, rest=self.rest,
                                           param_shardings=self.param_shardings, opt_shardings=self.opt_sh,
                                           batch_sharding=self.placement.batch_sharding(r))
        with jax.set_mesh(self.mesh):
            params, self.opt_state, metr = self._steps[r](params, self.opt_state, jnp.int32(self.count), dev)
        self.held.state = self.held.state.replace(params=params)
        out = self.procs.host_values(lambda: {k: float(v) for k, v in jax.device_get(metr).items()})
        self.count += int(out["nonfinite_updates"] == 0)  # like AdamW's count: applied updates
        dt = time.perf_counter() - t0
        out.update(sft_tokens=float(n_loss), step_time_s=dt, tokens_per_s=float(b["attention_mask"].sum()) / dt)
        return out
