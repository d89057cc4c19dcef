"""Fault tolerance with real failures: killed actors, exiting and SIGKILLed processes, stuck workers."""
import logging
import os
import signal
import threading
import time

import pytest
import ray
import torch

from conftest import assert_released
from helpers import CountingOperator, FaultyOperator, counts, exit_once_hook, seeding_hook
from raysgd.torch.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("ray_4cpus")

CONFIG = {"lr": 0.01, "momentum": 0.9, "data_size": 400, "batch_size": 10, "shuffle": True}


def faulty(tmp_path, kind, rank=1, batch=5, **extra):
    return dict(CONFIG, batch_sleep=0.02, fault={"rank": rank, "batch": batch, "kind": kind,
                                                 "marker": str(tmp_path / "fault"), **extra})


def when_marker(path, action, timeout_s=60):
    """Run ``action(pid)`` in a thread once the worker wrote its pid to ``path``."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(path) and open(path).read():
                action(int(open(path).read()))
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def trainers(trainer_factory):
    defaults = {"training_operator_cls": FaultyOperator, "num_workers": 2, "timeout_s": 20}
    return lambda **kwargs: trainer_factory(**{**defaults, **kwargs})


@pytest.mark.parametrize("how", ["os_exit", "ray_kill", "sigkill"])
def test_worker_killed_mid_epoch_recovers_the_full_epoch(trainers, tmp_path, caplog, how):
    """Rank 1 dies at step 5 of 20 (no commit yet): the retry trains the epoch from its start, and every sample is
    trained exactly once in the epoch (the CountingModel's ``p[i]`` counts sample ``i`` in the trained state)."""
    n = 400
    fault = {"step": 5, "rank": 1, "marker": str(tmp_path / "fault"), "exit": how == "os_exit"}  # else it waits
    trainer = trainers(training_operator_cls=CountingOperator, initialization_hook=seeding_hook,
                       config={"n": n, "batch_size": 10, "batch_sleep": 0.02, "fault": fault})
    if how == "ray_kill":
        actor = trainer.worker_group.remote_workers[1]
        when_marker(tmp_path / "fault", lambda pid: ray.kill(actor))
    elif how == "sigkill":
        when_marker(tmp_path / "fault", lambda pid: os.kill(pid, signal.SIGKILL))
    caplog.set_level(logging.WARNING, logger="raysgd")
    stats = trainer.train()
    assert (tmp_path / "fault").exists()  # the fault really happened
    assert stats["num_samples"] == n and stats["epoch"] == 1
    assert trainer.num_failures == 1 and trainer.worker_group.num_workers == 2
    # seen as the death it is, not waited out as a rank that stopped answering (timeout_s)
    retries = [record.getMessage() for record in caplog.records if "restarting workers" in record.getMessage()]
    assert len(retries) == 1 and "rank 1: worker process died" in retries[0], retries
    assert "did not answer" not in retries[0], retries
    assert torch.equal(counts(trainer), torch.ones(n))  # every sample index trained exactly once
    assert trainer.train()["num_samples"] == n and torch.equal(counts(trainer), torch.full((n,), 2.0))
    moves = [state.value for state, _ in trainer.controller.history]  # the run's explicit states, in order
    assert moves == ["starting", "idle", "running", "restarting", "running", "idle", "running", "idle"], moves
    assert "failure 1 of 3" in trainer.controller.history[3][1]  # the failure policy's decision, as logged


@pytest.mark.parametrize("keep", ["1", "0"])
def test_survivors_keep_their_processes_and_only_a_replacement_starts(trainers, tmp_path, monkeypatch, keep):
    """Rank 1 dies mid-epoch: rank 0's call ends with its broken collective, and rank 0 joins the re-formed group
    in the same process; rank 1's bundle (its node is alive) takes a new process. SGD_KEEP_SURVIVORS=0 restarts
    both, as before."""
    monkeypatch.setenv("SGD_KEEP_SURVIVORS", keep)
    monkeypatch.setenv("SGD_SURVIVOR_GRACE_S", "30")  # however loaded the machine, rank 0's call ends in time
    trainer = trainers(config=faulty(tmp_path, "exit"))
    before = trainer.apply_all_workers(os.getpid)
    stats = trainer.train()
    after = trainer.apply_all_workers(os.getpid)
    assert (tmp_path / "fault").exists() and trainer.num_failures == 1
    assert stats["num_samples"] == 400 and trainer.worker_group.num_workers == 2
    assert after[1] != before[1]  # the dead rank was replaced
    assert (after[0] == before[0]) == (keep == "1")  # the survivor kept its process (or not, when turned off)
    assert trainer.validate()["num_samples"] == 100


def _final_state(trainer, inject_at_epoch=None, marker=None):
    for epoch in range(2):
        if epoch == inject_at_epoch:
            trainer.apply_all_operators(lambda op: op.config.update(
                fault={"rank": 1, "batch": 7, "kind": "exit", "marker": marker}))
        trainer.train()
    return trainer.state_dict()


def test_recovered_state_is_bit_identical_to_a_fault_free_run(trainers, tmp_path):
    # Input dropout draws from every rank's torch stream: the retry (from the call-start snapshot, no commit yet)
    # must put each rank's stream back, the replacement's and the survivor's.
    config = dict(CONFIG, input_dropout=0.3)
    clean = trainers(config=config, initialization_hook=seeding_hook)
    expected = _final_state(clean)
    clean.shutdown()
    recovered = trainers(config=config, initialization_hook=seeding_hook)
    got = _final_state(recovered, inject_at_epoch=1, marker=str(tmp_path / "fault"))
    assert recovered.num_failures == 1 and (tmp_path / "fault").exists()
    assert got["epoch"] == expected["epoch"] == 2
    for key in ("weight", "bias"):
        assert torch.equal(got["models"][0][key], expected["models"][0][key])
    for index, buffers in expected["optimizers"][0]["state"].items():
        assert torch.equal(got["optimizers"][0]["state"][index]["momentum_buffer"], buffers["momentum_buffer"])


def test_more_failures_than_retries_is_a_clean_bounded_error(trainers, tmp_path):
    trainer = trainers(config=faulty(tmp_path, "exit", always=True, batch=1))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Training run failed") as info:
        trainer.train(max_retries=2)
    assert time.monotonic() - start < 60
    assert trainer.num_failures == 3
    assert "rank 1" in str(info.value.__cause__) and "died" in str(info.value.__cause__)
    trainer.shutdown()
    assert_released()


def test_stuck_worker_is_ended_by_the_process_group_timeout(trainers, tmp_path, caplog):
    trainer = trainers(config=faulty(tmp_path, "sleep", seconds=300), timeout_s=10)
    caplog.set_level(logging.WARNING, logger="raysgd")
    start = time.monotonic()
    stats = trainer.train()
    elapsed = time.monotonic() - start
    assert stats["num_samples"] == 400 and trainer.num_failures == 1
    assert 10 <= elapsed < 45, elapsed
    assert any("did not answer: rank 1" in record.getMessage() for record in caplog.records)


def test_start_up_failure_during_a_resize_is_retried(trainers, tmp_path):
    trainer = trainers(config=faulty(tmp_path, "exit"))
    trainer.initialization_hook = exit_once_hook(str(tmp_path / "hook"))
    stats = trainer.train()
    assert (tmp_path / "hook").exists() and stats["num_samples"] == 400
    assert trainer.worker_group.num_workers == 2


def test_failure_during_validation_is_retried(trainers, tmp_path):
    class DiesInValidation(FaultyOperator):
        def validate_batch(self, batch, batch_info):
            marker = self.config["marker"]
            if self.world_rank == 1 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
            return super().validate_batch(batch, batch_info)

    trainer = trainers(training_operator_cls=DiesInValidation, config=dict(CONFIG, marker=str(tmp_path / "m")))
    trained = trainer.train()
    before = trainer.get_model().weight.clone()
    assert trainer.validate()["num_samples"] == 100 and trainer.num_failures == 1
    assert torch.equal(trainer.get_model().weight, before)  # restarted from the state after train()
    assert trained["epoch"] == trainer.state_dict()["epoch"]


def test_user_errors_are_not_retried(trainers):
    class Buggy(FaultyOperator):
        def train_batch(self, batch, batch_info):
            raise ZeroDivisionError("user bug in train_batch")

    trainer = trainers(training_operator_cls=Buggy, config=CONFIG)
    start = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="user bug in train_batch"):
        trainer.train(max_retries=5)
    assert time.monotonic() - start < 5 and trainer.num_failures == 0


