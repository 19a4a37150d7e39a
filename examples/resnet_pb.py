"""A pre-activation ResNet with GroupNorm trained with pipelined backpropagation
at micro-batch size 1 (Kosson et al. 2020) on scikit-learn's 8x8 digits.

Every stage runs one forward and one backward per tick and updates its
weights after each backward, so stage k's gradients are D_k = 2(K-1-k)
updates stale; the learning rate is scaled down for the stalest stages.

Run: python examples/resnet_pb.py
"""

import pipejax as pj

pj.simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

data = pj.data.digits()
layers = pj.models.resnet(depth=3, width=16, groups=4, classes=10, dims=2)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((1, 8, 8, 1)),
                   stages=4, microbatches=8, schedule="pb")
print(pipe)
print("delays", pipe.schedule.delays)


def optimizer(info: pj.StageInfo) -> optax.GradientTransformation:
    return optax.sgd(0.01 / (1 + 0.5 * info.delay), momentum=0.9)


trainer = pipe.trainer(optimizer)
state = trainer.init(pipe.init(jax.random.key(0)))
for epoch in range(3):
    for x, y in pj.data.batches(data.x_train, data.y_train, 8, seed=0, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
    print(f"epoch {epoch}  loss {float(metrics['loss']):.4f}")
state, _ = trainer.flush(state)

logits = pj.apply_layers(layers, pj.unstage(state.params), data.x_test, train=False)
print(f"test accuracy {np.mean(np.argmax(logits, -1) == data.y_test):.3f}")
