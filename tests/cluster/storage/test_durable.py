"""Durable runs on a real cluster: automatic checkpoints in storage_path, resume, fallback, S3, Tune's format."""
import logging
import os
import shutil
import threading
import time

import pytest
import torch

from conftest import assert_released
from helpers import LinearOperator
from raysgd.torch.storage import filesystem as storage
from raysgd.torch.errors import CheckpointError
from raysgd.torch.integrations.results import read_results
from s3_server import moto_s3

CONFIG = {"lr": 0.05, "momentum": 0.9, "batch_size": 8, "data_size": 32}


def weights(trainer):
    return {key: value.clone() for key, value in trainer.get_model(to_cpu=True).state_dict().items()}


def assert_same(first, second):
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_bad_storage_arguments_fail_before_any_actor_starts(ray_2cpus, trainer_factory):
    with pytest.raises(ValueError, match="storage_path expects a local folder or a URI"):
        trainer_factory(training_operator_cls=LinearOperator, storage_path="nosuchfs://bucket/run")
    with pytest.raises(ValueError, match="num_to_keep expects an int >= 1"):
        trainer_factory(training_operator_cls=LinearOperator, storage_path="/tmp/x", num_to_keep=-1)
    assert_released()


def test_second_trainer_continues_from_the_first(ray_2cpus, trainer_factory, tmp_path, caplog):
    path, logdir = str(tmp_path / "run"), str(tmp_path / "logs")
    first = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG, storage_path=path,
                            logdir=logdir)
    assert [first.train()["epoch"] for _ in range(2)] == [1, 2]
    final = weights(first)
    first.shutdown()  # flushes the upload of epoch 2
    assert storage.CheckpointStorage(path).latest().marker["epoch"] == 2

    with caplog.at_level(logging.INFO, logger="raysgd.torch.storage.durable"):
        second = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG,
                                 storage_path=path, logdir=logdir, num_to_keep=1)
    assert "Resuming from" in caplog.text and "checkpoint_000002" in caplog.text
    assert_same(weights(second), final)
    assert second.state_dict()["epoch"] == 2
    assert second.train()["epoch"] == 3
    second.save(str(tmp_path / "saved.pt"))  # save() writes a checkpoint too
    second.shutdown()
    restored = storage.CheckpointStorage(path).latest()
    assert restored.marker["reason"] == "save" and restored.marker["epoch"] == 3
    assert len(storage.CheckpointStorage(path).list()) == 1  # num_to_keep=1
    assert [row["epoch"] for row in read_results(logdir)] == [1, 2, 3]

    fresh = trainer_factory(training_operator_cls=LinearOperator, num_workers=1, config=CONFIG, storage_path=path,
                            resume=False)
    assert fresh.train()["epoch"] == 1


