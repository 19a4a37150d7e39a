"""A Transformer written in Flax NNX, pipelined with 1F1B over 4 stages.

The model is an ordinary `nnx.Sequential` of the researcher's own modules;
pipejax places their values on the stages, trains them, and writes the
trained values back into the same modules, which then evaluate and save
with orbax like any NNX model.

Run: python examples/nnx_transformer.py
"""

import pipejax as pj

pj.simulate_devices(4)

import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax import nnx  # noqa: E402


class Embed(nnx.Module):
    """[B, 40] signal -> [B, 10, dim]: patches of 4 samples, embedded, plus positions."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, dim, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (10, dim)))

    def __call__(self, x):
        return self.linear(x.reshape(x.shape[0], 10, 4)) + self.position[...]


class Block(nnx.Module):
    """x + attention(LN(x)), then x + MLP(LN(x)), with dropout."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(dim, rngs=rngs), nnx.LayerNorm(dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, dim, decode=False, deterministic=False,
                                                rngs=rngs, keep_rngs=False)
        self.mlp = nnx.Sequential(nnx.Linear(dim, 2 * dim, rngs=rngs), nnx.gelu,
                                  nnx.Linear(2 * dim, dim, rngs=rngs))
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.dropout(self.mlp(self.norm2(x)))


class Head(nnx.Module):
    def __init__(self, dim: int, classes: int, *, rngs: nnx.Rngs):
        self.norm, self.linear = nnx.LayerNorm(dim, rngs=rngs), nnx.Linear(dim, classes, rngs=rngs)

    def __call__(self, x):
        return self.linear(self.norm(x).mean(axis=1))


def transformer(rngs: nnx.Rngs, dim: int = 64, blocks: int = 4) -> nnx.Sequential:
    return nnx.Sequential(Embed(dim, rngs=rngs), *[Block(dim, 4, rngs=rngs) for _ in range(blocks)],
                          Head(dim, 10, rngs=rngs))


data = pj.data.mnist1d()
model = transformer(nnx.Rngs(params=0, dropout=1))
pipe = pj.pipeline(model, loss=pj.losses.cross_entropy, example=jnp.zeros((32, 40)),
                   stages=4, microbatches=4, schedule="1f1b")
print(pipe)

epochs, per_epoch = 20, len(data.x_train) // 128
schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, per_epoch, epochs * per_epoch)
trainer = pipe.trainer(optax.adamw(schedule, weight_decay=1e-4))
state = trainer.init(pipe.init(), jax.random.key(1))  # the modules' own values; dropout keys
for epoch in range(epochs):
    for x, y in pj.data.batches(data.x_train, data.y_train, 128, seed=0, epoch=epoch):
        state, metrics = trainer.step(state, (x, y))
    if epoch % 5 == 4:
        print(f"epoch {epoch:2d}  loss {float(metrics['loss']):.4f}")

pj.unstage(state, into=model)  # the trained values, written into the NNX modules
model.eval()  # no dropout
accuracy = lambda m: float(jnp.mean(jnp.argmax(m(data.x_test), -1) == data.y_test))
print(f"test accuracy {accuracy(model):.3f}")

# Save and load the parameters as for any NNX model (orbax).
path = tempfile.mkdtemp() + "/params"
checkpointer = ocp.StandardCheckpointer()
checkpointer.save(path, nnx.state(model, nnx.Param))
checkpointer.wait_until_finished()
fresh = transformer(nnx.Rngs(params=7, dropout=8))
nnx.update(fresh, checkpointer.restore(path, nnx.state(fresh, nnx.Param)))
fresh.eval()
print(f"test accuracy after a save and a load {accuracy(fresh):.3f}")
