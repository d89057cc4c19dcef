"""Commits inside an epoch: exactly-once resume after a real kill, bit-exact at the same size, bounded recompute."""
import logging
import os
import signal
import threading
import time

import pytest
import ray
import torch
from torch.utils.data import RandomSampler

from conftest import assert_released
from helpers import (CountingOperator, LinearOperator, counts, executed, kill_after_commit, seeding_hook,
                     stored_commit)
from raysgd.torch.state import checkpoint
from raysgd.torch.sharding.epoch_order import draw_stream

pytestmark = pytest.mark.usefixtures("ray_4cpus")

N, BATCH, EVERY = 96, 4, 3  # 2 workers: 12 steps an epoch, a commit every 3


@pytest.fixture
def trainers(trainer_factory):
    defaults = {"training_operator_cls": CountingOperator, "num_workers": 2, "timeout_s": 20,
                "commit_every_n_steps": EVERY, "initialization_hook": seeding_hook}
    return lambda **kwargs: trainer_factory(**{**defaults, **kwargs})


def test_fault_free_epoch_trains_every_sample_once_and_commits(trainers, tmp_path):
    trainer = trainers(config={"n": N, "batch_size": BATCH})
    stats = trainer.train()
    assert stats["num_samples"] == N
    assert torch.equal(counts(trainer), torch.ones(N))
    commit = stored_commit(trainer, 12)  # the commit at the last step may still be on its way when train() returns
    assert commit["cursor"]["steps"] == 12 and commit["cursor"]["consumed"] == N
    assert len(commit["rng"]) == 2 and len(commit["meters"]) == 2  # every rank contributed


def test_kill_after_a_commit_resumes_exactly_once_and_bit_exact(trainers, tmp_path):
    config = {"n": N, "batch_size": BATCH}
    clean = trainers(config=dict(config, log=str(tmp_path / "clean.log")))
    expected = [clean.train() for _ in range(2)]
    expected_state = clean.state_dict()
    clean.shutdown()

    log, marker = str(tmp_path / "faulty.log"), str(tmp_path / "fault")
    faulty = trainers(config=dict(config, log=log, fault={"step": 8, "rank": 1, "marker": marker}))
    kill_after_commit(faulty, marker, min_steps=6)
    first = faulty.train()
    assert os.path.exists(marker) and faulty.num_failures == 1
    assert first["num_samples"] == N  # the whole epoch, each batch once
    assert first["train_loss"] == pytest.approx(expected[0]["train_loss"], rel=1e-9)
    assert torch.equal(counts(faulty), torch.ones(N))
    # at most one commit interval recomputed (steps 6 and 7 on both ranks), not the epoch (2 x 8)
    assert executed(log) <= 24 + 2 * EVERY, executed(log)
    faulty.train()
    got = faulty.state_dict()
    assert got["epoch"] == expected_state["epoch"] == 2 and got["global_step"] == expected_state["global_step"]
    for key, value in expected_state["models"][0].items():
        assert torch.equal(got["models"][0][key], value), key  # dropout streams included
    for index, buffers in expected_state["optimizers"][0]["state"].items():
        assert torch.equal(got["optimizers"][0]["state"][index]["momentum_buffer"], buffers["momentum_buffer"])
    # every rank's torch stream (the operator seeds torch; numpy's and Python's are unseeded in these processes)
    assert [r["torch"] for r in got["rng"]] == [r["torch"] for r in expected_state["rng"]] and len(got["rng"]) == 2


@pytest.mark.parametrize("case, step_sleeps", [("a slow warm-up", [0.5] * 5), ("a later slow-down", [0.0] * 5 + [0.2] * 19)])
def test_time_based_commits_follow_the_training_time_not_the_first_steps(trainers, monkeypatch, case, step_sleeps):
    """About one commit per SGD_COMMIT_INTERVAL_S (1 s here) of training, over 24 steps: a slow warm-up (2.5 s)
    must not make every later fast step count as slow (the cadence agreed once from the first 5 steps committed
    every 2 steps to the end), and steps that slow down later (3.8 s) must still commit (it never did)."""
    from raysgd.torch.commits import commit_stats

    monkeypatch.setenv("SGD_COMMIT_INTERVAL_S", "1")
    trainer = trainers(commit_every_n_steps=None, config={"n": 96, "batch_size": 2, "step_sleeps": step_sleeps})
    start = time.monotonic()
    assert trainer.train()["num_samples"] == 96
    elapsed = time.monotonic() - start
    # the commits taken, not those stored: the last one may still be on its way to the store as train() returns
    taken = trainer.apply_all_workers(lambda: commit_stats.process_stats().taken())
    assert taken[0] == taken[1], taken  # every rank committed at the same steps
    assert trainer.latest_commit() is not None  # complete: every rank's record under one key
    # One per second of training time, which the call's wall time bounds (a loaded machine stretches both): 2 after
    # the warm-up and 3-4 for the slow-down on a quiet machine. The old cadence took 12 (every 2 steps) after the
    # warm-up, and 0 for the slow-down.
    lowest = 1 if case == "a slow warm-up" else 2
    assert lowest <= len(taken[0]) <= int(elapsed) + 1, (case, elapsed, taken)


