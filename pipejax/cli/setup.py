"""What `pipejax train` and `pipejax plan` share: model defaults, devices, the pipeline."""

from __future__ import annotations

import sys

from pipejax.cli.schedule_flag import schedule_arg

# Per model: keyword arguments of its builder and the training settings that
# reach the accuracies of docs/training-job.md on MNIST-1D (4 stages, GPipe); the GPT's
# reach the validation loss of docs/language-models.md on Shakespeare's works.
MODEL_DEFAULTS = {
    "mlp": ({"depth": 4, "width": 256}, {"lr": 1e-3, "epochs": 60}),
    "snn": ({"depth": 16, "width": 128}, {"lr": 3e-4, "epochs": 40}),
    "resnet": ({"depth": 6, "width": 32, "groups": 8}, {"lr": 3e-3, "epochs": 15}),
    "vgg": ({}, {"lr": 1e-3, "epochs": 30}),
    "transformer": ({"layers": 4, "dim": 64, "heads": 4}, {"lr": 1e-3, "epochs": 40}),
    "residual_lstm": ({"layers": 3, "hidden": 64}, {"lr": 3e-3, "epochs": 15}),
    "gpt": ({"depth": 6, "width": 128, "heads": 4, "context": 128},
            {"lr": 2e-3, "steps": 2000, "optimizer": "adamw", "lr_schedule": "cosine",
             "warmup": 100, "batch_size": 32, "eval_every": 250}),
}
# What a flag left out means when the model's defaults do not say.
FLAG_DEFAULTS = {"lr_schedule": "constant", "warmup": 0, "eval_every": 0}


def apply_model_defaults(args) -> set[str]:
    """Fill the flags left out (None) from the model's training defaults, then
    from FLAG_DEFAULTS; --data from the model's kind (tasks.py). Given --epochs
    keeps the model's --steps out, given --microbatch-size its --batch-size
    (each sets the other's quantity). The model's rate is `model_lr(args)`.
    Returns the flags filled."""
    from pipejax.cli.tasks import default_data

    args.data = args.data or default_data(args.model)
    filled = set()
    for key, value in {**FLAG_DEFAULTS, **MODEL_DEFAULTS[args.model][1]}.items():
        if key == "lr" or (key == "steps" and getattr(args, "epochs", None) is not None):
            continue  # --lr stays None: --reference sets the rate when --lr is left out
        if key == "batch_size" and args.microbatch_size is not None:
            continue
        if key == "optimizer" and getattr(args, "reference", None):
            continue  # eq. 9 scales momentum, not a model's adamw
        if getattr(args, key, None) is None:
            setattr(args, key, value)
            filled.add(key)
    return filled


def model_lr(args) -> float:
    """--lr, else the model's default rate."""
    return args.lr if args.lr is not None else MODEL_DEFAULTS[args.model][1]["lr"]


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


