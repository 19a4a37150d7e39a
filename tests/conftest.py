"""Tests run on a real mesh of 8 simulated CPU devices (set before JAX starts).

The test processes (pytest-xdist's workers) share one JAX persistent
compilation cache in a fresh temporary directory: tests build many pipelines
that lower to the same programs, and each is compiled once per session."""

import os
import shutil
import tempfile

# XLA's CPU backend compiles each kernel through LLVM, and the tests compile
# hundreds of small programs that run a few times each: LLVM's optimizations
# cost more than they save (a 2-D ResNet's init program: 8.2 s -> 1.2 s).
# Its MLIR fusion emitters compile on threads of their own, which two test
# workers on two cores do not have (a zero-bubble trainer test: 14.2 s -> 12.1 s).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0"
                           " --xla_cpu_use_fusion_emitters=false").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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


if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller: one cache for the session
    _CACHE = tempfile.mkdtemp(prefix="pipejax-test-jax-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

    def pytest_unconfigure(config):
        shutil.rmtree(_CACHE, ignore_errors=True)