def store_processes():
    """Pids of the live commit-store actors (this module runs one trainer at a time)."""
    from ray._private.state import state

    return [actor["Pid"] for actor in state.actor_table(None).values()
            if actor["ActorClassName"] == "_StoreActor" and actor["State"] == "ALIVE"]


def wait_for_stores(condition, what, timeout_s=30):
    """The live store pids once ``condition(pids)`` holds; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition(pids := store_processes()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s (live store pids: {pids})")
        time.sleep(0.05)
    return pids


def test_a_lost_commit_store_is_replaced_and_the_call_restarts_from_its_start(trainers, tmp_path):
    """The store's process is killed as the OOM killer would (SIGKILL), then a worker: the call recovers from its
    start (a missing store means no commit to resume from), exactly once, and the new store takes commits."""
    log, marker = str(tmp_path / "log"), str(tmp_path / "fault")
    trainer = trainers(config={"n": N, "batch_size": BATCH, "log": log,
                               "fault": {"step": 8, "rank": 1, "marker": marker}})
    (store_pid,) = wait_for_stores(bool, "the store's process starts with the trainer")
    killed = []

    def kill_store_then_worker():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # rank 1 waits at step 8, and the commit of step 6 is stored
            commit = trainer.latest_commit() if os.path.exists(marker) and open(marker).read() else None
            if commit is not None and commit["cursor"]["steps"] >= 6:
                break
            time.sleep(0.02)
        os.kill(store_pid, signal.SIGKILL)
        wait_for_stores(lambda pids: store_pid not in pids, "Ray knows the killed store is dead")
        os.kill(int(open(marker).read()), signal.SIGKILL)
        killed.append(True)

    watcher = threading.Thread(target=kill_store_then_worker, daemon=True)
    watcher.start()
    stats = trainer.train()
    watcher.join(10)
    assert killed and trainer.num_failures == 1
    assert stats["num_samples"] == N and torch.equal(counts(trainer), torch.ones(N))  # exactly once
    assert executed(log) >= 24 + 2 * 8, executed(log)  # replayed from the call's start: its commits were lost
    assert stored_commit(trainer, 12)["cursor"]["steps"] == 12  # the new store holds the retry's commits
    assert trainer.train()["num_samples"] == N and torch.equal(counts(trainer), 2 * torch.ones(N))


def test_a_commit_store_lost_between_calls_is_replaced_during_the_next_call(trainers, caplog):
    """The call's start does not wait for the store's answer (a round trip every call would pay): a store killed
    between calls is found and replaced while the next call runs, which trains every sample once; the call after
    commits into the new store."""
    trainer = trainers(config={"n": N, "batch_size": BATCH})
    trainer.train()
    (store_pid,) = store_processes()
    os.kill(store_pid, signal.SIGKILL)
    wait_for_stores(lambda pids: store_pid not in pids, "Ray knows the killed store is dead")
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.commits.commit_policy"):
        assert trainer.train()["num_samples"] == N
    assert "The commit store was lost" in caplog.text
    assert trainer.num_failures == 0 and torch.equal(counts(trainer), 2 * torch.ones(N))
    # the new store's process starts in the background
    assert store_pid not in wait_for_stores(bool, "a new store's process starts")
    trainer.train()
    assert stored_commit(trainer, 12)["cursor"]["steps"] == 12  # the new store holds the third call's commits


def test_the_store_and_holder_processes_import_neither_raysgd_nor_torch(trainers):
    """They are sent by value (``transport.by_value``), with the functions of raysgd they call: their processes
    import only what their code uses (a by-reference function would bring raysgd and torch back: ~1 CPU s each)."""
    trainer = trainers(config={"n": N, "batch_size": BATCH})
    trainer.train()
    from ray._private.state import state

    helpers = [actor for actor in state.actor_table(None).values() if actor["State"] == "ALIVE"
               and actor["ActorClassName"] in ("_StoreActor", "_HolderActor")]
    assert {actor["ActorClassName"] for actor in helpers} == {"_StoreActor", "_HolderActor"}
    for actor in helpers:
        with open(f"/proc/{actor['Pid']}/maps", encoding="ascii", errors="replace") as maps:
            mapped = maps.read()
        assert "libtorch" not in mapped, actor["ActorClassName"]  # raysgd imports torch: neither was imported


def test_commits_off_replays_the_call_from_its_start(trainers, tmp_path):
    log, marker = str(tmp_path / "log"), str(tmp_path / "fault")
    trainer = trainers(commit_every_n_steps=0, add_dist_sampler=False,  # and a user's own cursor sampler
                       config={"n": N, "batch_size": BATCH, "log": log, "own_sampler": True,
                                                      "fault": {"step": 8, "rank": 1, "marker": marker}})
    kill_after_commit(trainer, marker, min_steps=None)
    stats = trainer.train()
    assert stats["num_samples"] == N and torch.equal(counts(trainer), torch.ones(N))
    assert trainer.latest_commit() is None
    assert executed(log) >= 24 + 2 * 8  # the epoch was replayed from its start


def wait_for_commit(trainer, timeout_s=30):
    """The trainer's latest commit, once the store holds one (commits are stored in the background)."""
    deadline = time.monotonic() + timeout_s
    while (commit := trainer.latest_commit()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert commit is not None, "no commit was stored"
    return commit


def test_a_loaded_commit_survives_a_save_taken_before_its_epoch_resumes(trainers, tmp_path):
    """load_state_dict(latest_commit()), then apply_all_workers() and save(): the saved state resumes at the commit
    (with its random streams and committed metrics). It had no cursor, so a trainer loading it trained the epoch
    again from its start: the committed 24 of 96 samples twice."""
    first = trainers(config={"n": N, "batch_size": BATCH})
    first.train(num_steps=EVERY)  # one commit, on the call's last step: 2 ranks x 3 batches x 4 samples
    commit = wait_for_commit(first)
    assert commit["cursor"]["consumed"] == 24
    first.load_state_dict(commit)
    first.apply_all_workers(lambda: None)
    path = first.save(tmp_path / "ckpt")
    saved = checkpoint.load_state(path)
    assert saved["cursor"] == commit["cursor"] and saved["epoch"] == commit["epoch"] == 1
    assert saved["rng"] == commit["rng"] and saved["meters"] == commit["meters"]
    first.shutdown()
    second = trainers(num_workers=1, config={"n": N, "batch_size": BATCH})  # the rest re-sharded over one worker
    second.load(path)
    stats = second.train()
    assert torch.equal(counts(second), torch.ones(N))  # every sample once in the epoch
    assert stats["num_samples"] == N and stats["epoch"] == 1  # the call that resumed it reports the whole epoch


# ----------------------------------------------------------------- snapshot rules (issue 11, items 2 and 8)
class BestScore(LinearOperator):
    """Keeps a best score that a custom validate() changes (operator state)."""

    def setup(self, config):
        super().setup(config)
        self.best = 0.0

    def validate(self, val_iterator, info=None):
        self.best += 1.0
        return super().validate(val_iterator, info)

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state_dict):
        self.best = state_dict["best"]

    def train_batch(self, batch, batch_info):
        marker = self.config.get("raise_marker")
        if marker and self.world_rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            raise ValueError("a user bug")
        return super().train_batch(batch, batch_info)


