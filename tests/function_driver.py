"""A ``raysgd.train`` driver for test_mlflow's killed-driver test: a training function makes six reports, the even
ones with a checkpoint, to an ``MLflowLogger``. Its metrics have no ``epoch``: the logger numbers the reports.

    python tests/function_driver.py TRACKING_URI STORAGE_PATH [--pause PATH]

With ``--pause PATH`` rank 0 writes PATH after the fifth report and waits there, to be killed with its driver.
Every report's ``run`` metric is 1 with ``--pause``, else 2: the test tells which driver logged a step. The driver
joins the cluster of ``RAY_ADDRESS`` (as ``fit()`` does).

Imported, :func:`six_reports` also loses its worker once: with ``config["kill"]`` (a path) rank 0 waits before
report ``config["kill_at"]`` (default 6) until ``config["release"]`` exists (the test saw the report before it
logged), writes ``kill`` and SIGKILLs itself; the attempt after it reports ``run`` + 1.
"""
import argparse
import json
import os
import signal
import tempfile
import time

import raysgd.train
from raysgd.loggers import MLflowLogger
from raysgd.train import Checkpoint, RunConfig, ScalingConfig
from raysgd.train.torch import TorchTrainer

PAUSE_S = 300  # the longest a paused rank waits for its kill


def six_reports(config):
    """Reports 1-6 (``loss`` 1/step), a checkpoint keeping the step at every even one; resumes after its step."""
    start, kill = 0, config.get("kill")
    run = config["run"] + (1 if kill and os.path.exists(kill) else 0)
    checkpoint = raysgd.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder, open(os.path.join(folder, "step.json")) as handle:
            start = json.load(handle)["step"]
    for step in range(start + 1, 7):
        if step == 6 and config.get("pause"):
            open(config["pause"], "w").close()
            time.sleep(PAUSE_S)
        if step == config.get("kill_at", 6) and kill and not os.path.exists(kill):
            deadline = time.monotonic() + PAUSE_S
            while not os.path.exists(config["release"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            open(kill, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        metrics = {"loss": 1.0 / step, "run": run}
        if step % 2:
            raysgd.train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "step.json"), "w") as handle:
                json.dump({"step": step}, handle)
            raysgd.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tracking_uri")
    parser.add_argument("storage_path")
    parser.add_argument("--pause", default=None)
    args = parser.parse_args()
    logger = MLflowLogger(tracking_uri=args.tracking_uri, experiment_name="function-killed", run_name="six")
    TorchTrainer(six_reports, train_loop_config={"pause": args.pause, "run": 1 if args.pause else 2},
                 scaling_config=ScalingConfig(num_workers=1),
                 run_config=RunConfig(name="six", storage_path=args.storage_path, callbacks=[logger])).fit()


if __name__ == "__main__":
    main()
