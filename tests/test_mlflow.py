"""MLflowLogger against a real ``mlflow server`` (sqlite backend, artifacts served by it, on 127.0.0.1) and against
local stores: params from config, metrics per epoch at ``step=epoch``, checkpoints as artifacts, and a driver
SIGKILLed mid-run that runs again continuing the same MLflow run with every step exactly once."""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

mlflow = pytest.importorskip("mlflow")

from helpers import LinearOperator  # noqa: E402
from raysgd import optional  # noqa: E402
from raysgd.loggers import MLflowLogger  # noqa: E402
from test_durable_driver import finish_driver, kill_driver, start_driver, wait_until  # noqa: E402

CONFIG = {"lr": 0.01, "data_size": 40, "batch_size": 10}
SERVER_START_S = 120


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on a free port of 127.0.0.1 (sqlite backend, artifacts it serves); its URI."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{folder}/mlflow.db", "--artifacts-destination", str(folder / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mlflow server did not answer within {SERVER_START_S} s (exit code "
                                     f"{proc.poll()}): {(folder / 'server.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield uri
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_bad_arguments_and_a_missing_mlflow_are_clear_errors(monkeypatch):
    with pytest.raises(TypeError, match="MLflowLogger: tags expects None or a dict with str keys; got"):
        MLflowLogger(experiment_name="x", tags=["a"])
    with pytest.raises(TypeError, match="experiment_name expects a non-empty str"):
        MLflowLogger(experiment_name="")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "raysgd\[mlflow\]"') as info:
        MLflowLogger(experiment_name="x")
    assert isinstance(info.value, optional.MissingExtra) and info.value.extra == "mlflow"


@pytest.mark.usefixtures("ray_2cpus")
def test_a_run_logs_params_metrics_per_epoch_and_checkpoints_to_a_server(trainer_factory, mlflow_server, tmp_path):
    logger = MLflowLogger(tracking_uri=mlflow_server, experiment_name="server", run_name="linear",
                          tags={"team": "sgd"}, log_checkpoints=True)
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG,
                              storage_path=str(tmp_path / "storage"), callbacks=[logger])
    losses = []
    for _ in range(3):
        losses.append(trainer.train()["train_loss"])
        trainer.validate()
    trainer.shutdown()
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "linear" and run.data.tags["team"] == "sgd"
    assert run.data.params["lr"] == "0.01" and run.data.params["batch_size"] == "10"
    assert history(client, run.info.run_id, "train/train_loss") == [(1, losses[0]), (2, losses[1]), (3, losses[2])]
    assert [step for step, _ in history(client, run.info.run_id, "validate/val_loss")] == [1, 2, 3]
    logged = {os.path.basename(a.path) for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert logged and all(name.startswith("checkpoint_") for name in logged)
    files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, f"checkpoints/{max(logged)}")}
    assert "checkpoint.json" in files


@pytest.mark.usefixtures("ray_2cpus")
@pytest.mark.parametrize("store", ["folder", "file_uri"])
def test_local_stores(trainer_factory, tmp_path, monkeypatch, store):
    """A plain folder is MLflow's sqlite store in it; a ``file:`` URI is MLflow's file store (allowed by env)."""
    if store == "folder":
        uri, reader = str(tmp_path / "runs"), f"sqlite:///{tmp_path / 'runs'}/mlflow.db"
    else:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = reader = (tmp_path / "mlruns").as_uri()
    logger = MLflowLogger(tracking_uri=uri, experiment_name="local")
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=1, config=CONFIG,
                              callbacks=[logger])
    trainer.train()
    trainer.train()
    trainer.shutdown()
    client = mlflow.MlflowClient(tracking_uri=reader)
    assert [step for step, _ in history(client, logger.run_id, "train/train_loss")] == [1, 2]
    assert client.get_run(logger.run_id).info.status == "FINISHED"


def test_a_driver_killed_after_logging_continues_the_same_run_with_every_step_once(tmp_path, mlflow_server):
    """The driver is SIGKILLed at epoch 3's result, after MLflow logged it but before its checkpoint: the rerun
    resumes from epoch 2's checkpoint, trains epoch 3 again and goes on in the same MLflow run, logging epoch 3 only
    once (the value logged first stays), epochs 1-4 once each."""
    marker = tmp_path / "paused"
    storage = str(tmp_path / "storage")
    proc = start_driver(tmp_path, "crash", "--mlflow", mlflow_server, "--pause-at-result", "3", "--marker",
                        str(marker), storage_path=storage)
    try:
        wait_until(marker.exists, proc, "the driver paused at epoch 3's result")
    finally:
        kill_driver(proc)
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("durable")
    (run,) = client.search_runs([experiment.experiment_id])
    assert [step for step, _ in history(client, run.info.run_id, "train/train_loss")] == [1, 2, 3]
    first_three = history(client, run.info.run_id, "train/train_loss")
    _, log = finish_driver(tmp_path, "crash", start_driver(tmp_path, "crash", "--mlflow", mlflow_server,
                                                          storage_path=storage))
    assert "Continuing MLflow run" in log and "already holds step 3 of" in log  # epoch 3 was really trained again
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    train = history(client, run.info.run_id, "train/train_loss")
    assert [step for step, _ in train] == [1, 2, 3, 4] and train[:3] == first_three
    assert [step for step, _ in history(client, run.info.run_id, "validate/val_loss")] == [1, 2, 3, 4]


def test_a_logger_is_picklable_for_tune_trials(tmp_path):
    import pickle

    logger = MLflowLogger(tracking_uri=str(tmp_path / "runs"), experiment_name="pickled", tags={"a": "b"})
    copy = pickle.loads(pickle.dumps(logger))
    assert copy.tags == {"a": "b"} and copy.client.tracking_uri == logger.tracking_uri