def model_kwargs(name: str, text: str | None = None) -> dict:
    """The model's builder arguments: its defaults, overridden by --model-args
    `text` ("depth=2,width=64": numbers, or words for string arguments).

    Raises:
      ConfigError: naming an argument the builder does not take, or a pair
        that is not KEY=VALUE.
    """
    import inspect

    import pipejax as pj

    kwargs = dict(MODEL_DEFAULTS[name][0])
    known = [p for p in inspect.signature(pj.models.MODELS[name]).parameters
             if p not in ("api", "inputs", "rngs", "classes", "vocab")]
    for pair in filter(None, (text or "").split(",")):
        key, eq, value = pair.partition("=")
        if not eq or key.strip() not in known:
            raise pj.errors.ConfigError(
                f"--model-args {text!r}: {pair!r} is not KEY=VALUE of an argument of "
                f"pj.models.{name} ({', '.join(known)})")
        try:
            kwargs[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            kwargs[key.strip()] = value.strip()
    return kwargs


def build_layers(name: str, example_shape: tuple, classes: int, api: str = "linen",
                 seed: int = 0, kwargs: dict | None = None) -> list:
    """The named model for examples of `example_shape` (signals [L] or images
    [H, W, C]), in Flax linen or NNX (built from nnx.Rngs(seed)); a language
    model over `classes` tokens. `kwargs`: the builder's arguments
    (default: `model_kwargs(name)`)."""
    import numpy as np
    from flax import nnx

    import pipejax as pj
    from pipejax.models.common import flatten

    kwargs = model_kwargs(name) if kwargs is None else kwargs
    if name == "gpt":
        return pj.models.gpt(**kwargs, vocab=classes, **(
            {"api": "nnx", "rngs": nnx.Rngs(seed)} if api == "nnx" else {}))
    image = len(example_shape) == 3
    # The MLP, and the sequence models on images, read flat vectors (the SNN flattens itself).
    needs_flat = name == "mlp" or (image and name != "snn")
    if name in ("resnet", "vgg"):
        kwargs, needs_flat = {**kwargs, "dims": 2 if image else 1}, False
    inputs = (int(np.prod(example_shape)),) if needs_flat else tuple(example_shape)
    if api == "nnx":
        kwargs = {**kwargs, "api": "nnx", "inputs": inputs, "rngs": nnx.Rngs(seed)}
    layers = pj.models.MODELS[name](**kwargs, classes=classes)
    return [flatten] + layers if needs_flat else layers


def partition_arg(args) -> str | list[int]:
    """--partition as `pj.pipeline` takes it: an objective or layer counts."""
    if args.partition in ("variance", "bottleneck"):
        return args.partition
    return [int(n) for n in args.partition.split(",")]


def make_pipeline(args, task, mesh, weight_stashing: bool = False):
    """The model's layers and `pj.pipeline` of them for `task` (cli/tasks.py)."""
    import pipejax as pj

    layers = build_layers(args.model, getattr(task, "example_shape", ()), task.classes, args.api,
                          getattr(args, "seed", 0), model_kwargs(args.model, args.model_args))
    mb = args.batch_size // (args.microbatches * args.replicas)
    example, targets = task.example(mb)
    pipe = pj.pipeline(layers, loss=task.loss, example=example, targets=targets,
                       stages=args.stages, microbatches=args.microbatches,
                       schedule=schedule_arg(args), partition=partition_arg(args), remat=args.remat,
                       mesh=mesh, weight_stashing=weight_stashing,
                       compute_dtype=args.compute_dtype, max_padding=args.max_padding,
                       virtual=args.virtual, placement=args.placement)
    return layers, pipe


def resolve_batch_size(args) -> int:
    """Examples per step: --batch-size, or --microbatch-size x --microbatches x --replicas
    (both given must agree); 128 by default."""
    import pipejax as pj

    per_step = args.microbatches * args.replicas
    if args.microbatch_size is None:
        return 128 if args.batch_size is None else args.batch_size
    if args.microbatch_size < 1:
        raise pj.errors.ConfigError(f"--microbatch-size {args.microbatch_size}; use 1 or more")
    size = args.microbatch_size * per_step
    if args.batch_size is not None and args.batch_size != size:
        raise pj.errors.ConfigError(
            f"--batch-size {args.batch_size} disagrees with --microbatch-size "
            f"{args.microbatch_size} x --microbatches {args.microbatches} x --replicas "
            f"{args.replicas} = {size}; give one of the two")
    return size


def parse_numbers(text: str, flag: str, counts: tuple[int, ...] = (),
                  example: str = "0.5,0.75") -> list[float]:
    """Comma-separated numbers; `counts`: how many may be given (any if empty)."""
    import pipejax as pj

    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or (counts and len(values) not in counts):
        many = " or ".join(map(str, counts)) or "one or more"
        raise pj.errors.ConfigError(f"{flag} {text!r}: give {many} comma-separated numbers, "
                                    f"e.g. {example}")
    return values


def make_optimizer(args, lr: float | None, updates: tuple[int, int], update_size: int,
                   synchronous: bool) -> tuple:
    """(optimizer for `pipe.trainer`, weight stashing, settings): the named
    optax optimizer, or with `--mitigation` the named staleness mitigation on
    it, at a learning rate that follows `--lr-schedule` over `updates` =
    (optimizer updates in all, in one epoch); with `--reference LR,M,B`, the
    rate and momentum of that recipe scaled to `update_size` by Kosson et
    al.'s eq. 9. `settings` holds the peak rate and the momentum used, for
    the log and metrics."""
    import optax

    import pipejax as pj

    T, ConfigError = pj.transforms, pj.errors.ConfigError
    updates, per_epoch = updates
    if args.mitigation is not None and synchronous:
        raise ConfigError(f"--mitigation {args.mitigation} repairs the staleness of an "
                          f"asynchronous schedule; --schedule {args.schedule} has none "
                          "(use --schedule pb or pipedream)")
    pipemare = args.mitigation == "pipemare"
    warmup = 0 if pipemare else args.warmup
    decay_at = tuple(parse_numbers(args.decay_at, "--decay-at"))
    momentum = 0.0 if args.optimizer == "sgd" else (
        0.9 if args.momentum is None else args.momentum)
    settings = {"optimizer": args.optimizer, "lr_schedule": args.lr_schedule,
                "update_size": update_size, "updates": updates, "warmup": args.warmup}
    if args.optimizer == "adamw":
        settings["weight_decay"] = args.weight_decay
    if args.lr_schedule == "step":
        settings["decay_at"] = list(decay_at)
    if args.reference is None:
        peak = lr
        rate = T.lr_schedule(args.lr_schedule, lr, updates, decay_at=decay_at, warmup_steps=warmup)
    else:
        if args.optimizer != "momentum":
            raise ConfigError(f"--reference scales SGD with momentum (eq. 9); --optimizer "
                              f"{args.optimizer} takes --lr directly: use --optimizer momentum")
        if args.lr is not None or args.momentum is not None:
            raise ConfigError("--reference LR,M,B sets the learning rate and momentum (eq. 9); "
                              "leave out --lr and --momentum")
        ref_lr, ref_m, ref_b = parse_numbers(args.reference, "--reference", (3,), "0.1,0.9,128")
        reference = T.lr_schedule(args.lr_schedule, ref_lr, updates, decay_at=decay_at,
                                  warmup_steps=warmup)
        rate, momentum = T.scale_hyperparams(reference, ref_m, int(ref_b), update_size)
        peak = T.scale_hyperparams(ref_lr, ref_m, int(ref_b), update_size)[0]
        settings["reference"] = [ref_lr, ref_m, int(ref_b)]
    settings.update(lr=peak, momentum=momentum)
    if args.mitigation is None:
        return {"sgd": lambda: optax.sgd(rate), "momentum": lambda: optax.sgd(rate, momentum),
                "adam": lambda: optax.adam(rate),
                "adamw": lambda: optax.adamw(rate, b2=0.95, weight_decay=args.weight_decay,
                                             mask=_matrices)}[args.optimizer](), False, settings
    adam = args.optimizer in ("adam", "adamw")
    if args.mitigation == "nesterov" and not adam:
        raise ConfigError("--mitigation nesterov is NAdam on stashed weights; use --optimizer "
                          "adam or adamw")
    nesterov = args.mitigation == "nesterov"  # its own β1 0.99; on adam, all its settings
    base = {"adam": None if nesterov else "adam",
            "adamw": T.AdamW(0.99 if nesterov else 0.9, b2=0.95, weight_decay=args.weight_decay,
                             mask=_matrices)}.get(args.optimizer, "momentum")
    mit = T.mitigation(args.mitigation, rate, momentum=None if adam else momentum,
                       horizon_scale=args.horizon_scale, form=args.form, optimizer=base,
                       warmup_steps=(args.warmup or per_epoch) if pipemare else None)
    return mit.optimizer, mit.weight_stashing, settings


def _matrices(params):
    """AdamW's decay mask: the weight matrices and embeddings (2-D and up),
    not the biases and LayerNorm scales."""
    import jax

    return jax.tree.map(lambda p: p.ndim >= 2, params)


def describe_optimizer(settings: dict) -> str:
    """One line: the optimizer, its peak rate, schedule and momentum, and the scaling used."""
    s = settings
    text = f"{s['optimizer']}, lr {s['lr']:.3g}"
    if s["lr_schedule"] == "step":
        text += (" (x0.1 at " + ", ".join(f"{100 * f:g} %" for f in s["decay_at"])
                 + f" of {s['updates']} updates)")
    elif s["lr_schedule"] == "cosine":
        text += f" (cosine decay over {s['updates']} updates)"
    if s["warmup"]:
        text += f", {s['warmup']} warm-up updates"
    if s["optimizer"] == "adamw":
        text += f", betas (0.9, 0.95), weight decay {s['weight_decay']:g} on matrices"
    elif s["optimizer"] != "adam":
        text += f", momentum {s['momentum']:.6g}"
    if "reference" in s:
        lr, m, b = s["reference"]
        text += (f"; Kosson et al. eq. 9 from lr {lr:g}, momentum {m:g}, batch {b} to update "
                 f"size {s['update_size']}")
    return text
