"""The loop-free cost pieces (part of :mod:`jax_rl.compile`; the method is in its docstring): the
pieces compiled at depth 1 and 2 and two LM-head chunk lengths and extrapolated to the run's depth
and length (:func:`_fit`), the train step's cost summed from them with their trip counts
(:func:`_train_cost`), the optimizer update's cost, and the SFT step's program."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import jax.numpy as jnp

from jax_rl.checkpoint import abstract_like
from jax_rl.compile.analysis import _attn_unit, _compile
from jax_rl.compile.target import _Target, _batch, _depth, _layout, _learner
from jax_rl.config import Config
from jax_rl.learner.trees import tree_finite, tree_where
from jax_rl.learner.logprobs import CHUNK_ELEMS, chunk_len
from jax_rl.placement import BatchPlacement
from jax_rl.learner.sft import SFT_FIELDS, make_sft_step
from jax_rl.learner.train_step import make_grads_fn, make_logprob_fn, opt_state_shardings

if TYPE_CHECKING:  # annotations only
    from jax_rl.learner.spec import LearnerSpec


def _forwards_in_prox(strategy, cfg, lrn: LearnerSpec, U: int, m: int, r: int, T: int, t: _Target) -> int:
    """How many chunked forwards the strategy's in-jit pi_prox runs (counted while tracing it)."""
    calls = []

    def chunk(params, tokens, attention_mask):
        calls.append(1)
        return jax.numpy.zeros(tokens.shape, jax.numpy.float32)

    b, _ = _batch(t, strategy, U, m, r, T)
    jax.eval_shape(lambda p, c, bb: strategy.prox_logp(chunk, p, c, bb, jax.numpy.int32(0)),
                   lrn.state.params, lrn.state.correction, b)
    return len(calls)


