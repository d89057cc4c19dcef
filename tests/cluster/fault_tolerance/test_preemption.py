"""Preemption: a real SIGTERM to a worker mid-epoch commits at the agreed step; the epoch resumes from it."""
import io
import logging
import os
import shutil
import signal
import threading
import time

import pytest
import torch

from helpers import (CountingOperator, SlowCleanupOperator, SlowCommitOperator, env_hook, seeding_hook,
                     signal_at_marker)
from raysgd.torch.storage import filesystem as storage
from raysgd.torch.errors import CheckpointError

pytestmark = pytest.mark.usefixtures("ray_4cpus")

N, BATCH, STEP = 96, 4, 5  # 2 workers: 12 steps an epoch; rank 1 is signalled during step 5


def sigterm_at_marker(marker, timeout_s=60):
    """Once the signalled rank wrote its pid to ``marker`` (it then waits for the signal), SIGTERM it."""
    return signal_at_marker(marker, signal.SIGTERM, timeout_s=timeout_s)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_mid_epoch_commits_at_once_and_loses_no_step(trainer_factory, tmp_path):
    log, marker = str(tmp_path / "batches.log"), str(tmp_path / "pid")
    config = {"n": N, "batch_size": BATCH, "log": log,
              "fault": {"step": STEP, "rank": 1, "marker": marker, "until_sigterm": True}}
    path = str(tmp_path / "run")
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=2, timeout_s=30, config=config,
                              commit_every_n_steps=1000, initialization_hook=seeding_hook, storage_path=path,
                              num_to_keep=3)
    pids = trainer.apply_all_workers(os.getpid)
    watcher = sigterm_at_marker(marker)
    stats = trainer.train()
    watcher.join(5)
    assert trainer.num_failures == 1
    assert int(open(marker).read()) == pids[1]
    deadline = time.monotonic() + 30
    while alive(pids[1]) and time.monotonic() < deadline:  # the signalled process exits after its commit
        time.sleep(0.1)
    assert not alive(pids[1])
    assert stats["num_samples"] == N
    assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(N))  # every sample trained once
    executed = len(open(log).read().splitlines())
    assert executed <= 2 * (12 + 1), executed  # at most about one step per rank recomputed (here none)
    commit = trainer.latest_commit()  # the only commit: agreed at the boundary after the signalled step's next
    assert commit is not None and commit["cursor"]["steps"] == STEP + 2
    trainer.shutdown()  # waits for the uploads: the preemption commit, then the end of train()
    store = storage.CheckpointStorage(path, num_to_keep=3)
    written = [storage.read_checkpoint_dir(store.filesystem, d) for _, d in store.list()]
    assert [marker["reason"] for _, marker in written] == ["preemption", "train"]
    state = torch.load(io.BytesIO(written[0][0]), weights_only=True)  # a safe load resumes at the cursor
    assert state["cursor"]["steps"] == STEP + 2 and state["cursor"]["consumed"] == 2 * BATCH * (STEP + 2)


def checkpoints(path):
    """``[(state bytes, marker)]`` of storage_path's complete checkpoints, oldest first."""
    store = storage.CheckpointStorage(path, num_to_keep=3)
    return [storage.read_checkpoint_dir(store.filesystem, directory) for _, directory in store.list()]


