"""Checkpoint files: atomic writes, safe loads, clear errors on damage."""
import os

import pytest
import torch

from raysgd.torch import checkpoint
from raysgd.torch.errors import CheckpointError


def state():
    return {"epoch": 3, "global_step": 30, "operator": {"best": 0.5}, "models": [torch.nn.Linear(2, 1).state_dict()],
            "optimizers": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}]}


def test_round_trip(tmp_path):
    path = checkpoint.save_state(state(), tmp_path / "ckpt")
    loaded = checkpoint.load_state(path)
    assert loaded["epoch"] == 3 and loaded["operator"] == {"best": 0.5}
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary file left


def test_truncated_and_corrupted_files_name_the_file(tmp_path):
    path = checkpoint.save_state(state(), tmp_path / "ckpt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="ckpt.*(corrupted|truncated)"):
        checkpoint.load_state(path)
    open(path, "wb").write(b"not a checkpoint at all" * 10)
    with pytest.raises(CheckpointError, match="ckpt"):
        checkpoint.load_state(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load_state(tmp_path / "missing")


def test_not_a_raysgd_checkpoint(tmp_path):
    torch.save({"weights": torch.ones(1)}, tmp_path / "other")
    with pytest.raises(CheckpointError, match="not a raysgd checkpoint"):
        checkpoint.load_state(tmp_path / "other")


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_safe_load_refuses_code_and_opt_in_allows_objects(tmp_path):
    unsafe = dict(state(), operator={"obj": Payload()})
    path = checkpoint.save_state(unsafe, tmp_path / "unsafe")
    with pytest.raises(CheckpointError, match="weights_only=False"):
        checkpoint.load_state(path)

    trusted = dict(state(), operator={"obj": complex(1, 2)})
    path = checkpoint.save_state(trusted, tmp_path / "trusted")
    assert checkpoint.load_state(path, weights_only=False)["operator"]["obj"] == complex(1, 2)


def test_crash_mid_save_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = checkpoint.save_state(state(), tmp_path / "ckpt")
    before = open(path, "rb").read()

    def crash(obj, handle):
        handle.write(b"partial")
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_state(dict(state(), epoch=4), path)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["ckpt"]


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_file_permissions_follow_the_umask(tmp_path, umask, expected):
    old = os.umask(umask)
    try:
        path = checkpoint.save_state(state(), tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert oct(os.stat(path).st_mode & 0o777) == oct(expected)


def test_folder_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    import stat

    real_fsync = os.fsync
    synced = []  # (is a directory, the checkpoint's name already in the folder)

    def spy(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), os.path.exists(tmp_path / "ckpt")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    checkpoint.save_state(state(), tmp_path / "ckpt")
    assert synced[0] == (False, False)  # the file's data, before the rename
    assert synced[-1] == (True, True)  # then the folder, once the new name is in it
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
