"""The pure train step: ``make_train_step(cfg, graphdef, tx, strategy, mesh)`` returns one
jitted function ``(TrainState, LearnerBatch) -> (TrainState, metrics)`` (explicit in/out
shardings, the state donated), built once per batch layout, as purejaxrl's ``make_train``.

One call does everything for one published version:

1. pi_prox: ``strategy.prox_logp`` (:mod:`jax_rl.learner.correction`; it may update its own state, e.g.
   the EWMA reset, effective for this step), and from it the train-infer factor pi_prox/mu of the
   whole batch, once (:func:`train_infer_once`; a strategy that derives pi_prox from the gradient
   forward, ``linear_prox`` with one update, has each microbatch compute its own).
2. ``optim.ppo_epochs x optim.minibatches`` optimizer updates (``lax.scan``), each over
   ``optim.microbatches`` gradient-accumulation microbatches (``lax.scan``). Normalisation is
   global: every microbatch's loss is divided by the minibatch's
   :func:`jax_rl.learner.losses.loss_denominator`, so the summed loss and gradient equal the
   single-microbatch ones whatever the split. An update with a non-finite loss, gradient norm
   or updated params is skipped (params and optimizer state kept; ``nonfinite_updates``).
3. ``strategy.after_update`` (the EWMA update), then ``version += 1`` and
   ``step += number of applied updates``.

Batch layout: rows are split ``B = U * m * r`` (U = ``optim.minibatches``, m =
``optim.microbatches``) into [U, m, r, T]; minibatch u, microbatch j is rows
``(u*m + j)*r : (u*m + j + 1)*r``. All log-prob forwards go through :func:`make_logprob_fn`
(``jax_rl.learner.logprobs.sequence_logprobs``: fp32 logits, temperature ``algo.temperature``,
and ``rollout.top_k`` / ``rollout.top_p`` reproduced when the sampler truncates: log pi_trunc,
with tokens outside the learner's kept set masked by ``losses.policy_loss`` and counted by
``losses.truncation_metrics``).

MoE routing replay (``moe.routing_replay``, :class:`jax_rl.routing_replay.RoutingReplay`): ``r3`` forces the rollout
engine's recorded expert ids (``batch.routes``) in every forward of the step (pi_prox and the
gradient forward; the exact route's host-step forwards do the same in the learner); ``r2`` runs
one no-grad routing forward at the step's starting params and forces its routes in the gradient
forward only. Both log ``routing_agreement`` when the batch carries the rollout's routes: the
fraction of (token, MoE layer) pairs where the learner's router at the step's starting params
picks the same top-k set as the rollout engine did.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_rl.learner import losses
from jax_rl.learner.batch import LearnerBatch
from jax_rl.config import Config, OptimConfig
from jax_rl.learner.correction import Correction
from jax_rl.learner.trees import tree_finite, tree_where
from jax_rl.learner.logprobs import HeadOptions, LogprobOutput, sequence_logprobs
from jax_rl.models import bitwise
from jax_rl.models.qwen3 import stack_routes, unstack_routes
from jax_rl.learner.reductions import SUM, Reduction, combine_metrics, combine_updates
from jax_rl.routing_replay import RoutingReplay, routing_agreement  # noqa: F401 (routing_agreement re-exported)
from jax_rl.sampling import truncates

__all__ = ["TrainState", "StepParts", "PackedStep", "train_infer_once", "make_schedule", "make_optimizer", "make_logprob_fn", "make_train_step",
           "make_grads_fn", "make_logprob_step", "group_metrics", "make_route_fn", "routing_agreement", "opt_state_shardings", "train_state_shardings", "init_train_state", "initial_state"]


@flax.struct.dataclass
class TrainState:
    """Everything the train step reads and writes (a pytree; donated to the step).

    Fields:
        params: ``nnx.State`` of the model's ``nnx.Param``s, fp32 master weights.
        opt_state: optax state of ``make_optimizer``'s chain (moments like the params).
        correction: the correction strategy's state (EWMA: :class:`jax_rl.learner.correction.EwmaState`;
            None for the stateless modes).
        version: int32 scalar, published versions (one per train step).
        step: int32 scalar, applied optimizer updates.

    No PRNG key: the train step is deterministic (sampling keys live in the engine, per request
    seed and position). Checkpoints written with the former ``rng`` leaf still restore
    (:data:`jax_rl.checkpoint.trees.RETIRED_STATE_LEAVES`).
    """

    params: Any
    opt_state: Any
    correction: Any
    version: jax.Array
    step: jax.Array


# ======================================================================================
# Optimizer
# ======================================================================================


def make_schedule(lr: float, warmup_steps: int, schedule: str = "constant", total_steps: Optional[int] = None,
                  min_lr_ratio: float = 0.0) -> optax.Schedule:
    """Learning-rate schedule over optimizer updates: linear warmup 0 -> lr, then constant or
    cosine decay to ``lr * min_lr_ratio`` at ``total_steps`` (cosine only)."""
    if schedule == "cosine":
        total = max(int(total_steps or 1), warmup_steps + 1)
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps=warmup_steps, decay_steps=total, end_value=lr * min_lr_ratio
        )
    if schedule != "constant":
        raise ValueError(f"optim.schedule={schedule!r} must be 'constant' or 'cosine'")
    if warmup_steps <= 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)], [warmup_steps]
    )


def _layer_ndim(path: tuple, x: Any) -> int:
    """``x``'s rank as one layer sees it: under ``model.scan_layers`` a decoder param sits at
    ``layers/<name>`` with the layers on a leading axis, which is not counted (an unrolled one
    sits at ``layers/<i>/<name>``)."""
    keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
    nd = jnp.ndim(x)
    if "layers" in keys[:-1]:
        nxt = keys[keys.index("layers") + 1]
        if not (isinstance(nxt, int) or str(nxt).isdigit()):
            nd -= 1
    return nd


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (not norms / biases), in either layer layout: a stacked
    norm weight [L, H] is a vector per layer and is not decayed."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _layer_ndim(p, x) >= 2, params)


def make_optimizer(optim: OptimConfig, total_steps: Optional[int] = None, *, lr: Optional[float] = None,
                   warmup_steps: Optional[int] = None, schedule: Optional[str] = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``optax.chain(clip_by_global_norm, adamw)`` with the warmup + constant|cosine schedule.

    Args:
        optim: the optim config section (b1, b2, eps, weight_decay, max_grad_norm, ...).
        total_steps: optimizer updates of the whole run (cosine decay length).
        lr / warmup_steps / schedule: overrides (the SFT chain uses sft.lr, constant).

    Returns:
        (tx, schedule): the schedule maps the update count (int) to the lr.
    """
    sched = make_schedule(
        optim.lr if lr is None else lr,
        optim.warmup_steps if warmup_steps is None else warmup_steps,
        optim.schedule if schedule is None else schedule,
        total_steps,
        optim.min_lr_ratio,
    )
    clip = optax.identity() if optim.max_grad_norm is None else optax.clip_by_global_norm(optim.max_grad_norm)
    tx = optax.chain(
        clip,
        optax.adamw(sched, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                    mask=_decay_mask),
    )
    return tx, sched


