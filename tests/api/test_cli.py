"""The ``raysgd`` command, run for real against the checkpoints of real training runs.

One module fixture trains once of each kind on a local Ray cluster: a DDP run with ``storage_path`` (three epochs,
the newest two kept), the file its ``save()`` wrote, an FSDP run's ``save()`` folder (one part per rank) and a
``raysgd.train`` run folder. The tests copy what they damage. The command runs as the entry point's own function
(``raysgd.cli.main``, what ``python -m raysgd`` and the installed ``raysgd`` script call), in this process with its
stdout and stderr captured: each ``python -m raysgd`` in a subprocess costs ~3.5 s here (importing torch and Ray),
and ~30 of them made this the slowest API module. The entry points themselves run as subprocesses where it is what
a test checks: ``python -m raysgd --help``, the installed script, and ``raysgd run`` (a program with or without the
legacy mapping, which must not touch this process's imports).
"""
import contextlib
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import raysgd.torch.errors
import raysgd.train
import s3_server
from helpers import LinearOperator
from raysgd import TorchTrainer, cli
from raysgd.cli import export
from raysgd.train import Checkpoint, RunConfig, ScalingConfig
from raysgd.train.torch import TorchTrainer as FunctionTrainer

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = {"data_size": 64, "batch_size": 16}


def report_twice(config):
    """A training function reporting two checkpoints of its own files (``weights.pt``)."""
    for epoch in range(2):
        with tempfile.TemporaryDirectory() as folder:
            torch.save({"w": torch.ones(2) * epoch}, os.path.join(folder, "weights.pt"))
            raysgd.train.report({"epoch": epoch, "step": 4 * (epoch + 1)}, checkpoint=Checkpoint.from_directory(folder))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_2cpus):
    root = tmp_path_factory.mktemp("runs")
    ddp = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, storage_path=str(root / "ddp"),
                       num_to_keep=2, config=CONFIG)
    for _ in range(3):
        ddp.train()
    ddp.save(str(root / "ddp_saved.pt"))
    ddp_model = {k: v.clone() for k, v in ddp.get_model().state_dict().items()}
    ddp.shutdown()
    fsdp = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, strategy="fsdp", config=CONFIG)
    fsdp.train()
    fsdp.save(str(root / "fsdp_saved"))
    fsdp_model = {k: v.clone() for k, v in fsdp.get_model().state_dict().items()}
    fsdp.shutdown()
    FunctionTrainer(report_twice, scaling_config=ScalingConfig(num_workers=1),
                    run_config=RunConfig(name="fn", storage_path=str(root / "train"))).fit()
    return {"root": root, "ddp": root / "ddp", "file": root / "ddp_saved.pt", "fsdp": root / "fsdp_saved",
            "train": root / "train" / "fn", "ddp_model": ddp_model, "fsdp_model": fsdp_model}


