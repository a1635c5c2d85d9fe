"""Shared test utilities: references in float64 and error bounds that grow with k."""
import numpy as np
import pytest


def error_bound(a, b, k, dtype, extra=None):
    """Elementwise bound for |A@B - ref|: a few ulps per term of each dot product."""
    eps = np.finfo(dtype).eps
    bound = 4 * max(k, 1) * eps * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    if extra is not None:
        bound = bound + 4 * eps * np.abs(extra)
    return bound + np.finfo(dtype).tiny


def assert_close(got, expected, bound, context):
    """Fail naming the worst element (i, j), what was expected, what came out, and the context."""
    got = np.asarray(got, np.float64)
    expected = np.asarray(expected, np.float64)
    assert got.shape == expected.shape, f"{context}: shape {got.shape} != {expected.shape}"
    err = np.abs(got - expected)
    bad = ~(err <= bound)  # NaN in got counts as bad
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1)), err.shape)
        pytest.fail(f"{context}: {int(bad.sum())} elements off; worst at {tuple(int(i) for i in idx)}: "
                    f"expected {expected[idx]!r}, got {got[idx]!r}, bound {np.broadcast_to(bound, err.shape)[idx]!r}")


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
