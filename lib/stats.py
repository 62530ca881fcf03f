"""
The statistics this project compares methods with: pure numpy, each checked in the tests against values worked
by hand and an independent formula (partial rho as the correlation of regression residuals, the bootstrap
against the normal-theory interval), and against scipy.stats where scipy is installed (tests/test_stats.py).

    python -m pytest tests/test_stats.py -q

Over runs (support/harness/report.py):
  ranks, spearman       Spearman rho (§4.3 of the paper: rho between reward and routing entropy), ties averaged
  partial_spearman      rho(x, y | z): with z = the step, what is left of rho(reward, H) beyond a shared drift
  mean_std              Table 1's mean +- std over seeds (sample std, ddof = 1)
  permutation_p         exact permutation test over seeds (3 against 3: p >= 0.1, said in the table)
  sign_flip_p           exact paired test over seeds (one difference per seed): the PRIMARY figure whenever a
                        comparison has fewer than MIN_SEEDS_FOR_BOOTSTRAP seeds
  sign_flip_ci          its interval for the mean difference, by inversion (exact if symmetric; >= 6 seeds)
  hierarchical_bootstrap_ci   method minus single, item by item, resampling seeds then items: DESCRIPTIVE only
                        below MIN_SEEDS_FOR_BOOTSTRAP seeds (its coverage is measured in tests/test_stats.py:
                        with a between-seed sd of 15 points and 100 items, its 95 % interval excludes 0 in 18 %
                        of null draws with 2 seeds, 13 % with 3 and 10 % with 5, not in 5 %)
  holm                  Holm-Bonferroni adjusted p-values over a family of tests declared in advance
Over items of one run (evaluate.py --paired):
  sign_test_p           exact two-sided sign test (McNemar's exact test for 0/1 outcomes)
  paired_bootstrap_ci   bootstrap interval of a mean paired difference, resampling items
  paired_comparison     both, for one pair of conditions on the same items

None of these is in the paper, which reports means over 3 seeds without tests.
"""
import itertools
from math import comb

import numpy as np

# Below this many seeds an interval that resamples seeds has too few distinct resamples to cover (3 seeds give
# 10 distinct multisets): tables print the exact seed-level test as the primary figure and mark the bootstrap.
MIN_SEEDS_FOR_BOOTSTRAP = 10


