"""Sharded models' state (``TorchTrainer(strategy="fsdp")``): commits, call-start restart points and durable
checkpoints hold one DCP part per rank, kept on the ranks' nodes, and load resharded on any number of workers: a
killed worker resumes from the sharded commit exactly once and bit-exact at the same size; a checkpoint written by
2 workers resumes the same epoch on 3, every sample once.

``CountingOperator``'s ``p[i]`` counts how often sample ``i`` was trained (a parameter of 96 entries, sharded over
the ranks); its small ``lin`` layer draws dropout from each rank's own stream, so a resume that put a stream back
wrong would differ.
"""
import os

import pytest
import torch

from helpers import (BatchNormOperator, CountingOperator, buffers_of, counts, executed, kill_after_commit, seeding_hook,
                     stored_commit)
from raysgd.torch.operator import fsdp
from raysgd.torch.storage import filesystem
from s3_server import moto_s3

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