def test_truncated_newest_uses_the_previous_checkpoint(ray_2cpus, trainer_factory, tmp_path, caplog):
    path = str(tmp_path / "run")
    trainer = trainer_factory(training_operator_cls=LinearOperator, config=CONFIG, storage_path=path)
    trainer.train()
    trainer.controller.durable.flush(timeout_s=60)
    after_one = weights(trainer)
    trainer.train()
    trainer.shutdown()
    newest = os.path.join(storage.CheckpointStorage(path).list()[-1][1], storage.STATE_FILE)
    with open(newest, "r+b") as handle:
        handle.truncate(os.path.getsize(newest) // 2)
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.storage.filesystem"):
        resumed = trainer_factory(training_operator_cls=LinearOperator, config=CONFIG, storage_path=path)
    assert "checkpoint_000002" in caplog.text and "damaged" in caplog.text
    assert_same(weights(resumed), after_one)
    assert resumed.train()["epoch"] == 2


def test_s3_round_trip_through_a_trainer(ray_2cpus, trainer_factory):
    with moto_s3() as (bucket, query):
        uri = f"{bucket}/exp{query}"
        first = trainer_factory(training_operator_cls=LinearOperator, config=CONFIG, storage_path=uri)
        first.train()
        final = weights(first)
        first.shutdown()
        second = trainer_factory(training_operator_cls=LinearOperator, config=CONFIG, storage_path=uri)
        assert_same(weights(second), final)
        assert second.train()["epoch"] == 2
        second.shutdown()


def test_tune_checkpoint_has_the_storage_format(ray_2cpus, trainer_factory, tmp_path):
    pytest.importorskip("ray.tune")
    from raysgd.torch.integrations import tune as raysgd_tune

    assert raysgd_tune.CHECKPOINT_FILE == storage.STATE_FILE and raysgd_tune.MARKER_FILE == storage.MARKER_FILE
    trainer = trainer_factory(training_operator_cls=LinearOperator, config=CONFIG)
    trainer.train()
    trainable = object.__new__(raysgd_tune.BaseTorchTrainable)  # no Tune run needed for save/load
    trainable._trainer, trainable._iteration = trainer, 1
    trainable.save_checkpoint(str(tmp_path))
    stream, marker = storage.read_checkpoint_dir(*storage.resolve(str(tmp_path)))
    assert marker["epoch"] == 1 and marker["reason"] == "tune"
    saved = weights(trainer)
    trainer.train()
    trainable.load_checkpoint(str(tmp_path))
    assert_same(weights(trainer), saved)
    with open(tmp_path / storage.STATE_FILE, "r+b") as handle:  # damaged: refused with the file named
        handle.truncate(100)
    with pytest.raises(storage.DamagedCheckpoint, match="damaged"):
        trainable.load_checkpoint(str(tmp_path))


def test_shutdown_raises_a_failed_upload_and_load_takes_a_checkpoint_directory(ray_2cpus, trainer_factory,
                                                                                  tmp_path):
    run = tmp_path / "run"
    trainer = trainer_factory(training_operator_cls=LinearOperator, config=CONFIG, storage_path=str(run),
                              use_local=True)
    trainer.train()
    trainer.controller.durable.flush(timeout_s=60)
    stored = storage.CheckpointStorage(str(run), 2).list()[-1][1]
    expected = weights(trainer)
    trainer.load(stored)  # a checkpoint directory (it used to say that the directory "does not exist")
    assert_same(weights(trainer), expected)
    with pytest.raises(CheckpointError, match="is a directory without checkpoint.json"):
        trainer.load(str(tmp_path))
    for entry in run.iterdir():  # the storage is gone under the run: a file where its folder was
        shutil.rmtree(entry)
    run.rmdir()
    run.write_text("not a folder")
    trainer.train()  # its checkpoint upload fails on the writer thread
    with pytest.raises(CheckpointError, match="asynchronous checkpoint write failed") as info:
        trainer.shutdown()  # it used to log a warning and return
    causes, error = [], info.value
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(isinstance(cause, NotADirectoryError) for cause in causes), causes  # the storage's own error
    assert_released()


def test_closing_a_durable_run_gives_up_on_a_stuck_upload_at_its_deadline(tmp_path, monkeypatch):
    """A storage write that never returns (a hung network mount, which cannot be made here: a blocked write
    stands in for it) ends ``close()`` with a TimeoutError naming the checkpoint, after SGD_CHECKPOINT_FLUSH_S."""
    from raysgd.torch.storage import durable

    run, release = durable.open_run(str(tmp_path / "run")), threading.Event()
    run.storage.write = lambda stream, meta: release.wait(60)
    run.submit(b"state", epoch=3)
    monkeypatch.setenv("SGD_CHECKPOINT_FLUSH_S", "0.5")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="checkpoint of epoch 3"):
        run.close()
    assert time.monotonic() - start < 10
    release.set()


def test_a_checkpoint_a_safe_load_refuses_stops_the_resume_with_what_to_do(ray_2cpus, trainer_factory, tmp_path):
    """The workers load the resumed state safely (it never passes through the driver): a state holding a class is
    refused there, and the error names the checkpoint and the ways out."""
    from raysgd.torch.state.checkpoint import state_to_bytes

    first = trainer_factory(training_operator_cls=LinearOperator, config=CONFIG)
    unsafe = {**first.state_dict(), "operator": {"obj": threading.Lock}}  # a class: a safe load refuses it
    first.shutdown()
    path = str(tmp_path / "run")
    storage.CheckpointStorage(path).write(state_to_bytes(unsafe), {"epoch": 0})
    with pytest.raises(CheckpointError, match="cannot be resumed from.*resume=False"):
        trainer_factory(training_operator_cls=LinearOperator, config=CONFIG, storage_path=path)
    assert_released()