# ======================================================================================
# State
# ======================================================================================


def opt_state_shardings(tx, abstract_params: Any, param_shardings: Any, mesh) -> Any:
    """Shardings of ``tx``'s state: moments like their params, counters replicated."""
    rep = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, abstract_params), param_shardings,
        transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def train_state_shardings(tx, strategy: Correction, param_shardings: Any, abstract_params: Any, mesh) -> TrainState:
    """Shardings of every TrainState leaf: params by the logical rules, optimizer moments like
    their params, the strategy's state as it declares, scalars replicated."""
    rep = NamedSharding(mesh, P())
    opt_sh = opt_state_shardings(tx, abstract_params, param_shardings, mesh)
    return TrainState(params=param_shardings, opt_state=opt_sh,
                      correction=strategy.state_shardings(param_shardings, rep),
                      version=rep, step=rep)


def initial_state(tx, strategy: Correction, params: Any) -> TrainState:
    """The step-0 TrainState of ``params`` (pure: jit it, or ``jax.eval_shape`` it for AOT)."""
    return TrainState(params=params, opt_state=tx.init(params), correction=strategy.init_state(params),
                      version=jnp.int32(0), step=jnp.int32(0))


def init_train_state(tx, strategy: Correction, params: Any, shardings: TrainState) -> TrainState:
    """The step-0 TrainState on the mesh (:func:`initial_state` jitted with the given out shardings)."""
    return jax.jit(lambda p: initial_state(tx, strategy, p), in_shardings=(shardings.params,),
                   out_shardings=shardings)(params)


