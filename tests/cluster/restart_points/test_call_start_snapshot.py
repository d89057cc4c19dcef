"""The call-start snapshot is taken beside the call (raysgd/torch/restart_points/call_start.py): the call trains while rank 0
serialises its starting state, no rank steps before it is stored, and a failure in the call's first steps restarts
from it bit-exact, every sample once.

Real actors on a local cluster; the order of events is what each worker recorded, never a wall time.
"""
import logging
import os
import signal
import threading
import time

import pytest
import torch

from helpers import CountingOperator, SnapshotProbeOperator, counts, seeding_hook
from raysgd.torch.restart_points import call_start

pytestmark = pytest.mark.usefixtures("ray_4cpus")

N, BATCH = 96, 4  # 2 workers: 12 steps an epoch


@pytest.fixture
def trainers(trainer_factory):
    defaults = {"training_operator_cls": CountingOperator, "num_workers": 2, "timeout_s": 30,
                "commit_every_n_steps": 0, "initialization_hook": seeding_hook}
    return lambda **kwargs: trainer_factory(**{**defaults, **kwargs})


def rank0_events(trainer):
    return trainer.apply_all_workers(lambda: list(call_start.EVENTS))[0]


def last_call(events):
    """The events of rank 0's latest overlapped call, from its ``"captured"`` on, names only."""
    start = max(i for i, (name, _) in enumerate(events) if name == "captured")
    return [name for name, _ in events[start:]]


def test_the_call_trains_while_its_snapshot_is_serialised_and_steps_only_once_it_is_stored(trainers):
    # The probe in the operator's state holds rank 0's serialisation until the call's first batch has started: a
    # call that waited for its snapshot would never start (the probe gives up after 30 s and the snapshot fails).
    trainer = trainers(training_operator_cls=SnapshotProbeOperator, config={"n": N, "batch_size": BATCH})
    trainer.train(num_steps=2)  # the first call's snapshot is taken before it (a fallback exists from then on)
    for call in range(2):
        trainer.train(num_steps=2)
        names = last_call(rank0_events(trainer))
        order = [names.index(name) for name in ("captured", "batch_start", "serialised", "gate_open", "batch_end")]
        assert order == sorted(order), names  # the first step (inside batch_end's batch) after the bytes were stored
        assert names.count("gate_open") == 1 and "stored_wait" in names, names


@pytest.mark.parametrize("rank, step", [(1, 12), (0, 13)], ids=["rank1-first-step", "rank0-second-step"])
def test_a_worker_lost_in_the_first_steps_of_a_call_restarts_bit_exact_every_sample_once(trainers, tmp_path, rank,
                                                                                          step):
    # Call 2 starts at global step 12 with its snapshot serialised beside it. Rank 1 dying at its first batch (rank
    # 0 still serialising, or holding its first step for the bytes) or rank 0 at its second (after it stepped once:
    # the bytes were stored) restarts call 2 from its call-start snapshot: bit-exact with a run that lost nothing.
    config = {"n": N, "batch_size": BATCH}
    clean = trainers(config=config)
    for _ in range(3):
        clean.train()
    expected = clean.state_dict()
    clean.shutdown()

    marker = str(tmp_path / "fault")
    faulty = trainers(config=dict(config, fault={"step": step, "rank": rank, "marker": marker, "exit": True}))
    faulty.train()
    stats = faulty.train()
    assert faulty.num_failures == 1 and (tmp_path / "fault").exists()
    assert stats["num_samples"] == N  # the whole epoch once
    faulty.train()  # (state_dict() before it would have taken its snapshot already: nothing to take beside it)
    events = faulty.apply_all_workers(lambda: list(call_start.EVENTS))
    assert "serialised" in [name for name, _ in events[0]], events  # the snapshot was taken beside the call
    assert torch.equal(counts(faulty), 3 * torch.ones(N))  # every sample once per epoch
    got = faulty.state_dict()
    assert got["epoch"] == expected["epoch"] == 3 and got["global_step"] == expected["global_step"]
    for key, value in expected["models"][0].items():
        assert torch.equal(got["models"][0][key], value), key
    for index, per_param in expected["optimizers"][0]["state"].items():
        for name, value in per_param.items():
            assert torch.equal(got["optimizers"][0]["state"][index][name], value), (index, name)