def test_save_and_state_dict_hold_the_current_state_after_validate_and_local_changes(trainer_factory, tmp_path):
    trainer = trainer_factory(training_operator_cls=BestScore, num_workers=1, use_local=True, timeout_s=20)
    trainer.train()
    trainer.validate()
    trainer.validate()
    path = trainer.save(tmp_path / "ckpt")
    assert checkpoint.load_state(path)["operator"] == {"best": 2.0}
    trainer.get_local_operator().best = 7.0
    assert trainer.state_dict()["operator"] == {"best": 7.0}
    trainer.get_local_operator().model.weight.data.fill_(3.0)
    assert float(trainer.state_dict()["models"][0]["weight"]) == 3.0


def test_a_lost_worker_never_makes_the_trainer_unusable(trainer_factory, tmp_path):
    trainer = trainer_factory(training_operator_cls=BestScore, num_workers=2, timeout_s=20,
                              config={"raise_marker": str(tmp_path / "raised")})
    with pytest.raises(ValueError, match="a user bug"):  # user error, no retries: the group is torn down
        trainer.train(max_retries=0)
    assert trainer.train()["num_samples"] == 200
    with pytest.raises(RuntimeError, match="worker was lost"):
        trainer.apply_all_workers(lambda: os._exit(1) if torch.distributed.get_rank() == 1 else None)
    assert trainer.train()["num_samples"] == 200  # restarted from the last restart point
    assert trainer.state_dict()["epoch"] == 2  # nothing trained was lost


