"""Sharded models' state (``TorchTrainer(strategy="fsdp")``): commits, call-start restart points and durable
checkpoints hold one DCP part per rank, kept on the ranks' nodes, and load resharded on any number of workers: a
killed worker resumes from the sharded commit exactly once and bit-exact at the same size; a checkpoint written by
2 workers resumes the same epoch on 3, every sample once.

``CountingOperator``'s ``p[i]`` counts how often sample ``i`` was trained (a parameter of 96 entries, sharded over
the ranks); its small ``lin`` layer draws dropout from each rank's own stream, so a resume that put a stream back
wrong would differ.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import TESTS_DIR
from helpers import (BatchNormOperator, CountingOperator, buffers_of, counts, executed, kill_after_commit, seeding_hook,
                     stored_commit)
from raysgd.torch.operator import fsdp
from raysgd.torch.state import sharded
from raysgd.torch.storage import dcp_files, filesystem
from s3_server import moto_s3
from test_durable_driver import kill_driver, wait_until

try:
    fsdp.check_strategy("fsdp")
except ValueError as err:
    pytest.skip(f"this torch cannot run FSDP2 on CPU: {err}", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("ray_4cpus")

N, BATCH, EVERY = 96, 4, 3  # 2 workers: 12 steps an epoch, a commit every 3


@pytest.fixture
def trainers(trainer_factory):
    defaults = {"training_operator_cls": CountingOperator, "num_workers": 2, "timeout_s": 30, "strategy": "fsdp",
                "commit_every_n_steps": EVERY, "initialization_hook": seeding_hook}
    return lambda **kwargs: trainer_factory(**{**defaults, **kwargs})


def assert_same(got, want, where="state"):
    """``got`` equals ``want`` exactly: the same nested keys, every tensor bit-identical."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), (where, sorted(got), sorted(want))
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert got == want, (where, got, want)


def test_a_worker_killed_after_a_sharded_commit_resumes_exactly_once_and_bit_exact(trainers, tmp_path, caplog):
    config = {"n": N, "batch_size": BATCH}
    clean = trainers(config=config)
    expected = [clean.train() for _ in range(2)]
    expected_state = clean.state_dict()
    clean.shutdown()

    log, marker = str(tmp_path / "faulty.log"), str(tmp_path / "fault")
    faulty = trainers(config=dict(config, log=log, fault={"step": 8, "rank": 1, "marker": marker}))
    commit = None
    kill_after_commit(faulty, marker, min_steps=6)
    with caplog.at_level("INFO"):
        first = faulty.train()
    assert os.path.exists(marker) and faulty.num_failures == 1
    assert "Resuming from the commit at step 6" in caplog.text  # the sharded commit, not the call's start
    assert first["num_samples"] == N and first["train_loss"] == pytest.approx(expected[0]["train_loss"], rel=1e-9)
    assert torch.equal(counts(faulty), torch.ones(N))  # every sample once
    assert executed(log) <= 24 + 2 * EVERY, executed(log)  # one commit interval recomputed, not the epoch
    commit = stored_commit(faulty, 12)  # the whole state of a sharded commit, consolidated where it is asked for
    assert commit["cursor"]["steps"] == 12 and torch.equal(commit["models"][0]["p"], torch.ones(N))
    faulty.train()
    got = faulty.state_dict()
    assert got["epoch"] == expected_state["epoch"] == 2 and got["global_step"] == expected_state["global_step"]
    assert_same(got["models"], expected_state["models"], "models")  # dropout streams included
    assert_same(got["optimizers"], expected_state["optimizers"], "optimizers")  # momentum buffers
    assert [r["torch"] for r in got["rng"]] == [r["torch"] for r in expected_state["rng"]]


def test_a_batchnorm_resnet_killed_after_a_commit_resumes_bit_identical_buffers_included(trainers, tmp_path):
    """FSDP2 leaves buffers to each rank; raysgd keeps them as DDP does (rank 0's, broadcast at the forward after
    one with gradients, and before anything reads the state). So every rank holds the same running statistics,
    get_model() and the checkpoint hold those, and a run restarted from a commit ends bit-identical to one that was
    not, running statistics and num_batches_tracked included."""
    config = {"n": 64, "batch_size": 4}  # 2 workers: 8 steps an epoch, a commit every 3
    clean = trainers(training_operator_cls=BatchNormOperator, config=config)
    for _ in range(2):
        clean.train()
    expected, expected_val = clean.state_dict(), clean.validate()
    model, saved = clean.get_model(), expected["models"][0]
    buffers = buffers_of(model)
    assert buffers["1.num_batches_tracked"].item() == 16 and not torch.equal(buffers["1.running_var"], torch.ones(8))
    assert_same({name: saved[name] for name in buffers}, buffers, "checkpoint vs get_model()")
    for held in clean.apply_all_operators(lambda op: buffers_of(op.model)):  # every rank holds rank 0's
        assert_same(held, buffers, "a rank's buffers")
    clean.shutdown()

    marker = str(tmp_path / "fault")
    faulty = trainers(training_operator_cls=BatchNormOperator, config=dict(config, fault={"step": 5, "rank": 1,
                                                                                            "marker": marker}))
    kill_after_commit(faulty, marker, min_steps=3)
    faulty.train()
    assert os.path.exists(marker) and faulty.num_failures == 1
    faulty.train()
    got = faulty.state_dict()
    assert_same(got["models"], expected["models"], "models")  # buffers included
    assert_same(got["optimizers"], expected["optimizers"], "optimizers")
    assert faulty.validate() == expected_val
    assert_same(buffers_of(faulty.get_model()), buffers, "get_model() after the restart")


