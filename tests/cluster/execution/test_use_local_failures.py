"""use_local=True: the driver watches the remote ranks while rank 0 trains in its thread."""
import _thread
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from helpers import FaultyOperator
from raysgd.torch.errors import CollectiveError

pytestmark = pytest.mark.usefixtures("ray_2cpus")

CONFIG = {"data_size": 400, "batch_size": 10, "batch_sleep": 0.02}


class RemoteValueError(FaultyOperator):
    def train_batch(self, batch, batch_info):
        if self.world_rank == 1 and batch_info["batch_idx"] == 3:
            raise ValueError("bad batch on rank 1")
        return super().train_batch(batch, batch_info)


def rank0_threads():
    return [t for t in threading.enumerate() if t.name == "raysgd-rank0" and t.is_alive()]


@pytest.fixture
def local_trainer(trainer_factory):
    return lambda **kw: trainer_factory(**{"training_operator_cls": FaultyOperator, "num_workers": 2,
                                           "use_local": True, "timeout_s": 600, **kw})


def test_remote_user_error_reaches_the_caller_with_its_type_at_once(local_trainer):
    trainer = local_trainer(training_operator_cls=RemoteValueError, config=CONFIG)
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad batch on rank 1"):
        trainer.train(max_retries=3)  # rank 0 waits in allreduce for rank 1: only the driver can see it
    assert time.monotonic() - start < 120  # not timeout_s=600 (generous: the CI machine is shared)
    assert trainer.num_failures == 0  # a user error is never retried
    assert len(rank0_threads()) <= 1 and not dist.is_initialized()  # rank 0's old thread and process group ended


def test_remote_death_is_recovered_within_seconds(local_trainer, tmp_path):
    fault = {"rank": 1, "batch": 5, "kind": "exit", "marker": str(tmp_path / "exit")}
    trainer = local_trainer(config=dict(CONFIG, fault=fault))
    start = time.monotonic()
    stats = trainer.train()
    assert (tmp_path / "exit").exists() and stats["num_samples"] == 400
    assert time.monotonic() - start < 120 and trainer.num_failures == 1  # not timeout_s=600
    assert trainer.worker_group.num_workers == 2 and dist.is_initialized()  # the driver's group was re-created


@pytest.fixture
def default_ctrl_c():
    """Python's own SIGINT handler for the test: Ray Tune leaves its handler (which only logs "Stop signal
    received") installed in a process that ran a Tune experiment, as earlier test modules in this one did."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_stops_every_rank_and_the_next_train_restarts(local_trainer, default_ctrl_c):
    trainer = local_trainer(config=dict(CONFIG, batch_sleep=0.2))
    threading.Timer(1.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert not rank0_threads() and not dist.is_initialized()
    assert trainer.worker_group.broken
    assert trainer.train(num_steps=2)["num_samples"] == 40  # restarted from the snapshot taken before
    assert os.getpid() == trainer.apply_all_workers(os.getpid)[0]  # rank 0 is still this process


class ErrorAndVictim(FaultyOperator):
    """At batch 3 rank 1 raises the user's error while rank 0 reports what a victim's collective reports."""

    def train_batch(self, batch, batch_info):
        if batch_info["batch_idx"] == 3:
            if self.world_rank == 1:
                raise ValueError("rank 1 gave up")
            raise CollectiveError(0, "Connection closed by peer (rank 1 is gone)")
        return super().train_batch(batch, batch_info)


@pytest.mark.parametrize("use_local", [True, False])
def test_a_user_error_beside_its_victims_collective_error_is_raised(trainer_factory, use_local):
    # Both arrive together, in either order (the user's error often during the wait for the cause that
    # follows a collective error): the user's error is the cause, never dropped for a retry.
    trainer = trainer_factory(training_operator_cls=ErrorAndVictim, num_workers=2, use_local=use_local,
                              config=CONFIG, timeout_s=600)
    with pytest.raises(ValueError, match="rank 1 gave up"):
        trainer.train(max_retries=3)
    assert trainer.num_failures == 0
