"""The ``raysgd`` command in this process: checkpoints and export on folders written here, run of a module; no Ray
cluster, no subprocess.

The command runs as its entry point's function (``raysgd.cli.main``) with its output captured. A whole state's run
folder is written by :class:`~raysgd.torch.storage.filesystem.CheckpointStorage`; a sharded (FSDP) state's folder by
:class:`LocalShardedSave`, which writes one rank's DCP part, the head and ``.metadata`` as ``save()`` does under
``strategy="fsdp"`` (a save over an existing one takes the other set of names: ``__0_1.distcp``,
``trainer.1.checkpoint``), then the marker, through the same ``write_checkpoint_dir``.
"""
import http.server
import json
import os
import sys
import threading
import zlib

import pytest
import torch
from safetensors.torch import load_file

import raysgd.logs
from raysgd import cli
from raysgd.torch.state import dcp_blobs, sharded
from raysgd.torch.state.checkpoint import state_to_bytes
from raysgd.torch.storage import dcp_files, filesystem, parts


class LocalShardedSave:
    """A one-rank sharded state (one model whose weight is ``weight``) written into a checkpoint folder in this
    process, in the set of names its existing marker does not use; ``write_checkpoint_dir`` writes the marker."""

    def __init__(self, weight, epoch):
        self.weight, self.epoch = weight, epoch

    def write_to(self, directory, name):
        fs, _ = filesystem.resolve(directory)
        try:
            generation = 1 - filesystem.read_marker(fs, directory).get("generation", 0)
        except filesystem.DamagedCheckpoint:
            generation = 0
        part = sharded.save_parts({"models": [{"weight": self.weight}], "optimizers": [{}]})
        file = parts.part_file(0, generation)
        metadata = dcp_blobs.renamed_files(part.metadata, {part.file_name: file})
        written = dcp_files.write_file(fs, f"{directory}/{file}", part.blob)
        head = {"rest": {"epoch": self.epoch, "global_step": 2 * self.epoch, "sharded": True},
                "metadata": bytes(metadata), "layout": part.layout}
        head_file = filesystem.STATE_FILES[generation]
        size, crc32 = filesystem.write_state_file(fs, f"{directory}/{head_file}", state_to_bytes(head))
        dcp_files.write_file(fs, f"{directory}/{parts.DCP_METADATA}", metadata)
        return size, crc32, {"parts": {file: list(written)}, "file": head_file, "generation": generation}

    def after_marker(self, directory, marker):
        named = {marker["file"], *marker["parts"]}
        for name in os.listdir(directory):
            if name.startswith(("__", "trainer")) and name not in named:
                os.unlink(os.path.join(directory, name))


def save_sharded(folder, value, epoch):
    """What ``save(folder)`` writes under ``strategy="fsdp"`` for a model whose weight is ``value`` everywhere."""
    fs, directory = filesystem.resolve(folder)
    filesystem.write_checkpoint_dir(fs, directory, LocalShardedSave(torch.full((2,), float(value)), epoch),
                                    {"reason": "save", "epoch": epoch})


def whole_run(folder, epochs=2):
    """A run folder of whole (DDP) states, one checkpoint per epoch, the model's weight the epoch's number."""
    store = filesystem.CheckpointStorage(str(folder), num_to_keep=None)
    for epoch in range(1, epochs + 1):
        state = {"epoch": epoch, "global_step": 2 * epoch, "operator": None, "optimizers": [{}],
                 "models": [{"weight": torch.full((2,), float(epoch))}]}
        store.write(state_to_bytes(state), {"epoch": epoch, "reason": "train"})
    return store


def command(capsys, *args):
    """``(exit status, stdout, stderr)`` of ``raysgd args...`` run in this process."""
    code = cli.main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_an_fsdp_checkpoint_saved_over_an_older_one_is_listed_ok_and_exported(tmp_path, capsys):
    folder = tmp_path / "fsdp saved é"
    save_sharded(folder, 1, epoch=1)
    save_sharded(folder, 3, epoch=3)  # the other set of names: trainer.1.checkpoint, __0_1.distcp
    assert "trainer.checkpoint" not in os.listdir(folder)
    code, out, err = command(capsys, "checkpoints", folder, "--json")
    row = json.loads(out)
    assert code == 0 and row["status"] == "ok", out + err
    assert (row["epoch"], row["step"], row["workers"], row["strategy"]) == (3, 6, 1, "fsdp"), row
    for path in (folder, folder / "trainer.1.checkpoint"):  # the folder, or the state file its marker names
        target = tmp_path / "model.safetensors"
        code, out, err = command(capsys, "export", path, target, "--overwrite")
        assert code == 0 and "(epoch 3, step 6)" in out, err
        assert torch.equal(load_file(str(target))["weight"], torch.full((2,), 3.0))


