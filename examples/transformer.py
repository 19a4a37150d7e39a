"""A Transformer encoder classifier over patches of MNIST-1D signals, one encoder
block per layer of the list, pipelined with GPipe over 4 stages.

Run: python examples/transformer.py
"""

import pipejax as pj

pj.simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

data = pj.data.mnist1d()
layers = pj.models.transformer(layers=4, dim=64, heads=4, classes=10, patch=4)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((32, 40)),
                   stages=4, microbatches=4)
print(pipe)

epochs, per_epoch = 25, len(data.x_train) // 128
schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, per_epoch, epochs * per_epoch)
trainer = pipe.trainer(optax.adamw(schedule, weight_decay=1e-4))
state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))
for epoch in range(epochs):
    for x, y in pj.data.batches(data.x_train, data.y_train, 128, seed=0, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
    if epoch % 5 == 4:
        print(f"epoch {epoch:2d}  loss {float(metrics['loss']):.4f}")

accuracy = pj.evaluator(layers)(pj.unstage(state.params), data.x_test, data.y_test)
print(f"test accuracy {accuracy:.3f}")