# ======================================================================================
# Forward and gradients
# ======================================================================================


def make_logprob_fn(graphdef, rest: Any, temperature: float, chunk_tokens: Optional[int] = None, *,
                    top_k: int = 0, top_p: float = 1.0):
    """``(params, tokens [r,T], attention_mask [r,T], return_entropy=False, routes=None,
    return_moe_drops=False) -> LogprobOutput`` (:class:`jax_rl.learner.logprobs.LogprobOutput`: ``logp``
    [r,T] float32, ``logp[:, 0] = 0``; ``entropy`` [r,T] with ``return_entropy``; ``moe_drops``
    with ``return_moe_drops``; see ``sequence_logprobs``), training numerics. ``chunk_tokens``:
    LM-head chunk length (``model.logits_chunk_tokens``; None: by a 4M-logit budget).
    ``top_k`` / ``top_p``: the rollout sampler's truncation (``rollout.top_k`` / ``rollout.top_p``),
    reproduced in the chunked head (log pi_trunc, ``-inf`` outside the kept set; see
    ``sequence_logprobs``); the defaults leave the untruncated path unchanged."""

    def logprobs(params, tokens, attention_mask, return_entropy: bool = False, routes=None,
                 return_moe_drops: bool = False) -> LogprobOutput:
        # routes [r,T,n_moe_layers,k] or None: forced expert ids (moe.routing_replay)
        return sequence_logprobs(nnx.merge(graphdef, params, rest), tokens, attention_mask,
                                 temperature=temperature, return_entropy=return_entropy,
                                 head=HeadOptions(chunk_tokens=chunk_tokens, top_k=top_k, top_p=top_p),
                                 forced_expert_ids=unstack_routes(routes), return_moe_drops=return_moe_drops)

    return logprobs


def make_route_fn(graphdef, rest: Any):
    """``(params, tokens [r,T], attention_mask [r,T]) -> routes int32 [r,T,n_moe_layers,k]``: the
    top-k expert ids the model's own routers pick at every position (the decoder trunk only, no
    LM head; no gradient). The learner's side of ``routing_agreement`` and r2's recorded routes."""

    def routes(params, tokens, attention_mask):
        model = nnx.merge(graphdef, lax.stop_gradient(params), rest)
        return stack_routes(model.hidden_states(tokens, None, attention_mask).expert_ids).astype(jnp.int32)

    return routes


def _rl_logprob_fn(cfg: Config, graphdef, rest: Any):
    """The RL learner's log-prob forward: the rollout's temperature AND truncation (every RL
    forward goes through it: the gradient forward, the prox forwards of the correction
    strategies, the exact route's snapshot forwards), so pi_prox/mu and pi_theta/pi_prox are
    both ratios of the distribution the rollout sampled from."""
    r = cfg.rollout
    return make_logprob_fn(graphdef, rest, float(cfg.algo.temperature), cfg.model.logits_chunk_tokens,
                           top_k=int(r.top_k), top_p=float(r.top_p))


def _logp_only(logprobs) -> Callable[..., jax.Array]:
    """A :func:`make_logprob_fn` closure as ``(params, tokens, attention_mask, routes=None) -> logp
    [r,T]`` (its ``LogprobOutput.logp``): what :func:`chunked` maps over a batch."""
    return lambda params, tokens, attention_mask, routes=None: logprobs(params, tokens, attention_mask,
                                                                        routes=routes).logp


def chunked(logprobs, *, with_routes: bool = True) -> Callable[..., jax.Array]:
    """Log-probs of a chunked batch [U, m, r, T], one microbatch forward at a time:
    ``(params, tokens, attention_mask, routes=None)``; ``routes`` [U, m, r, T, n_moe_layers, k]
    forces those expert ids (``moe.routing_replay``). ``logprobs(params, tokens [r,T],
    attention_mask [r,T], routes=...)`` returns an array [r,T,...] (:func:`_logp_only` of a
    log-prob forward). ``with_routes=False``: ``logprobs`` takes no ``routes`` (e.g.
    :func:`make_route_fn`); the output keeps its trailing dims."""

    def chunk_logprobs(params, tokens, attention_mask, routes=None):
        U, m, r, T = tokens.shape
        tk = tokens.reshape(U * m, r, T)
        am = attention_mask.reshape(U * m, r, T)
        rt = None if routes is None else routes.reshape(U * m, r, T, *routes.shape[4:])
        kw = (lambda x: {"routes": x}) if with_routes else (lambda x: {})
        if U * m == 1:
            out = logprobs(params, tk[0], am[0], **kw(None if rt is None else rt[0]))[None]
        else:
            out = lax.map(lambda xs: logprobs(params, xs[0], xs[1], **kw(xs[2])), (tk, am, rt))
        return out.reshape(U, m, r, T, *out.shape[3:])

    return chunk_logprobs


