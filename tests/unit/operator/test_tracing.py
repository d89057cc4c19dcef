"""The profiler traces' folder and files (raysgd.torch.operator.tracing), in one process."""
import os

import pytest

from raysgd.torch.operator.tracing import prepare_logdir, write_traces


def test_a_logdir_under_home_is_the_home_folders(tmp_path, monkeypatch):
    """``profile(logdir="~/traces")`` writes under the home folder. Before, it made a folder named ``~`` in the
    working directory and wrote the traces there."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    folder = prepare_logdir("~/traces")
    assert folder == str(tmp_path / "home" / "traces") and os.path.isdir(folder)
    assert not (tmp_path / "~").exists()
    assert write_traces({1: b"b", 0: b"a"}, folder) == [os.path.join(folder, f"rank_{r}.pt.trace.json") for r in (0, 1)]


def test_a_logdir_that_is_a_uri_is_refused():
    with pytest.raises(ValueError, match="logdir expects a local folder path"):
        prepare_logdir("s3://bucket/traces")
