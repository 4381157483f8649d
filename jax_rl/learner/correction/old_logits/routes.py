"""The exact-old-logit routes, one registry keyed by ``old_logits.route`` (as :mod:`jax_rl.learner.correction`
is keyed by ``loss.correction``).

A route is how ``loss.correction=exact`` gets log pi_v, the training-side log-probs at each token's
own behaviour version v (the paper's routes: docs/design.md §2.2 Correction modes). Each route declares:

- its cost (:attr:`Route.extra_forwards`, :attr:`Route.extra_param_copies`), which
  :class:`jax_rl.learner.correction.Exact` reports as its own;
- its learner-side inputs: the learner keeps a :class:`~jax_rl.learner.correction.old_logits.store.SnapshotStore`
  and scores each batch in its host step (:attr:`Route.learner_store`), or every batch arrives
  with ``old_logp`` filled on the rollout side (:attr:`Route.scores_before_buffer`);
- its producer hooks, what the rollout side runs: the versions its scorer holds
  (:meth:`Route.scorer_keep`), whether the agent loops keep unscored episodes
  (:attr:`Route.track_unscored`), the retirer it wraps the scorer in (:meth:`Route.make_retirer`)
  and what a publish does (:meth:`Route.publish`);
- what it refuses (:meth:`Route.check`): other correction modes, runtimes, ``placement.scorer``.

Nothing outside this module and ``jax_rl/config/training.py`` (which lists the names the schema accepts;
``tests/test_structure.py`` checks that the two agree) branches on a route's name. Adding a route:
one subclass and ``@register_route("name")``, plus the name in
``jax_rl.config.OldLogitsConfig.route``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from jax_rl.learner.correction.old_logits.retire import RetiringScorer
from jax_rl.registry import registrar

if TYPE_CHECKING:  # annotations only
    from jax_rl.config import Config
    from jax_rl.learner.correction.old_logits.scorer import OldLogitScorer

__all__ = ["Route", "ROUTES", "register_route", "make_route"]

ROUTES: dict[str, type["Route"]] = {}


register_route = registrar(ROUTES)
"""Class decorator: ``@register_route(name)`` registers a :class:`Route` subclass under ``old_logits.route=name``."""


def make_route(cfg: "Config") -> "Route":
    """The route of ``cfg.old_logits.route``.

    Raises:
        ValueError: an unknown name (the schema refuses it first when the config was validated).
    """
    name = cfg.old_logits.route
    try:
        return ROUTES[name](cfg)
    except KeyError:
        raise ValueError(f"unknown old_logits.route {name!r}; known: {sorted(ROUTES)}") from None


class Route:
    """Base route. Subclasses set the class attributes and override the hooks they need.

    Args:
        cfg: the run config (``async.max_staleness``, ``old_logits``, ``runtime``, ``placement``).
    """

    name: ClassVar[str] = ""
    extra_forwards: ClassVar[str] = "0"
    """Extra log-prob forwards per learner step (or where they run instead), as text for the cost line."""
    extra_param_copies: ClassVar[str] = "0"
    """Extra copies of the params held, as text for the cost line."""
    learner_store: ClassVar[bool] = False
    """The learner keeps the snapshot store and runs the old-logit forwards in its host step."""
    scores_before_buffer: ClassVar[bool] = False
    """Every trajectory enters the buffer with ``old_logp`` filled (the buffer refuses an unscored one)."""
    track_unscored: ClassVar[bool] = False
    """The agent loops keep every unscored episode, finished or partial, for the retires."""
    exact_only: ClassVar[bool] = True
    """Refused under any ``loss.correction`` other than ``exact``."""
    runtimes: ClassVar[Optional[tuple[str, ...]]] = None
    """The ``runtime.kind`` values the route runs under (None: all)."""
    reads_scorer_devices: ClassVar[bool] = False
    """The route's scorer may run on ``placement.scorer``'s own devices."""
    old_logp_is_behav: ClassVar[bool] = False
    """The learner takes ``old_logp`` = ``behav_logp`` (the bitwise mode's route): no store, no scorer."""

    def __init__(self, cfg: "Config"):
        self.cfg = cfg

    # ---------------------------------------------------------------------------- config
    @classmethod
    def check(cls, cfg: "Config", *, exact: bool) -> None:
        """Refuse a config this route cannot serve, one line naming the keys.

        Args:
            exact: ``loss.correction`` is ``exact`` (the route is used); otherwise only
                ``old_logits.measure_error`` may read a snapshot store.

        Raises:
            ValueError: the route under another correction mode, under a runtime it does not
                run in, or ``placement.scorer`` set for a route that reads no scorer devices.
        """
        if cls.exact_only and not exact:
            raise ValueError(f"old_logits.route={cls.name} serves loss.correction=exact only, not "
                             f"loss.correction={cfg.loss.correction!r}: set old_logits.route=snapshot")
        if cls.runtimes is not None and cfg.runtime.kind not in cls.runtimes:
            raise ValueError(f"old_logits.route={cls.name} is implemented for runtime="
                             f"{'|'.join(cls.runtimes)} only, not runtime={cfg.runtime.kind}: use "
                             f"runtime={cls.runtimes[0]} or old_logits.route=snapshot")
        scorer = cfg.placement.scorer
        if scorer is not None and not cls.reads_scorer_devices:
            readers = sorted(n for n, r in ROUTES.items() if r.reads_scorer_devices)
            raise ValueError(f"placement.scorer={scorer} is read by old_logits.route={'|'.join(readers)} only "
                             f"(route={cls.name}): set placement.scorer=null")

    # ---------------------------------------------------------------------------- producer hooks
    def scorer_keep(self) -> Optional[int]:
        """Versions the rollout side's :class:`~jax_rl.learner.correction.old_logits.scorer.OldLogitScorer` holds at
        most, or None when the route needs no rollout-side scorer."""
        return None

    def make_retirer(self, scorer: "OldLogitScorer", sources: Callable[[], list],
                     release: Optional[Callable], *, rows_per_forward: int) -> Optional["RetiringScorer"]:
        """The :class:`~jax_rl.learner.correction.old_logits.retire.RetiringScorer` wrapping ``scorer`` (None: the
        route scores finished groups with ``scorer`` alone). ``sources`` / ``release``: the agent
        loops' unscored episodes and the call that releases a scored group's."""
        return None

    def publish(self, version: int, params: Any, generators: list, *, scorer: Optional["OldLogitScorer"],
                retirer: Optional["RetiringScorer"]) -> float:
        """What the rollout side does when the learner publishes ``version`` (``params``, a copy
        nobody donates): hand the params to every generator (each swaps at its next step).

        Returns:
            the generators' cast seconds (``update_params``), summed.
        """
        return float(sum(float(g.update_params(params, version) or 0.0) for g in generators))


@register_route("snapshot")
class Snapshot(Route):
    """The learner keeps the last K+1 versions' params (:class:`~jax_rl.learner.correction.old_logits.store.SnapshotStore`)
    and runs one forward per behaviour version present in a batch (the paper's first route). Also the store
    ``old_logits.measure_error`` reads under an approximate mode, so it is allowed with every mode."""

    extra_forwards = "1 per distinct behaviour version in the batch (host step, snapshot route)"
    extra_param_copies = "up to K+1 snapshots (old_logits.store: host or disk)"
    learner_store = True
    exact_only = False


@register_route("dedicated")
class Dedicated(Route):
    """A scorer holding the live versions scores each finished group before the buffer (the paper's
    second route); it runs on ``placement.scorer`` or, by default, the learner's devices."""

    extra_forwards = ("0 in the learner (a scorer thread runs 1 per behaviour version present in each "
                      "finished group, before the buffer)")
    extra_param_copies = "up to K+1 versions on the scorer's devices (placement.scorer; default the learner's)"
    scores_before_buffer = True
    runtimes = ("embedded",)
    reads_scorer_devices = True

    def scorer_keep(self) -> Optional[int]:
        return int(self.cfg.async_.max_staleness) + 1

    def publish(self, version, params, generators, *, scorer, retirer) -> float:
        # before any generator runs ``version``: every token of it finds its params. The scorer keeps
        # a reference to this device copy (same devices) or copies it to its own (placement.scorer);
        # versions older than version - K go: a token that old is never trained (the buffer drops it
        # as stale), so it is never scored either.
        scorer.put(int(version), params, copy=False)
        scorer.drop_below(int(version) - int(self.cfg.async_.max_staleness))
        return super().publish(version, params, generators, scorer=scorer, retirer=retirer)


class _Retiring(Route):
    """Version v's tokens, finished and partial, are scored with theta_v when the fleet leaves v
    (:class:`~jax_rl.learner.correction.old_logits.retire.RetiringScorer`); the scorer holds the fleet's version and at
    most one retiring one."""

    pauses_rollouts: ClassVar[bool] = False
    scores_before_buffer = True
    track_unscored = True
    runtimes = ("embedded",)

    def scorer_keep(self) -> Optional[int]:
        return 2

    def make_retirer(self, scorer, sources, release, *, rows_per_forward):
        return RetiringScorer(scorer, sources, release, pause=self.pauses_rollouts,
                              rows_per_forward=rows_per_forward)

    def publish(self, version, params, generators, *, scorer, retirer) -> float:
        # the retirer holds the params, moves every generator to ``version`` (each has swapped when
        # this returns) and retires the outgoing version's tokens
        return retirer.publish(int(version), params, generators)


@register_route("interrupt")
class Interrupt(_Retiring):
    """At each publish the rollouts pause while the outgoing version's tokens are scored (the paper's
    third route): a measured stall per publish (``old_logits_stall_s``)."""

    extra_forwards = ("0 in the learner (at each publish the rollouts pause while 1 forward per chunk of "
                      "unscored episodes scores the outgoing version's tokens)")
    extra_param_copies = "1 (the fleet's version; 2 during a publish)"
    pauses_rollouts = True


@register_route("retire")
class Retire(_Retiring):
    """Ours: the fleet swaps at once and a background thread scores the outgoing version's tokens
    while it generates at the new one; exact with one or two extra copies whatever K is."""

    extra_forwards = ("0 in the learner (a background thread scores the outgoing version's tokens, finished "
                      "and partial, while the fleet generates at the new one)")
    extra_param_copies = "1 or 2 whatever K is (the fleet's version and one retiring)"


@register_route("behav")
class Behav(Route):
    """log pi_v = the behaviour log-prob: under ``model.bitwise`` the engine's log-prob of a token
    is, bit for bit, the learner's forward at the params that sampled it, so it *is* log pi_v, provided every
    K/V the token was decoded over was computed by that same version. ``rollout.partial=recompute_kv`` (or
    ``abort``) guarantees it: at each publish the in-flight slots are re-prefilled under the new params
    (``recomputes`` in the step rows: the route's cost, one prefill of prompt + generated-so-far per in-flight
    slot per publish) and held multi-turn K/V are dropped (``kv_dropped_swap``), so no token is ever decoded
    over an older version's K/V and none needs marking. ``continue`` is refused."""

    extra_forwards = ("0 (behav_logp is log pi_v under model.bitwise; rollout.partial=recompute_kv re-prefills the "
                      "in-flight slots at each publish)")
    extra_param_copies = "0"
    old_logp_is_behav = True

    @classmethod
    def check(cls, cfg: "Config", *, exact: bool) -> None:
        super().check(cfg, exact=exact)
        if not getattr(cfg.model, "bitwise", False):
            raise ValueError("old_logits.route=behav needs model.bitwise=true (else the behaviour log-prob is not "
                             "the learner's log pi_v): set model.bitwise=true or old_logits.route=snapshot")
        if cfg.rollout.partial not in ("recompute_kv", "abort"):
            raise ValueError(f"old_logits.route=behav needs rollout.partial=recompute_kv|abort, not "
                             f"{cfg.rollout.partial!r} (a token decoded over K/V an older version computed is pi "
                             "of no single version)")
