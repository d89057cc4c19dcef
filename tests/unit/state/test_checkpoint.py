"""Checkpoint files: atomic writes, safe loads, clear errors on damage."""
import os

import pytest
import torch

from raysgd.torch.state import checkpoint
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


def _write_not_checkpoints(folder):
    """``{name: path}``: files a user may pass to load() by mistake, none of them a raysgd checkpoint."""
    import pickle
    import zipfile

    made = {}

    def put(name, write):
        made[name] = str(folder / name)
        write(made[name])

    put("notes.txt", lambda p: open(p, "w").write("epoch 3 went well\nnext: lower the lr\n"))
    put("empty-dict.pkl", lambda p: pickle.dump({}, open(p, "wb")))
    put("list.pkl", lambda p: pickle.dump([1, 2, 3], open(p, "wb")))
    put("empty", lambda p: open(p, "wb").close())
    put("archive.zip", lambda p: zipfile.ZipFile(p, "w").writestr("notes.txt", "hello"))
    put("torch-list.pt", lambda p: torch.save([torch.ones(1)], p))
    put("torch-weights.pt", lambda p: torch.save(torch.nn.Linear(2, 1).state_dict(), p))  # a model's, not ours
    put("torch-tensor.pt", lambda p: torch.save(torch.ones(3), p))
    return made


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_file_that_is_not_a_checkpoint_is_named_and_called_so(tmp_path, weights_only):
    """A text file gave a raw ``KeyError: 101``; a pickle of ``{}`` said to trust it with weights_only=False."""
    for name, path in _write_not_checkpoints(tmp_path).items():
        with pytest.raises(CheckpointError) as info:
            checkpoint.load_state(path, weights_only=weights_only)
        message = str(info.value)
        assert name in message and "not a raysgd checkpoint" in message, (name, message)
        assert "weights_only=False" not in message, (name, message)  # never "trust it" for a foreign file


def test_bytes_that_are_not_a_state_get_the_same_error():
    import pickle

    for stream in (b"", b"hello", pickle.dumps({}), checkpoint.state_to_bytes({"epoch": 1}),
                   checkpoint.state_to_bytes({"epoch": 1, "models": "weights", "optimizers": []})):
        with pytest.raises(CheckpointError, match="my bytes.*not a raysgd checkpoint"):
            checkpoint.read_state(__import__("io").BytesIO(stream), "my bytes", trust_hint="")


def test_1x_checkpoint_formats_still_load(tmp_path):
    """What RaySGD 1.x's save() wrote: torch.save of the runner state (zip format, or the legacy one of old torch),
    with the 1.x apex key ``amp``; and a file without the newer optional keys."""
    legacy = {"epoch": 2, "operator": None, "models": [torch.nn.Linear(2, 1).state_dict()],
              "optimizers": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}], "amp": {}}
    torch.save(legacy, tmp_path / "zip.checkpoint")
    torch.save(legacy, tmp_path / "old.checkpoint", _use_new_zipfile_serialization=False)
    for name in ("zip.checkpoint", "old.checkpoint"):
        loaded = checkpoint.load_state(tmp_path / name)
        assert loaded["epoch"] == 2 and torch.equal(loaded["models"][0]["weight"], legacy["models"][0]["weight"])
    truncated = open(tmp_path / "old.checkpoint", "rb").read()
    open(tmp_path / "old.checkpoint", "wb").write(truncated[: len(truncated) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):  # a damaged torch file stays "damaged"
        checkpoint.load_state(tmp_path / "old.checkpoint")


@pytest.mark.parametrize("name, error, said", [
    ("folder", IsADirectoryError, "got '{tmp}/folder', a folder"),
    ("new/", IsADirectoryError, "got '{tmp}/new/', a folder"),
    ("", ValueError, "got ''")])
def test_a_path_that_is_no_file_is_refused_naming_the_argument(tmp_path, name, error, said):
    (tmp_path / "folder").mkdir()
    path = f"{tmp_path}/{name}" if name else name
    with pytest.raises(error) as raised:
        checkpoint.save_state(state(), path)
    assert str(raised.value).startswith("TorchTrainer.save: checkpoint_path expects the path of a file to write")
    assert str(raised.value).endswith(said.format(tmp=tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["folder"] and os.listdir(tmp_path / "folder") == []  # nothing written


def test_a_uri_is_refused_not_written_to_a_local_folder_named_after_its_scheme(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^TorchTrainer.save: checkpoint_path expects a local file path: .*; "
                                         r"got 's3://bucket/model.pt'$"):
        checkpoint.save_state(state(), "s3://bucket/model.pt")
    assert os.listdir(tmp_path) == []  # no folder 's3:' here
