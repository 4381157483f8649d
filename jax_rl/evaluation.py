"""Eval statistics: unbiased pass@k, avg@k, per-environment aggregation, held-out seeds.

Definitions (docs/design.md §2.6 Metrics; Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", eq. 1):

- A sample *succeeds* when its reward is ``>= 1.0 - SUCCESS_EPS`` (rewards live in [0, 1]).
- ``pass@k`` of one task with ``n >= k`` samples of which ``c`` succeed is the unbiased
  estimator ``1 - C(n-c, k) / C(n, k)`` of "at least one of k samples succeeds", computed in the
  numerically stable product form ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``.
- ``pass^k`` of one task (tau-bench's metric, Yao et al. 2024, "tau-bench", §4) is the unbiased
  estimator ``C(c, k) / C(n, k)`` of "all k of k samples succeed" (reported for ``k > 1``; pass^1
  is pass@1, the success rate).
- ``avg@k`` of one task is the mean reward over its samples (an unbiased estimate of the mean
  reward of k samples; with 0/1 rewards it is the success rate, i.e. ``pass@1``).
- Aggregates are unweighted means over tasks: per environment (``"<env>/avg@k"``) and over all
  tasks of all environments (``"avg@k"``, micro average).

Pure Python + numpy; no jax.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "SUCCESS_EPS",
    "is_success",
    "pass_at_k",
    "pass_hat_k",
    "avg_at_k",
    "summarize_eval",
    "eval_seeds",
    "check_disjoint_seeds",
]

SUCCESS_EPS = 1e-6


def is_success(reward: float) -> bool:
    """True iff ``reward >= 1.0 - SUCCESS_EPS``."""
    return float(reward) >= 1.0 - SUCCESS_EPS


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from ``n`` samples with ``c`` successes.

    Args:
        n: number of samples drawn for the task (``n >= 1``).
        c: number of successful samples (``0 <= c <= n``).
        k: the k of pass@k (``1 <= k <= n``).
    Returns:
        ``1 - C(n-c, k) / C(n, k)`` as a float in [0, 1]; exactly 1.0 when ``n - c < k``
        and exactly 0.0 when ``c == 0``.
    Raises:
        ValueError: on out-of-range arguments.
    """
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"pass_at_k: need n >= 1 samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if c == 0:
        return 0.0
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return float(min(1.0, max(0.0, 1.0 - fail)))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k estimate (tau-bench): ``C(c, k) / C(n, k)``, the chance that k samples drawn
    without replacement from the ``n`` (``c`` successful) all succeed.

    Args: as :func:`pass_at_k`. Returns a float in [0, 1]: exactly 0.0 when ``c < k``, 1.0 when
    ``c == n``. Raises ValueError on out-of-range arguments.
    """
    pass_at_k(n, c, k)  # the same argument checks
    n, c, k = int(n), int(c), int(k)
    if c < k:
        return 0.0
    out = 1.0
    for i in range(k):
        out *= (c - i) / (n - i)
    return float(min(1.0, max(0.0, out)))


def avg_at_k(rewards: Sequence[float]) -> float:
    """Mean reward over a task's samples. Raises ValueError on an empty sequence."""
    rewards = [float(r) for r in rewards]
    if not rewards:
        raise ValueError("avg_at_k: no rewards")
    return math.fsum(rewards) / len(rewards)


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def summarize_eval(results: Iterable[Mapping[str, Any]], k: int) -> dict[str, float]:
    """Aggregate per-task eval samples into avg@k / pass@k, per environment and overall.

    Args:
        results: one dict per task: ``env`` (str), ``task_seed`` (int), ``rewards``
            (list of ``n >= k`` floats in [0, 1], one per sample), optionally ``task`` (the task's
            identity when seeds may map to the same task). Extra keys are ignored.
        k: the k of avg@k / pass@k (``>= 1``).
    Returns:
        A flat dict of floats (ints for counts), JSON-ready for ``MetricsWriter.write_eval``:

        - ``"avg@{k}"``, ``"pass@{k}"``: means over all tasks;
        - ``"avg@1"``, ``"pass@1"`` too when ``k > 1`` (``avg@1`` equals ``avg@k`` as an estimate;
          ``pass@1`` is the success rate);
        - ``"num_tasks"``, ``"num_samples"``; ``"num_distinct_tasks"`` (distinct ``(env, task)``, the
          ``task`` key when given, e.g. tau²'s task id, else ``task_seed``: below ``num_tasks`` when a
          task was evaluated twice) and ``"samples_per_task"`` (samples of each task when they are all
          equal, else their mean);
        - the same keys prefixed ``"<env>/"`` for each environment, e.g. ``"calculator/avg@4"``.
    Raises:
        ValueError: no results, ``k < 1``, a task with fewer than ``k`` rewards, or a
            non-finite reward.
    """
    k = int(k)
    if k < 1:
        raise ValueError(f"summarize_eval: k must be >= 1, got {k}")
    per_env: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    ks = [k] if k == 1 else [1, k]
    count = 0
    n_samples: dict[str, int] = defaultdict(int)
    distinct: set = set()
    per_task_n: list[int] = []
    for r in results:
        env = str(r.get("env", "all"))
        distinct.add((env, str(r.get("task", r.get("task_seed")))))
        rewards = [float(x) for x in r["rewards"]]
        if any(not math.isfinite(x) for x in rewards):
            raise ValueError(f"summarize_eval: non-finite reward for env={env} seed={r.get('task_seed')}")
        n = len(rewards)
        if n < k:
            raise ValueError(
                f"summarize_eval: env={env} seed={r.get('task_seed')} has {n} rewards, need >= k={k}"
            )
        c = sum(is_success(x) for x in rewards)
        m = avg_at_k(rewards)
        for kk in ks:
            per_env[env][f"avg@{kk}"].append(m)
            per_env[env][f"pass@{kk}"].append(pass_at_k(n, c, kk))
            if kk > 1:
                per_env[env][f"pass^{kk}"].append(pass_hat_k(n, c, kk))
        n_samples[env] += n
        per_task_n.append(n)
        count += 1
    if count == 0:
        raise ValueError("summarize_eval: no results")

    out: dict[str, float] = {}
    all_vals: dict[str, list[float]] = defaultdict(list)
    for env in sorted(per_env):
        for key, vals in per_env[env].items():
            out[f"{env}/{key}"] = _mean(vals)
            all_vals[key].extend(vals)
        out[f"{env}/num_tasks"] = len(per_env[env][f"avg@{k}"])
        out[f"{env}/num_samples"] = n_samples[env]
    for key, vals in all_vals.items():
        out[key] = _mean(vals)
    out["num_tasks"] = count
    out["num_samples"] = sum(n_samples.values())
    out["num_distinct_tasks"] = len(distinct)
    out["samples_per_task"] = per_task_n[0] if len(set(per_task_n)) == 1 else _mean(per_task_n)
    return out


def eval_seeds(num_tasks: int, seed_offset: int) -> list[int]:
    """Held-out task seeds ``[seed_offset, seed_offset + num_tasks)``.

    Training uses seeds ``< seed_offset`` (``eval.seed_offset`` in the config), so the two sets
    are disjoint by construction. Raises ValueError for ``num_tasks < 0`` or ``seed_offset < 0``.
    """
    num_tasks, seed_offset = int(num_tasks), int(seed_offset)
    if num_tasks < 0 or seed_offset < 0:
        raise ValueError(f"eval_seeds: need num_tasks >= 0 and seed_offset >= 0, got {num_tasks}, {seed_offset}")
    return list(range(seed_offset, seed_offset + num_tasks))


def check_disjoint_seeds(train_seeds: Iterable[int], seed_offset: int) -> None:
    """Raise ValueError if any training seed is ``>= seed_offset`` (would leak into eval)."""
    bad = sorted({int(s) for s in train_seeds if int(s) >= seed_offset})
    if bad:
        raise ValueError(
            f"training seeds overlap the held-out range [>= {seed_offset}]: {bad[:5]}"
            + (" ..." if len(bad) > 5 else "")
        )
