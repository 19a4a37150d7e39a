"""How fast delayed momentum methods converge on a convex quadratic
(Kosson et al. 2020, §3.5; EQUATIONS.md, characteristic polynomials).

On L = ½·λ·w² the iterates of each method are w_t ∝ z^t, with z a root of
its characteristic polynomial in x = ηλ; the convergence rate is the largest
root's modulus ρ and the half-life ln ½ / ln ρ steps. For a condition number
κ, the best rate over (η, m) is min over (η, m) of max over λ ∈ [1/κ, 1].
"""

from __future__ import annotations

import numpy as np
from numpy.polynomial import polynomial as P

from pipejax.errors import ConfigError
from pipejax.transforms.spike import coefficients

METHODS = ("gdm", "nesterov", "sc", "lwp", "lwp+sc")


def _z(n: int) -> np.ndarray:
    """The monomial z^n as ascending coefficients."""
    return np.eye(n + 1)[n]


def characteristic(method: str, x: float, m: float, D: int, T: float | None = None) -> np.ndarray:
    """Ascending coefficients of the method's polynomial in z (EQUATIONS.md):

      gdm       z^(D−1)(z−1)(z−m) + x                       delayed GDM
      nesterov  SC(a = m, b = 1)                            (SC_1)
      sc        z^D(z−1)(z−m) + x·(a·z + b·(z−m))           SC_D, eq. 14
      lwp       (z−1)·[z^D(z−m) + x·T] + x·z                LWP_D, T = D
      lwp+sc    z^(D+1)(z−1)(z−m) + x·(a·z + b·(z−m))·((1+T)z − T)
                                                            difference form
    """
    T = float(D if T is None else T)
    zm, z1 = np.array([-m, 1.0]), np.array([-1.0, 1.0])
    if method == "gdm":
        if D < 1:
            raise ConfigError("the delayed GDM polynomial needs D >= 1")
        return P.polyadd(P.polymul(P.polymul(_z(D - 1), z1), zm), [x])
    if method == "lwp":
        return P.polyadd(P.polymul(z1, P.polyadd(P.polymul(_z(D), zm), [x * T])), [0.0, x])
    a, b = (m, 1.0) if method == "nesterov" else coefficients(m, D)
    drive = P.polyadd([0.0, a], b * zm) * x
    if method in ("nesterov", "sc"):
        return P.polyadd(P.polymul(P.polymul(_z(D), z1), zm), drive)
    if method == "lwp+sc":
        return P.polyadd(P.polymul(P.polymul(_z(D + 1), z1), zm),
                         P.polymul(drive, [-T, 1.0 + T]))
    raise ConfigError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


def rates(method: str, xs: np.ndarray, m: float, D: int, T: float | None = None) -> np.ndarray:
    """ρ = max |root| for each x in `xs` (eigenvalues of companion matrices, batched)."""
    polys = np.stack([characteristic(method, float(x), m, D, T) for x in np.atleast_1d(xs)])
    n = polys.shape[1] - 1
    comp = np.zeros((len(polys), n, n))
    comp[:, 1:, :-1] = np.eye(n - 1)
    comp[:, :, -1] = -polys[:, :-1] / polys[:, -1:]
    return np.abs(np.linalg.eigvals(comp)).max(axis=1)


def half_life(rho: np.ndarray | float) -> np.ndarray:
    """Steps to halve the distance to the optimum: ln ½ / ln ρ (inf when ρ >= 1)."""
    rho = np.asarray(rho, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(rho < 1.0, np.log(0.5) / np.log(np.minimum(rho, 1 - 1e-16)), np.inf)
