"""Durable checkpoint storage without Ray: atomic directories, keep-N, damaged checkpoints, the async writer, S3."""
import logging
import os
import threading
import time

import pytest
import torch

from raysgd.torch.storage import async_writer
from raysgd.torch.storage import durable
from raysgd.torch.storage import filesystem as storage
from raysgd.torch.state.checkpoint import load_state, save_state, state_to_bytes
from raysgd.torch.errors import CheckpointError
from raysgd.torch.integrations.results import ResultLogger, read_results
from s3_server import moto_s3


def state(epoch):
    return {"epoch": epoch, "global_step": 10 * epoch, "operator": {}, "models": [{"w": torch.full((4,), epoch)}],
            "optimizers": [{}]}


def test_keeps_the_newest_complete_checkpoints(tmp_path):
    store = storage.CheckpointStorage(str(tmp_path / "run"), num_to_keep=2)
    assert store.latest() is None and store.list() == []
    for epoch in (1, 2, 3):
        store.write(state_to_bytes(state(epoch)), {"epoch": epoch})
    assert [index for index, _ in store.list()] == [2, 3]
    restored = store.latest()
    assert restored.marker["epoch"] == 3 and restored.path.endswith("checkpoint_000003")
    assert torch.load(__import__("io").BytesIO(restored.stream), weights_only=True)["models"][0]["w"][0] == 3
    assert sorted(os.listdir(restored.path)) == [storage.MARKER_FILE, storage.STATE_FILE]


