"""raysgd.train, the Ray Train function API: real Ray actors and gloo groups on one shared 2-CPU cluster.

A counting dataset (sample ids) checks exactly-once across a worker SIGKILLed mid-epoch; a driver SIGKILLed and
re-run resumes from the latest reported checkpoint; bad input fails before any actor starts.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import raysgd.train
from raysgd.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from raysgd.train.torch import TorchConfig, TorchTrainer, prepare_data_loader, prepare_model

from conftest import REPO_DIR, assert_released

REPO = REPO_DIR
N, BATCH, EPOCHS = 32, 4, 2  # 2 workers: 4 global steps per epoch
FAST = TorchConfig(timeout_s=30)


@pytest.fixture(scope="module")
def cluster(ray_2cpus):
    return ray_2cpus


def counting_loop(config):
    """``counts[i]``: how often sample ``i`` was trained (summed over the ranks, as DDP replicas agree); a
    checkpoint every 2 steps and at each epoch's end (``report`` is a collective: every rank reports); rank 1
    SIGKILLs itself once, mid-epoch 0, right after the report of step 1 (half the epoch)."""
    counts, start_epoch, resumed_from = torch.zeros(N), 0, None
    checkpoint = raysgd.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        counts, start_epoch, resumed_from = state["counts"], state["epoch"], state["at"]
    model = prepare_model(torch.nn.Linear(1, 1))
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH, shuffle=True),
                                 exactly_once=config.get("exactly_once", True))
    rank = raysgd.train.get_context().get_world_rank()

    def save(epoch, metrics):
        with tempfile.TemporaryDirectory() as folder:
            torch.save({"counts": counts, "epoch": epoch, "at": (metrics["epoch"], metrics.get("step"))},
                       os.path.join(folder, "state.pt"))
            raysgd.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))

    for epoch in range(start_epoch, EPOCHS):
        loader.sampler.set_epoch(epoch)
        for step, (ids,) in enumerate(loader):
            seen = torch.zeros(N)
            seen[ids] += 1
            dist.all_reduce(seen)
            counts += seen
            model(ids.float().unsqueeze(1)).sum().backward()
            if step % 2 == 1:
                save(epoch, {"epoch": epoch, "step": step})  # a collective: durable on return, on every rank
            if config.get("kill_marker") and rank == 1 and epoch == 0 and step == 1 and \
                    not os.path.exists(config["kill_marker"]):
                open(config["kill_marker"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # half the epoch trained and committed
        save(epoch + 1, {"epoch": epoch, "done": True, "resumed_from": resumed_from})


def read_counts(checkpoint):
    with checkpoint.as_directory() as folder:
        return torch.load(os.path.join(folder, "state.pt"))["counts"]


def test_a_worker_sigkilled_mid_epoch_resumes_exactly_once(cluster, tmp_path):
    marker = str(tmp_path / "killed")
    trainer = TorchTrainer(counting_loop, train_loop_config={"kill_marker": marker, "storage": str(tmp_path)},
                           scaling_config=ScalingConfig(num_workers=2), torch_config=FAST,
                           run_config=RunConfig(name="counting", storage_path=str(tmp_path),
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    assert os.path.exists(marker) and result.num_failures == 1
    assert result.metrics["done"] and result.metrics["epoch"] == EPOCHS - 1
    assert result.metrics["resumed_from"] == (0, 1)  # mid-epoch 0: its cursor skipped the 16 positions trained
    assert read_counts(result.checkpoint).tolist() == [float(EPOCHS)] * N  # every sample once per epoch
    assert result.path == str(tmp_path / "counting") and result.error is None
    assert_released()


def test_bad_input_fails_before_any_actor_starts(cluster):
    with pytest.raises(TypeError, match=r"ScalingConfig\(num_workers=...\) expects an int >= 1 .*got str '2'"):
        ScalingConfig(num_workers="2")
    with pytest.raises(TypeError, match=r"TorchTrainer\(scaling_config=...\) expects a raysgd.train.ScalingConfig"):
        TorchTrainer(counting_loop, scaling_config={"num_workers": 2})
    with pytest.raises(TypeError, match=r"TorchTrainer\(train_loop_config=...\) expects None or a dict; got list"):
        TorchTrainer(counting_loop, train_loop_config=[1])
    with pytest.raises(TypeError, match=r"FailureConfig\(max_failures=...\) expects an int >= -1"):
        FailureConfig(max_failures=1.5)
    with pytest.raises(TypeError, match=r"TorchTrainer\(run_config=...\) expects a raysgd.train.RunConfig"):
        TorchTrainer(counting_loop, run_config="exp")
    with pytest.raises(ImportError, match=r"raysgd.train.xgboost is not supported: .*ray.train.xgboost"):
        raysgd.train.xgboost  # noqa: B018
    with pytest.raises(RuntimeError, match="only inside the training function"):
        raysgd.train.report({"loss": 1.0})
    from raysgd.compat import TrainFinder  # python -m raysgd.legacy --train: Ray Train's other modules

    with pytest.raises(ModuleNotFoundError, match=r"ray.train.tensorflow is not supported by raysgd.train .*TensorFlow"):
        TrainFinder().find_spec("ray.train.tensorflow")
    assert TrainFinder().find_spec("ray.train.torch").loader.target == "raysgd.train.torch"
    assert TrainFinder().find_spec("ray.train.utils").loader.target == "raysgd.train.utils"  # Ray Data asks it
    assert_released(timeout_s=1)


GUIDE = os.path.join(REPO, "examples", "ray_train_guide.py")
DRIVER_DEADLINE_S = 240


def start_guide(tmp_path, address, *extra):
    """The guide's script under ``python -m raysgd.legacy --train`` in a session of its own, on this cluster."""
    env = {**os.environ, "RAY_ADDRESS": address,
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)}
    log = open(tmp_path / f"driver-{len(list(tmp_path.glob('driver-*')))}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "raysgd.legacy", "--train", GUIDE, "--smoke-test", "--name",
                             "guide", "--storage-path", str(tmp_path / "storage"), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True), log.name


