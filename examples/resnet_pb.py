"""A pre-activation ResNet with GroupNorm trained with pipelined backpropagation
at micro-batch size 1, in Kosson et al. (2020)'s regime, on scikit-learn's 8x8
digits.

Every stage runs one forward and one backward per tick and updates its
weights after each backward, so stage k's gradients are D_k = 2(K-1-k)
updates stale. The recipe: each convolution (and each residual sum) is a
layer; the hyper-parameters of a recipe tuned at batch 128 (lr 0.1, momentum
0.9, decayed x0.1 at 50 % and 75 %) scaled to update size 1 by their eq. 9;
spike compensation and linear weight prediction (LWP_D + SC_D) untuned.

Run: python examples/resnet_pb.py
"""

import pipejax as pj

pj.simulate_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

EPOCHS, M = 3, 8
data = pj.data.digits()
layers = pj.models.resnet(depth=3, width=16, groups=4, classes=10, dims=2, fine=True)
pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy, example=jnp.zeros((1, 8, 8, 1)),
                   stages=4, microbatches=M, schedule="pb")
print(pipe)
print("delays", pipe.schedule.delays)

updates = EPOCHS * (len(data.x_train) // M) * M  # one per micro-batch of one example
reference = pj.transforms.lr_schedule("step", 0.1, updates)  # x0.1 at 50 % and 75 %
mit = pj.transforms.lwp_sc(reference=(reference, 0.9, 128), batch=1)
print(f"lr {mit.learning_rate(0):.3g}, momentum {mit.momentum:.5f} (eq. 9 from 0.1, 0.9, 128)")

trainer = pipe.trainer(mit.optimizer)
state = trainer.init(pipe.init(jax.random.key(0)))
for epoch in range(EPOCHS):
    for x, y in pj.data.batches(data.x_train, data.y_train, M, seed=0, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
    print(f"epoch {epoch}  loss {float(metrics['loss']):.4f}")
state, _ = trainer.flush(state)

accuracy = pj.evaluator(layers)(pj.unstage(state.params), data.x_test, data.y_test)
print(f"test accuracy {accuracy:.3f}")