def weights(trainer):
    return {key: value.clone() for key, value in trainer.get_model(to_cpu=True).state_dict().items()}


def test_rank0_lost_while_serialising_restarts_bit_exact_from_a_survivors_capture(trainers, tmp_path, caplog):
    # Call 2: rank 0's serialisation waits for its first batch (the probe), and rank 0 dies just before that batch,
    # so its snapshot is never stored. No rank stepped (each waits for it), and rank 1, kept as a survivor, captured
    # the same starting state with every rank's random streams: the retry starts from it, bit-exact.
    config = {"n": N, "batch_size": BATCH}
    clean = trainers(training_operator_cls=SnapshotProbeOperator, config=config)
    for _ in range(3):
        clean.train()
    expected = weights(clean)
    clean.shutdown()

    fault = {"step": 12, "rank": 0, "marker": str(tmp_path / "fault"), "exit": True}
    faulty = trainers(training_operator_cls=SnapshotProbeOperator, config=dict(config, fault=fault))
    faulty.train()
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.execution.controller"):
        stats = faulty.train()
    assert faulty.num_failures == 1 and (tmp_path / "fault").exists() and stats["num_samples"] == N
    assert "a survivor's capture of the call's start is the restart point" in caplog.text
    assert "falls back to the previous restart point" not in caplog.text
    faulty.train()
    got = weights(faulty)
    assert torch.equal(got["p"], 3 * torch.ones(N))  # every sample once per epoch
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_rank0_lost_between_calls_restarts_from_a_survivors_capture(trainers, caplog):
    # Rank 0 dies between calls: the next call's snapshot is never stored and rank 1's capture is the restart point:
    # every sample once. (Rank 0's own random streams die with it, as they did when the snapshot preceded the
    # call; this operator's weights then differ from a run that lost nothing, on main too.)
    trainer = trainers(config={"n": N, "batch_size": BATCH})
    trainer.train()
    os.kill(trainer.apply_all_workers(os.getpid)[0], signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.execution.controller"):
        stats = trainer.train()
    assert trainer.num_failures == 1 and stats["num_samples"] == N
    assert "a survivor's capture of the call's start is the restart point" in caplog.text
    assert torch.equal(counts(trainer), 2 * torch.ones(N))


def test_the_previous_restart_point_is_dropped_once_the_calls_own_is_stored_not_at_the_calls_end(trainers, tmp_path):
    release = tmp_path / "release"
    trainer = trainers(config={"n": N, "batch_size": BATCH, "hold_until": {"step": 14, "path": str(release)}})
    trainer.train()  # the first call's point is taken before it starts; the second's beside it
    previous, results = trainer.controller.points.current, []
    call = threading.Thread(target=lambda: results.append(trainer.train()), daemon=True)
    call.start()
    try:
        deadline = time.monotonic() + 60  # every rank waits at the call's second step until released
        while trainer.controller.points.current is previous and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trainer.controller.points.current is not previous  # the old point's bytes can go
        assert call.is_alive() and not results  # while the call still trains
    finally:
        release.touch()
        call.join(60)
    assert results and results[0]["num_samples"] == N and torch.equal(counts(trainer), 2 * torch.ones(N))


def _sleep(seconds):
    time.sleep(seconds)


def test_the_gate_opens_without_a_slow_copy_but_not_without_rank0s_bytes(caplog):
    import ray  # noqa: PLC0415

    slow = ray.remote(num_cpus=0)(_sleep).remote(5)  # a copy still on its way
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.restart_points.call_start"):
        gate = call_start.Gate(call_start.SnapshotPlan(1, [ray.put({"bytes": 8}), slow], timeout_s=0.5), [optimizer],
                               rank=1)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()  # waited for rank 0's bytes, then gave up on the copy
        gate.close()
    assert "copy (part 1) was not stored within 0.5 s" in caplog.text
    gate = call_start.Gate(call_start.SnapshotPlan(2, [slow], timeout_s=0.5), [optimizer], rank=1)
    with pytest.raises(TimeoutError, match="not stored within 0.5 s"):
        optimizer.step()
    gate.close()


def test_a_capture_keeps_parameters_by_reference_copies_the_rest_and_sees_a_change_in_place():
    model = torch.nn.BatchNorm1d(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # momentum buffers exist
    streams = [{"python": [3, list(range(625)), None]}]  # made for this capture: taken as it is (not walked)
    state = {"models": [model.state_dict()], "optimizers": [optimizer.state_dict()], "epoch": 1, "rng": streams,
             "meters": [{"loss": [1.0]}]}
    capture = call_start.Capture(state, call_start.protected_storages(
        call_start.gated_tensors([model], [optimizer])), fresh=("rng",))
    assert capture.state["rng"] is streams
    assert capture.state["meters"] == state["meters"] and capture.state["meters"][0] is not state["meters"][0]
    frozen = capture.state["models"][0]
    assert frozen["weight"].data_ptr() == model.weight.data_ptr()  # a parameter: by reference
    assert frozen["running_mean"].data_ptr() != model.running_mean.data_ptr()  # a buffer: copied
    before = frozen["running_mean"].clone()
    model(torch.randn(4, 3))  # a forward moves the running statistics, not the capture's
    assert torch.equal(frozen["running_mean"], before) and capture.changed() == 0
    optimizer.step()  # what the gate holds back: the capture sees it
    assert capture.changed() > 0


def test_a_handoff_waits_for_its_token_and_says_when_the_call_failed_first():
    handoff = call_start.Handoff()
    with pytest.raises(call_start.SnapshotNotTaken, match="within 0.05 s"):
        handoff.take(1, timeout_s=0.05)
    handoff.offer(2, ValueError("setup broke"))
    with pytest.raises(call_start.SnapshotNotTaken, match="ValueError"):
        handoff.take(2, timeout_s=1)
    handoff.offer(3, "capture")
    handoff.offer(4, "newer")  # only the newest is kept
    assert handoff.take(4, timeout_s=1) == "newer"
    with pytest.raises(call_start.SnapshotNotTaken):
        handoff.take(3, timeout_s=0.05)


def _gather_on_rank(rank, world_size, init_file, out_dir):
    """One rank of a real gloo world: the random streams of each rank gathered twice, small ones (one slot) and one
    rank's too large for its slot (every rank falls back together); written to ``out_dir`` for the test."""
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        small = call_start.gather_rngs({"rank": rank, "torch": torch.get_rng_state()}, world_size)
        big = {"rank": rank, "pad": bytes(call_start.RNG_SLOT_BYTES * (rank == 1))}
        large = call_start.gather_rngs(big, world_size)
        torch.save({"small": small, "large": large}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_random_streams_of_every_rank_are_gathered_in_one_slot_or_together_fall_back(tmp_path):
    world_size = 2
    torch.multiprocessing.spawn(_gather_on_rank, args=(world_size, str(tmp_path / "init"), str(tmp_path)),
                                nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    for result in results:  # every rank holds every rank's own streams, in rank order
        assert [result["small"][rank]["rank"] for rank in range(world_size)] == [0, 1]
        assert [len(result["large"][rank]["pad"]) for rank in range(world_size)] == [0, call_start.RNG_SLOT_BYTES]
    assert torch.equal(results[0]["small"][1]["torch"], results[1]["small"][1]["torch"])
