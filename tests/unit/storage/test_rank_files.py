"""``rank_files``' functions that need no Ray: a reported checkpoint's files and marker on a local folder."""
import os

from raysgd.torch.storage import filesystem, rank_files


def test_a_checkpoint_of_empty_folders_is_written_and_read_back(tmp_path):
    source, run = tmp_path / "source", tmp_path / "run"
    source.mkdir()
    run.mkdir()
    directory = str(run / "checkpoint_000001")
    names = rank_files.local_files(str(source))
    assert names == []  # every rank reported an empty folder: no rank writes a file (reporting.py skips the call)
    marker = rank_files.write_marker(str(run), directory, {}, {"index": 1}, filesystem.REPORT_MARKER, home=None)
    assert marker["files"] == {}
    fs, _ = filesystem.resolve(str(run))
    rank_files.verify(fs, directory, filesystem.read_marker(fs, directory, filesystem.REPORT_MARKER))
    fetched = rank_files.fetch(str(run), directory, [], str(tmp_path / "back"), home=None)
    assert os.listdir(fetched) == []

