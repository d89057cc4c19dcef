"""Result logs without Tune: CSV rows and TensorBoard scalars for every train()/validate() result."""
import glob
import importlib.util
import os
import struct

import pytest

from helpers import LinearOperator
from raysgd import TorchTrainer
from raysgd.torch.integrations.results import ResultLogger, open_result_log, read_results


def read_scalars(logdir):
    """``{tag: [(step, value), ...]}`` from the TensorBoard event files in ``logdir`` (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as handle:
            data = handle.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_rows_steps_and_new_columns(tmp_path):
    log = ResultLogger(tmp_path, tensorboard=False)
    log.log("validate", {"val_loss": 2.0})  # before any training: step 0
    log.log("train", {"num_samples": 10, "train_loss": 1.5, "profile": {"mean_fwd_s": 0.01}})
    log.log("train", {"num_samples": 10, "train_loss": 0.75, "extra": 3})  # a new metric widens the file
    log.log("validate", {"val_loss": 0.5})
    log.close()
    train = read_results(tmp_path, "train")
    assert [row["step"] for row in train] == [1, 2]
    assert train[0]["profile/mean_fwd_s"] == 0.01 and train[0]["extra"] is None
    assert train[1]["train_loss"] == 0.75 and train[1]["extra"] == 3
    assert [(row["step"], row["val_loss"]) for row in read_results(tmp_path, "validate")] == [(0, 2.0), (2, 0.5)]
    with open(tmp_path / "train.csv") as handle:
        assert handle.readline().strip() == "step,time,num_samples,train_loss,profile/mean_fwd_s,extra"
    assert not glob.glob(str(tmp_path / "events.out.tfevents.*"))


def test_an_existing_log_is_continued(tmp_path):
    first = ResultLogger(tmp_path, tensorboard=False)
    first.log("train", {"train_loss": 1.0})
    first.close()
    second = ResultLogger(tmp_path, tensorboard=False)
    second.log("train", {"train_loss": 0.5})
    second.log("validate", {"val_loss": 0.25})
    assert [(r["step"], r["train_loss"]) for r in read_results(tmp_path, "train")] == [(1, 1.0), (2, 0.5)]
    assert read_results(tmp_path, "validate")[0]["step"] == 2


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX (the logging extra) is not installed")
    log = ResultLogger(tmp_path)
    assert log.tensorboard
    log.log("train", {"train_loss": 0.5, "num_samples": 8, "note": "text is CSV only"})
    log.log("train", {"train_loss": 0.25, "num_samples": 8, "note": "x"})
    log.log("validate", {"val_loss": 0.125})
    log.close()
    scalars = read_scalars(tmp_path)
    assert scalars["train/train_loss"] == [(1, 0.5), (2, 0.25)]
    assert scalars["validate/val_loss"] == [(2, 0.125)]
    assert "train/note" not in scalars and "train/step" not in scalars


def test_bad_arguments_name_what_was_given(tmp_path):
    with pytest.raises(TypeError, match=r"TorchTrainer\(logdir=...\) expects a directory path.*got 3"):
        open_result_log(3)
    with pytest.raises(ValueError, match=r"tensorboard=...\) expects 'auto', True or False; got 'yes'"):
        ResultLogger(tmp_path, tensorboard="yes")
    log = ResultLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match=r"phase=...\) expects one of .*got 'test'"):
        log.log("test", {})
    with pytest.raises(TypeError, match="expects a dict of metrics; got list"):
        log.log("train", [1.0])


def test_trainer_logdir_rows_equal_returned_metrics(ray_2cpus, tmp_path):
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, use_local=True, timeout_s=60,
                           logdir=tmp_path, config={"data_size": 100, "batch_size": 10})
    try:
        returned = [trainer.train(), trainer.train(profile=True)]
        per_worker = trainer.train(reduce_results=False)
        validated = trainer.validate()
    finally:
        trainer.shutdown()
    train_rows, val_rows = read_results(tmp_path, "train"), read_results(tmp_path, "validate")
    assert len(train_rows) == 3 and len(val_rows) == 1
    for row, result in zip(train_rows, returned):
        for key, value in result.items():
            if isinstance(value, dict):
                for inner, inner_value in value.items():
                    assert row[f"{key}/{inner}"] == inner_value
            else:
                assert row[key] == value, key
    assert train_rows[2]["num_samples"] == sum(w["num_samples"] for w in per_worker) == 100  # logged reduced
    assert {k: v for k, v in val_rows[0].items() if k not in ("step", "time")} == validated
    assert val_rows[0]["step"] == 3
    if importlib.util.find_spec("tensorboardX") is not None:
        assert len(read_scalars(tmp_path)["train/train_loss"]) == 3