def train_infer_once(loss_cfg, prox: jax.Array, b: LearnerBatch) -> losses.TrainInfer:
    """The train-infer factor pi_prox/mu of a whole chunked batch, once per step
    (:func:`jax_rl.learner.losses.train_infer_factor` over its rows; every leaf [U, m, r, T], the
    ``catastrophic_row`` [U, m, r]). pi_prox (computed before the updates), mu, the masks and turn ids
    do not move during the step's ``ppo_epochs x minibatches`` updates, so every update and
    microbatch takes its rows of this one result instead of recomputing it; the factor is per row, so
    the values are those of a per-microbatch computation."""
    shape = b.tokens.shape
    T = shape[-1]
    f = lambda x: x.reshape(-1, T)  # noqa: E731
    ti = losses.train_infer_factor(f(prox), f(b.behav_logp), f(b.loss_mask), loss_cfg, turn_ids=f(b.turn_ids))
    return jax.tree.map(lambda x: x.reshape(shape[:-1] + x.shape[1:]), ti)


def _minibatch_grads(cfg: Config, strategy: Correction, logprobs, params, mb: LearnerBatch, prox, g,
                     moe: bool = False, ti: Optional[losses.TrainInfer] = None):
    """Loss, grads and combined metrics of one minibatch ([m, r, T] arrays), accumulated over its
    m microbatches with the minibatch's global denominator. ``moe``: also count the gradient
    forward's MoE capacity drops (``moe_dropped_copies``, ``moe_copies``, ``moe_dropped_frac``).
    ``ti``: the minibatch's rows of the step's train-infer factor (:func:`train_infer_once`; leaves
    [m, r, T]); None: each microbatch computes its own (pi_prox derived from the gradient forward)."""
    lc = cfg.loss
    truncated = truncates(cfg.rollout.top_k, cfg.rollout.top_p)
    m, r, T = mb.tokens.shape
    f2 = lambda x: x.reshape((m * r,) + x.shape[2:])  # noqa: E731  [m, r, ...] -> [m*r, ...]
    if prox is None and not lc.keep_masked_in_denominator:
        # the kept-token denominator needs pi_prox, which this mode makes only inside the gradient
        # forward (``micro_prox``, e.g. linear_prox with one update per step); with one microbatch
        # that forward sees the whole minibatch, so its own denominator is the global one
        if m != 1:  # pragma: no cover - a strategy must supply prox_logp here (Correction.prox_logp)
            raise ValueError(f"loss.correction={lc.correction}: loss.keep_masked_in_denominator=false with "
                             f"{m} microbatches needs prox_logp before the gradient forward")
        denom = None
    else:
        denom = losses.loss_denominator(
            f2(mb.loss_mask), lc, prox_logp=None if prox is None else f2(prox),
            behav_logp=f2(mb.behav_logp), turn_ids=f2(mb.turn_ids),
            train_infer=None if ti is None else jax.tree.map(f2, ti),
        )

    def micro_loss(p, x: LearnerBatch, prox_j, ti_j):
        with_ent = lc.entropy_coef != 0.0  # entropy bonus: one pass over the same logits
        out = logprobs(p, x.tokens, x.attention_mask, return_entropy=with_ent, routes=x.routes,
                       return_moe_drops=moe)
        pl = prox_j if prox_j is not None else strategy.micro_prox(out.logp, x, g)
        loss, metr, tok = losses.policy_loss(
            out.logp, pl, x.behav_logp, x.advantages, x.loss_mask, lc, turn_ids=x.turn_ids,
            entropy=out.entropy, truncated=truncated, batch=losses.BatchTerms(denom, ti_j),
        )
        metr = dict(metr, **group_metrics(x, out.logp, pl, out.entropy, g, tok, truncated))
        if moe:
            metr = dict(metr, moe_dropped_copies=lax.stop_gradient(out.moe_drops.dropped),
                        moe_copies=lax.stop_gradient(out.moe_drops.copies))
        return loss, metr

    vg = jax.value_and_grad(micro_loss, has_aux=True)

    def body(acc, xs):
        x, prox_j, ti_j = xs
        (loss, metr), grads = vg(params, x, prox_j, ti_j)
        acc_g, acc_l = acc
        acc_g = jax.tree.map(jnp.add, acc_g, grads)
        return (acc_g, acc_l + loss), metr

    if m == 1:
        first = lambda v: None if v is None else jax.tree.map(lambda a: a[0], v)  # noqa: E731
        (loss, metr), grads = vg(params, mb.map(lambda v: v[0]), first(prox), first(ti))
    else:
        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, loss), metr = lax.scan(body, (zeros, jnp.float32(0.0)), (mb, prox, ti))
        metr = combine_metrics(metr, STEP_REDUCTIONS)
    return loss, grads, _with_moe_frac(metr) if moe else metr


