"""WandbLogger offline (nothing leaves the machine): a 2-worker run's config and metrics read back from wandb's own
transaction log (``run-<id>.wandb``), each epoch once; a second trainer on the same storage_path continues the
same run id without logging a step twice. A driver SIGKILLed mid-run that runs again continues the same run: that
case is tests/cluster/integrations/test_mlflow.py's driver-kill test, whose driver logs to both trackers (one killed driver, not two)."""
import glob
import os
import pickle
import sys
import time
import types

import pytest

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

from helpers import LinearOperator  # noqa: E402
from raysgd import optional  # noqa: E402
from raysgd.loggers import WandbLogger  # noqa: E402
from raysgd.torch.integrations.wandb_logger import read_offline_history, read_records  # noqa: E402
from raysgd.torch.storage import filesystem as storage  # noqa: E402

WRITE_TIMEOUT_S = 60
CONFIG = {"lr": 0.01, "data_size": 40, "batch_size": 10, "nested": {"momentum": 0.0}}


def use_offline_wandb(monkeypatch, tmp_path):
    """wandb offline and quiet: no network, no git, no console capture, its settings in a tmp folder."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off", "WANDB_API_KEY": "",
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}.items():
        if value:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path):
    use_offline_wandb(monkeypatch, tmp_path)


def segments(folder, run_id=None, finished=None, timeout_s=WRITE_TIMEOUT_S):
    """The offline segments (transaction logs) under ``folder``, oldest first: one per ``wandb.init``.

    ``finished=n``: wait (up to ``timeout_s``) until there are ``n`` and each ends with its ``exit`` record:
    wandb-core writes the log on its own after ``run.finish()`` returns."""
    pattern = os.path.join(folder, "wandb", f"offline-run-*-{run_id or '*'}", "run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        paths = sorted(glob.glob(pattern))
        if finished is None or (len(paths) == finished and all(ends_with_exit(path) for path in paths)):
            return paths
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {finished} finished wandb logs in {folder}; "
                                 f"{[(p, ends_with_exit(p)) for p in paths]}")
        time.sleep(0.1)


def ends_with_exit(path):
    kinds = [r.WhichOneof("record_type") for r in read_records(path, wandb_internal_pb2.Record)]
    return bool(kinds) and kinds[-1] == "exit"


def rows(paths):
    """Every history row of the segments, in order."""
    return [row for path in paths for row in read_offline_history(path)]


def run_records(path):
    return [r.run for r in read_records(path, wandb_internal_pb2.Record) if r.WhichOneof("record_type") == "run"]


def history(all_rows, key):
    return [(row["_step"], row[key]) for row in all_rows if key in row]


def test_bad_arguments_and_a_missing_wandb_are_clear_errors(monkeypatch):
    with pytest.raises(TypeError, match="WandbLogger: tags expects None or a list of str; got 'a'"):
        WandbLogger(tags="a")
    with pytest.raises(TypeError, match="WandbLogger: project expects a non-empty str; got ''"):
        WandbLogger(project="")
    with pytest.raises(TypeError, match="WandbLogger: mode expects None, 'online', 'offline' or 'disabled'"):
        WandbLogger(mode="offline ")
    with pytest.raises(TypeError, match="WandbLogger: log_checkpoints expects True or False; got 1"):
        WandbLogger(log_checkpoints=1)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r'WandbLogger needs wandb, .*: pip install "raysgd\[wandb\]"') as info:
        WandbLogger()
    assert isinstance(info.value, optional.MissingExtra) and info.value.extra == "wandb"


@pytest.mark.usefixtures("ray_2cpus")
def test_a_run_logs_config_and_every_epoch_once_and_a_second_trainer_continues_it_without_logging_a_step_twice(
        trainer_factory, tmp_path, caplog):
    """The first trainer logs its config and epochs 1-3 (train and validate, checkpoints as artifacts), each epoch
    once; its newest checkpoint (epoch 3) is then damaged, so the second resumes from epoch 2's and trains epoch 3
    again: that step is in the run already and is not logged again. (One first trainer for both checks: each
    trainer start is ~3 s of worker start-up.)"""
    path, runs = str(tmp_path / "storage"), tmp_path / "wandb-runs"
    first_logger = WandbLogger(project="linear", name="two-workers", mode="offline", dir=runs, tags=["sgd"],
                               group="tests", log_checkpoints=True)
    first = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG, storage_path=path,
                            callbacks=[first_logger])
    losses, val_losses = [], []
    for _ in range(3):
        losses.append(first.train()["train_loss"])
        val_losses.append(first.validate()["val_loss"])
        first.controller.durable.flush(timeout_s=60)  # each epoch's checkpoint, with the run id in its marker
    first.shutdown()
    assert first_logger.run is None  # finished
    (first_path,) = segments(runs, first_logger.run_id, finished=1)
    (run,) = run_records(first_path)
    assert run.run_id == first_logger.run_id and run.project == "linear" and run.display_name == "two-workers"
    assert list(run.tags) == ["sgd"] and run.run_group == "tests"
    config = {item.key: item.value_json for item in run.config.update}
    assert config["lr"] == "0.01" and config["batch_size"] == "10" and '"momentum":0' in config["nested"]
    before = rows([first_path])
    assert [row["_step"] for row in before] == [1, 2, 3]  # one row per epoch: train and validate together
    assert history(before, "train/train_loss") == [(1, losses[0]), (2, losses[1]), (3, losses[2])]
    assert history(before, "validate/val_loss") == [(1, val_losses[0]), (2, val_losses[1]), (3, val_losses[2])]
    assert [step for step, _ in history(before, "train/num_samples")] == [1, 2, 3]
    kinds = [r.WhichOneof("record_type") for r in read_records(first_path, wandb_internal_pb2.Record)]
    assert "artifact" in kinds and kinds[-1] == "exit"  # the checkpoints, then finished

    checkpoints = storage.CheckpointStorage(path).list()
    newest = os.path.join(checkpoints[-1][1], storage.STATE_FILE)
    with open(newest, "r+b") as handle:
        handle.truncate(os.path.getsize(newest) // 2)
    second_logger = WandbLogger(project="linear", mode="offline", dir=runs)
    with caplog.at_level("INFO", logger="raysgd.torch.integrations.wandb_logger"):
        second = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG,
                                 storage_path=path, callbacks=[second_logger])
        assert second_logger.run_id == first_logger.run_id  # from the checkpoint's marker
        assert second.train()["epoch"] == 3
        second.validate()
        assert second.train()["epoch"] == 4
        second.validate()
        second.shutdown()
    assert "already holds step 3" in caplog.text and "Continuing wandb run" in caplog.text
    paths = segments(runs, finished=2)
    assert len(paths) == 2 and all(f"-{first_logger.run_id}" in p for p in paths)  # one run, two segments
    assert [r.run_id for p in paths for r in run_records(p)] == [first_logger.run_id] * 2
    all_rows = rows(paths)
    assert [row["_step"] for row in all_rows] == [1, 2, 3, 4]  # every step once
    assert history(all_rows, "train/train_loss")[:3] == history(before, "train/train_loss")  # the first values stay
    assert [step for step, _ in history(all_rows, "validate/val_loss")] == [1, 2, 3, 4]


def test_a_step_below_the_runs_is_skipped_with_a_warning_not_an_error(tmp_path, caplog):
    """After an older state is loaded (``trainer.load``) the epoch goes back: wandb takes no step below its
    current one, so the logger says so and logs nothing for it (the hooks are called directly: only
    ``trainer.config`` is read)."""
    logger = WandbLogger(project="steps", mode="offline", dir=tmp_path)
    trainer = types.SimpleNamespace(config={"lr": 0.5})
    with caplog.at_level("WARNING", logger="raysgd.torch.integrations.wandb_logger"):
        for epoch, loss in [(1, 3.0), (2, 2.0), (3, 1.0), (2, 9.0), (4, 0.5)]:
            logger.on_train_result(trainer, {"epoch": epoch, "train_loss": loss})
            logger.on_validate_result(trainer, {"val_loss": loss + 1})
        logger.on_shutdown(trainer)
    assert "the train result of step 2 is not logged" in caplog.text
    assert "the validate result of step 2 is not logged" in caplog.text
    all_rows = rows(segments(tmp_path, logger.run_id, finished=1))
    assert history(all_rows, "train/train_loss") == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.5)]
    assert history(all_rows, "validate/val_loss") == [(1, 4.0), (2, 3.0), (3, 2.0), (4, 1.5)]


def test_a_logger_is_picklable_for_tune_trials(tmp_path):
    logger = WandbLogger(project="pickled", mode="offline", dir=tmp_path, tags=["a"])
    copy = pickle.loads(pickle.dumps(logger))
    assert copy.tags == ["a"] and copy.dir == str(tmp_path) and copy.run is None and copy.mode == "offline"