def _chunks(T: int) -> tuple[int, int]:
    """Two LM-head chunk lengths for the cost fits: T/8 and T/4 (8 and 4 chunks)."""
    c1 = max(1, T // 8)
    return c1, max(c1 + 1, T // 4)


def _with_chunk(cfg: Config, c: int) -> Config:
    out = cfg.model_copy(deep=True)
    out.model.logits_chunk_tokens = int(c)
    return out


def _fit(build: Callable[[Config, Any], tuple[Any, tuple]], t: _Target, L: int, T: int,
         rows: int) -> tuple[dict, float]:
    """The loop-free cost of a piece at depth L and length T: ``build(cfg, model_config)``
    returns (jitted fn, abstract args) for an unrolled model (model_config's depth) with the LM
    head in ``cfg.model.logits_chunk_tokens`` chunks. Where the run's head is chunked (``rows``
    rows per forward), fits ``X(d, C) = a + d*layer + b*C`` from (d, C) = (1, C1), (2, C1),
    (1, C2) and returns ``X(1, C1) + (L-1)*layer + b*(T - C1)``; where it is one chunk (no loop),
    ``X(1) + (L-1)*layer`` from the run's own chunking. Returns ({flops, bytes_accessed}, compile seconds)."""
    mc1, mc2 = _depth(t.model_config, 1), _depth(t.model_config, 2)
    chunked = chunk_len(rows, T, t.model_config.vocab_size, CHUNK_ELEMS, t.cfg.model.logits_chunk_tokens) < T
    c1, c2 = _chunks(T)
    cfg1 = _with_chunk(t.cfg, c1) if chunked else t.cfg
    secs = 0.0
    au = _attn_unit(t, rows, T)
    x11, s = _compile(*build(cfg1, mc1), t.mesh, au); secs += s  # noqa: E702
    x21, s = _compile(*build(cfg1, mc2), t.mesh, au); secs += s  # noqa: E702
    if chunked:
        x12, s = _compile(*build(_with_chunk(t.cfg, c2), mc1), t.mesh, au); secs += s  # noqa: E702
    out = {}
    for k in ("flops", "bytes_accessed"):
        v = x11[k] + (L - 1) * (x21[k] - x11[k])
        if chunked:
            v += (x12[k] - x11[k]) / (c2 - c1) * (T - c1)
        out[k] = max(v, 0.0)
    return out, secs


def _grads_piece(t: _Target, r: int, T: int, cfg_: Config, mc) -> tuple[Any, tuple]:
    """The train step's first-minibatch gradient (:func:`jax_rl.learner.train_step.make_grads_fn`, the
    strategy's pi_prox forward included) on one microbatch of ``r`` rows x ``T`` tokens, layers
    unrolled, for model config ``mc`` under ``cfg_``: ``(jitted fn, abstract args)`` for
    ``fn.trace(*args)``. The piece :func:`_fit` costs the train step from."""
    p = _learner(t, mc, cfg_, scan_layers=False)
    b, sh = _batch(t, p.strategy, 1, 1, r, T)
    fn = make_grads_fn(cfg_, p.graphdef, p.strategy, t.mesh, rest=p.rest, param_shardings=p.param_shardings,
                       batch_sharding=sh, routing=p.routing)
    return fn, (p.state.params, p.state.correction, p.state.version, b)


def _steady(t: _Target, strategy) -> _Target:
    """The target whose config traces the train step as it runs on a step where no rare branch
    fires (:meth:`jax_rl.learner.correction.Correction.steady_config`; for ``ppo_ewma`` the reset off: XLA
    costs its reset ``lax.cond`` with the second forward in full although that branch runs only
    on a reset step). ``t`` itself when the strategy has no such branch."""
    cfg = strategy.steady_config()
    return t if cfg is t.cfg else dataclasses.replace(t, cfg=cfg)


def _train_cost(t: _Target, lrn: LearnerSpec, B: int, T: int) -> tuple[dict, float, int, Optional[dict]]:
    """The train step's cost on a step without a reset (see :func:`_steady`), compile seconds of
    the pieces, the pi_prox forwards in that step, and the extra cost of a step whose EWMA reset
    fires (one more forward per microbatch; None when the strategy has no reset branch)."""
    cfg = t.cfg
    U, m, E = cfg.optim.minibatches, cfg.optim.microbatches, cfg.optim.ppo_epochs
    r = _layout(B, U, m, "optim.batch_size")
    L = t.model_config.num_hidden_layers
    f_all = _forwards_in_prox(lrn.strategy, cfg, lrn, U, m, r, T, t)
    ts = _steady(t, lrn.strategy)
    f = f_all if ts is t else _forwards_in_prox(_learner(ts).strategy, ts.cfg, lrn, U, m, r, T, ts)

    grads, secs = _fit(functools.partial(_grads_piece, ts, r, T), ts, L, T, r)
    fwd = {"flops": 0.0, "bytes_accessed": 0.0}
    if (E > 1 and f) or f_all > f:
        def fwd_piece(cfg_, mc):
            p = _learner(t, mc, cfg_, scan_layers=False)
            b, sh = _batch(t, p.strategy, 1, 1, r, T)
            lp = make_logprob_fn(p.graphdef, p.rest, float(cfg_.algo.temperature),
                                 cfg_.model.logits_chunk_tokens)
            s2 = jax.sharding.NamedSharding(t.mesh, jax.sharding.PartitionSpec(*sh.spec[2:]))
            fn = jax.jit(lp, in_shardings=(p.param_shardings, s2, s2))
            tok = jax.ShapeDtypeStruct((r, T), b.tokens.dtype, sharding=s2)
            am = jax.ShapeDtypeStruct((r, T), b.attention_mask.dtype, sharding=s2)
            return fn, (p.state.params, tok, am)

        fwd, s = _fit(fwd_piece, t, L, T, r)
        secs += s

    # one optimizer update and the strategy's after_update: elementwise over the (stacked) params
    st = lrn.state
    a, s = _opt_update_cost(t, lrn, lrn.tx)
    secs += s
    after = {"flops": 0.0, "bytes_accessed": 0.0}
    if jax.tree.leaves(st.correction):
        aft = jax.jit(lambda p, c: lrn.strategy.after_update(p, c),
                      in_shardings=(lrn.state_shardings.params, lrn.state_shardings.correction))
        after, s = _compile(aft, (st.params, st.correction), t.mesh)
        secs += s
    out = {k: U * m * grads[k] + (E - 1) * U * m * (grads[k] - f * fwd[k]) + E * U * a[k] + after[k]
           for k in ("flops", "bytes_accessed")}
    reset = {k: (f_all - f) * U * m * fwd[k] for k in ("flops", "bytes_accessed")} if f_all > f else None
    return out, secs, f, reset


def _opt_update_cost(t: _Target, lrn: LearnerSpec, tx) -> tuple[dict, float]:
    opt_sh = opt_state_shardings(tx, lrn.params, lrn.param_shardings, t.mesh)
    opt = abstract_like(jax.eval_shape(tx.init, lrn.params), opt_sh)

    def update(params, opt_state, grads_):
        upd, new_opt = tx.update(grads_, opt_state, params)
        new_p = jax.tree.map(lambda a, u: a + u, params, upd)
        ok = tree_finite(new_p)
        return tree_where(ok, new_p, params), tree_where(ok, new_opt, opt_state)

    fn = jax.jit(update, in_shardings=(lrn.param_shardings, opt_sh, lrn.param_shardings))
    return _compile(fn, (lrn.state.params, opt, lrn.state.params), t.mesh)


def _sft_fn_args(t: _Target, p: LearnerSpec, tx, schedule, m: int, r: int, T: int, cfg: Optional[Config] = None):
    sh = BatchPlacement(t.mesh, 1, m).batch_sharding(r)
    opt_sh = opt_state_shardings(tx, p.params, p.param_shardings, t.mesh)
    opt = abstract_like(jax.eval_shape(tx.init, p.params), opt_sh)
    fn = make_sft_step(cfg or t.cfg, p.graphdef, tx, schedule, t.mesh, rest=p.rest, param_shardings=p.param_shardings,
                       opt_shardings=opt_sh, batch_sharding=sh)
    dts = {"tokens": jnp.int32, "attention_mask": jnp.bool_, "loss_mask": jnp.bool_}
    batch = {k: jax.ShapeDtypeStruct((1, m, r, T), dts[k], sharding=sh) for k in SFT_FIELDS}
    rep = jax.sharding.NamedSharding(t.mesh, jax.sharding.PartitionSpec())
    return fn, (p.state.params, opt, jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), batch)
