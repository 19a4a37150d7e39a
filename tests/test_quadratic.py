"""The characteristic polynomials of delayed momentum methods (EQUATIONS.md)."""

import numpy as np
import pytest

from pipejax.errors import ConfigError
from pipejax.quadratic import characteristic, half_life, rates


def test_the_papers_check_point():
    # m = 0.95, D = 8, ηλ = 0.005: about 133, 31 (SC_D), 25 (LWP_D), 13 (both)
    got = {k: float(half_life(rates(k, [0.005], 0.95, 8))[0]) for k in ("gdm", "sc", "lwp", "lwp+sc")}
    assert got == pytest.approx({"gdm": 133, "sc": 31, "lwp": 25, "lwp+sc": 13}, abs=0.6)


def test_reductions_between_polynomials():
    x, m, D = 0.01, 0.9, 3
    # SC_1 is Nesterov; with m = 0 spike compensation and plain delayed GD coincide
    assert np.allclose(characteristic("sc", x, m, 1), characteristic("nesterov", x, m, 1))
    assert np.allclose(rates("sc", [x], 0.0, D), rates("gdm", [x], 0.0, D))
    # the companion eigenvalues are the polynomial's roots
    p = characteristic("lwp+sc", x, m, D)
    assert rates("lwp+sc", [x], m, D)[0] == pytest.approx(np.abs(np.roots(p[::-1])).max())
    assert half_life(0.5) == pytest.approx(1.0) and half_life(1.0) == np.inf


def test_unknown_method():
    with pytest.raises(ConfigError, match="unknown method 'adam'"):
        characteristic("adam", 0.1, 0.9, 2)