# ----------------------------------------------------------------- elastic range
def test_a_range_starts_with_what_fits_and_an_unplaceable_minimum_is_a_clear_error(trainer_factory, monkeypatch):
    assert_released()  # the previous test's workers are gone: all 4 CPUs are free
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=(1, 4), num_cpus_per_worker=2,
                              timeout_s=20)
    assert trainer.worker_group.num_workers == 2  # 4 CPUs: two workers fit now; no wait for four
    assert trainer.train()["num_samples"] == 200
    trainer.shutdown()
    monkeypatch.setenv("SGD_PLACEMENT_GROUP_TIMEOUT_S", "2")
    with pytest.raises(TimeoutError, match=r"minimum of 3 workers.*free resources"):
        trainer_factory(training_operator_cls=LinearOperator, num_workers=(3, 4), num_cpus_per_worker=2)
    assert_released()


# ----------------------------------------------------------------- a resize inside an uneven epoch (issue 22)
@ray.remote(num_cpus=2)
class Holder:
    """Holds 2 of the 4 CPUs until killed, so that only one 2-CPU worker fits at first."""

    def ready(self):
        return True


@pytest.mark.slow
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
def test_a_grow_mid_epoch_trains_each_sample_as_the_readme_promises(trainer_factory, tmp_path, monkeypatch,
                                                                    drop_last):
    """53 samples, batches of 4, (1, 2) workers: 7 batches on one worker, then the group grows (a real restart at a
    commit point) and the 25 samples left are re-sharded over 2 workers, 25 = 3 x (2 x 4) + 1. README, "Data
    sharding": with drop_last=False every sample is trained once, except that the worker short of a last batch
    re-reads one sample from the start of what was left; with drop_last=True the last 1 is skipped."""
    assert_released()
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0")
    monkeypatch.setenv("SGD_GROW_CHECK_S", "0.2")
    n, batch, gate, log = 53, 4, tmp_path / "gate", tmp_path / "batches.log"
    holder = Holder.remote()
    ray.get(holder.ready.remote())
    config = {"n": n, "batch_size": batch, "drop_last": drop_last, "log": str(log),
              "fault": {"step": 6, "rank": 0, "marker": str(gate), "until_resize": True}}  # waits for the request
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=(1, 2), num_cpus_per_worker=2,
                              timeout_s=30, commit_every_n_steps=2, config=config, initialization_hook=seeding_hook)
    assert trainer.worker_group.num_workers == 1

    def free_room():  # once rank 0 waits at step 6, the held CPUs come back: the group can grow
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(holder)

    threading.Thread(target=free_room, daemon=True).start()
    stats = trainer.train(reduce_results=False)
    assert gate.exists() and trainer.num_failures == 0 and trainer.worker_group.num_workers == 2
    lines = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]  # (rank, global step)
    first = min(step for rank, step in lines if rank == 1)  # batches trained on one worker before growing
    consumed, left = first * batch, n - first * batch
    rounds, tail = divmod(left, 2 * batch)
    assert 0 < tail < 2  # the one uneven case: the last round holds fewer samples than workers
    assert len(lines) == first + 2 * (rounds + 1 - drop_last)  # nothing recomputed
    order = draw_stream(RandomSampler(range(n)), seed=0, epoch=0)  # the epoch's order (the loader's, seed 0)
    expected = torch.zeros(n)
    expected[order[:consumed]] += 1  # before the resize
    rest = order[consumed:]
    if drop_last:
        expected[rest[:left - tail]] += 1  # the last `tail` samples are skipped
    else:
        expected[rest] += 1
        expected[rest[0]] += 1  # the worker short of a last batch re-reads the first sample left
    assert torch.equal(counts(trainer), expected)
    assert sum(s["num_samples"] for s in stats) == (n - tail if drop_last else n + 1)
