"""SpecTrain's weight prediction error (Chen et al. 2018, §3.2, Figure 8).

While training a deep self-normalizing MLP (SELU, 16 hidden layers of 128) on
MNIST-1D with PipeDream's staleness on K = 4 stages and SpecTrain's velocity
forecast (`pj.simulate`, per-stage delays and horizons from the table), at
every update t: the RMSE between the predicted weights Ŵ_{t+s} = W_t −
s·η·v_t (eq. 4) and the weights the run actually reaches s updates later,
against the RMSE between the stale weights W_t and those, for s = 1, 2, 3.

Run: python benchmarks/spectrain_error.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import pipejax as pj
from common import RESULTS, save, table

K, MB, LR, MOMENTUM, EPOCHS, S = 4, 32, 0.01, 0.9, 4, (1, 2, 3)


def main() -> None:
    data = pj.data.load("mnist1d")
    layers = pj.models.snn(depth=16, width=128, classes=10)
    schedule = pj.schedules.pipedream(K, 4)
    mit = pj.transforms.mitigation("spectrain", LR, momentum=MOMENTUM)
    sim = pj.simulate(layers, loss=pj.losses.cross_entropy, optimizer=mit.optimizer, split=K,
                      delays=schedule)
    init = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((MB, 40)),
                       stages=1, microbatches=1).init(jax.random.key(0))
    state = sim.init(pj.unstage(init))

    @jax.jit
    def flat(state):
        """All weights W_t and all momentum traces v_t, as two vectors."""
        traces = [optax.tree.get_all_with_path(s, "trace")[0][1] for s in state.opt_states]
        return ravel_pytree(list(state.weights))[0], ravel_pytree(traces)[0]

    history, pred, stale, losses = [], {s: [] for s in S}, {s: [] for s in S}, []
    for epoch in range(EPOCHS):
        p = np.random.default_rng(epoch).permutation(len(data.x_train))
        xs = jnp.asarray(data.x_train[p]).reshape(-1, 1, MB, 40)
        ys = jnp.asarray(data.y_train[p]).reshape(-1, 1, MB)
        for x, y in zip(xs, ys):
            state, loss = sim.run(state, x, y)
            losses.append(float(loss[0]))
            w, v = (np.asarray(a, np.float64) for a in flat(state))
            history.append((w, v))
            for s in S:  # W_{t} is now the "actual" weights s updates after W_{t−s}
                if len(history) > s:
                    w0, v0 = history[-1 - s]
                    pred[s].append(np.sqrt(np.mean((w0 - s * LR * v0 - w) ** 2)))
                    stale[s].append(np.sqrt(np.mean((w0 - w) ** 2)))
            history = history[-max(S) - 1:]
    windows = lambda s: [np.asarray(a[:len(a) // 25 * 25]).reshape(-1, 25).mean(1)
                         for a in (pred[s], stale[s])]
    rows = [{"s": s, "rmse_predicted_mean": f"{np.mean(pred[s]):.3e}",
             "rmse_stale_mean": f"{np.mean(stale[s]):.3e}",
             "stale_over_predicted": round(float(np.mean(stale[s]) / np.mean(pred[s])), 2),
             "updates_predicted_below_stale": f"{np.mean(np.less(pred[s], stale[s])):.4f}",
             "windows_of_25_predicted_below_stale": f"{np.mean(np.less(*windows(s))):.4f}"}
            for s in S]
    print(table(rows))
    accuracy = pj.evaluator(layers)(sim.params(state), data.x_test, data.y_test)
    print(f"test accuracy after {EPOCHS} epochs: {100 * accuracy:.2f}%, delays {sim.delays}, "
          f"SpecTrain horizons {[(i.forward_horizon, i.backward_horizon) for i in sim.infos]}")
    plot(pred, stale)
    save("spectrain_error", {"K": K, "micro_batch": MB, "lr": LR, "momentum": MOMENTUM,
                             "epochs": EPOCHS, "updates": len(losses), "test_accuracy": accuracy,
                             "rows": rows, "claim_mean_predicted_below_stale": all(
                                 r["stale_over_predicted"] > 1 for r in rows)})


def plot(pred: dict, stale: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    smooth = lambda a: np.convolve(a, np.ones(25) / 25, mode="valid")
    for s, color in zip(S, ("tab:blue", "tab:orange", "tab:green")):
        ax.plot(smooth(stale[s]), color=color, ls="--", label=f"stale, s = {s}")
        ax.plot(smooth(pred[s]), color=color, label=f"predicted, s = {s}")
    ax.set(xlabel="update", ylabel="RMSE to the actual weights", yscale="log",
           title="SpecTrain prediction error (SNN, PipeDream, K = 4)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(RESULTS / "spectrain_error.png", dpi=100)


if __name__ == "__main__":
    main()