def test_export_reads_the_save_the_marker_names_not_a_newer_unfinished_one(tmp_path, capsys):
    folder = tmp_path / "fsdp"
    save_sharded(folder, 1, epoch=1)
    LocalShardedSave(torch.full((2,), 2.0), 2).write_to(str(folder), filesystem.STATE_FILE)  # killed before its marker
    target = tmp_path / "model.safetensors"
    code, out, err = command(capsys, "export", folder, target)
    assert code == 0 and "(epoch 1, step 2)" in out, err
    assert torch.equal(load_file(str(target))["weight"], torch.ones(2))  # epoch 1's weights, as the marker says


def test_a_sharded_head_without_its_marker_is_incomplete_and_not_exported(tmp_path, capsys):
    folder = tmp_path / "fsdp"
    folder.mkdir()
    LocalShardedSave(torch.ones(2), 1).write_to(str(folder), filesystem.STATE_FILE)  # the first save, killed
    code, out, err = command(capsys, "checkpoints", folder)
    assert code == 0 and "1 checkpoint(s): 1 incomplete" in out and "a save that did not finish" in out, out + err
    target = tmp_path / "model.safetensors"
    code, out, err = command(capsys, "export", folder, target)
    assert code == 2 and err.startswith("raysgd export: error: ") and "a save that did not finish" in err, err
    assert "Traceback" not in err and not target.exists()


@pytest.mark.parametrize("out, said", [
    ("folder", "got '{tmp}/folder', a folder"), ("new/", "got 'new/', a folder"),
    ("s3://bucket/model.safetensors", "got 's3://bucket/model.safetensors', a URI"),
    ("notes.txt/model.safetensors", "got 'notes.txt/model.safetensors': FileExistsError: ")])
def test_an_out_that_is_no_file_to_write_is_refused_naming_it(tmp_path, capsys, monkeypatch, out, said):
    whole_run(tmp_path / "run")
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("epoch 1 went well")
    monkeypatch.chdir(tmp_path)
    out = out.replace("folder", str(tmp_path / "folder")) if out == "folder" else out
    before = sorted(os.listdir(tmp_path))
    code, _, err = command(capsys, "export", tmp_path / "run", out, "--overwrite")
    assert code == 2 and err.startswith("raysgd export: error: OUT expects "), err
    assert said.format(tmp=tmp_path) in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "folder") == []  # nothing written


def test_a_model_index_out_of_range_is_refused_naming_it(tmp_path, capsys):
    whole_run(tmp_path / "run")
    for index in ("1", "-1"):
        code, _, err = command(capsys, "export", tmp_path / "run", tmp_path / "model.safetensors", "--model", index)
        assert code == 2 and err == (f"raysgd export: error: --model expects an index below 1 (the checkpoint holds "
                                     f"1 model(s)); got {index}\n"), err
    assert not (tmp_path / "model.safetensors").exists()


def reported(run, name, index, step):
    """A checkpoint folder as ``raysgd.train.report(..., checkpoint_dir_name=name)`` leaves it: the function's file
    and the marker (written last) listing it with its size and CRC-32, the metrics and the checkpoint's index."""
    folder = run / name
    folder.mkdir(parents=True)
    data = f"weights of step {step}".encode()
    (folder / "weights.pt").write_bytes(data)
    fs, directory = filesystem.resolve(str(folder))
    filesystem.write_marker(fs, directory, {"weights.pt": [len(data), zlib.crc32(data)]},
                            {"kind": "report", "index": index, "metrics": {"epoch": index, "step": step},
                             "world_size": 1}, name=filesystem.REPORT_MARKER)


