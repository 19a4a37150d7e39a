"""One pipeline across several processes: its stages live in different
processes (jax.distributed; CPU collectives through gloo), one jitted step.

Run: python examples/multiprocess.py                  # 2 processes x 2 CPU devices, 4 stages
     python examples/multiprocess.py --processes 4    # 4 processes x 1 device
     python examples/multiprocess.py --fsdp 2         # 2 stages, each over 2 devices

With --processes N it starts N copies of itself on this machine
(`pj.distributed.launch`); each joins the job (`pj.distributed.initialize`),
builds the same pipeline over the global mesh of every process's devices and
feeds the same batches. Process 0 prints the losses and, with --out, writes
them and the final parameters (gathered from all processes) to an .npz.
On several hosts, run on each host instead:

    PIPEJAX_COORDINATOR=host0:4321 PIPEJAX_PROCESSES=2 PIPEJAX_PROCESS_ID=<0 or 1> \\
    PIPEJAX_LOCAL_DEVICES=2 python examples/multiprocess.py
"""

from __future__ import annotations

import argparse
import sys

import pipejax as pj

STAGES, MICROBATCHES, BATCH = 4, 4, 64


def train(steps: int, devices=None, fsdp: int = 1) -> tuple[list[float], list]:
    """`steps` GPipe steps of an MLP on MNIST-1D over the first 4 devices of
    the job (`devices` to pick others), 4 / `fsdp` stages each sharded over
    `fsdp` of them; returns the losses and, per layer, the final variables."""
    import jax
    import jax.numpy as jnp
    import optax

    data = pj.data.mnist1d()
    layers = pj.models.mlp(depth=4, width=64, classes=data.classes)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                       example=jnp.zeros((BATCH // MICROBATCHES, data.x_train.shape[1])),
                       stages=STAGES // fsdp, microbatches=MICROBATCHES,
                       mesh=pj.make_mesh(STAGES // fsdp, devices=devices, fsdp=fsdp))
    trainer = pipe.trainer(optax.adam(1e-3))
    state = trainer.init(pipe.init(jax.random.key(0)))
    losses = []
    for x, y in list(pj.data.batches(data.x_train, data.y_train, BATCH, seed=0, epoch=0))[:steps]:
        state, metrics = trainer.step(state, (x, y))
        losses.append(float(metrics["loss"]))
    return losses, pj.unstage(state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="write losses and parameters to this .npz")
    parser.add_argument("--fsdp", type=int, default=1, choices=[1, 2, 4],
                        help="devices each stage is sharded over (of the 4)")
    args = parser.parse_args()
    if not pj.distributed.launched():
        local = pj.distributed.devices_per_process(STAGES, args.processes)
        return pj.distributed.launch([sys.executable, *sys.argv], args.processes, local,
                                     timeout=300)
    pj.distributed.initialize()
    import jax
    import numpy as np

    losses, variables = train(args.steps, fsdp=args.fsdp)
    if jax.process_index() == 0:
        print(f"{jax.process_count()} processes, devices {jax.devices()}")
        print("losses " + " ".join(f"{v:.6f}" for v in losses))
        if args.out:
            leaves = jax.tree.leaves(variables)
            np.savez(args.out, losses=np.array(losses), **{f"p{i}": a for i, a in enumerate(leaves)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