def wait_for(condition, proc, what, timeout_s=DRIVER_DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the driver ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def reported(tmp_path):
    """``{checkpoint name: metrics}`` of the complete checkpoints of the guide's run."""
    run = tmp_path / "storage" / "guide"
    markers = sorted(run.glob("checkpoint_*/.raysgd_report.json")) if run.exists() else []
    return {marker.parent.name: json.loads(marker.read_text())["metrics"] for marker in markers}


def test_the_guide_script_runs_unchanged_and_a_killed_driver_resumes_from_its_latest_checkpoint(cluster, tmp_path):
    """The PyTorch guide's script (``ray.train`` imports, 2 CPU workers, ``python -m raysgd.legacy --train``): its
    driver is SIGKILLed after epoch 0's checkpoint; run again with the same name and storage path, it resumes at
    epoch 1 from that checkpoint and finishes."""
    address = cluster.get_runtime_context().gcs_address
    first, _ = start_guide(tmp_path, address, "--pause-after-epoch", "0")
    try:
        wait_for(lambda: "checkpoint_000001" in reported(tmp_path), first, "checkpoint of epoch 0")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    second, log = start_guide(tmp_path, address)
    try:
        second.wait(timeout=DRIVER_DEADLINE_S)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
    output = open(log).read()
    assert second.returncode == 0, output[-3000:]
    metrics = reported(tmp_path)
    assert [(m["epoch"], m["resumed_from"]) for m in metrics.values()] == [(0, 0), (1, 1)], metrics
    assert "'resumed_from': 1" in output and "checkpoint_000002" in output
    assert_released(timeout_s=30)


def lightning_loop(config):
    """The Lightning names on every rank: a checkpoint per epoch (4 batches of 4 per epoch, 2 per rank); rank 1
    SIGKILLs itself once, at epoch 1's second batch; a restart resumes Lightning from ``get_checkpoint()``."""
    import lightning.pytorch as pl  # noqa: PLC0415 (only this test needs Lightning)

    from raysgd.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, index):
            if raysgd.train.get_context().get_world_rank() == 1 and self.current_epoch == 1 and index == 1 and \
                    not os.path.exists(config["kill_marker"]):
                open(config["kill_marker"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(16, 2), torch.randn(16, 1)), batch_size=4)
    trainer = prepare_trainer(pl.Trainer(
        max_epochs=3, devices="auto", accelerator="cpu", strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()], enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False))
    checkpoint = raysgd.train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME)
        trainer.fit(Tiny(), data, ckpt_path=path if checkpoint else None)


def test_lightning_on_two_workers_reports_each_epoch_and_a_killed_rank_resumes_from_the_checkpoint(cluster, tmp_path):
    """A Lightning Trainer in the function on 2 real workers (DDP of 2 ranks; Lightning's sampler shards the data):
    rank 1 SIGKILLed in epoch 1; the group re-forms and Lightning resumes from epoch 0's checkpoint (global step 2),
    so the epochs are reported in order with the steps of 2 ranks, and the last checkpoint is Lightning's."""
    marker = str(tmp_path / "killed")
    result = TorchTrainer(lightning_loop, train_loop_config={"kill_marker": marker},
                          scaling_config=ScalingConfig(num_workers=2), torch_config=FAST,
                          run_config=RunConfig(name="lightning", storage_path=str(tmp_path),
                                               failure_config=FailureConfig(max_failures=1))).fit()
    assert os.path.exists(marker) and result.num_failures == 1
    reports = sorted((tmp_path / "lightning").glob("checkpoint_*/.raysgd_report.json"))
    markers = [json.loads(report.read_text()) for report in reports]
    assert [(m["world_size"], m["metrics"]["epoch"], m["metrics"]["step"]) for m in markers] == \
        [(2, 0, 2), (2, 1, 4), (2, 2, 6)], markers
    assert result.metrics["epoch"] == 2 and result.metrics["step"] == 6
    assert sorted(os.listdir(result.checkpoint.path)) == [".raysgd_report.json", "checkpoint.ckpt"]  # the marker
    assert_released()


