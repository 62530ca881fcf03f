"""lib/stats.py against scipy.stats, an independent implementation (skipped where scipy is not installed; the
hand-worked cases are in tests/test_baselines.py and tests/test_collaboration.py)."""
import numpy as np
import pytest

from lib.stats import (paired_comparison, partial_spearman, permutation_p, ranks, sign_flip_p, sign_test_p,
                               spearman)

scipy_stats = pytest.importorskip("scipy.stats")


def test_ranks_and_spearman_match_scipy_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.integers(0, 6, 25), rng.normal(size=25).round(1)  # many ties in both
        assert np.allclose(ranks(a), scipy_stats.rankdata(a))
        assert spearman(a, b) == pytest.approx(scipy_stats.spearmanr(a, b).statistic, abs=1e-12)


def test_sign_test_matches_scipy_binomtest():
    for wins, losses in [(5, 0), (3, 1), (10, 2), (7, 7), (30, 18), (0, 9)]:
        ref = scipy_stats.binomtest(wins, wins + losses, 0.5).pvalue
        assert sign_test_p(wins, losses) == pytest.approx(ref, rel=1e-9)


def test_permutation_p_matches_scipy_exact_permutation_test():
    a, b = [0.54, 0.40, 0.42], [0.38, 0.26, 0.35]
    ref = scipy_stats.permutation_test((a, b), lambda x, y: np.mean(x) - np.mean(y), permutation_type="independent",
                                       alternative="two-sided", n_resamples=np.inf).pvalue
    assert permutation_p(a, b) == pytest.approx(ref)


def test_sign_flip_p_matches_scipy_exact_paired_permutation_test():
    for d in ([-10.8, -29.0, -10.5, 4.0, -2.0], [1.0, 2.0, 3.0], [0.5, -0.5, 0.25, -0.25], [-3.0, -1.0, -4.0, -1.0, -5.0]):
        ref = scipy_stats.permutation_test((d,), np.mean, permutation_type="samples", alternative="two-sided",
                                           n_resamples=np.inf).pvalue
        assert sign_flip_p(d) == pytest.approx(ref)
    assert sign_flip_p([-1.0, -2.0, -3.0, -4.0, -5.0]) == pytest.approx(2 / 32)  # the smallest p with 5 seeds
    for d in ([1.0, 2.0, 3.0, -0.5, 4.0, 2.0, 1.0, 0.5], [-1.0, 2.0, -3.0], [0.0, 0.0, 1.0]):
        ref = scipy_stats.permutation_test((d,), np.mean, permutation_type="samples", alternative="greater",
                                           n_resamples=np.inf).pvalue
        assert sign_flip_p(d, "greater") == pytest.approx(ref)
    assert sign_flip_p([1.0] * 8, "greater") == 1 / 256 and sign_flip_p([-1.0] * 8, "greater") == 1.0


def test_partial_spearman_matches_the_pearson_partial_of_the_ranks():
    rng = np.random.default_rng(1)
    z = np.arange(40.0)
    x, y = z + rng.normal(0, 10, 40), 0.5 * z + rng.normal(0, 10, 40)
    rx, ry, rz = (scipy_stats.rankdata(v) for v in (x, y, z))
    r = lambda u, v: scipy_stats.pearsonr(u, v).statistic  # noqa: E731
    ref = (r(rx, ry) - r(rx, rz) * r(ry, rz)) / np.sqrt((1 - r(rx, rz) ** 2) * (1 - r(ry, rz) ** 2))
    assert partial_spearman(x, y, z) == pytest.approx(ref, abs=1e-12)


def test_paired_comparison_counts_and_mean():
    a, b = np.array([1, 1, 0, 0, 1, 0]), np.array([0, 1, 0, 1, 0, 0])
    out = paired_comparison(a, b)
    assert (out["better"], out["worse"], out["n"]) == (2, 1, 6) and out["diff"] == pytest.approx(1 / 6)
    assert out["p_sign"] == pytest.approx(scipy_stats.binomtest(2, 3, 0.5).pvalue)


