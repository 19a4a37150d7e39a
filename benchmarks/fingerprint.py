"""Bit-for-bit fingerprints of the compiled programs, to check a refactor.

Runs every schedule, remat mode, mitigation, data rule, clip and guard on a
heterogeneous model with dropout (8 simulated devices) and hashes the exact
bytes of what comes back: `pipe.init`, `value_and_grad`, and the losses,
parameters and optimizer state after three steps and a flush. Run it before
and after a change that must not change behaviour, on one machine:

    python fingerprint.py --out results/fingerprint.json        # before
    python fingerprint.py --against results/fingerprint.json    # after

A hash differs when a single bit does, so this checks on one machine and one
JAX version only; the tests check the maths against references.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import hashlib
import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import pipejax as pj


def _layers() -> list:
    return [nn.Dense(32), nn.relu, lambda x: x.reshape(x.shape[0], 16, 2), nn.Conv(4, (3,)),
            jnp.tanh, lambda x: x.reshape(x.shape[0], -1), nn.LayerNorm(), nn.Dense(48),
            nn.gelu, nn.Dropout(0.25), nn.Dense(24), nn.relu, nn.Dense(10)]


def _digest(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(jax.device_get(leaf))
        h.update(str((a.shape, a.dtype)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _batch(R: int, M: int, mb: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(R * M * mb, 40)).astype(np.float32)
    y = rng.integers(0, 10, size=(R * M * mb,)).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


CASES = {
    # name: (schedule, K, data, remat, stash, optimizer, rule, clip, skip[, virtual])
    "gpipe-stage": ("gpipe", 3, 1, "stage", False, "adam", None, None, False),
    "gpipe-none-clip": ("gpipe", 3, 1, "none", False, "adam", None, 0.5, False),
    "1f1b-none-skip": ("1f1b", 3, 1, "none", False, "sgdm", None, None, True),
    "1f1b-dots": ("1f1b", 4, 1, "dots", False, "adam", None, None, False),
    "gpipe-k1": ("gpipe", 1, 1, "none", False, "adam", None, None, False),
    "pb-sgdm": ("pb", 3, 1, "stage", False, "sgdm", None, None, False),
    "pb-lwp+sc": ("pb", 3, 1, "stage", False, "lwp+sc", None, None, False),
    "pb-spectrain-clip-skip": ("pb", 3, 1, "stage", False, "spectrain", None, 0.5, True),
    "pipedream-stash": ("pipedream", 3, 1, "none", True, "adam", None, None, False),
    "pipedream-spectrain": ("pipedream", 4, 1, "stage", False, "spectrain", None, None, False),
    "pb-k1": ("pb", 1, 1, "stage", False, "sgdm", None, None, False),
    "gpipe-ssgd": ("gpipe", 2, 2, "stage", False, "adam", "ssgd", None, False),
    "1f1b-adpsgd-clip": ("1f1b", 2, 2, "none", False, "sgdm", "adpsgd", 0.5, False),
    "pb-ssgd-lwp+sc": ("pb", 2, 2, "stage", False, "lwp+sc", "ssgd", None, False),
    "pb-elastic-skip": ("pb", 3, 2, "stage", False, "sgdm", "elastic", None, True),
    "pipedream-adpsgd": ("pipedream", 2, 2, "stage", False, "adam", "adpsgd", 0.5, False),
    "zb-h1-none": ("zb-h1", 3, 1, "none", False, "adam", None, None, False),
    "interleaved-v2": ("interleaved", 2, 1, "stage", False, "adam", None, None, False, 2),
    "zb-h1-v2-clip": ("zb-h1", 3, 1, "stage", False, "sgdm", None, 0.5, False, 2),
}


def _optimizer(name: str):
    if name == "adam":
        return optax.adam(1e-3)
    if name == "sgdm":
        return optax.sgd(0.05, momentum=0.9)
    return pj.transforms.mitigation(name, 0.05).optimizer


def run_case(name: str) -> dict:
    schedule, K, data, remat, stash, opt, rule, clip, skip, *virtual = CASES[name]
    M, mb = 4, 8
    mesh = pj.make_mesh(K, data) if data > 1 else None
    remat = jax.checkpoint_policies.dots_saveable if remat == "dots" else remat
    x, y = _batch(1, 1, mb, 0)
    pipe = pj.pipeline(_layers(), loss=pj.losses.cross_entropy, example=x, stages=K,
                       microbatches=M, schedule=schedule, remat=remat, mesh=mesh,
                       weight_stashing=stash, virtual=virtual[0] if virtual else 1)
    out = {}
    params = pipe.init(jax.random.key(1))
    out["init"] = _digest(params.buffers)
    if pipe.schedule.synchronous:
        loss, grads = pipe.value_and_grad(params, _batch(data, M, mb, 1), jax.random.key(2))
        out["value_and_grad"] = _digest((loss, grads.buffers))
    rules = {"ssgd": pj.transforms.ssgd, "adpsgd": pj.transforms.adpsgd,
             "elastic": lambda: pj.transforms.elastic(every=2)}
    trainer = pipe.trainer(_optimizer(opt), rule=rules[rule]() if rule else None,
                           clip_norm=clip, skip_nonfinite=skip)
    state = trainer.init(params, jax.random.key(3))
    for step in range(3):
        x, y = _batch(data, M, mb, 10 + step)
        if skip and step == 1:
            x = x.at[0, 0].set(jnp.nan)
        state, metrics = trainer.step(state, (x, y))
        out[f"step{step}"] = _digest(metrics)
    state, metrics = trainer.flush(state)
    out["flush"] = _digest(metrics)
    out["params"] = _digest(state.params.buffers)
    out["opt_state"] = _digest(state.opt_state.buffers)
    out["rule_state"] = _digest(state.rule_state)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprints to this JSON")
    ap.add_argument("--against", help="compare with the fingerprints in this JSON")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    results = {}
    for name in args.cases:
        results[name] = run_case(name)
        print(f"{name:28s} " + " ".join(f"{k}={v[:8]}" for k, v in results[name].items()),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "cases": results}, f, indent=1)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)["cases"]
        bad = [(n, k) for n, r in results.items() for k, v in r.items()
               if before.get(n, {}).get(k) != v]
        for n, k in bad:
            print(f"DIFFERS: {n} {k}")
        print(f"{sum(len(r) for r in results.values()) - len(bad)} equal, {len(bad)} differ")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
