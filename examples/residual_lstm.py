"""Stacked residual LSTMs (Flax nn.RNN over nn.LSTMCell) reading MNIST-1D
signals one sample at a time, split over 4 stages with the bottleneck
(PipeDream) partition objective.

Run: python examples/residual_lstm.py
"""

import pipejax as pj

pj.simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

data = pj.data.mnist1d()
layers = pj.models.residual_lstm(layers=3, hidden=64, classes=10)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((32, 40)),
                   stages=4, microbatches=4, partition="bottleneck")
print(pipe)

trainer = pipe.trainer(optax.adam(3e-3))
state = trainer.init(pipe.init(jax.random.key(0)))
for epoch in range(8):
    for x, y in pj.data.batches(data.x_train, data.y_train, 128, seed=0, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
    print(f"epoch {epoch}  loss {float(metrics['loss']):.4f}")

accuracy = pj.evaluator(layers)(pj.unstage(state.params), data.x_test, data.y_test)
print(f"test accuracy {accuracy:.3f}")
