"""A real driver process SIGKILLed between epochs 2 and 3, then run again, ends bit-identical to an uninterrupted run."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from raysgd.torch.results import read_results

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durable_driver.py")
RUN_TIMEOUT_S = 300


def start_driver(tmp_path, name, *extra):
    """Start the driver script (its own Ray cluster) in the background, its log in a file (a pipe nobody reads
    could fill and stall it); ``finish_driver`` waits for it."""
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / f"{name}-storage"),
                                 str(tmp_path / f"{name}-logs"), str(tmp_path / f"{name}.pt"), *extra],
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


def finish_driver(tmp_path, name, proc):
    """Wait for a started driver to end (killing it past the deadline); returns its final model state and log."""
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # with its Ray cluster
            proc.wait(timeout=60)
    log = (tmp_path / f"{name}.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    return torch.load(tmp_path / f"{name}.pt", weights_only=True), log


def wait_for(path, proc, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"the driver ended (code {proc.returncode}) before pausing: "
                                 f"{proc.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"the driver did not pause within {timeout_s} s")
        time.sleep(0.2)


def session_processes(sid):
    """Live processes of session ``sid`` (the killed driver's Ray cluster and workers belong to it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    found.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
    return found


def crash_then_resume(tmp_path):
    """Run the driver to epoch 2's durable checkpoint, SIGKILL its process group, check that nothing of it is
    left, then run it again to its end; returns the second run's final model state and log."""
    marker = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / "crash-storage"), str(tmp_path / "crash-logs"),
                             str(tmp_path / "crash.pt"), "--pause-after", "2", "--marker", str(marker)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(marker, proc, RUN_TIMEOUT_S)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything in its process group
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60  # Ray's workers of the killed driver end once their raylet is gone
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not session_processes(proc.pid), "processes of the killed driver's session survived"
    assert not (tmp_path / "crash.pt").exists()
    assert [row["epoch"] for row in read_results(tmp_path / "crash-logs", "train")] == [1, 2]
    return finish_driver(tmp_path, "crash", start_driver(tmp_path, "crash"))


def test_driver_killed_between_epochs_resumes_bit_identical(tmp_path):
    # The uninterrupted reference runs beside the crashing run (each driver starts its own cluster), so the test
    # takes about the longer of the two rather than their sum.
    reference_proc = start_driver(tmp_path, "reference")
    try:
        resumed, log = crash_then_resume(tmp_path)
    except BaseException:
        os.killpg(reference_proc.pid, signal.SIGKILL)
        reference_proc.wait(timeout=60)
        raise
    reference, _ = finish_driver(tmp_path, "reference", reference_proc)
    assert "Resuming from" in log and "checkpoint_000002" in log
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key
    assert [row["epoch"] for row in read_results(tmp_path / "crash-logs", "train")] == [1, 2, 3, 4]
    assert [row["step"] for row in read_results(tmp_path / "crash-logs", "validate")] == [1, 2, 3, 4]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