def raysgd_command(*args, script=None, process=False):
    """Run ``raysgd args...``; returns the finished run (``returncode``, ``stdout``, ``stderr``).

    By default in this process (``raysgd.cli.main``, what both entry points call); with ``process=True`` as
    ``python -m raysgd`` in a subprocess, or the installed ``script``."""
    argv = [str(arg) for arg in args]
    if not (script or process):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = cli.main(argv)
            except SystemExit as done:  # argparse's --help (0) and usage errors (2), as the process would exit
                code = done.code
        return subprocess.CompletedProcess(["raysgd", *argv], code, stdout.getvalue(), stderr.getvalue())
    command = [str(script)] if script else [sys.executable, "-m", "raysgd"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([*command, *argv], env=env, cwd=REPO, capture_output=True, text=True, timeout=180)


def listed(path):
    done = raysgd_command("checkpoints", path, "--json")
    return done, [json.loads(line) for line in done.stdout.splitlines()]


def test_each_command_has_its_help():
    done = raysgd_command("--help", process=True)  # the entry point itself, once
    assert done.returncode == 0 and all(name in done.stdout for name in ("run", "checkpoints", "export")), done
    for name, words in (("run", "--legacy"), ("checkpoints", "CRC-32"), ("export", "safetensors")):
        done = raysgd_command(name, "--help")
        assert done.returncode == 0 and f"usage: raysgd {name}" in done.stdout and words in done.stdout, done
    done = raysgd_command()
    assert done.returncode == 2 and "usage: raysgd" in done.stderr


def test_the_installed_script_is_the_same_command():
    script = pathlib.Path(sys.executable).parent / "raysgd"
    if not script.exists():
        pytest.skip(f"no raysgd script beside {sys.executable}: this environment was installed before the entry "
                    f"point existed (pip install -e . adds it)")
    done = raysgd_command("--version", script=script)
    assert done.returncode == 0 and done.stdout.strip() == f"raysgd {raysgd.__version__}", done


def test_a_runs_checkpoints_are_listed_with_what_they_hold(runs):
    done, rows = listed(runs["ddp"])
    assert done.returncode == 0, done.stderr
    # the newest two kept (how many were written depends on the writer coalescing uploads: the newest waiting wins)
    assert [row["checkpoint"] for row in rows] == sorted(os.listdir(runs["ddp"])) and len(rows) == 2, rows
    assert [row["epoch"] for row in rows] == sorted(row["epoch"] for row in rows) and rows[-1]["epoch"] == 3, rows
    assert all((row["step"], row["workers"], row["strategy"], row["status"]) == (2 * row["epoch"], 2, "ddp", "ok")
               for row in rows), rows  # 64 samples, 16 per rank: 2 steps an epoch
    assert all(row["size"] > 0 and row["reason"] in ("train", "save") for row in rows)
    table = raysgd_command("checkpoints", runs["ddp"])
    assert table.returncode == 0
    header, *lines = table.stdout.splitlines()
    assert header.split() == ["checkpoint", "epoch", "step", "workers", "strategy", "size", "written", "reason", "check"]
    assert lines[-1] == "2 checkpoint(s): 2 ok" and rows[-1]["checkpoint"] in table.stdout


def test_a_damaged_checkpoint_is_named_and_an_unfinished_one_is_not_an_error(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["ddp"], run)
    older, newest = sorted(os.listdir(run))
    state = run / newest / "trainer.checkpoint"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, another CRC-32
    state.write_bytes(bytes(data))
    unfinished = f"checkpoint_{int(newest.split('_')[1]) + 1:06d}"
    (run / unfinished).mkdir()  # a write that did not finish: no marker
    (run / unfinished / "trainer.checkpoint").write_bytes(b"partial")
    done, rows = listed(run)
    assert done.returncode == 1, done.stderr
    assert [(row["checkpoint"], row["status"]) for row in rows] == [
        (older, "ok"), (newest, "damaged"), (unfinished, "incomplete")]
    assert "trainer.checkpoint has" in rows[1]["detail"] and "CRC-32" in rows[1]["detail"]
    table = raysgd_command("checkpoints", run)
    assert table.returncode == 1
    assert f"{newest}: damaged: its file trainer.checkpoint has" in table.stdout, table.stdout
    assert "1 ok, 1 damaged, 1 incomplete" in table.stdout
    # export skips the damaged newest one, saying so, and writes the newest good one
    out = tmp_path / "model.safetensors"
    done = raysgd_command("export", run, out)
    assert done.returncode == 0, done.stderr
    assert f"skipping {newest}: damaged" in done.stderr and f"exported {older}" in done.stdout


def test_a_sharded_checkpoint_lists_its_parts_and_a_damaged_part(runs, tmp_path):
    done, rows = listed(runs["fsdp"])
    assert done.returncode == 0, done.stderr
    assert [(row["epoch"], row["step"], row["workers"], row["strategy"], row["status"]) for row in rows] == [
        (1, 2, 2, "fsdp", "ok")]
    folder = tmp_path / "fsdp"
    shutil.copytree(runs["fsdp"], folder)
    (folder / "__1_0.distcp").write_bytes((folder / "__1_0.distcp").read_bytes()[:-1])  # truncated by a byte
    done, rows = listed(folder)
    assert done.returncode == 1 and rows[0]["status"] == "damaged" and "__1_0.distcp" in rows[0]["detail"], rows
    done = raysgd_command("export", folder, tmp_path / "never.safetensors")
    assert done.returncode == 2 and "cannot be exported: damaged" in done.stderr, done.stderr
    assert not (tmp_path / "never.safetensors").exists()


def test_a_file_save_wrote_and_a_train_run_folder_are_listed(runs):
    done, rows = listed(runs["file"])
    assert done.returncode == 0 and len(rows) == 1, done.stderr
    assert (rows[0]["epoch"], rows[0]["step"], rows[0]["workers"], rows[0]["status"]) == (3, 6, 2, "ok")
    done, rows = listed(runs["train"])
    assert done.returncode == 0, done.stderr
    assert [(row["epoch"], row["step"], row["workers"], row["status"]) for row in rows] == [
        (0, 4, 1, "complete"), (1, 8, 1, "complete")]
    assert "file(s) checked" in rows[0]["detail"]  # every file against its size and CRC-32 in the marker
    done, rows = listed(runs["train"] / "checkpoint_000002")  # one of its checkpoints
    assert done.returncode == 0 and [(row["checkpoint"], row["step"]) for row in rows] == [("checkpoint_000002", 8)]


def test_a_train_checkpoint_with_a_file_changed_is_listed_damaged(runs, tmp_path):
    folder = tmp_path / "train"
    shutil.copytree(runs["train"], folder)
    marker = json.loads((folder / "checkpoint_000002" / ".raysgd_report.json").read_text())
    name = sorted(marker["files"])[0]
    path = folder / "checkpoint_000002" / name
    path.write_bytes(b"x" + path.read_bytes()[1:])  # same size, another byte: only the CRC-32 tells
    done, rows = listed(folder)
    assert done.returncode == 1 and [row["status"] for row in rows] == ["complete", "damaged"], rows
    assert name in rows[1]["detail"] and "CRC-32" in rows[1]["detail"]


@pytest.mark.parametrize("kind", ["ddp", "file", "fsdp"])
def test_export_writes_the_models_whole_weights_as_safetensors(runs, tmp_path, kind):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    done = raysgd_command("export", runs[kind], out)
    assert done.returncode == 0, done.stderr
    expected = runs["fsdp_model" if kind == "fsdp" else "ddp_model"]
    written = load_file(str(out))
    assert set(written) == set(expected)  # the model's own keys: load_state_dict takes them as they are
    for key, value in expected.items():
        assert torch.equal(written[key], value), key
    with safe_open(str(out), "pt") as handle:
        assert handle.metadata()["raysgd.strategy"] == ("fsdp" if kind == "fsdp" else "ddp")
    model = torch.nn.Linear(1, 1)
    model.load_state_dict(written)
    again = raysgd_command("export", runs[kind], out)
    assert again.returncode == 2 and "exists: pass --overwrite" in again.stderr


def test_a_run_in_an_object_store_is_listed_and_exported_as_a_local_one(runs, tmp_path):
    import pyarrow.fs as pafs
    from safetensors.torch import load_file

    with s3_server.moto_s3() as (prefix, query):
        fs, bucket = pafs.FileSystem.from_uri(f"{prefix}{query}")
        for name in ("ddp", "fsdp"):
            pafs.copy_files(str(runs[name]), f"{bucket}/runs/{name}", source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=fs)
        local, remote = listed(runs["ddp"])[1], listed(f"{prefix}/runs/ddp{query}")
        assert remote[0].returncode == 0, remote[0].stderr
        assert [{k: v for k, v in row.items() if k != "written"} for row in remote[1]] == \
            [{k: v for k, v in row.items() if k != "written"} for row in local]
        for name in ("ddp", "fsdp"):
            out = tmp_path / f"{name}.safetensors"
            done = raysgd_command("export", f"{prefix}/runs/{name}{query}", out)
            assert done.returncode == 0, done.stderr
            expected = runs[f"{name}_model"]
            assert all(torch.equal(load_file(str(out))[key], value) for key, value in expected.items())


def test_paths_that_are_not_raysgd_checkpoints_say_what_was_expected(runs, tmp_path):
    (tmp_path / "notes.txt").write_text("epoch 1 went well")
    (tmp_path / "empty").mkdir()
    for path, said in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "found an empty folder"),
                       (tmp_path / "notes.txt", "is not a raysgd checkpoint"),
                       (runs["root"] / "train", "holds run folders (fn): pass one of them")):
        for command in (["checkpoints", path], ["export", path, tmp_path / "out.safetensors"]):
            done = raysgd_command(*command)
            assert done.returncode == 2, (command, done.stdout, done.stderr)
            assert done.stderr.startswith(f"raysgd {command[0]}: error: ") and said in done.stderr, done.stderr
            assert "Traceback" not in done.stderr
    done = raysgd_command("export", runs["train"], tmp_path / "out.safetensors")
    assert done.returncode == 2 and "raysgd.train run folder" in done.stderr, done.stderr


