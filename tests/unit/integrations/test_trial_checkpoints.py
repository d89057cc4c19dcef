"""A Tune trial's checkpoint in one process (no Ray, no trial): what BaseTorchTrainable.save_checkpoint writes and
checkpoint_state reads back. Trials that save and restore are tested in tests/api/test_tune.py."""
import os
import types

import pytest
import torch

pytest.importorskip("ray.tune")

from raysgd.torch.errors import CheckpointError  # noqa: E402 (after the skip)
from raysgd.torch.integrations import tune as raysgd_tune  # noqa: E402


class Trainer:
    """What save_checkpoint reads of the trial's trainer: its state."""

    def state_dict(self):
        return {"epoch": 2, "models": [{"weight": torch.ones(2)}], "optimizers": [{}]}


def saved_trial_checkpoint(directory):
    trial = types.SimpleNamespace(trainer=Trainer(), training_iteration=3)
    raysgd_tune.BaseTorchTrainable.save_checkpoint(trial, str(directory))
    return directory


def test_checkpoint_state_reads_the_directory_tune_hands_load_checkpoint(tmp_path):
    directory = saved_trial_checkpoint(tmp_path / "checkpoint_000002")
    assert sorted(os.listdir(directory)) == [raysgd_tune.MARKER_FILE, raysgd_tune.CHECKPOINT_FILE]
    # the directory (result.checkpoint.path, load_checkpoint's argument) raised "is a directory"
    for path in (directory, str(directory), directory / raysgd_tune.CHECKPOINT_FILE):
        state = raysgd_tune.checkpoint_state(path, weights_only=False)
        assert state["epoch"] == 2 and torch.equal(state["models"][0]["weight"], torch.ones(2))
    assert raysgd_tune.checkpoint_state(directory)["epoch"] == 2  # safe by default


def test_checkpoint_state_checks_the_directory_against_its_marker(tmp_path):
    directory = saved_trial_checkpoint(tmp_path / "checkpoint_000002")
    with open(directory / raysgd_tune.CHECKPOINT_FILE, "r+b") as handle:
        handle.seek(-8, os.SEEK_END)
        handle.write(b"damaged!")
    with pytest.raises(CheckpointError, match="checkpoint_000002"):
        raysgd_tune.checkpoint_state(directory)
    with pytest.raises(CheckpointError, match="is a directory without checkpoint.json or trainer.checkpoint"):
        raysgd_tune.checkpoint_state(tmp_path)
