"""MLflowLogger against a real ``mlflow server`` (sqlite backend, artifacts served by it, on 127.0.0.1) and against
local stores: params from config, metrics per epoch at ``step=epoch``, checkpoints as artifacts, and a driver
SIGKILLed mid-run that runs again continuing the same MLflow run with every step exactly once (the same driver logs
to W&B too: its run continues the same way, see tests/cluster/integrations/test_wandb.py)."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

mlflow = pytest.importorskip("mlflow")

from conftest import TESTS_DIR  # noqa: E402
from helpers import LinearOperator  # noqa: E402
from raysgd import optional  # noqa: E402
from raysgd.loggers import MLflowLogger  # noqa: E402
from test_durable_driver import checkpointed, finish_driver, kill_driver, start_driver, wait_until  # noqa: E402

CONFIG = {"lr": 0.01, "data_size": 40, "batch_size": 10}
SERVER_START_S = 120
HOLD_S = 120  # the longest the gated proxy holds a request


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
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            # no job runner: raysgd runs no MLflow server jobs, and its eight polling processes
                            # (huey consumers) would take about half a core for as long as the server lives
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
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


class GatedProxy:
    """A real HTTP reverse proxy on 127.0.0.1 in front of the MLflow server whose requests wait while it is ``held``
    (at most ``HOLD_S``): a tracking server as slow as the test wants. ``drop()`` closes every held and later
    request unanswered (a server gone, as for a driver killed with its writes in flight)."""

    def __init__(self, upstream):
        self.upstream, self.mode, self.changed = upstream, "open", threading.Condition()
        self.held = 0  # requests waiting now
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.changed:
                    proxy.held += 1
                    proxy.changed.notify_all()
                    proxy.changed.wait_for(lambda: proxy.mode != "held", timeout=HOLD_S)
                    proxy.held -= 1
                    mode = proxy.mode
                if mode != "open":
                    self.close_connection = True  # no answer: the client sees the connection closed
                    return
                request = urllib.request.Request(proxy.upstream + self.path, data=body or None, method=self.command,
                                                 headers={"Content-Type": self.headers.get("Content-Type",
                                                                                           "application/json")})
                try:
                    with urllib.request.urlopen(request, timeout=60) as answer:
                        status, payload, kind = answer.status, answer.read(), answer.headers.get("Content-Type")
                except urllib.error.HTTPError as err:
                    status, payload, kind = err.code, err.read(), err.headers.get("Content-Type")
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PATCH = do_DELETE = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, mode):
        with self.changed:
            self.mode = mode
            self.changed.notify_all()

    def wait_held(self, count=1, timeout_s=60):
        """Wait until ``count`` requests are held (a write reached the server's door and waits there)."""
        with self.changed:
            assert self.changed.wait_for(lambda: self.held >= count, timeout=timeout_s), \
                f"no request reached the proxy within {timeout_s} s"

    def close(self):
        self.set("dropped")
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gated_proxy(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a dropped request fails at once
    proxy = GatedProxy(mlflow_server)
    yield proxy
    proxy.close()


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


def test_a_driver_killed_after_logging_continues_the_same_mlflow_and_wandb_runs_with_every_step_once(
        tmp_path, mlflow_server, monkeypatch):
    """The driver, logging to MLflow and to W&B (offline), is SIGKILLed at epoch 3's result, after both loggers took
    it but before its checkpoint: the rerun resumes from epoch 2's checkpoint, trains epoch 3 again and goes on in
    the same MLflow run and the same W&B run id. MLflow logs epoch 3 only once (the value logged first stays),
    epochs 1-4 once each; W&B's rerun logs epochs 3-4 and no step is in the run twice (wandb-core buffers its
    offline transaction log: what it had not written when killed is lost, as any unflushed offline data). One
    killed driver for both trackers: each driver start is a Ray cluster and two workers (~12 s here)."""
    wandb_files = pytest.importorskip("test_wandb")  # W&B's offline logs (the rest of this module needs no wandb)
    wandb_files.use_offline_wandb(monkeypatch, tmp_path)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # this process's wandb-core: each driver starts its own
    marker, runs, storage = tmp_path / "paused", tmp_path / "wandb-runs", str(tmp_path / "storage")
    trackers = ["--mlflow", mlflow_server, "--wandb", str(runs)]
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    proc = start_driver(tmp_path, "crash", *trackers, "--pause-at-result", "3", "--marker", str(marker),
                        storage_path=storage)

    def logged_epoch_3():  # the logger's thread writes it while the driver is paused
        experiment = client.get_experiment_by_name("durable")
        runs = client.search_runs([experiment.experiment_id]) if experiment is not None else []
        return len(runs) == 1 and 3 in [step for step, _ in history(client, runs[0].info.run_id, "train/train_loss")]

    try:
        wait_until(marker.exists, proc, "the driver paused at epoch 3's result")
        wait_until(logged_epoch_3, proc, "MLflow holds epoch 3's result", timeout_s=60)
        wait_until(checkpointed(storage, 2), proc, "epoch 2's checkpoint is complete", timeout_s=60)
    finally:
        kill_driver(proc)
    experiment = client.get_experiment_by_name("durable")
    (run,) = client.search_runs([experiment.experiment_id])
    assert [step for step, _ in history(client, run.info.run_id, "train/train_loss")] == [1, 2, 3]
    first_three = history(client, run.info.run_id, "train/train_loss")
    (killed,) = wandb_files.segments(runs)
    run_id = os.path.basename(killed)[len("run-"):-len(".wandb")]
    assert set(row["_step"] for row in wandb_files.rows([killed])) <= {1, 2, 3}

    _, log = finish_driver(tmp_path, "crash", start_driver(tmp_path, "crash", *trackers, storage_path=storage))

    assert "Continuing MLflow run" in log and "already holds step 3 of" in log  # epoch 3 was really trained again
    (again,) = client.search_runs([experiment.experiment_id])
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    train = history(client, run.info.run_id, "train/train_loss")
    assert [step for step, _ in train] == [1, 2, 3, 4] and train[:3] == first_three
    assert [step for step, _ in history(client, run.info.run_id, "validate/val_loss")] == [1, 2, 3, 4]

    assert f"Continuing wandb run {run_id}" in log
    paths = wandb_files.segments(runs, run_id)
    assert len(paths) == 2 and paths[0] == killed and wandb_files.ends_with_exit(paths[1])  # the rerun has ended
    assert [r.run_id for r in wandb_files.run_records(paths[1])] == [run_id]
    steps = [row["_step"] for row in wandb_files.rows(paths)]
    assert [row["_step"] for row in wandb_files.rows(paths[1:])] == [3, 4] and sorted(steps) == sorted(set(steps))


def run_in_thread(fn, timeout_s=60):
    """``fn()`` on a thread; its result, or a failure when it has not returned within ``timeout_s``."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still waiting after {timeout_s} s (the tracking server holds its requests)"
    return out["result"]


@pytest.mark.usefixtures("ray_2cpus")
def test_a_tracking_server_that_does_not_answer_does_not_hold_up_train(trainer_factory, mlflow_server, gated_proxy):
    """While the server's requests are held, train() and validate() return (MLflow writes on the logger's thread);
    once the server answers, flush() sees every step in the run, in order."""
    logger = MLflowLogger(tracking_uri=gated_proxy.uri, experiment_name="gated")
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=1, config=CONFIG, callbacks=[logger])
    gated_proxy.set("held")
    losses = [run_in_thread(trainer.train)["train_loss"] for _ in range(2)]
    run_in_thread(trainer.validate)
    gated_proxy.wait_held()  # the first write (the run's start) waits at the server's door
    assert logger.run_id is None  # nothing reached MLflow yet
    gated_proxy.set("open")
    logger.flush(timeout_s=60)
    trainer.shutdown()
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    assert history(client, logger.run_id, "train/train_loss") == [(1, losses[0]), (2, losses[1])]
    assert [step for step, _ in history(client, logger.run_id, "validate/val_loss")] == [2]
    assert client.get_run(logger.run_id).info.status == "FINISHED"


@pytest.mark.usefixtures("ray_2cpus")
def test_results_still_queued_at_a_checkpoint_are_written_by_the_resumed_run(trainer_factory, mlflow_server,
                                                                             gated_proxy, tmp_path, caplog):
    """Epoch 2's result is queued but never reaches the server (held, then dropped: a driver killed with the write
    in flight); its checkpoint's marker names it, so the trainer resumed from that checkpoint writes it: epochs 1-3
    once each. The dropped write's error is logged and raised at shutdown (by on_shutdown: the trainer logs it)."""
    storage = str(tmp_path / "storage")
    first = MLflowLogger(tracking_uri=gated_proxy.uri, experiment_name="queued")
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=1, config=CONFIG,
                              storage_path=storage, callbacks=[first])
    loss_1 = trainer.train()["train_loss"]
    gated_proxy.set("held")
    loss_2 = run_in_thread(trainer.train)["train_loss"]
    gated_proxy.wait_held()
    trainer.controller.durable.flush(timeout_s=60)  # epoch 2's checkpoint, its marker naming the queued result
    gated_proxy.set("dropped")
    trainer.shutdown()
    assert "MLflowLogger: writing train step 2" in caplog.text and "failed in the background" in caplog.text
    second = MLflowLogger(tracking_uri=mlflow_server, experiment_name="queued")
    resumed = trainer_factory(training_operator_cls=LinearOperator, num_workers=1, config=CONFIG,
                              storage_path=storage, callbacks=[second])
    loss_3 = resumed.train()["train_loss"]
    resumed.shutdown()
    assert second.run_id == first.run_id
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    assert history(client, first.run_id, "train/train_loss") == [(1, loss_1), (2, loss_2), (3, loss_3)]
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_a_rewind_lets_the_queued_writes_land_first_so_every_step_is_logged_once(gated_proxy, mlflow_server):
    """A logger rewound to step 0 of its run (a training function restarted before its first checkpoint) while its
    writes of steps 2 and 3 wait at a slow server: the rewind waits for them, so the steps made again (1-4) are
    written only where the run lacks them. Without that wait the run's steps would be read before 2 and 3 landed,
    and both would be written twice."""
    logger = MLflowLogger(tracking_uri=gated_proxy.uri, experiment_name="rewound")
    logger.on_train_result(None, {"loss": 1.0, "run": 1})
    logger.flush(timeout_s=60)
    gated_proxy.set("held")
    for step in (2, 3):
        logger.on_train_result(None, {"loss": 1.0 / step, "run": 1})
    gated_proxy.wait_held()
    rewound = threading.Thread(target=logger.rewind, daemon=True)
    rewound.start()
    rewound.join(0.5)
    assert rewound.is_alive()  # held by the queued writes: the server has not answered them
    gated_proxy.set("open")
    rewound.join(60)
    assert not rewound.is_alive() and logger.epoch == 0
    for step in range(1, 5):
        logger.on_train_result(None, {"loss": 1.0 / step, "run": 2})
    logger.on_shutdown(None)
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    assert history(client, logger.run_id, "train/run") == [(1, 1), (2, 1), (3, 1), (4, 2)]
    assert client.get_run(logger.run_id).info.status == "FINISHED"


