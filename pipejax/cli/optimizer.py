"""The optimizer the flags name: an optax optimizer, or a staleness
mitigation on one, at a rate that follows --lr-schedule."""

from __future__ import annotations

from pipejax.cli.config import TrainConfig
from pipejax.cli.setup import parse_numbers


def make_optimizer(cfg: TrainConfig, updates: tuple[int, int], update_size: int,
                   synchronous: bool) -> tuple:
    """(optimizer for `pipe.trainer`, weight stashing, settings): the named
    optax optimizer, or with `--mitigation` the named staleness mitigation on
    it, at a learning rate that follows `--lr-schedule` over `updates` =
    (optimizer updates in all, in one epoch); with `--reference LR,M,B`, the
    rate and momentum of that recipe scaled to `update_size` by Kosson et
    al.'s eq. 9. `settings` holds the peak rate and the momentum used, for
    the log and metrics."""
    from pipejax.errors import ConfigError
    from pipejax.schedules import FAMILIES

    if cfg.mitigation is not None and synchronous:
        asynchronous = " or ".join(sorted(n for n, f in FAMILIES.items() if f.asynchronous))
        raise ConfigError(f"--mitigation {cfg.mitigation} repairs the staleness of an "
                          f"asynchronous schedule; --schedule {cfg.schedule} has none "
                          f"(use --schedule {asynchronous})")
    decay_at = tuple(parse_numbers(cfg.decay_at, "--decay-at"))
    settings = {"optimizer": cfg.optimizer, "lr_schedule": cfg.lr_schedule,
                "update_size": update_size, "updates": updates[0], "warmup": cfg.warmup}
    if cfg.optimizer in ("adamw", "muon"):
        settings["weight_decay"] = cfg.weight_decay
    if cfg.lr_schedule == "step":
        settings["decay_at"] = list(decay_at)
    rate, momentum, used = _rate(cfg, updates[0], update_size, decay_at)
    settings.update(used)
    if cfg.mitigation is None:
        return _named(cfg, rate, momentum), False, settings
    mit = _mitigation(cfg, rate, momentum, updates[1])
    return mit.optimizer, mit.weight_stashing, settings


def _rate(cfg: TrainConfig, updates: int, update_size: int, decay_at: tuple) -> tuple:
    """The learning rate (a schedule over `updates`), the momentum and the
    settings used (the peak rate, the momentum, the reference): the flags'
    own, or with --reference that recipe's scaled to `update_size` (eq. 9)."""
    import pipejax as pj

    T = pj.transforms
    warmup = 0 if cfg.mitigation == "pipemare" else cfg.warmup  # PipeMare warms up its own way
    if cfg.momentum is not None and cfg.optimizer != "momentum":
        has = "has none" if cfg.optimizer == "sgd" else "keeps its own (Adam's β1, Muon's beta)"
        raise pj.errors.ConfigError(f"--momentum {cfg.momentum:g} is SGD with momentum's; "
                                    f"--optimizer {cfg.optimizer} {has}: use --optimizer "
                                    "momentum or leave out --momentum")
    momentum = 0.0 if cfg.optimizer == "sgd" else (0.9 if cfg.momentum is None else cfg.momentum)
    if cfg.reference is None:
        rate = T.lr_schedule(cfg.lr_schedule, cfg.learning_rate, updates, decay_at=decay_at,
                             warmup_steps=warmup)
        return rate, momentum, {"lr": cfg.learning_rate, "momentum": momentum}
    if cfg.optimizer != "momentum":
        raise pj.errors.ConfigError(f"--reference scales SGD with momentum (eq. 9); --optimizer "
                                    f"{cfg.optimizer} takes --lr directly: use --optimizer "
                                    "momentum")
    if cfg.lr is not None or cfg.momentum is not None:
        raise pj.errors.ConfigError("--reference LR,M,B sets the learning rate and momentum "
                                    "(eq. 9); leave out --lr and --momentum")
    ref_lr, ref_m, ref_b = parse_numbers(cfg.reference, "--reference", (3,), "0.1,0.9,128")
    reference = T.lr_schedule(cfg.lr_schedule, ref_lr, updates, decay_at=decay_at,
                              warmup_steps=warmup)
    rate, momentum = T.scale_hyperparams(reference, ref_m, int(ref_b), update_size)
    peak = T.scale_hyperparams(ref_lr, ref_m, int(ref_b), update_size)[0]
    return rate, momentum, {"reference": [ref_lr, ref_m, int(ref_b)], "lr": peak,
                            "momentum": momentum}


def _named(cfg: TrainConfig, rate, momentum: float):
    """--optimizer as optax builds it (adamw: betas 0.9, 0.95, decay on matrices)."""
    import optax

    if cfg.optimizer == "sgd":
        return optax.sgd(rate)
    if cfg.optimizer == "momentum":
        return optax.sgd(rate, momentum)
    if cfg.optimizer == "adam":
        return optax.adam(rate)
    if cfg.optimizer == "muon":
        return _muon(cfg)(rate)
    return optax.adamw(rate, b2=0.95, weight_decay=cfg.weight_decay, mask=_matrices)


def _muon(cfg: TrainConfig):
    """--optimizer muon: `pj.transforms.Muon` with --weight-decay on matrices, on
    the matrices the zoo model names (`ZooModel.muon`)."""
    import pipejax as pj

    return pj.transforms.Muon(weight_decay=cfg.weight_decay, mask=_matrices,
                              dimensions=pj.models.MODELS[cfg.model].muon)


def _mitigation(cfg: TrainConfig, rate, momentum: float, per_epoch: int):
    """--mitigation on --optimizer (`pj.transforms.mitigation`)."""
    import pipejax as pj

    T = pj.transforms
    adam = cfg.optimizer in ("adam", "adamw")
    if cfg.mitigation == "nesterov" and not adam:
        raise pj.errors.ConfigError("--mitigation nesterov is NAdam on stashed weights; use "
                                    "--optimizer adam or adamw")
    nesterov = cfg.mitigation == "nesterov"  # its own β1 0.99; on adam, all its settings
    base = _muon(cfg) if cfg.optimizer == "muon" else {
        "adam": None if nesterov else "adam",
        "adamw": T.AdamW(0.99 if nesterov else 0.9, b2=0.95, weight_decay=cfg.weight_decay,
                         mask=_matrices)}.get(cfg.optimizer, "momentum")
    pipemare = cfg.mitigation == "pipemare"
    own = adam or cfg.optimizer == "muon"  # its momentum is its own (β1, beta)
    return T.mitigation(cfg.mitigation, rate, momentum=None if own else momentum,
                        horizon_scale=cfg.horizon_scale, form=cfg.form, optimizer=base,
                        warmup_steps=(cfg.warmup or per_epoch) if pipemare else None)


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
    elif s["optimizer"] == "muon":
        from pipejax.transforms.muon import Muon

        text += f", beta {Muon().beta:g}, weight decay {s['weight_decay']:g} on matrices"
    elif s["optimizer"] != "adam":
        text += f", momentum {s['momentum']:.6g}"
    if "reference" in s:
        lr, m, b = s["reference"]
        text += (f"; Kosson et al. eq. 9 from lr {lr:g}, momentum {m:g}, batch {b} to update "
                 f"size {s['update_size']}")
    return text
