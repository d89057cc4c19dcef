"""raysgd.train's Checkpoint and Result as Ray Train 2.x's: a checkpoint's folder, metadata, pickling and copies
(local, and in a real S3 server, moto, for the remote paths), and a run folder read back as a Result (its metrics as
reported, its best checkpoints). No Ray cluster: the run folders are written as a run writes them.
"""
import json
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from raysgd.base.checks import plain_json
from raysgd.train import Checkpoint, CheckpointConfig, Result
from raysgd.train.retention import checkpoints_to_delete
from train_functions import RunFolder


# ------------------------------------------------------------------------------------------------------ checkpoint
def test_checkpoint_from_a_missing_folder_is_refused_at_once(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"from_directory\(path=...\) expects an existing local directory; "
                                                r"got '.*/nope', which does not exist"):
        Checkpoint.from_directory(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"expects a directory; got '.*/file', a file"):
        Checkpoint.from_directory(str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"expects a local directory; got the URI 's3://b/c': use Checkpoint"):
        Checkpoint.from_directory("s3://b/c")
    with pytest.raises(TypeError, match=r"expects a local directory \(str\); got int 3"):
        Checkpoint.from_directory(3)


def test_a_local_checkpoint_prints_as_ray_keeps_metadata_and_pickles(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"w")
    checkpoint = Checkpoint.from_directory(tmp_path)
    assert repr(checkpoint) == f"Checkpoint(filesystem=local, path={tmp_path})"
    assert checkpoint.path == str(tmp_path) and checkpoint.filesystem.type_name == "local" and checkpoint.is_local
    assert checkpoint.get_metadata() == {}
    checkpoint.set_metadata({"epoch": 1, "tags": ["a"]})
    checkpoint.update_metadata({"epoch": 2, "lr": 0.1})
    assert checkpoint.get_metadata() == {"epoch": 2, "tags": ["a"], "lr": 0.1}
    assert json.loads((tmp_path / ".metadata.json").read_text()) == checkpoint.get_metadata()
    with pytest.raises(TypeError, match=r"set_metadata\(metadata=...\) expects a dict that JSON can write"):
        checkpoint.set_metadata({"model": torch.nn.Linear(1, 1)})
    with pytest.raises(TypeError, match=r"update_metadata\(metadata=...\) expects a dict; got list"):
        checkpoint.update_metadata([1])
    assert checkpoint.get_metadata()["epoch"] == 2  # a refused update changes nothing
    copy = pickle.loads(pickle.dumps(checkpoint))
    assert copy == checkpoint and copy.get_metadata() == checkpoint.get_metadata()
    copied = checkpoint.to_directory(tmp_path.parent / "copy")
    assert sorted(os.listdir(copied)) == [".metadata.json", "model.pt"] and Checkpoint(copied) != checkpoint
    with pytest.raises(TypeError, match="A Checkpoint is not a path"):
        os.fspath(checkpoint)
    with pytest.raises(ValueError, match="with a filesystem the path is a path inside it"):
        Checkpoint("s3://b/c", filesystem=checkpoint.filesystem)
    assert Checkpoint(str(tmp_path), filesystem=checkpoint.filesystem) == checkpoint