@pytest.mark.parametrize("signalled", ["every rank", "one rank"])
def test_the_preemption_commit_reaches_storage_whichever_news_reaches_the_driver_first(trainer_factory, tmp_path,
                                                                                         signalled):
    """Whole-cluster preemption (every worker signalled) and one signalled worker, whose platform SIGKILLs them
    once the commit is stored (the end of its grace period): the operator takes 4 s to clean up after the call's
    error, so no error carrying the preemption mark reaches the driver first (it waits 2 s for survivors). The
    driver learns of the preemption commit from the store, where the ranks marked it, and writes it to
    storage_path."""
    log, marker, path = str(tmp_path / "batches.log"), str(tmp_path / "pid"), str(tmp_path / "run")
    config = {"n": N, "batch_size": BATCH, "log": log, "cleanup_s": 4.0,
              "fault": {"step": STEP, "rank": 1, "marker": marker, "until_sigterm": True}}
    trainer = trainer_factory(training_operator_cls=SlowCleanupOperator, num_workers=2, timeout_s=30,
                              config=config, commit_every_n_steps=1000, initialization_hook=seeding_hook,
                              storage_path=path, num_to_keep=3)
    pids = trainer.apply_all_workers(os.getpid)
    targets = pids if signalled == "every rank" else pids[1:]

    def sigterm_all():
        deadline = time.monotonic() + 60
        while not (os.path.exists(marker) and open(marker).read()) and time.monotonic() < deadline:
            time.sleep(0.02)
        for pid in targets:
            os.kill(pid, signal.SIGTERM)
        while time.monotonic() < deadline:  # the agreed commit is complete in the store: the grace ends
            if trainer.latest_commit() is not None:  # the only commit: the preemption commit
                break
            time.sleep(0.02)
        for pid in targets:
            os.kill(pid, signal.SIGKILL)

    watcher = threading.Thread(target=sigterm_all, daemon=True)
    watcher.start()
    stats = trainer.train()
    watcher.join(5)
    assert trainer.num_failures == 1 and stats["num_samples"] == N
    assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(N))  # exactly once
    assert len(open(log).read().splitlines()) <= 2 * (12 + 1)  # resumed from the preemption commit
    trainer.shutdown()
    written = checkpoints(path)
    assert [marker["reason"] for _, marker in written] == ["preemption", "train"]
    state = torch.load(io.BytesIO(written[0][0]), weights_only=True)
    # Rank 1 waits in step STEP for its signal, so its news enters the exchange at the boundary after it and is
    # agreed one boundary later (STEP + 2). A signal to every rank can reach rank 0 while it is still before its
    # own boundary after step STEP - 1 (ranks leave a step's all-reduce together but reach their boundary apart):
    # then the agreement comes one boundary earlier. Either way the stored commit is the agreed one, whole.
    agreed = {STEP + 2} if signalled == "one rank" else {STEP + 1, STEP + 2}
    steps = state["cursor"]["steps"]
    assert steps in agreed and state["cursor"]["consumed"] == 2 * BATCH * steps, state["cursor"]


def test_an_earlier_failed_upload_does_not_abort_the_recovery_from_a_preemption(trainer_factory, tmp_path, caplog):
    """The first epoch's checkpoint upload fails (storage_path became a file); a preemption in the second epoch
    recovers from its commit all the same, and the upload's error is raised once the call is done, with the
    group whole and the epoch trained exactly once (the error used to end the recovery, the group torn down)."""
    marker, path = str(tmp_path / "pid"), tmp_path / "run"
    config = {"n": N, "batch_size": BATCH,
              "fault": {"step": 12 + STEP, "rank": 1, "marker": marker, "until_sigterm": True}}  # epoch 2
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=2, timeout_s=30, config=config,
                              commit_every_n_steps=1000, initialization_hook=seeding_hook, storage_path=str(path))
    for entry in path.iterdir() if path.exists() else []:
        shutil.rmtree(entry)
    if path.exists():
        path.rmdir()
    path.write_text("not a folder any more")
    with caplog.at_level(logging.ERROR, logger="raysgd.torch.storage.async_writer"):
        trainer.train()  # its checkpoint's upload fails on the writer thread, which logs it at once
        deadline = time.monotonic() + 60
        while "checkpoint of epoch 1" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "failed" in caplog.text
    watcher = sigterm_at_marker(marker)
    with pytest.raises(CheckpointError, match="asynchronous checkpoint write failed"):
        trainer.train()
    watcher.join(5)
    assert trainer.num_failures == 1 and not trainer.worker_group.broken
    assert torch.equal(trainer.state_dict()["models"][0]["p"], 2 * torch.ones(N))  # both epochs, exactly once
    with pytest.raises(CheckpointError):  # the later uploads failed too
        trainer.shutdown()