def group_metrics(x: LearnerBatch, logp, prox_logp, entropy, g, tok: losses.PolicyTokens, truncated: bool
                  ) -> dict[str, jax.Array]:
    """The metric groups beside ``policy_loss``'s own (:data:`jax_rl.learner.losses.METRIC_GROUPS`) that the
    step's static config enables: ``staleness`` always (every batch carries ``versions``), ``prox_error``
    when the batch carries ``old_logp``, ``entropy`` when ``entropy`` [r, T] was computed
    (``loss.entropy_coef != 0``), ``truncation`` when the sampler truncates. ``x``: one microbatch ([r, T]
    fields); ``logp`` / ``prox_logp``: float [r, T] as the loss saw them; ``g``: int32 scalar, the
    version being trained; ``tok``: :func:`jax_rl.learner.losses.policy_loss`'s per-token masks."""
    m = losses.staleness_metrics(x.versions, g, x.loss_mask, tok.kept, tok.clipped)
    if x.old_logp is not None:
        m.update(losses.prox_error_metrics(prox_logp, x.old_logp, x.loss_mask, tok.usable))
    if entropy is not None:
        m.update(losses.entropy_metrics(entropy, x.loss_mask))
    if truncated:
        m.update(losses.truncation_metrics(logp, prox_logp, x.loss_mask))
    return m


STEP_REDUCTIONS: dict[str, Reduction] = {
    **losses.METRIC_REDUCTIONS,
    "moe_dropped_copies": SUM,  # the MoE layers' capacity drops in the gradient forward (counts)
    "moe_copies": SUM,
    "moe_dropped_frac": Reduction("update"),  # recomputed from the two counts
    "loss": Reduction("update"),
    "grad_norm": Reduction("update"),
    "lr": Reduction("update"),
    "nonfinite_updates": Reduction("update", over_updates="sum"),
}
"""The declared reduction of every metric one optimizer update yields: :func:`jax_rl.learner.losses.policy_loss`'s
and the train step's own (:func:`jax_rl.learner.reductions.combine_metrics` over microbatches,
:func:`jax_rl.learner.reductions.combine_updates` over the step's updates)."""


def _with_moe_frac(metrics: dict) -> dict:
    """``metrics`` with ``moe_dropped_frac`` = its ``moe_dropped_copies / moe_copies`` (0 when no
    copy was routed)."""
    return dict(metrics, moe_dropped_frac=metrics["moe_dropped_copies"] / jnp.maximum(metrics["moe_copies"], 1.0))


# ======================================================================================
# The train step
# ======================================================================================


def _route_chunk(graphdef, rest: Any, routing: RoutingReplay):
    """The chunked no-grad routing forward the routing-replay policy runs in the step (None when it
    runs none)."""
    if not routing.active:
        return None
    return chunked(make_route_fn(graphdef, rest), with_routes=False)


def _mode_options(cfg: Config) -> dict:
    """``jax.jit`` kwargs of the learner's programs: the bitwise mode's compiler options (``model.bitwise``)."""
    on = bool(getattr(cfg.model, "bitwise", False))
    return {"compiler_options": bitwise.compiler_options()} if on and bitwise.compiler_options() else {}