def test_load_of_a_damaged_checkpoint_names_the_file(trainers, tmp_path):
    trainer = trainers(config=CONFIG, num_workers=1)
    path = trainer.save(str(tmp_path / "model.ckpt"))
    data = open(path, "rb").read()
    open(path, "wb").write(data[:100])
    with pytest.raises(CheckpointError, match="model.ckpt"):
        trainer.load(path)


def test_every_worker_lost_between_calls_restarts_from_the_last_restart_point(trainers):
    """Both workers die while the driver is between calls: the next call restarts them from the snapshot taken at
    the start of the last call (it used to raise WorkerFailure at every call, for good)."""
    trainer = trainers(config=dict(CONFIG, data_size=40))
    trainer.train()
    assert trainer.train()["epoch"] == 2  # the snapshot: the state at the start of this call (epoch 1)
    for actor in trainer.worker_group.remote_workers:
        ray.kill(actor)
    stats = trainer.train()
    assert trainer.num_failures == 1 and trainer.worker_group.num_workers == 2
    assert stats["epoch"] == 2 and stats["num_samples"] == 40  # epoch 2 was lost with the workers: trained again
    assert trainer.get_model() is not None and trainer.validate()["num_samples"] == 100


def test_a_strict_spread_group_on_one_node_does_not_try_to_grow_at_every_call(trainers, monkeypatch):
    """STRICT_SPREAD needs a node per worker: on one node a (1, 2) range stays at 1 worker in the same process
    (it used to tear its group down at every call, wait for 2 bundles that could never be placed, and restart)."""
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0")
    trainer = trainers(config=dict(CONFIG, data_size=40), num_workers=(1, 2), placement_strategy="STRICT_SPREAD")
    pids = trainer.apply_all_workers(os.getpid)
    for _ in range(2):
        assert trainer.train()["num_samples"] == 40
        assert trainer.apply_all_workers(os.getpid) == pids and trainer.worker_group.num_workers == 1
