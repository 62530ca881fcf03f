"""The stage-4 analysis's item-level sign-flip tests against brute force over every flip."""
import itertools
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))

from mechanism_seeds import lattice_sign_flip_p, mc_sign_flip_p  # noqa: E402


def brute(d):
    flips = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    return float(np.mean((flips * d).sum(1) >= d.sum() - 1e-9))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_lattice_sign_flip_p_is_the_exact_share_of_flips(k):
    rng = np.random.default_rng(k)
    for _ in range(5):
        d = rng.integers(-k, k + 1, 13) / k
        assert lattice_sign_flip_p(d, k) == pytest.approx(brute(d), abs=1e-12)


def test_lattice_sign_flip_p_refuses_values_off_the_lattice():
    with pytest.raises(ValueError):
        lattice_sign_flip_p(np.array([0.5, 0.25]), 3)


def test_mc_sign_flip_p_is_near_the_exact_share():
    d = np.random.default_rng(0).normal(0.3, 1.0, 12)
    assert abs(mc_sign_flip_p(d, n=100_000) - brute(d)) < 0.01