def test_a_slow_preemption_commit_is_not_cut_short_by_the_grace_timer(trainer_factory, tmp_path):
    """SGD_PREEMPT_GRACE_S bounds reaching the agreed step, not the commit: a send that takes longer than the
    grace (4 s against 1.5 s here, as a multi-GB state would) still completes, and the call resumes from it."""
    log, marker = str(tmp_path / "batches.log"), str(tmp_path / "pid")
    config = {"n": N, "batch_size": BATCH, "log": log, "save_s": 4.0,
              "fault": {"step": STEP, "rank": 0, "marker": marker, "until_sigterm": True}}  # rank 0 sends the state
    trainer = trainer_factory(training_operator_cls=SlowCommitOperator, num_workers=2, timeout_s=30, config=config,
                              commit_every_n_steps=1000, initialization_hook=env_hook(SGD_PREEMPT_GRACE_S=1.5))
    pids = trainer.apply_all_workers(os.getpid)
    watcher = sigterm_at_marker(marker)
    stats = trainer.train()
    watcher.join(5)
    assert int(open(marker).read()) == pids[0] and trainer.num_failures == 1
    commit = trainer.latest_commit()
    assert commit is not None and commit["cursor"]["steps"] == STEP + 2  # the slow commit was stored
    assert stats["num_samples"] == N and torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(N))
    assert len(open(log).read().splitlines()) <= 2 * (12 + 1)  # nothing replayed from the call's start


def test_a_rank_stuck_in_its_step_after_sigterm_exits_at_the_grace(trainer_factory, tmp_path):
    """SGD_PREEMPT_GRACE_S bounds the wait for the agreed step: a rank that stays inside its step (20 s here) exits
    at the grace (1.5 s), not when its call ends (Ray's own SIGTERM handling waits for that); the trainer then
    recovers from the latest regular commit, exactly once."""
    marker = str(tmp_path / "pid")
    config = {"n": N, "batch_size": BATCH,
              "fault": {"step": STEP, "rank": 1, "marker": marker, "until_sigterm": True, "after_s": 20}}
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=2, timeout_s=60, config=config,
                              commit_every_n_steps=3, initialization_hook=env_hook(SGD_PREEMPT_GRACE_S=1.5))
    pids, times = trainer.apply_all_workers(os.getpid), []

    def signal_then_time_the_exit():
        deadline = time.monotonic() + 60
        while not (os.path.exists(marker) and open(marker).read()) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(pids[1], signal.SIGTERM)
        times.append(time.monotonic())
        while alive(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        times.append(time.monotonic())

    watcher = threading.Thread(target=signal_then_time_the_exit, daemon=True)
    watcher.start()
    stats = trainer.train()
    watcher.join(30)
    assert len(times) == 2 and times[1] - times[0] < 10, times  # the grace, not the 20 s left in the step
    assert trainer.num_failures == 1 and stats["num_samples"] == N
    assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(N))


def test_sigterm_to_an_idle_worker_exits_it(trainer_factory):
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=2, timeout_s=30,
                              config={"n": N, "batch_size": BATCH}, commit_every_n_steps=1000)
    pids = trainer.apply_all_workers(os.getpid)
    os.kill(pids[1], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids[1])  # outside a train call Ray's own handling applies: the process exits
    trainer.train()
    assert trainer.num_failures == 1
    assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(N))


def test_an_agreement_left_by_an_aborted_call_is_never_read_by_the_next():
    """Rank 0 under use_local lives on in the driver: a call that ended with an error must not hand its
    in-flight agreement (on a process group that is gone) to the next call, whose first agreement would
    then re-raise the old call's gloo error (seen as a second, spurious failure after a recovery)."""
    from raysgd.torch.commits.preemption import PreemptionState

    class DeadGroupWork:
        def wait(self):
            raise RuntimeError("Connection closed by peer (the old process group)")

    state = PreemptionState()  # the driver's rank 0 (use_local) has one per process, as every worker
    state.pending = (DeadGroupWork(), torch.zeros(1, dtype=torch.int32))
    state.set_active(True)  # the next committing call starts
    assert state.pending is None
    state.set_active(False)