def test_a_logger_is_picklable_for_tune_trials(tmp_path):
    import pickle

    logger = MLflowLogger(tracking_uri=str(tmp_path / "runs"), experiment_name="pickled", tags={"a": "b"})
    copy = pickle.loads(pickle.dumps(logger))
    assert copy.tags == {"a": "b"} and copy.client.tracking_uri == logger.tracking_uri


def reports_three_epochs(config):
    """A training function reporting a checkpoint and its loss each epoch (every rank: a collective)."""
    import tempfile

    import torch

    import raysgd.train

    for epoch in range(3):
        with tempfile.TemporaryDirectory() as folder:
            torch.save({"epoch": epoch}, os.path.join(folder, "state.pt"))
            raysgd.train.report({"epoch": epoch + 1, "loss": 1.0 / (epoch + 1)},
                                checkpoint=raysgd.train.Checkpoint.from_directory(folder))


@pytest.mark.usefixtures("ray_2cpus")
def test_a_training_function_logs_every_report_and_checkpoint_to_the_server(mlflow_server, tmp_path):
    """raysgd.train's RunConfig(callbacks=[MLflowLogger(...)]): the same logger as the operator API's, fed by every
    report (its metrics at the reported epoch), each checkpoint an artifact, the run finished at the end."""
    from raysgd.train import RunConfig, ScalingConfig
    from raysgd.train.torch import TorchTrainer

    logger = MLflowLogger(tracking_uri=mlflow_server, experiment_name="function", run_name="fn",
                          log_checkpoints=True)
    result = TorchTrainer(reports_three_epochs, train_loop_config={"lr": 0.5},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="fn", storage_path=str(tmp_path), callbacks=[logger])).fit()
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "fn" and run.data.params["lr"] == "0.5"
    assert history(client, run.info.run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    logged = {os.path.basename(a.path) for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert logged == {"checkpoint_000001", "checkpoint_000002", "checkpoint_000003"}
    files = {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, "checkpoints/checkpoint_000003")}
    assert "state.pt" in files and os.path.basename(result.checkpoint.path) == "checkpoint_000003"


@pytest.mark.usefixtures("ray_2cpus")
def test_a_killed_function_driver_run_again_goes_on_from_its_checkpoints_logged_step(mlflow_server, tmp_path):
    """A training function's driver (tests/function_driver.py, on this cluster) is SIGKILLed after its fifth report,
    which MLflow holds, and the fourth's checkpoint. Run again, it resumes from that checkpoint, and the logger
    with it: from the state kept in the checkpoint's folder, at step 4, in the same MLflow run. The function
    reports step 5 again (not logged: the run has it) and then step 6: every step once, at its own number."""
    import ray

    script = os.path.join(TESTS_DIR, "function_driver.py")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    storage, paused = str(tmp_path / "storage"), tmp_path / "paused"
    client = mlflow.MlflowClient(tracking_uri=mlflow_server)

    def start(*extra):
        with open(tmp_path / "driver.log", "a") as log:
            return subprocess.Popen([sys.executable, script, mlflow_server, storage, *extra], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def runs():
        experiment = client.get_experiment_by_name("function-killed")
        return client.search_runs([experiment.experiment_id]) if experiment is not None else []

    def logged_step_5():  # the logger's thread writes it while rank 0 waits
        found = runs()
        return len(found) == 1 and 5 in [step for step, _ in history(client, found[0].info.run_id, "train/loss")]

    first = start("--pause", str(paused))
    try:
        wait_until(paused.exists, first, "rank 0 waits after its fifth report")
        wait_until(logged_step_5, first, "MLflow holds the fifth report", timeout_s=60)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    (run,) = runs()
    assert [step for step, _ in history(client, run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    kept = tmp_path / "storage" / "six" / "checkpoint_000002" / ".raysgd_callbacks.json"
    assert kept.exists() and not (tmp_path / "storage" / "six" / ".raysgd_callbacks.json").exists()

    second = start()
    try:
        second.wait(timeout=300)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(timeout=60)
    log = (tmp_path / "driver.log").read_text()
    assert second.returncode == 0, log[-4000:]
    assert f"Continuing MLflow run {run.info.run_id} after step 4" in log
    (again,) = runs()
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert history(client, run.info.run_id, "train/loss") == [(step, 1.0 / step) for step in range(1, 7)]
    assert history(client, run.info.run_id, "train/run") == [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 2)]


@pytest.mark.usefixtures("ray_2cpus")
@pytest.mark.parametrize("kill_at", [6, 2], ids=["after-a-checkpoint", "before-the-first-checkpoint"])
def test_a_training_function_restarted_after_a_lost_worker_logs_every_step_once(mlflow_server, tmp_path,
                                                                               monkeypatch, kill_at):
    """The training function's only worker SIGKILLs itself before report ``kill_at``, once both loggers (MLflow, and
    W&B offline) took the one before: the function runs again, from the fourth report's checkpoint (kill_at 6:
    the callbacks are rewound with it, to the state kept in that checkpoint's folder) or from its beginning
    (kill_at 2, before the first checkpoint: the callbacks are rewound to step 0 of their runs). Either way the
    reports made again are logged neither a second time nor at new steps. One run for both trackers, as for the
    killed driver."""
    wandb_files = pytest.importorskip("test_wandb")
    wandb_files.use_offline_wandb(monkeypatch, tmp_path)
    from function_driver import six_reports
    from raysgd.loggers import WandbLogger
    from raysgd.train import FailureConfig, RunConfig, ScalingConfig
    from raysgd.train.torch import TorchTrainer

    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    release, runs = tmp_path / "release", tmp_path / "wandb-runs"
    mlflow_logger = MLflowLogger(tracking_uri=mlflow_server, experiment_name=f"restarted-{kill_at}")
    wandb_logger = WandbLogger(project="restarted", mode="offline", dir=runs)
    stop, last = threading.Event(), kill_at - 1

    def logged_last():
        return mlflow_logger.run_id is not None and wandb_logger.epoch == last and \
            last in [step for step, _ in history(client, mlflow_logger.run_id, "train/loss")]

    def release_once_logged():  # the worker dies only after the driver heard the report and MLflow holds it
        while not stop.wait(0.05):
            if logged_last():
                release.touch()
                return

    watcher = threading.Thread(target=release_once_logged, daemon=True)
    watcher.start()
    try:
        result = TorchTrainer(six_reports, train_loop_config={"run": 1, "kill": str(tmp_path / "killed"),
                                                              "release": str(release), "kill_at": kill_at},
                              scaling_config=ScalingConfig(num_workers=1),
                              run_config=RunConfig(name="six", storage_path=str(tmp_path / "storage"),
                                                   callbacks=[mlflow_logger, wandb_logger],
                                                   failure_config=FailureConfig(max_failures=1))).fit()
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert release.exists() and (tmp_path / "killed").exists() and result.num_failures == 1
    run_id = mlflow_logger.run_id
    first_run = [(step, 1) for step in range(1, kill_at)]
    second_run = [(step, 2) for step in range(kill_at, 7)]
    assert history(client, run_id, "train/loss") == [(step, 1.0 / step) for step in range(1, 7)]
    assert history(client, run_id, "train/run") == first_run + second_run
    assert client.get_run(run_id).info.status == "FINISHED"
    (path,) = wandb_files.segments(runs, wandb_logger.run_id, finished=1)  # one wandb.init: the run stayed open
    rows = wandb_files.rows([path])
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert wandb_files.history(rows, "train/run") == first_run + second_run
