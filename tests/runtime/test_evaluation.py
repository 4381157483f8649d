"""pass@k / avg@k / summarize_eval / eval_seeds (jax_rl.evaluation)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_rl.evaluation import (
    avg_at_k,
    check_disjoint_seeds,
    eval_seeds,
    is_success,
    pass_at_k,
    summarize_eval,
)


def _comb_pass(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # C(7,5)=21, C(10,5)=252
    assert pass_at_k(4, 1, 4) == 1.0  # n == k: any success -> 1
    assert pass_at_k(4, 2, 3) == 1.0  # n - c < k


def test_pass_at_k_large_n_is_stable():
    # C(1000, 500) overflows floats; the product form does not.
    v = pass_at_k(1000, 10, 500)
    assert 0.99 < v <= 1.0
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)


@pytest.mark.parametrize("args", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_bad_args(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_combinatorial_and_is_monotone(nck):
    n, c, k = nck
    v = pass_at_k(n, c, k)
    assert 0.0 <= v <= 1.0
    assert v == pytest.approx(_comb_pass(n, c, k), abs=1e-12)
    if k < n:
        assert pass_at_k(n, c, k + 1) >= v - 1e-12  # monotone in k
    if c < n:
        assert pass_at_k(n, c + 1, k) >= v - 1e-12  # monotone in c
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # k = 1: success rate
    assert pass_at_k(n, c, n) == (1.0 if c > 0 else 0.0)  # n == k: any success


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.floats(0.0, 1.0))
def test_pass_at_k_is_unbiased(n, k, p):
    """E_c~Bin(n,p)[pass_at_k(n, c, k)] == 1 - (1-p)^k exactly (Chen et al.)."""
    if k > n:
        n, k = k, n
    expect = sum(math.comb(n, c) * p**c * (1 - p) ** (n - c) * pass_at_k(n, c, k) for c in range(n + 1))
    assert expect == pytest.approx(1 - (1 - p) ** k, abs=1e-9)


def test_is_success_and_avg():
    assert is_success(1.0) and is_success(1.0 - 1e-7) and not is_success(0.999)
    assert avg_at_k([1.0, 0.0, 0.5, 0.5]) == 0.5
    with pytest.raises(ValueError):
        avg_at_k([])


def test_summarize_eval_hand_computed():
    results = [
        dict(env="calculator", task_seed=1_000_000, rewards=[1.0, 0.0, 0.0, 0.0]),  # avg .25, pass@4 1
        dict(env="calculator", task_seed=1_000_001, rewards=[0.0, 0.0, 0.0, 0.0]),  # avg 0,   pass@4 0
        dict(env="retail", task_seed=1_000_000, rewards=[1.0, 1.0, 0.5, 0.5]),  # avg .75, pass@4 1, pass@1 .5
    ]
    s = summarize_eval(results, k=4)
    assert s["calculator/avg@4"] == pytest.approx(0.125)
    assert s["calculator/pass@4"] == pytest.approx(0.5)
    assert s["calculator/pass@1"] == pytest.approx(0.125)
    assert s["calculator/num_tasks"] == 2 and s["calculator/num_samples"] == 8
    assert s["retail/avg@4"] == pytest.approx(0.75)
    assert s["retail/pass@4"] == 1.0 and s["retail/pass@1"] == pytest.approx(0.5)
    assert s["avg@4"] == pytest.approx((0.25 + 0 + 0.75) / 3)
    assert s["avg@1"] == s["avg@4"]
    assert s["pass@4"] == pytest.approx(2 / 3)
    assert s["pass@1"] == pytest.approx((0.25 + 0 + 0.5) / 3)
    assert s["num_tasks"] == 3 and s["num_samples"] == 12


def test_pass_hat_k_hand_table():
    from jax_rl.evaluation import pass_hat_k

    # C(c, k) / C(n, k): tau-bench's "all k samples succeed"
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)
    assert pass_hat_k(4, 3, 2) == pytest.approx(3 / 6)
    assert pass_hat_k(4, 4, 4) == 1.0 and pass_hat_k(4, 3, 4) == 0.0 and pass_hat_k(4, 1, 2) == 0.0
    assert pass_hat_k(5, 3, 1) == pytest.approx(pass_at_k(5, 3, 1)) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        pass_hat_k(3, 2, 4)
    s = summarize_eval([dict(env="tau2", task_seed=0, rewards=[1.0, 1.0, 0.0, 0.0]),
                        dict(env="tau2", task_seed=1, rewards=[1.0, 1.0, 1.0, 1.0])], k=2)
    assert s["tau2/pass^2"] == pytest.approx((1 / 6 + 1) / 2) and s["pass^2"] == s["tau2/pass^2"]
    assert "pass^1" not in s


def test_summarize_eval_more_samples_than_k_and_k1():
    s = summarize_eval([dict(env="e", task_seed=0, rewards=[1.0, 0.0, 0.0, 0.0])], k=2)
    assert s["pass@2"] == pytest.approx(0.5) and s["avg@2"] == pytest.approx(0.25)
    s1 = summarize_eval([dict(env="e", task_seed=0, rewards=[1.0])], k=1)
    assert s1 == {"e/avg@1": 1.0, "e/pass@1": 1.0, "e/num_tasks": 1, "e/num_samples": 1,
                  "avg@1": 1.0, "pass@1": 1.0, "num_tasks": 1, "num_samples": 1, "num_distinct_tasks": 1,
                  "samples_per_task": 1}


@pytest.mark.parametrize(
    "results,k",
    [
        ([], 4),
        ([dict(env="e", task_seed=0, rewards=[1.0, 0.0])], 4),
        ([dict(env="e", task_seed=0, rewards=[float("nan")])], 1),
        ([dict(env="e", task_seed=0, rewards=[1.0])], 0),
    ],
)
def test_summarize_eval_errors(results, k):
    with pytest.raises(ValueError):
        summarize_eval(results, k)


def test_eval_seeds_disjoint_from_training():
    seeds = eval_seeds(64, 1_000_000)
    assert seeds == list(range(1_000_000, 1_000_064))
    assert not set(seeds) & set(range(1_000_000))
    assert eval_seeds(0, 5) == []
    check_disjoint_seeds(range(10), 10)
    with pytest.raises(ValueError, match="overlap"):
        check_disjoint_seeds([3, 10, 11], 10)
    with pytest.raises(ValueError):
        eval_seeds(-1, 0)


def test_eval_summary_counts_distinct_tasks_and_samples_per_task():
    """Issue 48 item 2: the eval JSON says how many distinct tasks it covered and how many samples each:
    two seeds that land on the same task (``task``) count once."""
    s = summarize_eval([dict(env="tau2", task_seed=10, task="t1", rewards=[1.0, 0.0]),
                        dict(env="tau2", task_seed=13, task="t1", rewards=[0.0, 0.0]),
                        dict(env="tau2", task_seed=11, task="t2", rewards=[1.0, 1.0])], k=2)
    assert s["num_tasks"] == 3 and s["num_distinct_tasks"] == 2 and s["samples_per_task"] == 2
    s = summarize_eval([dict(env="calculator", task_seed=0, rewards=[1.0, 0.0]),
                        dict(env="calculator", task_seed=1, rewards=[1.0, 0.0, 1.0, 1.0])], k=2)
    assert s["num_distinct_tasks"] == 2 and s["samples_per_task"] == pytest.approx(3.0)  # unequal: the mean