def ranks(x):
    """Ranks 1..n with ties given their average rank (as scipy.stats.rankdata)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def spearman(a, b):
    """Spearman rho = Pearson correlation of the ranks. NaN when either series is constant."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def mean_std(values):
    """(mean, sample std with ddof = 1; 0 for a single value)."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def permutation_p(a, b):
    """Exact two-sided permutation test of mean(a) - mean(b): the share of all ways to split the pooled values
    into groups of len(a) and len(b) whose mean difference is at least as large in size as the observed one.
    With 3 seeds against 3 there are only 20 splits, so p can never fall below 2/20 = 0.1."""
    pooled, k = np.asarray(list(a) + list(b), dtype=float), len(a)
    observed = abs(np.mean(a) - np.mean(b))
    diffs = []
    for idx in itertools.combinations(range(len(pooled)), k):
        inside = np.zeros(len(pooled), bool)
        inside[list(idx)] = True
        diffs.append(abs(pooled[inside].mean() - pooled[~inside].mean()))
    return float(np.mean(np.asarray(diffs) >= observed - 1e-12))


def sign_flip_p(diffs, alternative="two-sided"):
    """Exact paired permutation test of mean(diffs) = 0 (one difference per seed, both methods on the same seed):
    the share of the 2^n ways to flip the signs whose mean is at least as large in size as the observed one
    (two-sided), or at least as large (alternative="greater": H1 mean > 0). With 5 seeds a two-sided p can never
    fall below 2/32 = 0.0625; with 8 seeds a one-sided p can reach 1/256."""
    if alternative not in ("two-sided", "greater"):
        raise ValueError(f"alternative must be 'two-sided' or 'greater', got {alternative!r}")
    d = np.asarray(diffs, dtype=float)
    flips = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    means = (flips * d).mean(1)
    if alternative == "greater":
        return float(np.mean(means >= d.mean() - 1e-12))
    return float(np.mean(np.abs(means) >= abs(d.mean()) - 1e-12))


def sign_flip_ci(diffs, level=0.95):
    """The interval sign_flip_p gives by inversion: the shifts t for which neither one-sided test of
    mean(diffs - t) = 0 rejects at (1 - level) / 2. Flipping the signs of the d_i - t of a set S leaves their mean
    at least as large as it was exactly when t >= the mean of the d_i in S, so the 2^n - 1 means of the non-empty
    subsets of the differences are where p changes; if the differences are symmetric about their
    centre, it falls between two neighbouring subset means with probability 1/2^n each (Hartigan 1969). The
    interval from the k-th smallest subset mean to the k-th largest, k = floor(2^n (1 - level) / 2), covers the
    centre with probability exactly 1 - 2k/2^n >= level. Returns (low, high, that coverage), or None when k = 0:
    a 95 % interval needs 6 seeds (5 give 93.75 % at most)."""
    d = np.asarray(diffs, dtype=float)
    k = int(np.floor(2 ** len(d) * (1 - level) / 2 + 1e-9))
    if k < 1:
        return None
    subsets = np.array(list(itertools.product((0.0, 1.0), repeat=len(d))))[1:]   # (2^n - 1, n), no empty set
    means = np.sort(subsets @ d / subsets.sum(1))
    return float(means[k - 1]), float(means[-k]), 1 - 2 * k / 2 ** len(d)


def partial_spearman(x, y, z):
    """Spearman correlation of x and y with z held fixed: the partial correlation of the ranks,
    (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2)). With z = the step, it removes the part of
    rho(reward, H) that any two series drifting over training would share."""
    rxy, rxz, ryz = spearman(x, y), spearman(x, z), spearman(y, z)
    denom = np.sqrt((1 - rxz ** 2) * (1 - ryz ** 2))
    return float((rxy - rxz * ryz) / denom) if denom > 0 else float("nan")


def hierarchical_bootstrap_ci(diffs_by_seed, level=0.95, n_boot=10_000, seed=0):
    """Percentile interval of the mean over seeds of each seed's mean difference, resampling seeds and then
    items within each drawn seed: the training seed and the item are both sources of variance."""
    rng = np.random.default_rng(seed)
    d = [np.asarray(x, dtype=float) for x in diffs_by_seed]
    means = [np.mean([d[s][rng.integers(0, len(d[s]), len(d[s]))].mean() for s in rng.integers(0, len(d), len(d))])
             for _ in range(n_boot)]
    return [float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, (1 + level) / 2))]


def sign_test_p(wins, losses):
    """Exact two-sided sign test (McNemar's exact test for binary outcomes): under H0 each of the wins + losses
    discordant items goes either way with probability 1/2; ties carry no information and are dropped.
    p = min(1, 2 P[Binomial(k, 1/2) <= min(wins, losses)])."""
    k = wins + losses
    if k == 0:
        return 1.0
    return min(1.0, 2 * sum(comb(k, j) for j in range(min(wins, losses) + 1)) / 2 ** k)


def paired_bootstrap_ci(diffs, level=0.95, n_boot=10_000, seed=0):
    """Percentile bootstrap interval of mean(diffs), resampling items (the pairs stay together)."""
    d = np.asarray(diffs, dtype=float)
    means = d[np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))].mean(1)
    return [float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, (1 + level) / 2))]


def paired_comparison(a, b):
    """a, b: one value per item, same items. Mean difference a - b, its 95 % bootstrap interval, the sign
    test's p over the items that differ, and how many went each way."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    return {"diff": float(d.mean()), "ci95": paired_bootstrap_ci(d), "p_sign": sign_test_p(wins, losses),
            "better": wins, "worse": losses, "n": len(d)}


def holm(pvalues):
    """Holm-Bonferroni step-down adjustment (Holm 1979), for a family of m tests declared before the data: sort
    p ascending, p_adj_(k) = max over j <= k of min(1, (m - j + 1) p_(j)) (1-based k), returned in the input
    order. Controls the family-wise error rate at alpha for any dependence between the tests; rejecting
    p_adj < alpha is the same decision as the sequential rule p_(k) < alpha / (m - k + 1)."""
    p = np.asarray(pvalues, dtype=float)
    m = len(p)
    order = np.argsort(p, kind="mergesort")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return [float(v) for v in out]
