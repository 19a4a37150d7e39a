"""The operand order of zero bubble's weight-gradient contractions."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from pipejax.compile.split import split_backward

# An attention's query projection after a layer's elementwise op: W
# contracts the output cotangent, which B files in the bridge, with the
# op's output, which W makes again from the stage input.
WEIGHT = jax.ShapeDtypeStruct((128, 4, 32), jnp.float32)
INPUT = jax.ShapeDtypeStruct((4, 128, 128), jnp.float32)
COTANGENT = jax.ShapeDtypeStruct((4, 128, 4, 32), jnp.float32)


def _forward(w, x):
    return jnp.einsum("bti,ihd->bthd", jnp.square(x), w)


def _backward(w, x, ct):
    return jax.vjp(_forward, w, x)[1](ct)


def _bridge_relaid(split) -> int:
    """Loop fusions of W's compiled program that read the bridge (or a
    bitcast of it): each lays it out anew before the matmul reads it."""
    run = jax.jit(lambda w, x, bridge: split.run_w([w, x], bridge))
    text = run.lower(WEIGHT, INPUT, list(split.avals)).compile().as_text()
    entry = text[text.index("ENTRY"):].splitlines()
    names = {re.search(r'%(\S+) = \S+ parameter\(\d+\), metadata=\{op_name="bridge', "\n".join(
        entry)).group(1)}
    relaid = 0
    for line in entry:
        reads = set(re.findall(r"%([\w.-]+)[,)]", line.split(" = ", 1)[-1])) & names
        if reads and " bitcast(" in line:
            names.add(line.split()[0].lstrip("%"))
        relaid += bool(reads) and "kind=kLoop" in line
    return relaid


def test_a_weight_gradient_reads_its_bridged_cotangent_where_it_lies():
    split = split_backward(_backward, [WEIGHT, INPUT, COTANGENT], 1, [True, True, False])
    assert [a.shape for a in split.avals] == [COTANGENT.shape]
    assert any(split.dots.values())
    assert _bridge_relaid(split) == 0
    # in the order jax's transpose wrote it, XLA's CPU dot copies the bridge
    unswapped = {i: False for i in split.dots}
    assert _bridge_relaid(dataclasses.replace(split, dots=unswapped)) == 1

    w, x, ct = (jax.random.normal(k, a.shape) for k, a in
                zip(jax.random.split(jax.random.key(0), 3), (WEIGHT, INPUT, COTANGENT)))
    _, bridge = split.run_b([w, x, ct])
    grad = jax.jit(lambda w, x, bridge: split.run_w([w, x], bridge))(w, x, bridge)[0]
    np.testing.assert_allclose(grad, _backward(w, x, ct)[0], rtol=1e-6, atol=1e-6)
