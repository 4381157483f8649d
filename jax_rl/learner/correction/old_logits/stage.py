"""The learner's old-logit stage: its no-grad forward, its snapshot store and the scorer of its run.

:class:`OldLogitStage` (``Learner.old_logits``) owns what the learner needs for exact old
log-probs (``loss.correction=exact``, or an approximate mode's ``old_logits.measure_error``):

- :meth:`~OldLogitStage.logprob_fn`: the learner's no-grad log-prob forward with its training
  numerics, jitted once per (routes, param shardings); every old-logit scorer runs it;
- :attr:`~OldLogitStage.store`: the snapshot store (:class:`jax_rl.learner.correction.old_logits.SnapshotStore`) when
  the correction strategy asks for it (:attr:`jax_rl.learner.correction.Correction.learner_store`), holding
  the last ``async.max_staleness + 1`` versions;
- :meth:`~OldLogitStage.score`: a batch's exact old log-probs from the store (the learner's host
  step, :func:`jax_rl.learner.correction.host_inputs`);
- :meth:`~OldLogitStage.make_scorer`: the rollout-side scorer of a route that scores before the
  buffer (:class:`jax_rl.learner.correction.old_logits.OldLogitScorer`), on the learner's devices or on
  ``placement.scorer``.

It is built from the learner's pieces and imports nothing of the learner above it: the learner's forward and
the scorer's placement arrive as callables (``make_forward``, ``place_scorer``), the live params through a
getter, so :class:`~jax_rl.learner.learner.Learner` composes it like its other stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import jax

from jax_rl.learner.correction.old_logits.scorer import OldLogitScorer
from jax_rl.learner.correction.old_logits.store import SnapshotStore, snapshot_logprobs, versions_needed
from jax_rl.placement import resolve_roles

__all__ = ["OldLogitStage"]

# (param_shardings=..., with_routes=bool) -> the jitted no-grad forward (the learner's make_logprob_step, bound)
MakeForward = Callable[..., Callable]
# scorer devices -> (mesh, abstract params, param shardings) on them (the learner's scorer_placement, bound)
PlaceScorer = Callable[[Any], tuple]


class OldLogitStage:
    """The old-logit stage of one learner, built from the learner's pieces (it holds no learner).

    Args:
        cfg: the run config (``old_logits.dir`` / ``store`` / ``route``, ``run.dir``, ``async.max_staleness``,
            ``optim.max_seq_len`` / ``seq_len_buckets`` and ``placement.scorer`` are read).
        params: the learner's params getter: ``params()`` -> the live params (an ``nnx.State``; read, never kept).
        keep_store: keep a snapshot store (:attr:`jax_rl.learner.correction.Correction.learner_store`).
        mesh: the learner's ``('data','fsdp','tensor','expert')`` mesh.
        param_shardings: the params' shardings on ``mesh``.
        routing: the routing-replay policy (:class:`jax_rl.routing_replay.RoutingReplay`: whether a forward
            forces the rollout's routes).
        make_forward: ``make_forward(param_shardings=..., with_routes=bool)`` -> the learner's jitted no-grad
            forward with its training numerics for params living there
            (:func:`jax_rl.learner.train_step.make_logprob_step` bound to the config and model split).
        place_scorer: ``place_scorer(devices)`` -> ``(mesh, abstract params, param shardings)`` of a scorer on
            those devices (:func:`jax_rl.learner.spec.scorer_placement` bound to the config and model config).
        model_state: the model has non-param state (a scorer on other devices cannot hold it).

    Attributes:
        store: the snapshot store (version 0 put at construction), or None when the correction
            strategy keeps none.
    """

    def __init__(self, cfg: Any, params: Callable[[], Any], *, keep_store: bool, mesh: Any, param_shardings: Any,
                 routing: Any, make_forward: MakeForward, place_scorer: PlaceScorer, model_state: bool = False):
        self.cfg, self.params, self.mesh, self.param_shardings = cfg, params, mesh, param_shardings
        self.routing, self.make_forward, self.place_scorer = routing, make_forward, place_scorer
        self.model_state = bool(model_state)
        self._fns: dict[bool, Any] = {}
        self.store: Optional[SnapshotStore] = None
        if keep_store:
            store_dir = cfg.old_logits.dir or (str(Path(cfg.run.dir) / "old_logits") if cfg.run.dir else None)
            self.store = SnapshotStore(int(cfg.async_.max_staleness) + 1, cfg.old_logits.store, store_dir)
            self.store.put(0, params())

    def logprob_fn(self, routes: bool = False, param_shardings: Any = None):
        """The learner's no-grad log-prob forward with its training numerics, jitted (the one every
        old-logit scorer runs).

        ``(params, tokens int32 [U,m,r,T], attention_mask bool [U,m,r,T]) -> logp float32 [U,m,r,T]``
        (``make_forward``, :func:`jax_rl.learner.train_step.make_logprob_step`: fp32 master params, the model's compute
        dtype, ``algo.temperature`` and the sampler's ``rollout.top_k`` / ``top_p`` truncation;
        ``logp[..., 0] = 0``, 0 on padding). ``routes=True``: ``(params, tokens, attention_mask,
        routes [U,m,r,T,n_moe_layers,k]) -> logp`` with those expert ids forced (the r3 forward).

        Args:
            param_shardings: where the params it reads live (default: the learner's own; built
                once and cached then). Another tree (a scorer on ``placement.scorer``) gets the
                same forward jitted for it.
        """
        if param_shardings is not None:
            return self.make_forward(param_shardings=param_shardings, with_routes=routes)
        if routes not in self._fns:
            self._fns[routes] = self.make_forward(param_shardings=self.param_shardings, with_routes=routes)
        return self._fns[routes]

    def forward(self, dev: dict) -> Callable:
        """The no-grad forward ``(params, tokens, attention_mask) -> logp`` for ``dev``'s batch (device
        arrays [U,m,r,T]): it forces the batch's routes when the routing-replay policy says so (r3)."""
        if self.routing.forces_rollout_routes and dev.get("routes") is not None:
            routes, fn = dev["routes"], self.logprob_fn(routes=True)
            return lambda p, t, a: fn(p, t, a, routes)
        return self.logprob_fn()

    def score(self, b: dict, dev: dict, g: int) -> tuple[jax.Array, dict]:
        """Exact old log-probs [U,m,r,T] of a batch from the snapshot store, each token under its own
        behaviour version (``versions``), and the store's stats (``old_logits_forwards``, ...); under
        ``moe.routing_replay=r3`` every version's forward forces the rollout's routes.

        Args:
            b: the host batch [B, T] (its ``versions`` and ``loss_mask`` name the versions needed).
            dev: the same batch as device arrays [U,m,r,T].
            g: the learner's version (its live params score version ``g``).

        Raises:
            jax_rl.learner.correction.old_logits.StaleVersionError: a version the store no longer holds.
        """
        return snapshot_logprobs(
            self.store, self.forward(dev), tokens=dev["tokens"], attention_mask=dev["attention_mask"],
            versions=dev["versions"], needed=versions_needed(b["versions"], b["loss_mask"]), current_version=g,
            current_params=self.params(), shardings=self.param_shardings,
        )

    def make_scorer(self, *, keep: Optional[int] = None, pad_id: int = 0, devices: Any = "placement"
                    ) -> OldLogitScorer:
        """The rollout-side old-logit scorer of this run (:class:`jax_rl.learner.correction.old_logits.OldLogitScorer`),
        holding at most ``keep`` versions (default ``async.max_staleness + 1``): on the learner's
        mesh with the learner's own forward (no scorer devices), else on a
        ``('data','fsdp','tensor','expert')`` mesh over the scorer's devices (fsdp = all of them)
        with the same forward jitted there. It forces the rollout's routes when the routing-replay
        policy does.

        Args:
            devices: the scorer's devices: default ``placement.scorer`` of this run
                (:func:`jax_rl.placement.resolve_roles`); None = the learner's.

        Raises:
            ValueError: a multi-process run (the scorer thread runs in one process); a model with
                non-param state on ``placement.scorer``.
        """
        cfg = self.cfg
        if jax.process_count() > 1:
            raise ValueError(f"old_logits.route={cfg.old_logits.route} runs its scorer thread in a single-process "
                             f"run only (this one has {jax.process_count()} processes): use old_logits.route's default "
                             "(the learner's snapshot store)")
        forced = self.routing.forces_rollout_routes
        keep = int(cfg.async_.max_staleness) + 1 if keep is None else int(keep)
        common = dict(keep=keep, max_seq_len=cfg.optim.max_seq_len, buckets=cfg.optim.seq_len_buckets,
                      pad_id=pad_id)
        devs = resolve_roles(cfg).scorer if isinstance(devices, str) else devices
        if devs is None:
            return OldLogitScorer(self.logprob_fn(), self.param_shardings, self.mesh,
                                  routes_fn=self.logprob_fn(routes=True) if forced else None, **common)
        if self.model_state:
            raise ValueError("placement.scorer: the model has non-param state; share the learner's devices "
                             "(placement.scorer=null)")
        mesh, _, shardings = self.place_scorer(devs)
        return OldLogitScorer(self.logprob_fn(param_shardings=shardings), shardings, mesh,
                              routes_fn=self.logprob_fn(routes=True, param_shardings=shardings) if forced else None,
                              **common)

    def close(self) -> None:
        """Release the snapshot store (its disk files, with ``old_logits.store=disk``)."""
        if self.store is not None:
            self.store.close()