class StepParts(NamedTuple):
    """What every train-step program of one learner is built from (the learner's recipe,
    :class:`jax_rl.learner.spec.LearnerSpec`; :meth:`of` reads them off it or off a ``Learner``).

    Attributes:
        graphdef / rest: the model's static graph and non-param variables (``nnx.split``).
        tx / schedule: :func:`make_optimizer`'s chain and schedule (``lr`` metric).
        strategy: the correction strategy (:func:`jax_rl.learner.correction.make_correction`).
        routing: the routing-replay policy (:class:`jax_rl.routing_replay.RoutingReplay`: the
            MoE's expert count, 0 for a dense model, and ``moe.routing_replay``); an MoE step also
            counts the gradient forward's capacity drops. Default: none, dense.
    """

    graphdef: Any
    rest: Any
    tx: Any
    schedule: Any
    strategy: Correction
    routing: RoutingReplay = RoutingReplay()

    @classmethod
    def of(cls, src: Any) -> "StepParts":
        """The parts of ``src`` (a :class:`~jax_rl.learner.spec.LearnerSpec` or a ``Learner``: any object with
        these six attributes)."""
        return cls(src.graphdef, src.rest, src.tx, src.schedule, src.strategy, src.routing)


def make_train_step(cfg: Config, parts: StepParts, mesh, *, state_shardings: TrainState,
                    batch_sharding: Optional[NamedSharding] = None, packed_metrics: bool = False):
    """One jitted ``(TrainState, LearnerBatch [U,m,r,T]) -> (TrainState, metrics)``.

    Args:
        parts: the model split, optimizer, correction strategy and routing policy (:class:`StepParts`).
        state_shardings: :func:`train_state_shardings`; the state is donated.
        batch_sharding: sharding of every batch array (None: the arrays' own).
        packed_metrics: return a :class:`PackedStep` whose metrics are one float32 vector (what the
            learner fetches: one transfer per step) instead of a dict of scalars.
    """
    graphdef, rest, tx, schedule, strategy, routing = parts
    logprobs = _rl_logprob_fn(cfg, graphdef, rest)
    chunk = chunked(_logp_only(logprobs))
    route_chunk = _route_chunk(graphdef, rest, routing)
    n_epochs = int(cfg.optim.ppo_epochs)

    def step(state: TrainState, b: LearnerBatch):
        g = state.version
        params0 = state.params
        prox_routes, b, route_metrics = routing.step_routes(route_chunk, params0, b)
        prox_chunk = lambda p, t, a: chunk(p, t, a, prox_routes)  # noqa: E731
        prox, cstate, extra = strategy.prox_logp(prox_chunk, params0, state.correction, b, g)
        ti = None if prox is None else train_infer_once(cfg.loss, prox, b)  # once per step, not per update
        U = b.tokens.shape[0]

        def one_update(carry, i):
            params, opt_state, step = carry
            take = lambda x: None if x is None else lax.dynamic_index_in_dim(x, i % U, 0, keepdims=False)  # noqa: E731
            loss, grads, metr = _minibatch_grads(cfg, strategy, logprobs, params, b.map(take), take(prox), g,
                                                 moe=routing.num_experts > 0,
                                                 ti=None if ti is None else jax.tree.map(take, ti))
            gnorm = optax.tree.norm(grads)
            updates, new_opt = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            # a finite loss and gradient can still give non-finite params (a huge lr, an overflow)
            finite = jnp.isfinite(gnorm) & jnp.isfinite(loss) & tree_finite(new_params)
            params = tree_where(finite, new_params, params)
            opt_state = tree_where(finite, new_opt, opt_state)
            metr = dict(metr)
            metr.update(loss=loss, grad_norm=gnorm, lr=jnp.asarray(schedule(step), jnp.float32),
                        nonfinite_updates=(~finite).astype(jnp.float32))
            return (params, opt_state, step + finite.astype(jnp.int32)), metr

        n_up = n_epochs * U
        (params, opt_state, opt_step), metr = lax.scan(
            one_update, (params0, state.opt_state, state.step), jnp.arange(n_up, dtype=jnp.int32)
        )
        metrics = combine_updates(metr, STEP_REDUCTIONS)
        if "moe_dropped_frac" in metrics:  # pooled over the updates, not a mean of their fractions
            metrics = _with_moe_frac(metrics)
        cstate, after = strategy.after_update(params, cstate)
        metrics.update(extra)
        metrics.update(after)
        metrics.update(route_metrics)
        metrics["tokens"] = jnp.sum(b.attention_mask.astype(jnp.float32))
        metrics["loss_tokens"] = jnp.sum(b.loss_mask.astype(jnp.float32))
        metrics["updates"] = jnp.float32(n_up)
        new_state = TrainState(params=params, opt_state=opt_state, correction=cstate, version=g + 1,
                               step=opt_step)
        if packed_metrics:  # one float32 vector: one device -> host transfer for every metric
            metrics["opt_step"] = opt_step
            names = tuple(sorted(metrics))
            metric_names[jax.tree.structure(b)] = names
            return new_state, jnp.stack([jnp.asarray(metrics[k], jnp.float32) for k in names])
        return new_state, metrics

    rep = NamedSharding(mesh, P())
    metric_names: dict = {}
    fn = jax.jit(step, in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, rep),
                 donate_argnums=(0,), **_mode_options(cfg))
    return PackedStep(fn, metric_names) if packed_metrics else fn