def test_a_checkpoint_of_2_sharded_workers_resumes_the_epoch_on_3_exactly_once(trainers, tmp_path):
    """A durable checkpoint taken mid-epoch by 2 workers (each writes its part; the folder is a DCP checkpoint) is
    resumed by a new trainer of 3 workers: the parts reshard, and the epoch goes on from its data cursor."""
    storage = str(tmp_path / "run")
    config = {"n": N, "batch_size": BATCH}
    first = trainers(config=config, storage_path=storage)
    assert first.train(num_steps=5)["num_samples"] == 2 * 5 * BATCH
    first.shutdown()
    (newest,) = sorted(p for p in os.listdir(storage) if p.startswith("checkpoint_"))[-1:]
    files = sorted(os.listdir(os.path.join(storage, newest)))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "checkpoint.json", "trainer.checkpoint"} <= set(files), files

    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(os.path.join(storage, newest)).read_metadata()  # torch's own reader reads it
    assert metadata.state_dict_metadata["models.0.p"].size == torch.Size([N])

    second = trainers(config=config, storage_path=storage, num_workers=3)
    for read in second.apply_all_workers(lambda: sharded.process_load_stats().latest()):  # each rank: its rows, from the files
        assert 0 < read["pulled"] <= 1.1 * read["needed"] and read["files"] <= 2, read
    rest = second.train()  # the rest of epoch 1 on 3 workers
    assert rest["num_samples"] == N - 2 * 5 * BATCH  # the rest of the epoch
    assert torch.equal(counts(second), torch.ones(N))  # every sample of the epoch once, across the reshard
    assert second.train()["num_samples"] == N and torch.equal(counts(second), 2 * torch.ones(N))


def test_a_sharded_checkpoint_on_s3_resumes_on_one_worker(trainers):
    """The same through a real S3-compatible server (moto): the parts are uploaded by tasks on the workers' nodes,
    the marker lists them, and a run of 1 worker resumes the epoch from them."""
    config = {"n": N, "batch_size": BATCH}
    with moto_s3() as (bucket, query):
        uri = f"{bucket}/fsdp{query}"
        first = trainers(config=config, storage_path=uri)
        first.train(num_steps=5)
        first.shutdown()
        newest = filesystem.CheckpointStorage(uri).latest()
        assert sorted(newest.marker["parts"]) == ["__0_0.distcp", "__1_0.distcp"]
        second = trainers(config=config, storage_path=uri, num_workers=1)
        assert second.train()["num_samples"] == N - 2 * 5 * BATCH
        assert torch.equal(counts(second), torch.ones(N))
        second.shutdown()  # its last checkpoint's upload, while the server runs


def test_saving_over_a_checkpoint_switches_between_two_sets_of_files_and_deletes_the_old(trainers, tmp_path):
    """save(path) again writes the other set of names (parts, state file; the DCP metadata records them), switches
    the marker to it, then deletes the old set: what a kill inside the save relies on (next test)."""
    path = str(tmp_path / "ckpt")
    trainer = trainers(config={"n": 16, "batch_size": 4})
    names = []
    for epoch in (1, 2, 3):
        trainer.train()
        trainer.save(path)
        names.append(sorted(name for name in os.listdir(path) if name != ".metadata"))
        assert dcp_files.consolidate(path)["models"][0]["p"].tolist() == [float(epoch)] * 16  # DCP's .metadata
    first = ["__0_0.distcp", "__1_0.distcp", "checkpoint.json", "trainer.checkpoint"]
    assert names == [first, ["__0_1.distcp", "__1_1.distcp", "checkpoint.json", "trainer.1.checkpoint"], first]
    trainer.train()
    trainer.load(path, blocking=True)
    assert torch.equal(counts(trainer), 3 * torch.ones(16))


