"""Delayed momentum methods on a convex quadratic (Kosson et al. 2020, §3.5).

Half-lives from the roots of the characteristic polynomials
(`pipejax.quadratic`) for delayed GDM, Nesterov, SC_D, LWP_D and LWP_D + SC_D
(difference form): at the paper's check point (m = 0.95, D = 8, ηλ = 0.005),
against the condition number κ (D = 8) and against the delay D (κ = 10³),
each with the best η and m; and the best momentum per method. Every
polynomial is checked against `pj.simulate` driving the real optax transforms
on L = ½·Σ λ_i·w_i² with the gradient delayed by D (half-life within 1 %).

Run: python benchmarks/quadratic.py
"""

from __future__ import annotations

import flax.linen as nn
import jax

jax.config.update("jax_enable_x64", True)  # the runs below decay by 2^-200
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj
from common import RESULTS, save, table
from pipejax.quadratic import METHODS, half_life, rates

MOMENTA = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.998,
           0.999)
STEPS_PER_DECADE = 20  # the ηλ grid: 10^(j / 20)
GRID = 10.0 ** (np.arange(-8 * STEPS_PER_DECADE, STEPS_PER_DECADE + 1) / STEPS_PER_DECADE)
KAPPAS = (10, 100, 1_000, 10_000, 100_000, 1_000_000)
DELAYS = (1, 2, 4, 8, 16, 32)
NAMES = {"gdm": "delayed GDM", "nesterov": "Nesterov", "sc": "SC_D", "lwp": "LWP_D",
         "lwp+sc": "LWP_D + SC_D"}


def optimizer(method: str, lr: float, m: float):
    """The optax chain of a method, as a function of the stage's StageInfo."""
    if method == "nesterov":
        return lambda s: optax.chain(optax.trace(m, nesterov=True), optax.scale(-lr))
    if method == "lwp-velocity":  # the velocity form, which the lwp polynomial describes
        return lambda s: optax.chain(optax.trace(m), optax.scale(-lr), pj.transforms.weight_forecast(
            s.delay, form="velocity", learning_rate=lr))
    name = {"gdm": "none"}.get(method, method)  # the lwp+sc polynomial is the difference form's
    return pj.transforms.mitigation(name, lr, momentum=m, form="difference").optimizer


class Quadratic(nn.Module):
    """w ⊙ x with w initialized to ones: the loss below makes it ½·Σ λ_i·w_i²."""

    n: int

    @nn.compact
    def __call__(self, x):
        return self.param("w", nn.initializers.ones, (self.n,)) * x


