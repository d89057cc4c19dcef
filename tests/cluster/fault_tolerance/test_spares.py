"""Warm spares (``TorchTrainer(num_spares=k)``) with real actors, real SIGKILLs and real gloo groups."""
import logging
import os
import signal
import time

import pytest
import torch

from conftest import assert_released
from helpers import CountingOperator, counts, seeding_hook
from raysgd import TorchTrainer
from test_fault_tolerance import when_marker

N = 200  # samples: 10 steps of 10 per rank at 2 workers


def config(tmp_path=None, rank=1, step=5):
    fault = {"step": step, "rank": rank, "marker": str(tmp_path / "fault")} if tmp_path is not None else None
    return {"n": N, "batch_size": 10, "batch_sleep": 0.02, "fault": fault}


def ready_spare_pids(trainer, count=1, other_than=(), timeout_s=120):
    """The pids of ``count`` ready spares, none of them in ``other_than`` (a spare killed must first be noticed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = trainer.worker_group.spares.wait_ready(count, timeout_s=1)
        pids = trainer.worker_group.spares.pids()
        if ready == count and not set(pids) & set(other_than):
            return pids
        assert time.monotonic() < deadline, f"{ready} of {count} new spares became ready within {timeout_s} s"


@pytest.mark.parametrize("num_spares", [-1, 1.5, True, "1"])  # a whole float (1.0) is a count: test_options.py
def test_num_spares_is_checked_before_any_actor_starts(num_spares):
    with pytest.raises(ValueError, match=rf"num_spares expects an int >= 0; got {num_spares!r}"):
        TorchTrainer(training_operator_cls=CountingOperator, num_spares=num_spares)


def test_a_killed_rank_is_replaced_by_the_spare_exactly_once_and_bit_exact(ray_4cpus, trainer_factory, tmp_path):
    """Rank 1's process is SIGKILLed mid-epoch, after a commit: the warm spare takes rank 1 (its pid), rank 0 keeps its
    process, every sample is trained exactly once, and the state is bit-identical to an uninterrupted run."""
    common = dict(training_operator_cls=CountingOperator, num_workers=2, initialization_hook=seeding_hook,
                  commit_every_n_steps=2, timeout_s=30)
    clean = trainer_factory(config=config(), **common)
    clean.train()
    expected = clean.state_dict()
    clean.shutdown()

    trainer = trainer_factory(config=config(tmp_path), num_spares=1, **common)
    spare_pid, = ready_spare_pids(trainer)
    before = trainer.apply_all_workers(os.getpid)
    when_marker(tmp_path / "fault", lambda pid: os.kill(pid, signal.SIGKILL))
    stats = trainer.train()
    after = trainer.apply_all_workers(os.getpid)
    assert (tmp_path / "fault").exists() and trainer.num_failures == 1
    assert stats["num_samples"] == N and trainer.worker_group.num_workers == 2
    assert after == [before[0], spare_pid], (before, spare_pid, after)  # rank 0 kept; rank 1 is the spare
    got = trainer.state_dict()
    assert torch.equal(got["models"][0]["p"], torch.ones(N))  # every sample trained exactly once
    for key, value in expected["models"][0].items():
        assert torch.equal(got["models"][0][key], value), key
    for index, state in expected["optimizers"][0]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["optimizers"][0]["state"][index][name], value), (index, name)
    ready_spare_pids(trainer, other_than=[spare_pid, *after])  # the vacated bundle took a new spare, in the background
    trainer.shutdown()
    assert_released()


def test_an_idle_spare_that_dies_is_refilled_and_is_no_failure(ray_4cpus, trainer_factory, tmp_path):
    """One worker and one spare: the idle spare is SIGKILLed: it is refilled and the run counts no failure; then the
    only rank is SIGKILLed mid-epoch and the refilled spare takes rank 0 alone (no survivor)."""
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=1, num_spares=1, timeout_s=30,
                              initialization_hook=seeding_hook, config=config(tmp_path, rank=0, step=8))
    first, = ready_spare_pids(trainer)
    os.kill(first, signal.SIGKILL)
    second, = ready_spare_pids(trainer, other_than=[first])  # noticed at a ping, and refilled
    assert trainer.num_failures == 0
    when_marker(tmp_path / "fault", lambda pid: os.kill(pid, signal.SIGKILL))
    stats = trainer.train()
    assert (tmp_path / "fault").exists() and trainer.num_failures == 1 and stats["num_samples"] == N
    assert trainer.apply_all_workers(os.getpid) == [second]
    assert torch.equal(counts(trainer), torch.ones(N))
    trainer.shutdown()
    assert_released()


def test_the_trainer_says_when_its_spares_are_ready_and_how_many_are(ray_4cpus, trainer_factory, caplog):
    """One INFO line says when the spares are ready, logged by the calls that tend the pool (nobody polls here), once:
    later calls do not say it again; ``num_spares_ready`` counts them without waiting."""
    caplog.set_level(logging.INFO, logger="raysgd.torch.execution.spares")
    trainer = trainer_factory(training_operator_cls=CountingOperator, num_workers=1, num_spares=1, timeout_s=30,
                              config={"n": 20, "batch_size": 10})

    def said():
        return [(r.levelname, r.getMessage()) for r in caplog.records if "warm spare(s) ready" in r.getMessage()]

    deadline = time.monotonic() + 120
    while not said():
        assert time.monotonic() < deadline, "no line said the spare was ready within 120 s"
        assert trainer.train()["num_samples"] == 20
    assert trainer.num_spares_ready == 1
    for _ in range(2):
        trainer.train()
    assert len(said()) == 1 and said()[0][0] == "INFO", said()
    assert said()[0][1].startswith("1 warm spare(s) ready, ") and said()[0][1].endswith("taken over by a warm process")
    trainer.shutdown()
    assert_released()


def test_spares_are_ignored_inside_a_trials_placement_group(ray_4cpus):
    """Inside a placement group that is not the trainer's own (a Tune trial's: bundle 0 for the trainable, then one
    per worker) no spare is started, and the run trains as with num_spares=0 (a warning says so)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    def trial():
        import logging

        seen = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())
        logging.getLogger("raysgd").addHandler(handler)
        trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=1, num_spares=1,
                               config={"n": 20, "batch_size": 10}, timeout_s=30)
        try:
            return (trainer.train()["num_samples"], len(trainer.worker_group.spares.bundles),
                    any("num_spares=1 is ignored inside a Tune trial" in line for line in seen))
        finally:
            trainer.shutdown()

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    try:
        ray.get(pg.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                    placement_group_capture_child_tasks=True)
        assert ray.get(trial.options(scheduling_strategy=strategy).remote(), timeout=300) == (20, 0, True)
    finally:
        remove_placement_group(pg)