def test_reported_checkpoints_go_to_an_s3_uri_marker_last_and_read_back(tmp_path):
    """The run folder on a real S3-compatible server (moto): two ranks' files go into one directory, its marker
    written last listing both; a directory without a marker is skipped; a file shorter than its marker says is found
    before any function reads it (the one before is resumed from); ``Checkpoint.as_directory`` downloads one, and
    ``to_directory`` copies its files but raysgd's marker."""
    from s3_server import moto_s3

    from raysgd.torch.storage import filesystem, rank_files
    from raysgd.train.commits import ReportCommits

    ranks = [tmp_path / "rank0", tmp_path / "rank1"]
    for rank, source in enumerate(ranks):
        source.mkdir()
        (source / f"shard_{rank}.pt").write_bytes(b"weights" * (rank + 1))
    with moto_s3() as (prefix, query):
        storage = filesystem.CheckpointStorage(filesystem.child_uri(f"{prefix}/runs{query}", "exp"), None,
                                               marker=filesystem.REPORT_MARKER)
        storage.check_writable()
        for index in (1, 2):
            directory = f"{storage.path}/{filesystem.numbered(index)}"
            files = {}
            for source in ranks:
                files.update(rank_files.write_files(storage.root, directory, str(source),
                                                    rank_files.local_files(str(source)), home=None)[0])
            rank_files.write_marker(storage.root, directory, files, {"kind": "report", "index": index,
                                                                     "metrics": {"loss": 1.0 / index}},
                                    filesystem.REPORT_MARKER, home=None)
        storage.filesystem.create_dir(storage.path + "/checkpoint_000003")  # a copy that never finished
        commits = ReportCommits(storage, home=None)
        uri, directory, marker = commits.newest_good()
        assert uri.startswith(f"{prefix}/runs/exp/checkpoint_000002") and marker["metrics"] == {"loss": 0.5}
        assert sorted(marker["files"]) == ["shard_0.pt", "shard_1.pt"]
        with storage.filesystem.open_output_stream(directory + "/shard_1.pt") as handle:
            handle.write(b"trunc")  # the newest is damaged: the one before it is the start
        assert commits.newest_good()[0].startswith(f"{prefix}/runs/exp/checkpoint_000001")
        with Checkpoint(commits.newest_good()[0]).as_directory() as local:
            assert sorted(os.listdir(local)) == [filesystem.REPORT_MARKER, "shard_0.pt", "shard_1.pt"]
            assert open(os.path.join(local, "shard_1.pt"), "rb").read() == b"weightsweights"
        copied = Checkpoint(commits.newest_good()[0]).to_directory(tmp_path / "copy")  # the user's files only
        assert sorted(os.listdir(copied)) == ["shard_0.pt", "shard_1.pt"]
        first, first_directory, first_marker = commits.newest_good()
        names = sorted(first_marker["files"])
        fetched = rank_files.fetch(storage.root, first_directory, names, str(tmp_path / "fetched"), home=None)
        assert sorted(os.listdir(fetched)) == ["shard_0.pt", "shard_1.pt"]  # no metadata: none to read
        Checkpoint(first).set_metadata({"epoch": 1})  # after the report: the marker does not list it
        fetched = rank_files.fetch(storage.root, first_directory, names, str(tmp_path / "fetched2"), home=None)
        assert Checkpoint(fetched).get_metadata() == {"epoch": 1}


def test_a_restored_cursor_resumes_its_epoch_exactly_once_on_another_world_size():
    """No Ray: two ranks take 2 batches of epoch 1, rank 0's cursor is saved; three ranks restored from it read the
    rest of epoch 1 (re-sharded), so the epoch is read exactly once; a pass of another epoch ignores the cursor."""
    from raysgd.train.prepare import PreparedLoader

    def loader():
        return DataLoader(list(range(24)), batch_size=3, shuffle=True)

    cpu = torch.device("cpu")
    first = [PreparedLoader(loader(), rank, 2, cpu) for rank in range(2)]
    taken = []
    for prepared in first:
        prepared.sampler.set_epoch(1)
        passes = iter(prepared)
        taken += [int(i) for _ in range(2) for i in next(passes)]
    cursor = first[0].cursor_state()
    assert cursor == {"epoch": 1, "consumed": 12, "complete": False, "positions": 24}
    rest = []
    for rank in range(3):  # no set_epoch: a restored loader starts at the cursor's epoch
        rest += [int(i) for batch in PreparedLoader(loader(), rank, 3, cpu, restored=cursor) for i in batch]
    assert sorted(taken + rest) == list(range(24)) and len(rest) == 12
    other = PreparedLoader(loader(), 0, 1, cpu, restored=cursor)
    other.sampler.set_epoch(2)
    assert len([i for batch in other for i in batch]) == 24  # epoch 2: the cursor of epoch 1 does not apply
