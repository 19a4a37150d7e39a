"""A 16-layer self-normalizing network trained asynchronously with PipeDream
(weight stashing) on MNIST-1D, as in the SpecTrain paper's SNN experiment.

Run: python examples/snn_pipedream.py
"""

import pipejax as pj

pj.simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

data = pj.data.mnist1d()
layers = pj.models.snn(depth=16, width=128, classes=10, dropout=0.02)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((32, 40)),
                   stages=4, microbatches=4, schedule="pipedream", weight_stashing=True)
print(pj.schedules.render(pipe.schedule))
print(f"weight stashing costs {pipe.layout.weight_stash_bytes / 2**20:.2f} MiB per stage")

trainer = pipe.trainer(optax.adam(3e-4))
state = trainer.init(pipe.init(jax.random.key(0)), jax.random.key(1))  # AlphaDropout needs a key
for epoch in range(15):
    for x, y in pj.data.batches(data.x_train, data.y_train, 128, seed=0, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
    print(f"epoch {epoch:2d}  loss {float(metrics['loss']):.4f}")
state, _ = trainer.flush(state)  # finish the micro-batches still in flight

accuracy = pj.evaluator(layers)(pj.unstage(state.params), data.x_test, data.y_test)
print(f"test accuracy {accuracy:.3f}")