def simulated_half_life(method: str, x: float, m: float, D: int, half_lives: float) -> float:
    """Half-life under pj.simulate with delay D (consistent: the whole gradient
    is taken at the delayed, forecast weights ŵ), from the per-step losses
    ½·ŵ²: their sum over a window of N/8 steps (many oscillation periods) a
    quarter and three quarters into a run of N steps that decays 2^-200
    (float64) falls by ρ^(2·N/2)."""
    N = int(200 * half_lives) + 400
    loss = lambda out, y: 0.5 * jnp.sum(out ** 2)  # λ = 1, η = x
    sim = pj.simulate([Quadratic(1)], loss=loss, optimizer=optimizer(method, x, m), split=1,
                      delays=[D], consistent=True)
    state = sim.init([{"params": {"w": jnp.ones(1)}}])
    _, losses = sim.run(state, jnp.ones((N, 1, 1)), jnp.zeros((N, 1)))
    energy = np.asarray(losses, np.float64)
    W = N // 8
    e1, e2 = energy[N // 4:N // 4 + W].sum(), energy[3 * N // 4:3 * N // 4 + W].sum()
    return float(half_life((e2 / e1) ** (1.0 / (2 * (N // 2)))))


def check_polynomials() -> list[dict]:
    rows = []
    for x, m, D in ((0.005, 0.95, 8), (0.02, 0.9, 4), (0.002, 0.99, 16)):
        for method in (*METHODS, "lwp-velocity"):
            theory = float(half_life(rates(method.split("-")[0], [x], m, D))[0])
            if not np.isfinite(theory) or theory > 2000:
                continue
            sim = simulated_half_life(method, x, m, D, theory)
            rows.append({"method": NAMES.get(method, "LWP_D velocity form"), "eta_lambda": x, "m": m, "D": D,
                         "half_life_roots": round(theory, 2), "half_life_simulated": round(sim, 2),
                         "rel_diff": round(abs(sim - theory) / theory, 5)})
    return rows


def best(method: str, D: int, kappa: int, table_: np.ndarray) -> tuple[float, float, float]:
    """(half-life, η, m) minimizing the worst rate over λ ∈ [1/κ, 1]; `table_`
    [momenta, grid] holds ρ at ηλ = GRID[j]."""
    w = int(round(np.log10(kappa) * STEPS_PER_DECADE))
    # η = GRID[j] spans ηλ ∈ GRID[j − w .. j]
    worst = np.stack([table_[:, j - w:j + 1].max(axis=1) for j in range(w, len(GRID))], axis=1)
    i, j = np.unravel_index(np.argmin(worst), worst.shape)
    return float(half_life(worst[i, j])), float(GRID[j + w]), MOMENTA[i]


def main() -> None:
    check_point = [{"method": NAMES[k], "half_life": round(float(half_life(
        rates(k, [0.005], 0.95, 8))[0]), 1)} for k in METHODS]
    print("m = 0.95, D = 8, ηλ = 0.005 (Kosson et al.: 133, SC_D 31, LWP_D 25, both 13)")
    print(table(check_point))

    rho = {(k, D): np.stack([rates(k, GRID, m, D) for m in MOMENTA])
           for k in METHODS for D in sorted({*DELAYS, 8})}
    by_kappa = [{"kappa": kappa, **{NAMES[k]: round(best(k, 8, kappa, rho[k, 8])[0], 1)
                                    for k in METHODS}} for kappa in KAPPAS]
    by_delay = [{"D": D, **{NAMES[k]: round(best(k, D, 1000, rho[k, D])[0], 1) for k in METHODS}}
                for D in DELAYS]
    momentum = [{"D": D, **{NAMES[k]: best(k, D, 1000, rho[k, D])[2] for k in METHODS}}
                for D in DELAYS]
    print("\nbest half-life (steps) against κ, D = 8"), print(table(by_kappa))
    print("\nbest half-life (steps) against D, κ = 1000"), print(table(by_delay))
    print("\nbest momentum m against D, κ = 1000"), print(table(momentum))

    checks = check_polynomials()
    print("\npolynomial roots against pj.simulate with the optax transforms"), print(table(checks))
    rows = by_kappa + by_delay
    mitigated = [NAMES[k] for k in ("sc", "lwp", "lwp+sc")]
    claims = {
        "every_mitigation_at_most_gdm": all(r[n] <= r["delayed GDM"] for r in rows
                                            for n in mitigated),
        "lwp_sc_lowest": all(r["LWP_D + SC_D"] == min(r[n] for n in NAMES.values()) for r in rows),
        "simulation_within_1_percent": all(c["rel_diff"] < 0.01 for c in checks)}
    print("\n" + "\n".join(f"{k}: {v}" for k, v in claims.items()))
    plot(by_kappa, by_delay)
    save("quadratic", {"check_point": check_point, "by_kappa_D8": by_kappa,
                       "by_delay_kappa1000": by_delay, "best_momentum_kappa1000": momentum,
                       "simulation_check": checks, "claims": claims,
                       "grid": {"momenta": MOMENTA, "eta_lambda_per_decade": STEPS_PER_DECADE}})


def plot(by_kappa: list[dict], by_delay: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in NAMES.values():
        a.loglog([r["kappa"] for r in by_kappa], [r[name] for r in by_kappa], "o-", label=name)
        b.loglog([r["D"] for r in by_delay], [r[name] for r in by_delay], "o-", label=name)
    a.set(xlabel="condition number κ", ylabel="best half-life (steps)", title="D = 8")
    b.set(xlabel="delay D", ylabel="best half-life (steps)", title="κ = 1000")
    b.set_xscale("log", base=2)
    a.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "quadratic.png", dpi=100)


if __name__ == "__main__":
    main()
