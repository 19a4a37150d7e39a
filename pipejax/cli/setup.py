"""What `pipejax train` and `pipejax plan` share: model defaults, devices, the pipeline."""

from __future__ import annotations

import sys

# Per model: keyword arguments of its builder and the training settings that
# reach the README's accuracies on MNIST-1D (4 stages, GPipe).
MODEL_DEFAULTS = {
    "mlp": ({"depth": 4, "width": 256}, {"lr": 1e-3, "epochs": 60}),
    "snn": ({"depth": 16, "width": 128}, {"lr": 3e-4, "epochs": 40}),
    "resnet": ({"depth": 6, "width": 32, "groups": 8}, {"lr": 3e-3, "epochs": 15}),
    "vgg": ({}, {"lr": 1e-3, "epochs": 30}),
    "transformer": ({"layers": 4, "dim": 64, "heads": 4}, {"lr": 1e-3, "epochs": 40}),
    "residual_lstm": ({"layers": 3, "hidden": 64}, {"lr": 3e-3, "epochs": 15}),
}


def setup_devices(stages: int, replicas: int = 1, nodes: int = 1):
    """The mesh to run on (`pj.make_mesh`): the default devices if they are
    accelerators enough for replicas x stages, else simulated CPU devices,
    announced. In a job of several processes, the devices of all of them."""
    import pipejax as pj

    need = stages * replicas
    if not pj.distributed.launched():
        pj.simulate_devices(max(need, 1))
    import jax

    found = jax.devices()
    if (found[0].platform != "cpu" and len(found) >= need) or jax.process_count() > 1:
        return pj.make_mesh(stages, replicas, nodes)
    why = ("no accelerator found" if found[0].platform == "cpu" else
           f"{len(found)} {found[0].platform} device(s) for {need}")
    print(f"pipejax: {why}; simulating {need} CPU devices, one per stage of each replica "
          "(they share this machine's cores: no speed-up from pipelining)", file=sys.stderr)
    return pj.make_mesh(stages, replicas, nodes, jax.devices("cpu"))


def build_layers(name: str, example_shape: tuple, classes: int) -> list:
    """The named model for examples of `example_shape` (signals [L] or images [H, W, C])."""
    import pipejax as pj
    from pipejax.models.common import flatten

    kwargs, _ = MODEL_DEFAULTS[name]
    image = len(example_shape) == 3
    if name in ("resnet", "vgg"):
        return pj.models.MODELS[name](**kwargs, classes=classes, dims=2 if image else 1)
    layers = pj.models.MODELS[name](**kwargs, classes=classes)
    # The MLP, and the sequence models on images, read flat vectors (the SNN flattens itself).
    needs_flat = name == "mlp" or (image and name != "snn")
    return [flatten] + layers if needs_flat else layers


def make_pipeline(args, example_shape, classes: int, mesh, weight_stashing: bool = False):
    import jax.numpy as jnp

    import pipejax as pj

    partition = args.partition
    if partition not in ("variance", "bottleneck"):
        partition = [int(n) for n in partition.split(",")]
    layers = build_layers(args.model, example_shape, classes)
    mb = args.batch_size // (args.microbatches * args.replicas)
    pipe = pj.pipeline(layers, loss=pj.losses.cross_entropy,
                       example=jnp.zeros((mb, *example_shape), jnp.float32),
                       stages=args.stages, microbatches=args.microbatches,
                       schedule=args.schedule, partition=partition, remat=args.remat, mesh=mesh,
                       weight_stashing=weight_stashing)
    return layers, pipe


def make_optimizer(args, lr: float):
    """(optimizer for `pipe.trainer`, weight stashing): the named optax
    optimizer, or with `--mitigation` the named staleness mitigation on it."""
    import optax

    import pipejax as pj

    if args.mitigation is None:
        return {"sgd": lambda: optax.sgd(lr), "momentum": lambda: optax.sgd(lr, args.momentum),
                "adam": lambda: optax.adam(lr)}[args.optimizer](), False
    if pj.schedules.make_schedule(args.schedule, 1, 1).synchronous:
        raise pj.errors.ConfigError(f"--mitigation {args.mitigation} repairs the staleness of an "
                                    f"asynchronous schedule; --schedule {args.schedule} has none "
                                    "(use --schedule pb or pipedream)")
    momentum = 0.0 if args.optimizer == "sgd" else args.momentum
    mit = pj.transforms.mitigation(args.mitigation, lr, momentum=momentum,
                                   horizon_scale=args.horizon_scale,
                                   optimizer="adam" if args.optimizer == "adam" else "momentum")
    return mit.optimizer, mit.weight_stashing