def test_truncated_newest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    store = storage.CheckpointStorage(str(tmp_path), num_to_keep=3)
    for epoch in (1, 2):
        store.write(state_to_bytes(state(epoch)), {"epoch": epoch})
    newest = os.path.join(store.list()[-1][1], storage.STATE_FILE)
    with open(newest, "r+b") as handle:
        handle.truncate(os.path.getsize(newest) // 2)
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.storage.filesystem"):
        assert store.latest().marker["epoch"] == 1
    assert "checkpoint_000002" in caplog.text and "damaged" in caplog.text


def test_a_checkpoint_without_its_marker_does_not_count(tmp_path, caplog):
    store = storage.CheckpointStorage(str(tmp_path), num_to_keep=2)
    store.write(state_to_bytes(state(1)), {"epoch": 1})
    partial = tmp_path / "checkpoint_000002"  # a crash after the state file, before the marker
    partial.mkdir()
    (partial / storage.STATE_FILE).write_bytes(state_to_bytes(state(2)))
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.storage.filesystem"):
        assert store.latest().marker["epoch"] == 1
    assert "incomplete" in caplog.text
    store.write(state_to_bytes(state(3)), {"epoch": 3})  # numbered after the partial one, which is pruned
    assert [index for index, _ in store.list()] == [1, 3]


def test_unsafe_checkpoint_is_refused_not_skipped(tmp_path):
    store = storage.CheckpointStorage(str(tmp_path), num_to_keep=2)
    unsafe = {**state(1), "operator": {"obj": threading.Lock}}  # a class: a safe load refuses it
    store.write(state_to_bytes(unsafe), {"epoch": 1})
    with pytest.raises(CheckpointError, match="weights_only=True"):
        store.latest()


def test_a_local_checkpoint_is_fsynced_file_marker_folder_before_the_previous_is_pruned(tmp_path, monkeypatch):
    """A power loss right after prune() must still find a complete checkpoint: the state file, then the marker,
    then the checkpoint folder and the storage folder (the new entry) reach the disk before an old one is deleted.
    os.fsync is observed (and still called) on the real write path."""
    store = storage.CheckpointStorage(str(tmp_path / "run"), num_to_keep=1)
    store.write(state_to_bytes(state(1)), {"epoch": 1})
    events, real_fsync, real_prune = [], os.fsync, store.prune

    def observed_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def observed_prune(entries=None):
        events.append(("prune", [index for index, _ in (entries or [])]))
        return real_prune(entries)

    monkeypatch.setattr(os, "fsync", observed_fsync)
    store.prune = observed_prune
    directory = store.write(state_to_bytes(state(2)), {"epoch": 2})
    assert events == [("fsync", os.path.join(directory, storage.STATE_FILE)),
                      ("fsync", os.path.join(directory, storage.MARKER_FILE)),
                      ("fsync", directory), ("fsync", str(tmp_path / "run")), ("prune", [1, 2])]
    assert [index for index, _ in store.list()] == [2]  # the previous one is gone only now


def test_a_marker_is_written_where_the_file_system_refuses_fsync_on_a_folder(tmp_path, monkeypatch):
    """Some network mounts refuse ``fsync`` on a folder (EINVAL): the marker is still written, the marker file itself
    fsynced, its folder and the folder's parent tried. Every writer of a file in place (storage, the rank files' task
    on the driver's node, ``save()``, the DCP parts, export) syncs through ``raysgd.base.durable_files``, whose folder
    sync skips such a folder; a file that cannot be synced is still an error. (A fake ``os.fsync``: no such file
    system exists on this machine.)"""
    from raysgd.base import durable_files

    real_fsync, tried = os.fsync, []

    def refusing_folders(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        tried.append(path)
        if os.path.isdir(path):
            raise OSError(22, "Invalid argument")
        return real_fsync(fd)

    directory = tmp_path / "run" / "checkpoint_000001"
    directory.mkdir(parents=True)
    monkeypatch.setattr(os, "fsync", refusing_folders)
    fs, path = storage.resolve(str(directory))
    storage.write_marker(fs, path, {}, {"epoch": 1})
    assert (directory / storage.MARKER_FILE).is_file()
    assert tried == [str(directory / storage.MARKER_FILE), str(directory), str(tmp_path / "run")]
    durable_files.fsync_directory(str(directory))  # the helper itself

    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(OSError, match="Input/output error"):
        durable_files.fsync_file(str(directory / storage.MARKER_FILE))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"storage_path": "foo://bucket/x"}, ValueError, "storage_path expects a local folder or a URI"),
    ({"storage_path": 3}, TypeError, "storage_path expects a folder path or a URI"),
    ({"storage_path": "/tmp/x", "num_to_keep": 0}, ValueError, "num_to_keep expects an int >= 1"),
    ({"storage_path": "/tmp/x", "num_to_keep": 1.5}, ValueError, "num_to_keep expects an int >= 1"),
    ({"storage_path": "/tmp/x", "resume": "yes"}, TypeError, "resume expects True or False"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        durable.open_run(**kwargs)


def test_writer_runs_one_job_at_a_time_and_the_newest_queued_one_wins():
    writer = async_writer.AsyncWriter()
    release, started, done = threading.Event(), threading.Event(), []

    def slow(value):
        started.set()
        assert release.wait(30)
        done.append(value)

    writer.submit(slow, 1)
    assert started.wait(30)
    writer.submit(done.append, 2)  # waits behind the running job ...
    writer.submit(done.append, 3)  # ... and is replaced by this one
    assert writer.busy and done == []
    release.set()
    writer.close(timeout_s=30)
    assert done == [1, 3] and writer.dropped == 1 and writer.completed == 2


def test_writer_errors_are_raised_at_the_next_call():
    writer = async_writer.AsyncWriter()

    def fail():
        raise OSError("disk full")

    with pytest.raises(CheckpointError, match="checkpoint 1.*disk full") as info:
        writer.submit(fail, description="checkpoint 1")  # never its own job's error (see the next test) ...
        writer.flush(timeout_s=30)  # ... here
    assert isinstance(info.value.__cause__, OSError)
    writer.flush(timeout_s=30)  # raised once
    with pytest.raises(CheckpointError):
        writer.submit(fail)
        writer.close(timeout_s=30)


def test_submit_never_raises_the_error_of_the_job_it_queues():
    """However fast a job fails, ``submit`` raises only an earlier job's error: here the job fails before submit
    returns (its lock is left only once the writer has recorded the failure), and flush raises it. (A durable
    run's first checkpoint failing at once used to fail the train() call that submitted it, on a loaded machine.)"""
    writer, main = async_writer.AsyncWriter(), threading.current_thread()

    class LeftOnceTheJobFailed(threading.Condition):
        hold = False

        def __exit__(self, *exc):
            left = super().__exit__(*exc)
            if self.hold and threading.current_thread() is main:
                self.hold = False
                deadline = time.monotonic() + 30
                while writer.failed is None and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert writer.failed == "checkpoint 1"
            return left

    def fail():
        raise OSError("not a directory")

    writer._cond = LeftOnceTheJobFailed()
    writer._cond.hold = True
    writer.submit(fail, description="checkpoint 1")  # the job has failed by now: not raised here
    with pytest.raises(CheckpointError, match="checkpoint 1.*not a directory"):
        writer.flush(timeout_s=30)
    writer.submit(lambda: None, description="checkpoint 2")
    writer.close(timeout_s=30)


def test_result_log_rewind_keeps_one_row_per_epoch(tmp_path):
    log = ResultLogger(str(tmp_path), tensorboard=False)
    for epoch in (1, 2, 3):
        log.log("train", {"epoch": epoch, "train_loss": 1.0})
        log.log("validate", {"val_loss": 1.0})
    log.close()
    resumed = ResultLogger(str(tmp_path))  # TensorBoard too when tensorboardX is installed: reopened with purge_step
    resumed.rewind(2)  # the checkpoint was taken after epoch 2: epoch 3 is redone
    resumed.log("train", {"epoch": 3, "train_loss": 0.5})
    resumed.close()
    assert [row["epoch"] for row in read_results(tmp_path, "train")] == [1, 2, 3]
    assert read_results(tmp_path, "train")[-1]["train_loss"] == 0.5
    assert [row["step"] for row in read_results(tmp_path, "validate")] == [1, 2]


def test_component_states_are_asked_only_when_a_checkpoint_is_written(tmp_path):
    """A run without storage never asks its components (an MLflow logger's answer can wait on its server); one
    with storage asks once per checkpoint, at submit, and writes what it answered into the marker."""
    asked = []

    def states():
        asked.append(len(asked) + 1)
        return {"logger": {"asked": len(asked)}}

    none = durable.open_run(None)
    none.on_result("train", {"epoch": 1}, b"x", states=states)
    none.on_save(state(1), b"x", states=states)
    none.on_recovery(RuntimeError("preempted"), b"x", epoch=1, preempted=True, states=states)
    assert asked == []
    run = durable.open_run(str(tmp_path / "run"))
    run.on_result("validate", {"epoch": 1}, b"x", states=states)  # no checkpoint after a validate()
    assert asked == []
    run.on_result("train", {"epoch": 1}, state_to_bytes(state(1)), states=states)
    run.flush(timeout_s=60)
    run.close(timeout_s=60)
    assert asked == [1]
    assert durable.open_run(str(tmp_path / "run")).restore(timeout_s=60).marker["logger"] == {"asked": 1}


def test_s3_round_trip_through_moto_server():
    with moto_s3() as (bucket, query):
        uri = f"{bucket}/runs/exp1{query}"
        run = durable.open_run(uri, num_to_keep=2, resume=True)
        assert run.restore(timeout_s=60) is None
        for epoch in (1, 2, 3):
            run.submit(state_to_bytes(state(epoch)), epoch=epoch)
            run.flush(timeout_s=60)
        run.close(timeout_s=60)
        store = storage.CheckpointStorage(uri, num_to_keep=2)
        assert len(store.list()) == 2  # keep-N on S3 too
        restored = durable.open_run(uri).restore(timeout_s=60)
        assert restored.marker["epoch"] == 3 and restored.path.startswith("raysgd-test/runs/exp1/checkpoint_")


def test_as_trainable_refuses_a_shared_storage_path():
    pytest.importorskip("ray.tune")
    from raysgd import TorchTrainer
    from helpers import LinearOperator

    with pytest.raises(ValueError, match="as_trainable: storage_path expects None under Tune"):
        TorchTrainer.as_trainable(training_operator_cls=LinearOperator, storage_path="/tmp/x")


def _rewrite_marker(directory, **changes):
    import json

    path = os.path.join(directory, storage.MARKER_FILE)
    marker = json.loads(open(path).read())
    marker.update(changes)
    open(path, "w").write(json.dumps(marker))


@pytest.mark.parametrize("file", ["../../../../etc/hostname", "/etc/hostname", "other.checkpoint", "", 3, None])
def test_a_marker_naming_another_file_is_a_damaged_checkpoint(tmp_path, caplog, file):
    """The marker's ``file`` was joined to the directory unchecked: it may only name the state file."""
    store = storage.CheckpointStorage(str(tmp_path / "run"), num_to_keep=3)
    for epoch in (1, 2):
        store.write(state_to_bytes(state(epoch)), {"epoch": epoch})
    newest = store.list()[-1][1]
    os.rename(os.path.join(newest, storage.STATE_FILE), os.path.join(newest, "other.checkpoint"))
    _rewrite_marker(newest, file=file)
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.storage.filesystem"):
        assert store.latest().marker["epoch"] == 1  # skipped like any damaged checkpoint
    assert "checkpoint_000002" in caplog.text and storage.STATE_FILE in caplog.text
    with pytest.raises(CheckpointError, match=f"checkpoint_000002.*{storage.STATE_FILE}"):
        storage.read_path(newest)  # an explicit load() of that directory


def test_a_state_file_that_is_not_a_checkpoint_is_damaged(tmp_path, caplog):
    import pickle

    store = storage.CheckpointStorage(str(tmp_path / "run"), num_to_keep=3)
    store.write(state_to_bytes(state(1)), {"epoch": 1})
    store.write(pickle.dumps({}), {"epoch": 2})  # the marker matches the bytes: only their content is wrong
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.storage.filesystem"):
        assert store.latest().marker["epoch"] == 1
    assert "checkpoint_000002" in caplog.text and "not a raysgd checkpoint" in caplog.text
    with pytest.raises(CheckpointError, match="not a raysgd checkpoint"):
        storage.read_path(store.list()[-1][1])


EXIT_SCRIPT = """
import threading
from raysgd.torch.storage import async_writer

started = threading.Event()

def write():
    started.wait(30)  # runs once the script has ended
    if {fail}:
        raise OSError("disk full")

async_writer.AsyncWriter().submit(write, description="checkpoint 7")
started.set()
"""


@pytest.mark.parametrize("fail", [True, False])
def test_a_write_that_fails_at_exit_is_an_error_and_exit_status_1(fail):
    """Without shutdown(), a failed upload was logged to raysgd's NullHandler and the process exited 0."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(fail=fail)], capture_output=True, text=True,
                          timeout=120)
    if fail:
        assert done.returncode == 1 and async_writer.EXIT_STATUS_ON_FAILURE == 1, (done.returncode, done.stderr)
        assert "checkpoint 7" in done.stderr and "disk full" in done.stderr, done.stderr
    else:
        assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_tilde_path_is_the_home_folder_for_storage_save_and_load(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    store = storage.CheckpointStorage("~/run", num_to_keep=2)
    store.write(state_to_bytes(state(1)), {"epoch": 1})
    assert os.listdir(home / "run") == ["checkpoint_000001"]
    assert save_state(state(2), "~/saved/model.pt") == str(home / "saved" / "model.pt")
    assert os.listdir(work) == []  # never a folder named ~ in the working directory
    assert load_state("~/saved/model.pt")["epoch"] == 2
    assert storage.read_path("~/saved/model.pt")["epoch"] == 2
    stream = storage.read_path("~/run/checkpoint_000001")  # a checkpoint directory: checked against its marker
    assert torch.load(__import__("io").BytesIO(stream), weights_only=True)["epoch"] == 1


def test_a_checkpoint_uri_pyarrow_cannot_open_names_the_argument_of_load():
    with pytest.raises(ValueError, match=r"^TorchTrainer.load: checkpoint_path expects a local folder or a URI that "
                                         r"pyarrow.fs understands .*; got 'foo://bucket/ckpt': "):
        storage.read_path("foo://bucket/ckpt")


def test_a_file_named_like_a_checkpoint_keeps_its_name_and_is_no_checkpoint(tmp_path):
    store = storage.CheckpointStorage(str(tmp_path), num_to_keep=2)
    store.write(state_to_bytes(state(1)), {"epoch": 1})
    (tmp_path / "checkpoint_000002").write_bytes(b"a file of the user's, named like a checkpoint")
    assert store.next_index() == 3
    written = store.write(state_to_bytes(state(2)), {"epoch": 2})  # never into the file's name
    assert written.endswith("checkpoint_000003") and store.latest().marker["epoch"] == 2
    assert [index for index, _ in store.list()] == [1, 3]
    assert (tmp_path / "checkpoint_000002").read_bytes() == b"a file of the user's, named like a checkpoint"