@pytest.mark.parametrize("stage", ["head", "metadata"])
def test_a_driver_killed_inside_a_save_over_a_checkpoint_leaves_the_old_one_loadable(trainers, tmp_path, stage):
    """The common pattern, save("ckpt") every epoch, with the driver SIGKILLed inside the second save: once the new
    state file is written (its parts' tasks started), or once DCP's new .metadata is written too. The old
    checkpoint loads (p == 1 after one epoch, not 2); DCP's own readers see a complete set (the new one once its
    .metadata is written)."""
    path, inside = tmp_path / "ckpt", tmp_path / "inside"
    script = os.path.join(TESTS_DIR, "save_driver.py")
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen([sys.executable, script, str(path), stage, str(inside)], stdout=subprocess.DEVNULL,
                                stderr=log, start_new_session=True)
    try:
        wait_until(inside.exists, proc, f"the second save stopped after its {stage}", timeout_s=240)
    finally:
        if proc.poll() is None:
            kill_driver(proc)
    marker = json.loads((path / "checkpoint.json").read_text())
    assert marker.get("generation", 0) == 0 and "trainer.1.checkpoint" in os.listdir(path)  # inside the 2nd save
    trainer = trainers(config={"n": 16, "batch_size": 4})
    trainer.load(str(path), blocking=True)
    assert torch.equal(counts(trainer), torch.ones(16))  # the first save's state
    seen_by_dcp = dcp_files.consolidate(str(path))["models"][0]["p"]
    assert torch.equal(seen_by_dcp, (2.0 if stage == "metadata" else 1.0) * torch.ones(16))


def _holder_pids():
    import ray  # noqa: PLC0415

    return [actor["Pid"] for actor in ray._private.state.actors().values()
            if actor["ActorClassName"] == "_HolderActor" and actor["State"] == "ALIVE"]


def test_a_part_holder_killed_mid_run_is_replaced_and_the_next_commit_completes(trainers, tmp_path):
    """The holder of the workers' node (one node here) is SIGKILLed while every rank waits inside step 7, after the
    commit at step 6: Ray restarts it there, the driver counts the replacement, and the commits at steps 9 and 12
    are kept by the new process; no worker fails, every sample is trained once."""
    release = tmp_path / "release"
    trainer = trainers(config={"n": N, "batch_size": BATCH, "hold_until": {"step": 7, "path": str(release)}})
    killed = []

    def kill_the_holder():
        try:
            deadline = time.monotonic() + 120
            while (stored_commit(trainer, 6, timeout_s=0) or {}).get("cursor", {}).get("steps", 0) < 6:
                assert time.monotonic() < deadline, "no commit at step 6"
                time.sleep(0.05)
            (pid,) = _holder_pids()
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            while trainer.holder_replacements < 1 and time.monotonic() < deadline:
                time.sleep(0.05)  # counted at the driver's next tick (the call waits for the ranks meanwhile)
        finally:
            release.touch()

    watcher = threading.Thread(target=kill_the_holder, daemon=True)
    watcher.start()
    result = trainer.train()
    watcher.join(60)
    assert killed and trainer.holder_replacements == 1 and trainer.num_failures == 0
    assert result["num_samples"] == N and torch.equal(counts(trainer), torch.ones(N))
    commit = stored_commit(trainer, 12)  # complete: every rank's part kept by the replaced holder
    assert commit["cursor"]["steps"] == 12 and torch.equal(commit["models"][0]["p"], torch.ones(N))
    (pid,) = _holder_pids()
    assert pid != killed[0]


def test_the_sharded_call_start_snapshot_is_taken_beside_the_call_and_a_failure_restarts_from_it(trainers, tmp_path):
    """Without commits, a call's restart point is its call-start snapshot. Sharded, every rank writes its part beside
    the call (in its snapshot thread, over a process group of their own) and no rank steps before every part is
    stored: rank 1 ends its process at step 3, inside the second call, and the call restarts from the snapshot taken
    at its start (step 2): bit-exact, every sample once."""
    from raysgd.torch.restart_points import call_start  # noqa: PLC0415

    config = {"n": N, "batch_size": BATCH}
    clean = trainers(config=config, commit_every_n_steps=0)
    clean.train(num_steps=2)
    clean.train()
    expected = clean.state_dict()
    clean.shutdown()

    marker = str(tmp_path / "exited")
    faulty = trainers(config=dict(config, fault={"step": 3, "rank": 1, "marker": marker, "exit": True}),
                      commit_every_n_steps=0)
    faulty.train(num_steps=2)  # the first call's point is taken before it starts
    events = faulty.apply_all_workers(lambda: [event for event, _ in call_start.EVENTS])
    assert all("serialising" not in seen for seen in events), events
    faulty.train()
    assert os.path.exists(marker) and faulty.num_failures == 1
    assert torch.equal(counts(faulty), torch.ones(N))
    got = faulty.state_dict()
    assert_same(got["models"], expected["models"], "models")
    assert_same(got["optimizers"], expected["optimizers"], "optimizers")
    faulty.train(num_steps=1)  # starts from state_dict()'s snapshot: the state has not moved since
    faulty.train(num_steps=1)  # its snapshot is taken beside it by every rank
    for seen in faulty.apply_all_workers(lambda: list(call_start.EVENTS)):
        latest = {event for event, token in seen if token == seen[-1][1]}
        assert {"captured", "serialising", "serialised", "gate_open"} <= latest, seen
