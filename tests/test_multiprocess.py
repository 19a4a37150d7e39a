"""Several processes form one mesh: 2 local processes of 2 CPU devices each
run a 4-stage pipeline whose stages cross between them (jax.distributed,
gloo), 4 processes of one device 2 stages each sharded over 2 of them, and
train exactly as one process with 4 devices does. The launcher
never leaves a process behind."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import pipejax as pj
from pipejax.errors import DeviceError

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("multiprocess", ROOT / "examples" / "multiprocess.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("processes, fsdp", [(2, 1), (4, 2)])  # (4, 2): gathers cross them
def test_several_processes_train_like_one(tmp_path, processes, fsdp):
    out = tmp_path / "two.npz"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "multiprocess.py"),
                           "--processes", str(processes), "--steps", "5", "--out", str(out),
                           "--fsdp", str(fsdp)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{processes} processes" in done.stdout
    two = np.load(out)
    losses, variables = _example().train(5, devices=jax.devices()[:4], fsdp=fsdp)
    np.testing.assert_allclose(two["losses"], losses, rtol=1e-6)
    leaves = jax.tree.leaves(variables)
    assert len(leaves) == len(two.files) - 1
    for i, a in enumerate(leaves):
        np.testing.assert_allclose(two[f"p{i}"], a, rtol=1e-6, atol=1e-7)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failing_process_stops_the_others(tmp_path):
    """Process 1 fails at once; process 0, which listens on the coordinator's
    port as JAX's coordinator does and would then sleep a minute, is killed:
    the launch returns the failure's status and the port is free again."""
    script = ("import os, pathlib, socket, time\n"
              "me, port = os.environ['PIPEJAX_PROCESS_ID'], os.environ['PIPEJAX_COORDINATOR']\n"
              f"pathlib.Path(r'{tmp_path}', me).write_text(str(os.getpid()))\n"
              "if me == '1':\n"
              "    time.sleep(1); raise SystemExit(3)\n"
              "s = socket.socket(); s.bind(('localhost', int(port.split(':')[1]))); s.listen()\n"
              "time.sleep(60)\n")
    port = pj.distributed.free_port()
    start = time.monotonic()
    assert pj.distributed.launch([sys.executable, "-c", script], 2, 1, timeout=30, port=port) == 3
    assert time.monotonic() - start < 20
    assert not _alive(int((tmp_path / "0").read_text()))
    with socket.socket() as s:
        s.bind(("localhost", port))  # nobody holds the port


def test_a_launch_past_its_time_is_stopped(tmp_path):
    script = "import time; time.sleep(60)"
    start = time.monotonic()
    assert pj.distributed.launch([sys.executable, "-c", script], 2, 1, timeout=2) == 124
    assert time.monotonic() - start < 15


def test_devices_that_do_not_split_over_the_processes():
    with pytest.raises(DeviceError, match=r"8 devices .* do not split evenly over 3 processes"):
        pj.distributed.devices_per_process(8, 3)


def test_a_pinned_launch_gives_each_process_its_core_and_one_thread(tmp_path):
    """`launch(pinned=True)`: process i is told core i (of the cores this
    process may use), which `initialize` pins it to, and XLA:CPU runs its
    kernels on one thread; no forced device count reaches it."""
    script = ("import os, json, pathlib; e = os.environ; pathlib.Path(e['OUT'] + e['PIPEJAX_PROCESS_ID'])"
              ".write_text(json.dumps([e['PIPEJAX_CORE'], e['XLA_FLAGS']]))")
    os.environ["OUT"] = str(tmp_path / "p")
    try:
        assert pj.distributed.launch([sys.executable, "-c", script], 2, 1, timeout=30,
                                     pinned=True) == 0
    finally:
        del os.environ["OUT"]
    cores = sorted(os.sched_getaffinity(0))
    for i in range(2):
        core, flags = json.loads((tmp_path / f"p{i}").read_text())
        assert int(core) == cores[i % len(cores)]
        assert pj.distributed.ONE_THREAD in flags and "device_count" not in flags