def test_run_runs_a_program_with_or_without_the_legacy_mapping(tmp_path):
    script = tmp_path / "legacy.py"
    script.write_text("import sys\nfrom ray.util.sgd.torch import TorchTrainer\nimport raysgd\n"
                      "assert TorchTrainer is raysgd.TorchTrainer\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    done = raysgd_command("run", "--legacy", script, "--smoke-test", "-x", process=True)
    assert done.returncode == 3 and "args ['--smoke-test', '-x']" in done.stdout, done.stderr
    done = raysgd_command("run", script, process=True)  # no mapping: Ray's own ray.util.sgd, which says it was removed
    assert done.returncode == 1 and "DeprecationWarning" in done.stderr, done.stderr
    done = raysgd_command("run", "--legacy", tmp_path / "missing.py", process=True)
    assert done.returncode == 2 and "not a file" in done.stderr
    done = raysgd_command("run", "--log-level", "LOUD", script, process=True)
    assert done.returncode == 2 and "--log-level expects a level name" in done.stderr


def test_several_models_are_exported_behind_their_index_or_one_alone():
    models = [{"weight": torch.ones(2)}, {"weight": torch.zeros(3), "extra": "not a tensor"}]
    assert set(export.flatten(models)[0]) == {"0.weight", "1.weight"}
    tensors, skipped, count = export.flatten(models, 1)
    assert list(tensors) == ["weight"] and skipped == ["extra"] and count == 1
    with pytest.raises(ValueError, match=r"--model expects an index below 2 .*; got 5"):
        export.flatten(models, 5)
    tied = torch.ones(4)
    ready = export.writable({"a": tied, "b": tied})
    assert ready["a"].untyped_storage().data_ptr() != ready["b"].untyped_storage().data_ptr()


class Opaque:
    """An object a safe load refuses (an operator state holding one needs --trust to be exported)."""


def test_a_state_a_safe_load_refuses_is_exported_only_with_trust(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"epoch": 1, "models": [{"w": torch.ones(2)}], "optimizers": [], "operator": Opaque()}, path)
    with pytest.raises(raysgd.torch.errors.CheckpointError, match=r"safe load .* refuses: if you trust the checkpoint, "
                                                                   r"pass --trust"):
        export.models_in(None, str(path), trust=False)
    assert torch.equal(export.models_in(None, str(path), trust=True)[0]["w"], torch.ones(2))