def test_a_resize_request_applies_to_its_own_call_and_attempt_and_sigterm_outranks_it():
    """The driver's request to grow is an agreement level below SIGTERM; a late request (another call or
    attempt) is never acted on; a call ended for a resize is told apart from a failure or a preemption."""
    from types import SimpleNamespace

    from raysgd.torch.commits import preemption
    from raysgd.torch.fault_tolerance import stops
    from raysgd.torch.errors import WorkerFailure

    one_rank, state = SimpleNamespace(world_size=1), preemption.PreemptionState()
    state.request_resize(4, 1)
    assert state.resize_wanted(4, 1)
    assert not state.resize_wanted(4, 0) and not state.resize_wanted(5, 1)
    assert state.agree(one_rank, resize=state.resize_wanted(4, 1)) == preemption.RESIZE
    assert state.agree(one_rank, resize=state.resize_wanted(4, 2)) == preemption.GO_ON
    state.requested = True  # as the SIGTERM handler sets it during a committing call
    assert state.agree(one_rank, resize=True) == preemption.PREEMPT
    assert not preemption.process_state().requested and not preemption.resize_requested()  # this process's: untouched
    resized = {0: f"{stops.RESIZE_MARK}; committed at step 7", 1: f"{stops.RESIZE_MARK}; committed at step 7"}
    assert stops.was_resize(WorkerFailure("ended", resized))
    assert not stops.was_resize(WorkerFailure("ended", {**resized, 1: "worker process died"}))
    assert not stops.was_resize(WorkerFailure("ended", {}))
    assert not stops.was_preempted(WorkerFailure("ended", resized))


def test_a_commit_on_the_last_step_of_a_call_stays_the_restart_point_after_it(trainer_factory, tmp_path):
    """SIGTERM lands so that the commit falls on the last step of train(num_steps=5): the resumed attempt has no
    step left and ends at once, its loaded cursor still waiting for the next call. The state read then (the next
    call's restart point, save(), a storage_path checkpoint) must hold that cursor and the commit's random
    streams: it held neither, so a failure in the next call, before its first commit, trained the committed 40
    samples again."""
    marker, crash = str(tmp_path / "pid"), str(tmp_path / "crash")
    config = {"n": N, "batch_size": BATCH, "fault": {"step": 3, "rank": 1, "marker": marker, "until_sigterm": True}}
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=2, timeout_s=30, config=config,
                              commit_every_n_steps=1000, initialization_hook=seeding_hook)
    watcher = sigterm_at_marker(marker)
    stats = trainer.train(num_steps=5)
    watcher.join(5)
    commit = trainer.latest_commit()
    assert trainer.num_failures == 1 and commit["cursor"]["steps"] == 5  # agreed one step late: the last step
    assert stats["num_samples"] == 2 * BATCH * 5  # the committed steps, reported once
    state = trainer.state_dict()
    assert state["cursor"]["consumed"] == 2 * BATCH * 5 and state["epoch"] == 1
    assert state["rng"] == commit["rng"]  # every rank's streams, as the resumed epoch will start with them
    # the next call loses a worker before it commits: it restarts from the state at its start
    trainer.apply_all_operators(lambda op: op.config.update(fault={"step": 7, "rank": 1, "marker": crash,
                                                                   "exit": True}))
    rest = trainer.train()
    assert os.path.exists(crash) and trainer.num_failures == 2
    assert rest["num_samples"] == N - 2 * BATCH * 5  # the rest of the epoch (the first call reported the rest)
    assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(N))  # every sample once in the epoch
