"""Preemption: a real SIGTERM to a worker mid-epoch commits at the agreed step; the epoch resumes from it."""
import io
import os
import signal
import time

import pytest
import torch

from helpers import CountingOperator, seeding_hook, signal_at_marker
from raysgd.torch import storage

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
    from raysgd.torch import preemption

    class DeadGroupWork:
        def wait(self):
            raise RuntimeError("Connection closed by peer (the old process group)")

    preemption._STATE["pending"] = (DeadGroupWork(), torch.zeros(1, dtype=torch.int32))
    try:
        preemption.set_active(True)  # the next committing call starts
        assert preemption._STATE["pending"] is None
    finally:
        preemption.set_active(False)
        preemption._STATE["pending"] = None


def test_a_resize_request_applies_to_its_own_call_and_attempt_and_sigterm_outranks_it():
    """The driver's request to grow is an agreement level below SIGTERM; a late request (another call or
    attempt) is never acted on; a call ended for a resize is told apart from a failure or a preemption."""
    from types import SimpleNamespace

    from raysgd.torch import preemption
    from raysgd.torch.errors import WorkerFailure

    one_rank = SimpleNamespace(world_size=1)
    try:
        preemption.request_resize(4, 1)
        assert preemption.resize_wanted(4, 1)
        assert not preemption.resize_wanted(4, 0) and not preemption.resize_wanted(5, 1)
        assert preemption.agree(one_rank, resize=preemption.resize_wanted(4, 1)) == preemption.RESIZE
        assert preemption.agree(one_rank, resize=preemption.resize_wanted(4, 2)) == preemption.GO_ON
        preemption._STATE["requested"] = True
        assert preemption.agree(one_rank, resize=True) == preemption.PREEMPT
    finally:
        preemption._STATE.update(requested=False, resize=None)
    resized = {0: f"{preemption.RESIZE_MARK}; committed at step 7", 1: f"{preemption.RESIZE_MARK}; committed at step 7"}
    assert preemption.was_resize(WorkerFailure("ended", resized))
    assert not preemption.was_resize(WorkerFailure("ended", {**resized, 1: "worker process died"}))
    assert not preemption.was_resize(WorkerFailure("ended", {}))
    assert not preemption.was_preempted(WorkerFailure("ended", resized))


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