class PackedStep:
    """A jitted train step (:func:`make_train_step` with ``packed_metrics``) whose metrics come back as
    ONE float32 vector [n_metrics] (one device -> host transfer per step, where a dict of ~60 scalars
    is ~60): ``(state, batch) -> (state, vector)``; :meth:`metrics` turns the fetched vector into the
    dict. ``lower`` is the jitted function's (AOT).

    Its entries are the step's metrics sorted by name, plus ``opt_step`` (the applied optimizer
    updates after the step, so the host needs no second transfer for ``TrainState.step``). The names
    depend on which optional batch fields are present (``old_logp``, ``routes``, ...), so they are
    recorded per batch structure when the step is traced.
    """

    def __init__(self, jitted, names: dict):
        self._jit = jitted
        self._names = names

    def __call__(self, state: TrainState, batch: LearnerBatch):
        return self._jit(state, batch)

    def lower(self, *args, **kwargs):
        return self._jit.lower(*args, **kwargs)

    def names(self, batch: LearnerBatch) -> tuple[str, ...]:
        """The vector's keys for a batch of ``batch``'s structure (after a call traced it).

        Raises:
            KeyError: no batch of this structure was traced yet.
        """
        return self._names[jax.tree.structure(batch)]

    def metrics(self, batch: LearnerBatch, vector: Any) -> dict[str, float]:
        """``{name: python float}`` of a step's vector (``np.asarray`` of it: the one transfer)."""
        import numpy as np

        vals = np.asarray(vector).tolist()
        return dict(zip(self.names(batch), vals))


def make_grads_fn(cfg: Config, graphdef, strategy: Correction, mesh, *, rest: Any, param_shardings: Any,
                  batch_sharding: Optional[NamedSharding] = None, routing: RoutingReplay = RoutingReplay()):
    """Jitted ``(params, correction state, version, LearnerBatch [U,m,r,T]) -> (loss, grads,
    metrics)`` of the FIRST minibatch with the strategy's pi_prox (tests, debugging)."""
    logprobs = _rl_logprob_fn(cfg, graphdef, rest)
    chunk = chunked(_logp_only(logprobs))
    route_chunk = _route_chunk(graphdef, rest, routing)

    def fn(params, cstate, version, b: LearnerBatch):
        prox_routes, b, _ = routing.step_routes(route_chunk, params, b)
        prox, _, _ = strategy.prox_logp(lambda p, t, a: chunk(p, t, a, prox_routes), params, cstate, b, version)
        first = lambda x: None if x is None else x[0]  # noqa: E731
        return _minibatch_grads(cfg, strategy, logprobs, params, b.map(first), first(prox), version,
                                moe=routing.num_experts > 0)

    rep = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(param_shardings, None, rep, batch_sharding),
                   out_shardings=(rep, param_shardings, rep), **_mode_options(cfg))


def make_logprob_step(cfg: Config, graphdef, *, rest: Any, param_shardings: Any, with_routes: bool = False):
    """Jitted ``(params, tokens [U,m,r,T], attention_mask) -> logp [U,m,r,T]`` (no gradient);
    ``with_routes``: ``(params, tokens, attention_mask, routes [U,m,r,T,n_moe_layers,k])`` with
    those expert ids forced (``moe.routing_replay=r3``)."""
    chunk = chunked(_logp_only(_rl_logprob_fn(cfg, graphdef, rest)))
    if with_routes:
        return jax.jit(chunk, in_shardings=(param_shardings, None, None, None), **_mode_options(cfg))
    return jax.jit(lambda p, t, a: chunk(p, t, a), in_shardings=(param_shardings, None, None), **_mode_options(cfg))