def test_a_train_runs_checkpoints_named_by_the_function_are_listed_in_order(tmp_path, capsys):
    run = tmp_path / "train" / "fn"
    reported(run, "best", 1, 4)  # report(..., checkpoint_dir_name="best")
    code, out, err = command(capsys, "checkpoints", run, "--json")
    assert code == 0 and [json.loads(line)["checkpoint"] for line in out.splitlines()] == ["best"], out + err
    reported(run, "checkpoint_000002", 2, 8)
    reported(run, "a later one", 3, 12)
    (run / "checkpoint_000004").mkdir()  # a copy that did not finish
    code, out, err = command(capsys, "checkpoints", run, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [(row["checkpoint"], row.get("step"), row["status"]) for row in rows] == [
        ("best", 4, "complete"), ("checkpoint_000002", 8, "complete"), ("a later one", 12, "complete"),
        ("checkpoint_000004", None, "incomplete")], rows
    code, _, err = command(capsys, "export", run, tmp_path / "model.safetensors")
    assert code == 2 and "is a raysgd.train run folder" in err, err


def test_a_tilde_path_is_the_home_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    whole_run(tmp_path / "runs" / "mnist")
    code, out, err = command(capsys, "checkpoints", "~/runs/mnist", "--json")  # as a quoted or configured path
    assert code == 0 and [json.loads(line)["epoch"] for line in out.splitlines()] == [1, 2], out + err
    monkeypatch.chdir(tmp_path / "runs")
    code, out, err = command(capsys, "export", "~/runs/mnist/checkpoint_000001", "~/model.safetensors")
    assert code == 0 and "(epoch 1, step 2)" in out, err
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["weight"], torch.ones(2))
    assert sorted(os.listdir(tmp_path / "runs")) == ["mnist"]  # never a folder named ~ here


@pytest.mark.parametrize("flags", [[], ["--log-level", "WARNING"]])
def test_run_runs_a_module_as_its_usage_says(tmp_path, capsys, monkeypatch, flags):
    (tmp_path / "cli_run_probe.py").write_text("import sys\nprint('probe ran with', sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # where python -m finds it (the working directory), taken back after
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the program's sys.argv, taken back after
    levels = raysgd.logs.current_levels()
    try:
        code, out, err = command(capsys, "run", *flags, "-m", "cli_run_probe", "--epochs", "2", "-m", "x")
    finally:
        raysgd.logs.set_log_level(*levels)
    assert code == 0 and "probe ran with ['--epochs', '2', '-m', 'x']" in out, out + err


@pytest.mark.parametrize("uri, said", [("foo://bucket/run", "Unrecognized filesystem type"),
                                       ("file:///data/my run", "(a URI writes a space as %20)")])
def test_a_uri_pyarrow_cannot_open_is_a_bad_path_argument(tmp_path, capsys, uri, said):
    for args in (["checkpoints", uri], ["export", uri, tmp_path / "model.safetensors"]):
        code, _, err = command(capsys, *args)
        assert code == 2 and err.startswith(f"raysgd {args[0]}: error: PATH expects a local folder or a URI that "
                                            f"pyarrow.fs understands"), err
        assert said in err and "Traceback" not in err and "storage_path" not in err, err


def test_a_file_named_like_a_checkpoint_in_a_run_folder_is_no_checkpoint(tmp_path, capsys):
    whole_run(tmp_path / "run")
    (tmp_path / "run" / "checkpoint_000007").write_bytes(b"a file of the user's, named like a checkpoint folder")
    code, out, err = command(capsys, "checkpoints", tmp_path / "run", "--json")
    assert code == 0 and [json.loads(line)["checkpoint"] for line in out.splitlines()] == [
        "checkpoint_000001", "checkpoint_000002"], out + err
    code, out, err = command(capsys, "export", tmp_path / "run", tmp_path / "model.safetensors")
    assert code == 0 and "exported checkpoint_000002" in out and err == "", err


class _Refusing(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that refuses every request (403 Access Denied), as one does for a wrong key."""

    def _refuse(self):
        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                b"<Message>Access Denied</Message></Error>")
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _refuse

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def refusing_s3():
    """``s3://bucket/run?...``: a URI whose endpoint (on 127.0.0.1) refuses every request."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"s3://bucket/run?endpoint_override=127.0.0.1:{server.server_port}&scheme=http&region=us-east-1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.parametrize("command", ["checkpoints", "export"])
def test_a_read_that_object_storage_refuses_is_one_line_and_exit_status_1(command, refusing_s3, tmp_path, capsys,
                                                                           monkeypatch):
    """A network error or a refusal while reading S3 printed pyarrow's traceback (exit status 1 from Python)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    argv = [command, refusing_s3] + ([str(tmp_path / "model.safetensors")] if command == "export" else [])
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"raysgd {command}: error: OSError: ") and "Traceback" not in err, err
    assert "ACCESS_DENIED" in err or "Access Denied" in err, err
    assert len(err.strip().splitlines()) == 1, err
