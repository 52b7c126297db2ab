"""The tolerances other tests compare computed values with (``tests/support/tolerances.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.tolerances import assert_within, gamma, matmul_reference


def _sequential(x, w, b, order):
    """``x @ w + b`` summed one float32 term at a time in ``order``: the worst order for rounding."""
    out = np.array(b, np.float32)
    for k in order:
        out = (out + x[..., k, None] * w[k]).astype(np.float32)
    return out


def test_every_summation_order_stays_inside_the_matmul_bound_and_a_wrong_operand_does_not():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    w = (rng.standard_normal((256, 256)) * rng.choice([1e-3, 1.0, 1e3], (256, 1))).astype(np.float32)
    b = rng.standard_normal(256).astype(np.float32)
    exact, atol = matmul_reference(x, w, b)
    candidates = {"numpy": x @ w + b, "xla": np.asarray(jax.jit(lambda x, w, b: x @ w + b)(x, w, b)),
                  "ascending": _sequential(x, w, b, range(256)),
                  "descending": _sequential(x, w, b, range(255, -1, -1)),
                  "shuffled": _sequential(x, w, b, rng.permutation(256))}
    for name, computed in candidates.items():
        assert_within(computed, exact, atol, name)
    with pytest.raises(AssertionError, match=r"outside their tolerance; worst at"):
        assert_within(x @ w.T + b, exact, atol, "transposed")
    nudged = candidates["numpy"].copy()
    nudged[1, 2] += 1e-3 * np.abs(nudged).max()  # one element, by a thousandth of the scale
    with pytest.raises(AssertionError, match=r"1 of 1024 elements outside their tolerance; worst at \(1, 2\)"):
        assert_within(nudged, exact, atol)


def test_nan_and_shape_mismatches_fail():
    with pytest.raises(AssertionError, match="outside their tolerance"):
        assert_within(np.array([1.0, np.nan]), np.array([1.0, 2.0]), 1.0)
    with pytest.raises(AssertionError, match="shape"):
        assert_within(np.zeros(3), np.zeros(4), 1.0)
    assert_within(np.array([0.0, 1.0]), np.array([0.0, 1.0]), 0.0)  # a zero tolerance: only exact values


def test_gamma_is_highams_and_refuses_sums_it_cannot_bound():
    u = 2.0 ** -24
    assert gamma(64) == pytest.approx(64 * u / (1 - 64 * u), rel=1e-12)
    assert gamma(64, jnp.bfloat16) == pytest.approx(64 * 2.0 ** -8 / (1 - 64 * 2.0 ** -8), rel=1e-12)
    with pytest.raises(ValueError, match="no bound"):
        gamma(2 ** 24)
