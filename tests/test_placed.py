"""`pj.parameters`: where each parameter leaf lives, read from the build,
against the buffers the pipeline really places on a device."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pipejax as pj


def _pipe(F, T):
    layers = pj.models.gpt(depth=2, width=32, heads=2, context=16, vocab=64)
    x = jnp.zeros((8, 16), jnp.int32)
    return pj.pipeline(layers, loss=pj.losses.next_token, example=x, targets=x, stages=2,
                       microbatches=4, mesh=pj.make_mesh(2, fsdp=F, tensor=T))


def test_each_leaf_names_its_stage_split_and_bytes_a_device():
    pipe = _pipe(2, 2)
    placed = pj.parameters(pipe)
    query = placed[1]["params"]["attention"]["query"]["kernel"]
    assert query == pj.Placed(0, (32, 2, 16), np.dtype("float32"), P(None, "tensor", None), 2,
                              32 * 2 * 16 * 4 // 4)
    assert placed[3]["params"]["norm"]["scale"].spec == P()
    assert placed[3]["params"]["norm"]["scale"].stage == 1
    table = str(placed)
    assert "params.attention.query.kernel" in table and "P(None, 'tensor', None)" in table


def test_a_devices_share_is_what_its_buffers_hold_less_the_padding():
    for F, T in ((1, 1), (2, 1), (1, 2), (2, 2)):
        pipe = _pipe(F, T)
        params = pipe.init(jax.random.key(0))
        device = pipe.mesh.devices.flat[0]  # a device of stage 0
        held = sum(s.data.nbytes for b in params.buffers for s in b.addressable_shards
                   if s.device == device)
        leaves = [p for tree in pj.parameters(pipe)
                  for p in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, pj.Placed))]
        listed = [sum(p.device_bytes for p in leaves if p.stage == k) for k in range(2)]
        # stage 0's own leaves, in slots padded to the larger stage's (and to F pieces)
        assert listed[0] <= held <= max(listed) * 1.05, (F, T, listed, held)