def test_seed_table_pairs_each_method_with_single_on_the_same_seed(tmp_path):
    """experiments/seeds.py: runs' eval.json and per-seed scores from a file enter the same table; the
    difference to single is taken seed by seed, its p is the exact sign-flip p."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
    from seeds import scores_by_row, table
    for method, seed, score in [("single", 3, 0.17), ("ours", 3, 0.165), ("single", 4, 0.30), ("ours", 4, 0.20)]:
        d = tmp_path / f"{method}-s{seed}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"method": method, "team": "pocket", "seed": seed, "task": "t"}))
        (d / "eval.json").write_text(json.dumps({"score": score}))
        (d / "metrics.jsonl").write_text('{"step": 1}\n')  # a run folder holds its config and its log together
    extra = tmp_path / "old.json"
    extra.write_text(json.dumps({"score": {"single": {"0": 50.0}, "ours": {"0": 39.0}}}))
    rows = scores_by_row([str(tmp_path)], [str(extra)])
    assert rows["ours"] == {0: 39.0, 3: 16.5, 4: 20.0}
    line = next(ln for ln in table(rows).splitlines() if ln.startswith("| ours "))
    d = [39.0 - 50.0, 16.5 - 17.0, 20.0 - 30.0]                               # -11, -0.5, -10
    assert f"{np.mean(d):+.1f} ± {np.std(d, ddof=1):.1f} | 0 / 3 | {sign_flip_p(d):.3g} | exploratory | – |" in line
    assert sign_flip_p(d) == 0.25                                               # 2 of the 8 sign patterns
    # item by item, where both runs kept their items: one seed, the plain paired mean (the interval resamples
    # that one seed's 4 items)
    items = {"ours": {3: [1, 0, 1, 1]}, "single": {3: [0, 0, 1, 0]}}
    line = next(ln for ln in table(rows, items).splitlines() if ln.startswith("| ours "))
    assert "| +50.0 [" in line and "] (descriptive) (1) |" in line  # one seed: the interval is not a test


def test_seed_table_splits_rows_by_a_config_key_and_refuses_two_runs_of_one_row_and_seed(tmp_path):
    """The same method with two samplers (rollout_dtype) is two rows with --split-by, and without it the second
    run of (row, seed) is an error, not a silent overwrite."""
    import json
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
    from seeds import scores_by_row
    for dtype, score in [("float32", 0.2), ("int8", 0.25)]:
        d = tmp_path / f"single-{dtype}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"method": "single", "team": "pocket", "seed": 0, "task": "t",
                                                   "rollout_dtype": dtype}))
        (d / "eval.json").write_text(json.dumps({"score": score}))
        (d / "metrics.jsonl").write_text('{"step": 1}\n')
    rows = scores_by_row([str(tmp_path)], [], split_by=["rollout_dtype"])
    assert rows == {"single [rollout_dtype float32]": {0: 20.0}, "single [rollout_dtype int8]": {0: 25.0}}
    with pytest.raises(SystemExit, match="two runs of 'single' with seed 0"):
        scores_by_row([str(tmp_path)], [])

def test_holm_by_hand_and_as_the_sequential_rule():
    """Holm (1979) worked by hand: p = (0.01, 0.04, 0.03, 0.005), m = 4. Sorted 0.005, 0.01, 0.03, 0.04 times
    4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; the running maximum makes the last 0.06."""
    from lib.stats import holm
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5]) == [0.5] and holm([0.9, 0.2]) == [0.9, 0.4] and holm([0.6, 0.7, 0.01]) == [1.0, 1.0, 0.03]
    # the same decisions as the step-down rule: reject p_(k) while p_(k) < alpha / (m - k + 1), then stop
    rng = np.random.default_rng(0)
    for _ in range(200):
        p, alpha = rng.uniform(0, 0.1, rng.integers(1, 8)), 0.05
        order, reject = np.argsort(p), np.zeros(len(p), bool)
        for k, i in enumerate(order):
            if p[i] >= alpha / (len(p) - k):
                break
            reject[i] = True
        assert list(np.array(holm(p)) < alpha) == list(reject)


def test_the_two_level_bootstrap_covers_badly_with_few_seeds_and_the_sign_flip_test_does_not():
    """Why tables print the exact seed-level test as the primary figure below MIN_SEEDS_FOR_BOOTSTRAP seeds.
    Null simulation: two methods equal in expectation, each seed's training adds a shift of sd 15 points to the
    difference (the between-seed spread the pocket runs show), 100 items of 0/1 noise. The bootstrap's 95 %
    interval should exclude 0 in 5 % of draws; with 3 seeds it does so far more often. The exact sign-flip test
    at alpha = 0.05 never rejects with 3 seeds (its smallest p is 0.25) and stays at or below 5 % with 10."""
    from lib.stats import MIN_SEEDS_FOR_BOOTSTRAP, hierarchical_bootstrap_ci
    rng = np.random.default_rng(0)

    def null_draw(n_seeds):
        shift = rng.normal(0, 0.15, n_seeds)
        return [rng.binomial(1, 0.4, 100) - rng.binomial(1, np.clip(0.4 - s, 0, 1), 100) for s in shift]

    draws = 300
    excluded = 0
    for _ in range(draws):
        lo, hi = hierarchical_bootstrap_ci(null_draw(3), n_boot=400, seed=int(rng.integers(1 << 30)))
        excluded += lo > 0 or hi < 0
    assert excluded / draws > 0.08, excluded / draws    # measured 0.13 (0.18 with 2 seeds, 0.10 with 5)
    assert all(sign_flip_p([d.mean() for d in null_draw(3)]) >= 0.25 for _ in range(50))
    rejections = np.mean([sign_flip_p([d.mean() for d in null_draw(MIN_SEEDS_FOR_BOOTSTRAP)]) < 0.05
                          for _ in range(300)])
    assert rejections <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / 300), rejections   # exact: at most alpha, up to noise


def test_sign_flip_ci_by_hand_and_as_the_inversion_of_sign_flip_p():
    """[1, 2, 3]: subset means 1, 1.5, 2, 2, 2, 2.5, 3; at 75 % k = floor(8 x 0.125) = 1, so [1, 3]. Then on
    random differences the interval is the set of shifts t that neither one-sided sign_flip_p of d - t rejects
    at (1 - level) / 2, found on a grid (the inversion done the slow way)."""
    from lib.stats import sign_flip_ci
    assert sign_flip_ci([1, 2, 3], level=0.75) == (1.0, 3.0, 0.75)
    assert sign_flip_ci([1, 2, 3, 4, 5]) is None                          # 5 seeds: 93.75 % at most
    assert sign_flip_ci(np.arange(6.0))[2] == 1 - 2 / 64 and sign_flip_ci(np.arange(8.0))[2] == 1 - 12 / 256
    rng = np.random.default_rng(1)
    for n, level in ((6, 0.95), (7, 0.9), (8, 0.95)):
        d = rng.normal(0.1, 1.0, n)
        lo, hi, _ = sign_flip_ci(d, level)
        grid = np.linspace(d.min() - 1, d.max() + 1, 4001)
        kept = [t for t in grid if sign_flip_p(d - t, "greater") > (1 - level) / 2
                and sign_flip_p(t - d, "greater") > (1 - level) / 2]
        step = grid[1] - grid[0]
        assert abs(min(kept) - lo) <= step and abs(max(kept) - hi) <= step, (n, lo, hi, min(kept), max(kept))


def test_sign_flip_ci_covers_as_it_says_for_symmetric_differences():
    """6 seeds of Laplace noise about 0.3 (symmetric, heavy-tailed): the 95 % interval's exact coverage is
    1 - 2/64 = 96.9 %; 3,000 draws measure it to +-0.3 points (one standard error)."""
    from lib.stats import sign_flip_ci
    rng = np.random.default_rng(2)
    draws = 3000
    covered = np.mean([(lambda c: c[0] <= 0.3 <= c[1])(sign_flip_ci(0.3 + rng.laplace(0, 1, 6)))
                       for _ in range(draws)])
    assert abs(covered - 62 / 64) < 4 * np.sqrt(62 / 64 * 2 / 64 / draws), covered