def test_to_directory_onto_the_checkpoint_itself_or_to_no_local_path(tmp_path, monkeypatch):
    """to_directory(checkpoint.path) raised shutil.Error with a message spelt out letter by letter; a path that is
    no local directory is refused naming the argument."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights")
    checkpoint = Checkpoint.from_directory(folder)
    assert checkpoint.to_directory(str(folder) + "/") == str(folder)
    assert (folder / "model.pt").read_bytes() == b"weights"
    copy = tmp_path / "copy"
    assert checkpoint.to_directory(f"file://{copy}") == str(copy) and (copy / "model.pt").read_bytes() == b"weights"
    monkeypatch.chdir(copy)
    assert checkpoint.to_directory("") == str(copy)  # the working directory, as in Ray Train
    with pytest.raises(TypeError, match=r"to_directory\(path=...\) expects None or a local directory; got int 3"):
        checkpoint.to_directory(3)
    with pytest.raises(ValueError, match=r"to_directory\(path=...\) expects None or a local directory; got 's3://b/c'"):
        checkpoint.to_directory("s3://b/c")


def test_a_checkpoint_in_s3_has_rays_path_and_filesystem_keeps_metadata_and_reads_back(tmp_path):
    """On a real S3-compatible server (moto): the path inside the filesystem as Ray prints it, the URI's endpoint kept
    in the filesystem, metadata written and read there, a run folder read back by Result.from_path."""
    from s3_server import moto_s3

    source = tmp_path / "reported"
    source.mkdir()
    (source / "model.pt").write_bytes(b"weights")
    Checkpoint.from_directory(source).set_metadata({"source": "local"})
    with moto_s3() as (prefix, query):
        folder = RunFolder(f"{prefix}/runs{query}", "exp")
        folder.check_writable()
        first = folder.write(str(source), {"metrics": {"loss": 0.5, "epoch": 0}})
        second = folder.write(str(source), {"metrics": {"loss": 0.25, "epoch": 1}})
        checkpoint = Checkpoint(second)
        bucket = prefix[len("s3://"):]
        assert checkpoint.path == f"{bucket}/runs/exp/checkpoint_000002" and checkpoint.uri == second
        assert repr(checkpoint) == f"Checkpoint(filesystem=s3, path={bucket}/runs/exp/checkpoint_000002)"
        assert checkpoint.get_metadata() == {"source": "local"} and not checkpoint.is_local
        checkpoint.update_metadata({"epoch": 1})
        again = pickle.loads(pickle.dumps(checkpoint))  # the filesystem (its endpoint) travels with it
        assert again.get_metadata() == {"source": "local", "epoch": 1}
        with again.as_directory() as local:
            assert open(os.path.join(local, "model.pt"), "rb").read() == b"weights"
        result = Result.from_path(f"{prefix}/runs/exp{query}")
        assert result.path == f"{bucket}/runs/exp" and result.filesystem.type_name == "s3"
        assert result.metrics == {"loss": 0.25, "epoch": 1}  # as reported: no key added
        assert [c.uri for c, _ in result.best_checkpoints] == [first, second] and result.checkpoint == checkpoint
        assert result.get_best_checkpoint("loss", "max") == Checkpoint(first)
        assert "filesystem='s3'" in repr(result)


# ---------------------------------------------------------------------------------------------------------- result
def run_folder(tmp_path, *metrics):
    """A run folder ``tmp_path/runs/exp`` with one complete checkpoint per metrics dict (written as reports are)."""
    folder = RunFolder(str(tmp_path / "runs"), "exp")
    folder.check_writable()
    source = tmp_path / "source"
    source.mkdir(exist_ok=True)
    (source / "state.pt").write_bytes(b"s")
    return folder, [folder.write(str(source), {"metrics": m, "cursors": []}) for m in metrics]


def test_result_from_path_reads_a_run_folder_with_metrics_as_reported(tmp_path):
    folder, uris = run_folder(tmp_path, {"loss": 0.5, "val": {"acc": 0.6}}, {"loss": 0.3, "val": {"acc": 0.9}},
                              {"loss": 0.4, "val": {"acc": 0.7}})
    os.makedirs(folder.path + "/checkpoint_000004")  # a copy that never finished: not a checkpoint
    result = Result.from_path(folder.path)
    assert result.metrics == {"loss": 0.4, "val": {"acc": 0.7}} and result.checkpoint == Checkpoint(uris[-1])
    assert result.path == folder.path and result.filesystem.type_name == "local" and result.error is None
    assert [c.path for c, _ in result.best_checkpoints] == uris  # by age without a config
    assert result.get_best_checkpoint("loss", "min") == Checkpoint(uris[1])
    assert result.get_best_checkpoint("val/acc", "max") == Checkpoint(uris[1])
    scored = Result.from_path(folder.path + "/", checkpoint_config=CheckpointConfig(
        num_to_keep=2, checkpoint_score_attribute="val/acc"))
    assert [c.path for c, _ in scored.best_checkpoints] == [uris[2], uris[1]]  # the best 2, best last
    frame = scored.metrics_dataframe
    assert list(frame["loss"]) == [0.4, 0.3] and len(frame) == 2
    with pytest.raises(RuntimeError, match=r"run folder .*/runs/other does not exist"):
        Result.from_path(tmp_path / "runs" / "other")
    os.makedirs(tmp_path / "runs" / "empty")
    with pytest.raises(RuntimeError, match=r"holds no complete checkpoint"):
        Result.from_path(tmp_path / "runs" / "empty")
    with pytest.raises(NotImplementedError, match=r"storage_filesystem=...\) is not supported"):
        Result.from_path(folder.path, storage_filesystem=result.filesystem)


def test_a_run_folder_named_by_a_relative_or_home_path_is_read_and_restored(tmp_path, monkeypatch):
    """Result.from_path and TorchTrainer.restore read "~/..." and a relative path as the run's storage does
    (RunConfig(storage_path="~/runs") writes to $HOME/runs); a path that is no path is refused naming it."""
    from raysgd.train.torch import TorchTrainer

    monkeypatch.setenv("HOME", str(tmp_path))
    folder, uris = run_folder(tmp_path, {"loss": 0.5})
    assert Result.from_path("~/runs/exp").checkpoint == Checkpoint(uris[0])
    monkeypatch.chdir(tmp_path / "runs" / "exp")
    for path in ("~/runs/exp", "~/runs/exp/", ".", "../exp", f"file://{folder.path}"):
        assert TorchTrainer.can_restore(path), path
        trainer = TorchTrainer.restore(path, lambda: None)
        assert (trainer.run_config.storage_path, trainer.run_config.name) == (str(tmp_path / "runs"), "exp"), path
    monkeypatch.chdir(tmp_path / "runs")
    assert TorchTrainer.restore("exp", lambda: None).run_config.storage_path == str(tmp_path / "runs")
    for bad in (3, b"exp", ""):
        with pytest.raises(TypeError, match=r"TorchTrainer.restore\(path=...\) expects a run folder's path or URI"):
            TorchTrainer.restore(bad, lambda: None)
    with pytest.raises(TypeError, match=r"can_restore\(path=...\) expects a run folder's path or URI; got NoneType"):
        TorchTrainer.can_restore(None)
    with pytest.raises(TypeError, match=r"TorchTrainer.restore\(run_config=...\) expects None or a "
                                        r"raysgd.train.RunConfig; got dict"):  # was dataclasses.replace's TypeError
        TorchTrainer.restore("exp", lambda: None, run_config={"name": "exp"})


def test_a_result_refuses_a_checkpoint_config_that_is_no_config_naming_it(tmp_path):
    """A dict given for checkpoint_config raised AttributeError ('dict' object has no attribute 'num_to_keep')."""
    folder, uris = run_folder(tmp_path, {"loss": 0.5})
    with pytest.raises(TypeError, match=r"Result.from_path\(checkpoint_config=...\) expects None or a "
                                        r"raysgd.train.CheckpointConfig; got dict \{'num_to_keep': 1\}"):
        Result.from_path(folder.path, checkpoint_config={"num_to_keep": 1})
    with pytest.raises(TypeError, match=r"Result.from_checkpoints\(checkpoint_config=...\) expects None or a"):
        Result.from_checkpoints([(Checkpoint(uris[0]), {"loss": 0.5})], path=folder.path, checkpoint_config="loss")
    assert Result.from_path(folder.path, checkpoint_config=CheckpointConfig(1)).checkpoint == Checkpoint(uris[0])


def test_numpy_and_nested_metrics_read_back_as_numbers_and_rank_checkpoints(tmp_path):
    """What report() writes of its metrics (raysgd.base.checks.plain_json, in the marker) reads back as reported:
    numpy and one-element tensor values as numbers, nested dicts and lists as such, so a score ranks the
    checkpoints."""
    reported = [{"loss": np.float32(0.5), "epoch": np.int64(1), "val": {"acc": torch.tensor(0.6)}, "shape": (2, 3)},
                {"loss": np.float32(0.25), "epoch": np.int64(2), "val": {"acc": torch.tensor(0.9)}, "shape": (2, 3)},
                {"loss": np.float32(0.75), "epoch": np.int64(3), "val": {"acc": torch.tensor(0.7)}, "shape": (2, 3)}]
    folder, uris = run_folder(tmp_path, *[plain_json(metrics) for metrics in reported])
    result = Result.from_path(folder.path, checkpoint_config=CheckpointConfig(checkpoint_score_attribute="loss",
                                                                               checkpoint_score_order="min"))
    assert result.metrics == {"loss": 0.75, "epoch": 3, "val": {"acc": pytest.approx(0.7)}, "shape": [2, 3]}
    assert type(result.metrics["epoch"]) is int
    assert [c.path for c, _ in result.best_checkpoints] == [uris[2], uris[0], uris[1]]  # worst first, best last
    assert result.get_best_checkpoint("val/acc", "max") == Checkpoint(uris[1])
    by_accuracy = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="val/acc")
    by_age = [(index, metrics) for index, (_, metrics) in enumerate(Result.from_path(folder.path).best_checkpoints)]
    assert checkpoints_to_delete(by_age, by_accuracy) == [0]  # keeps the best (1) and the latest (2)


def test_result_prints_as_ray_and_finds_its_best_checkpoint(tmp_path):
    checkpoints = [(Checkpoint(f"/r/exp/checkpoint_00000{i}"), {"acc": acc, "done": False}) for i, acc in
                   ((1, 0.2), (2, 0.8), (3, 0.5))]
    result = Result.from_checkpoints(checkpoints, path="/r/exp", error=ValueError("boom"),
                                     metrics={"acc": 0.5, "done": True, "step": 7}, return_value={"best": 2})
    assert repr(result) == ("Result(\n  error='ValueError',\n  metrics={'acc': 0.5, 'step': 7},\n  path='/r/exp',\n"
                            "  filesystem='local',\n  checkpoint=Checkpoint(filesystem=local, "
                            "path=/r/exp/checkpoint_000003)\n)")
    assert result.metrics == {"acc": 0.5, "done": True, "step": 7} and result.return_value == {"best": 2}
    assert result.get_best_checkpoint("acc", "max").path == "/r/exp/checkpoint_000002"
    assert result.get_best_checkpoint("acc", "min").path == "/r/exp/checkpoint_000001"
    with pytest.raises(RuntimeError, match=r"metric='loss'\): no kept checkpoint was reported with that metric; "
                                           r"they have \['acc', 'done'\]"):
        result.get_best_checkpoint("loss", "min")
    with pytest.raises(ValueError, match=r"mode=...\) expects 'max' or 'min'; got 'best'"):
        result.get_best_checkpoint("acc", "best")
    with pytest.raises(TypeError, match=r"get_best_checkpoint\(metric=...\) expects a metric's name \(str; 'a/b' for "
                                        r"a nested one\); got NoneType None"):  # was AttributeError: no split
        result.get_best_checkpoint(None, "max")
    empty = Result(metrics={}, checkpoint=None, path="/r/exp")
    assert empty.metrics_dataframe is None and empty.best_checkpoints == []
    assert repr(empty) == "Result(\n  metrics={},\n  path='/r/exp',\n  filesystem='local',\n  checkpoint=None\n)"


def test_metrics_dataframe_without_pandas_names_the_extra(monkeypatch):
    result = Result.from_checkpoints([(Checkpoint("/r/c1"), {"loss": 1.0})], path="/r")
    monkeypatch.setitem(sys.modules, "pandas", None)  # as when pandas is not installed
    with pytest.raises(ImportError, match=r'Result.metrics_dataframe needs pandas, which is not importable here: '
                                          r'pip install "raysgd\[data\]"'):
        result.metrics_dataframe  # noqa: B018


def test_torch_checkpoint_and_rays_deprecated_torch_helpers():
    from raysgd.train.torch import TorchCheckpoint, accelerate, backward, prepare_optimizer

    model = torch.nn.Linear(2, 1)
    wrapped = {f"module.{key}": value for key, value in model.state_dict().items()}
    checkpoint = TorchCheckpoint.from_state_dict(wrapped)
    assert sorted(os.listdir(checkpoint.path)) == ["model.pt"] and isinstance(checkpoint, Checkpoint)
    assert torch.equal(checkpoint.get_model(torch.nn.Linear(2, 1)).weight, model.weight)
    with pytest.raises(ValueError, match=r"holds a state dict; pass the model"):
        checkpoint.get_model()
    whole = TorchCheckpoint.from_model(model)
    with pytest.raises(ValueError, match=r"if you trust it, load it with get_model\(weights_only=False\)"):
        whole.get_model()
    assert torch.equal(whole.get_model(weights_only=False).weight, model.weight)
    for deprecated in (lambda: accelerate(amp=True), lambda: backward(None), lambda: prepare_optimizer(None)):
        with pytest.raises(DeprecationWarning, match="are deprecated"):
            deprecated()
