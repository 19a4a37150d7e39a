"""Split an MLP over 4 (simulated) devices and train it on MNIST-1D with GPipe.

Run: python examples/quickstart.py
"""

import pipejax as pj

pj.simulate_devices(4)  # on a CPU; must come before any JAX computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

data = pj.data.mnist1d()
layers = pj.models.mlp(depth=4, width=256, classes=10)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                   example=jnp.zeros((32, 40)),        # ONE micro-batch of inputs
                   stages=4, microbatches=4, schedule="gpipe",
                   partition="variance", remat="stage")
print(pipe)
print(pj.schedules.render(pipe.schedule))

trainer = pipe.trainer(optax.adam(1e-3))
state = trainer.init(pipe.init(jax.random.key(0)))
for epoch in range(20):
    for x, y in pj.data.batches(data.x_train, data.y_train, 128, seed=0, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
    print(f"epoch {epoch:2d}  loss {float(metrics['loss']):.4f}")

variables = pj.unstage(state.params)                    # one dict per layer, stage-free
print(f"test accuracy {pj.evaluator(layers)(variables, data.x_test, data.y_test):.3f}")
