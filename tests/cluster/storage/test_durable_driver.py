"""A real driver process SIGKILLed between epochs, mid-epoch, mid-upload and after a preemption checkpoint, then run
again: the rerun resumes from the newest complete checkpoint and ends as the README promises (bit-identical to an
uninterrupted run; every sample trained exactly once)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import TESTS_DIR
from raysgd.torch.storage import filesystem as storage
from raysgd.torch.integrations.results import read_results
from s3_server import HoldingProxy, moto_s3

SCRIPT = os.path.join(TESTS_DIR, "durable_driver.py")
RUN_TIMEOUT_S = 300
EPOCH_STEPS = 12  # --counting: 96 samples, 4 per batch, 2 workers


def start_driver(tmp_path, name, *extra, storage_path=None):
    """Start the driver script (its own Ray cluster, in its own session) in the background, its log in a file (a
    pipe nobody reads could fill and stall it); ``finish_driver`` waits for it."""
    with open(tmp_path / f"{name}.log", "a") as log:
        return subprocess.Popen([sys.executable, SCRIPT, storage_path or str(tmp_path / f"{name}-storage"),
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


def wait_until(condition, proc, what, timeout_s=RUN_TIMEOUT_S):
    """Wait for ``condition()`` while the driver ``proc`` runs; fail naming ``what`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the driver ended (code {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)


def checkpointed(storage_path, epoch):
    """A condition for :func:`wait_until`: ``storage_path``'s newest complete checkpoint is of ``epoch`` (checkpoints
    are written in the background; the first one starts a process for its task)."""

    def condition():
        newest = storage.CheckpointStorage(storage_path).latest()
        return newest is not None and newest.marker["epoch"] == epoch

    return condition


def session_processes(sid):
    """Live processes of session ``sid`` (the killed driver's Ray cluster and workers belong to it). A zombie is not
    live: it has ended and waits only for the orphans' reaper (PID 1 here, which took about 1.3 s to reap them)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid and not _ended(entry):
                    found.append(int(entry))
            except (ProcessLookupError, PermissionError):
                continue
    return found


def _ended(pid):
    """Whether process ``pid`` has ended and is not yet reaped (state Z, a zombie, or X) in ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return True  # gone between the listing and the read
    return stat[stat.rindex(")") + 2] in "ZX"  # the state follows the command name, which may hold spaces and ")"


def kill_driver(proc):
    """SIGKILL the driver and everything in its session (its Ray cluster), and check that nothing of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 60  # Ray's workers of the killed driver end once their raylet is gone
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not session_processes(proc.pid), "processes of the killed driver's session survived"


def complete_checkpoint(path, reason=None):
    """Whether ``path`` holds a complete checkpoint (with that ``reason`` in its marker, if given) now."""
    try:
        latest = storage.CheckpointStorage(path, num_to_keep=3).latest()
    except Exception:  # noqa: BLE001 (being written right now)
        return False
    return latest is not None and (reason is None or latest.marker.get("reason") == reason)


class References:
    """The uninterrupted runs, the linear one then the counting one in one driver (its own cluster, beside the
    crashing run), started in the background on first use and waited for once: ``get(kind)`` returns that run's
    final model state."""

    def __init__(self, tmp_path):
        self.tmp_path, self._proc, self._done = tmp_path, None, None

    def start(self):
        if self._proc is None:
            self._proc = start_driver(self.tmp_path, "linear", "--and-counting", str(self.tmp_path / "counting.pt"))
        return self

    def get(self, kind):
        if self._done is None:
            linear = finish_driver(self.tmp_path, "linear", self.start()._proc)[0]
            self._done = {"linear": linear, "counting": torch.load(self.tmp_path / "counting.pt", weights_only=True)}
        return self._done[kind]

    def close(self):
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=60)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    made = References(tmp_path_factory.mktemp("reference"))
    yield made
    made.close()


def assert_bit_identical(resumed, reference):
    assert resumed.keys() == reference.keys()
    for key in reference:
        assert torch.equal(resumed[key], reference[key]), key


def test_driver_killed_between_epochs_resumes_bit_identical(tmp_path, references):
    references.start()
    marker = tmp_path / "paused"
    proc = start_driver(tmp_path, "crash", "--pause-after", "2", "--marker", str(marker))
    wait_until(marker.exists, proc, "pausing after epoch 2's checkpoint is durable")
    kill_driver(proc)
    assert not (tmp_path / "crash.pt").exists()
    assert [row["epoch"] for row in read_results(tmp_path / "crash-logs", "train")] == [1, 2]
    resumed, log = finish_driver(tmp_path, "crash", start_driver(tmp_path, "crash"))
    assert "Resuming from" in log and "checkpoint_000002" in log
    assert_bit_identical(resumed, references.get("linear"))
    assert [row["epoch"] for row in read_results(tmp_path / "crash-logs", "train")] == [1, 2, 3, 4]
    assert [row["step"] for row in read_results(tmp_path / "crash-logs", "validate")] == [1, 2, 3, 4]


def test_a_sharded_run_killed_between_epochs_resumes_on_another_number_of_workers(tmp_path):
    """FSDP: the driver is SIGKILLed once epoch 2's checkpoint is durable (a DCP folder, each of the 2 workers' parts
    written on its node) and run again with 1 worker: it resumes from that checkpoint (the parts loaded into the
    one unsharded model) and trains epochs 3 and 4, every sample once per epoch."""
    marker, sharded = tmp_path / "paused", ("--counting", "--strategy", "fsdp")
    proc = start_driver(tmp_path, "fsdp", *sharded, "--pause-after", "2", "--marker", str(marker))
    wait_until(marker.exists, proc, "pausing after epoch 2's checkpoint is durable")
    kill_driver(proc)
    newest = storage.CheckpointStorage(str(tmp_path / "fsdp-storage")).latest()
    assert newest.marker["epoch"] == 2 and sorted(newest.marker["parts"]) == ["__0_0.distcp", "__1_0.distcp"]
    resumed, log = finish_driver(tmp_path, "fsdp", start_driver(tmp_path, "fsdp", *sharded, "--num-workers", "1"))
    assert "Resuming from" in log and "checkpoint_000002" in log
    assert torch.equal(resumed["p"], 4 * torch.ones(96))  # 4 epochs, each sample once in each


@pytest.mark.slow
def test_driver_killed_mid_epoch_and_mid_upload_resumes_bit_identical_from_the_newest_complete_checkpoint(
        tmp_path, references):
    """Killed while rank 1 is inside the 2nd step of epoch 3 (it writes its pid, then stays there) and, at the same
    time, while the second checkpoint upload is in progress: real S3 (moto's server) behind a proxy that holds that
    upload's state file (its request sent, no answer). Epoch 3 never ends, so the held upload is epoch 2's and the
    newest complete checkpoint is epoch 1's; the rerun skips the incomplete checkpoint, resumes from epoch 1's,
    drops epoch 2's result rows logged after it (and logs epoch 2 once when it is redone) and ends bit-identical to an
    uninterrupted run. (One killed driver for both moments: each driver start is a Ray cluster and two workers.)"""
    references.start()
    marker = tmp_path / "inside-epoch-3"
    config = json.dumps({"fault": {"kind": "sleep", "rank": 1, "step": 9, "marker": str(marker), "seconds": 600}})
    with moto_s3() as (bucket, query):
        s3_port = int(query.split("endpoint_override=127.0.0.1:")[1].split("&")[0])
        with HoldingProxy(s3_port, b"/trainer.checkpoint", skip=1) as proxy:
            uri = f"{bucket}/mid-upload?endpoint_override=127.0.0.1:{proxy.port}&scheme=http&region=us-east-1"
            proc = start_driver(tmp_path, "crash", "--config", config, storage_path=uri)
            wait_until(lambda: marker.exists() and proxy.holding.is_set(), proc,
                       "a worker inside epoch 3 and the second checkpoint upload in progress")
            kill_driver(proc)
            proxy.release()
            held = proxy.held.split("/trainer.checkpoint")[0].rsplit("/", 1)[1]  # e.g. checkpoint_000002
            newest = storage.CheckpointStorage(uri).latest()  # what was durable when the driver died
            assert newest is not None and newest.path.rsplit("/", 1)[1] < held  # the held one never completed
            assert newest.marker["epoch"] == 1  # epoch 2's upload is the held one; epoch 3 never ends
            resumed, log = finish_driver(tmp_path, "crash", start_driver(tmp_path, "crash", "--config", config,
                                                                         storage_path=uri))
            assert storage.CheckpointStorage(uri).latest().marker["epoch"] == 4
    assert f"Skipping checkpoint {newest.path.rsplit('/', 1)[0]}/{held}" in log and "incomplete" in log
    assert f"Resuming from {newest.path}" in log
    assert_bit_identical(resumed, references.get("linear"))
    assert [row["epoch"] for row in read_results(tmp_path / "crash-logs", "train")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_driver_killed_after_a_preemption_resumes_from_its_checkpoint_exactly_once(tmp_path, references):
    """Rank 1 gets SIGTERM in epoch 3 (step 6 of 12): the ranks commit after step 7, the trainer recovers and writes
    that commit to storage_path; the driver is killed while epoch 3 goes on (rank 0 stays inside its step 10).
    The rerun resumes from the preemption checkpoint, mid-epoch, and every sample is trained exactly once per
    epoch, bit-identical to an uninterrupted run."""
    references.start()
    sigterm, hold, path = tmp_path / "sigterm", tmp_path / "hold", str(tmp_path / "crash-storage")
    config = json.dumps({"fault": {"step": 2 * EPOCH_STEPS + 5, "rank": 1, "marker": str(sigterm),
                                   "until_sigterm": True},
                         "hold": {"step": 2 * EPOCH_STEPS + 9, "rank": 0, "marker": str(hold)}})
    proc = start_driver(tmp_path, "crash", "--counting", "--config", config)
    wait_until(lambda: sigterm.exists() and sigterm.read_text(), proc, "rank 1 waiting for SIGTERM in epoch 3")
    os.kill(int(sigterm.read_text()), signal.SIGTERM)
    wait_until(lambda: hold.exists() and complete_checkpoint(path, "preemption"), proc,
               "the preemption checkpoint, with epoch 3 going on")
    kill_driver(proc)
    cursor = torch.load(storage.CheckpointStorage(path).latest().path + "/" + storage.STATE_FILE,
                        weights_only=True)["cursor"]
    assert cursor["epoch"] == 3 and cursor["steps"] == 7
    resumed, log = finish_driver(tmp_path, "crash", start_driver(tmp_path, "crash", "--counting", "--config", config))
    assert "Resuming from" in log and "written at the end of preemption" in log
    assert torch.equal(resumed["p"], 4 * torch.ones(96))  # every sample once per epoch
    assert_bit_identical(resumed, references.get("counting"))
    assert [row["epoch"] for row in read_results(tmp_path / "crash-logs", "train")] == [1, 2, 3, 4]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
