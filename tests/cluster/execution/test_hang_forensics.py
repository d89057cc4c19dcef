"""Where is each rank? Stacks of stuck ranks in the WorkerFailure and the log; trainer.stack_traces() by hand."""
import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from helpers import FaultyOperator
from raysgd.torch.execution import diagnostics
from raysgd.torch.errors import WorkerFailure

pytestmark = pytest.mark.usefixtures("ray_2cpus")

STUCK_LINE = 'time.sleep(fault.get("seconds", 600))'  # helpers.FaultyOperator.train_batch, kind "sleep"


@pytest.mark.parametrize("use_local", [False, True])
def test_a_rank_stuck_in_train_batch_is_shown_where_it_is(trainer_factory, tmp_path, caplog, use_local):
    config = {"data_size": 200, "batch_size": 10, "fault": {"rank": 1, "batch": 2, "kind": "sleep", "seconds": 120,
                                                             "marker": str(tmp_path / "stuck")}}
    trainer = trainer_factory(training_operator_cls=FaultyOperator, num_workers=2, config=config, timeout_s=5,
                              use_local=use_local)
    caplog.set_level(logging.WARNING, logger="raysgd")
    with pytest.raises(RuntimeError) as info:
        trainer.train(max_retries=0)  # rank 0's allreduce times out after 5 s while rank 1 sleeps
    failure = info.value.__cause__
    assert isinstance(failure, WorkerFailure) and 1 in failure.unresponsive
    assert "in train_batch" in failure.stacks[1] and STUCK_LINE in failure.stacks[1], failure.stacks
    assert "--- rank 1 ---" in str(failure) and STUCK_LINE in str(failure)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "did not answer: rank 1" in logged and STUCK_LINE in logged


@pytest.mark.parametrize("use_local", [False, True])
def test_stack_traces_from_another_thread_during_a_slow_train(trainer_factory, use_local):
    config = {"data_size": 200, "batch_size": 10, "batch_sleep": 0.3}
    trainer = trainer_factory(training_operator_cls=FaultyOperator, num_workers=2, config=config, use_local=use_local)
    seen, errors = {}, []

    def watch():  # poll (with a deadline) until both ranks were caught inside train_batch
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline and len(seen) < 2:
                for rank, text in trainer.stack_traces().items():
                    if "in train_batch" in text and "time.sleep(self.config.get" in text:
                        seen[rank] = text
                time.sleep(0.2)
        except Exception as err:  # noqa: BLE001 (reported by the assertion below)
            errors.append(err)

    thread = threading.Thread(target=watch)
    thread.start()
    stats = trainer.train()  # ~3 s: 10 batches of 0.3 s per rank
    thread.join(timeout=60)
    assert not errors and sorted(seen) == [0, 1], (errors, seen)
    assert stats["num_samples"] == 200
    assert set(trainer.stack_traces()) == {0, 1}  # idle ranks answer too


def test_a_rank_that_cannot_answer_is_dumped_with_py_spy(trainer_factory):
    # The fallback when a worker's control thread does not answer (its process holds the interpreter lock).
    trainer = trainer_factory(training_operator_cls=FaultyOperator, num_workers=2, config={"data_size": 40})
    actor = trainer.worker_group.remote_workers[0]
    if diagnostics.py_spy_path() is None:
        pytest.skip("py-spy is not installed")
    text = diagnostics.stacks_without_answer(actor._actor_id.hex(), timeout_s=0)
    if "Permission denied" in text or "Operation not permitted" in text:
        pytest.skip(f"ptrace is not permitted here: {text}")
    assert text.startswith("py-spy dump:") and "main_loop" in text, text


def test_a_process_that_ended_is_told_from_one_that_did_not_answer():
    """A rank that does not answer the stack request in time and whose process on this machine has ended (killed,
    not yet reaped, or reaped) is reported dead, as Ray reports a dead actor (a process lost with its node is reported
    by Ray only at its verdict on the node); a live one is not."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not diagnostics.process_ended(child.pid)
        child.kill()
        deadline = time.monotonic() + 30
        while not diagnostics.process_ended(child.pid):  # a zombie until waited for
            assert time.monotonic() < deadline, "the killed child never showed as ended"
            time.sleep(0.01)
        assert child.poll() is not None  # reaped now: gone from /proc
        assert diagnostics.process_ended(child.pid)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert not diagnostics.process_ended(os.getpid())
