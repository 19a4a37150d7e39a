"""A small VGG on scikit-learn's 8x8 digits with the synchronous 1F1B schedule
(PipeDream-Flush): the same gradients as GPipe, at most K inputs stashed.

Run: python examples/vgg_1f1b.py
"""

import pipejax as pj

pj.simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

data = pj.data.digits()
layers = pj.models.vgg((16, 16, "M", 32, "M"), classes=10, dims=2, dense=64)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((8, 8, 8, 1)),
                   stages=4, microbatches=8, schedule="1f1b", partition="bottleneck")
print(pipe)
print(pj.schedules.render(pipe.schedule))

# Each stage's optimizer sees that stage's parameters only: tree-wide transforms
# such as clip_by_global_norm would clip per stage, not over the whole model.
trainer = pipe.trainer(optax.adamw(2e-3, weight_decay=1e-4))
state = trainer.init(pipe.init(jax.random.key(0)))
for epoch in range(20):
    for x, y in pj.data.batches(data.x_train, data.y_train, 64, seed=1, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
print(f"loss {float(metrics['loss']):.4f}")

accuracy = pj.evaluator(layers)(pj.unstage(state.params), data.x_test, data.y_test)
print(f"test accuracy {accuracy:.3f}")
