"""Tests run on a real mesh of 8 simulated CPU devices (set before JAX starts)."""

import os
from importlib.metadata import version

# XLA's CPU backend compiles each kernel through LLVM, and the tests compile
# hundreds of small programs that run a few times each: LLVM's optimizations
# cost more than they save (a 4-stage GPT's AdamW step: 11.0 s -> 3.3 s).
# Its MLIR fusion emitters, and its split of each program's code into 32 parts,
# are made for compiling on threads of their own, which two test workers on
# two cores do not have (a zero-bubble trainer test: 14.2 s -> 12.1 s without
# the emitters; the suite's XLA compile time 285 s -> 262 s in one part).
# jaxlib 0.11's XLA has no fusion-emitter flag and aborts on a flag it does not know.
JAXLIB = tuple(int(p) for p in version("jaxlib").split(".")[:2])
EMITTERS = "" if JAXLIB >= (0, 11) else " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0" + EMITTERS +
                           " --xla_cpu_parallel_codegen_split_count=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache: few programs recur across tests, and
# writing every one cost the suite more (17 s) than its hits saved (2 to 13 s).

import pytest


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="run the tests marked slow too (make test-all)")


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked slow unless --all is given (`make test-all`)."""
    if config.getoption("--all"):
        return
    skip = pytest.mark.skip(reason="slow: its code path runs in a faster test; `make test-all` runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

