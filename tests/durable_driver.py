"""A seeded driver script with a durable run, for the driver-crash tests (tests/cluster/storage/test_durable_driver.py).

    python tests/durable_driver.py STORAGE LOGDIR OUT [--pause-after N --marker PATH] [--counting] [--config JSON]
    python tests/durable_driver.py STORAGE LOGDIR OUT --and-counting OUT2

Trains 2 workers with ``storage_path=STORAGE`` and ``logdir=LOGDIR`` in the loop
``while trainer.train()["epoch"] < 4`` (with ``validate()`` between), then writes the final model state to
OUT. With ``--pause-after N`` it waits, after epoch N's checkpoint is durable, until it is killed (writing
``--marker`` first, so the test knows when to kill it). The operator is ``FaultyOperator`` (input dropout),
or with ``--counting`` ``CountingOperator`` (``p[i]`` counts how often sample ``i`` was trained; dropout; a
commit only where the ranks stop for a SIGTERM). ``--config`` adds to the operator's config (its faults).
``--mlflow URI`` logs to MLflow (experiment ``durable``); ``--pause-at-result N`` pauses (marker, then sleep) inside
a callback at epoch N's train result, after MLflow logged it and before its checkpoint is written (epoch N-1's
checkpoint is made durable first).
``--wandb DIR`` logs to Weights & Biases offline under DIR (project ``durable``). ``--strategy fsdp`` shards the
models; ``--num-workers N`` trains on N workers instead of 2.
``--and-counting OUT2`` (with none of the options above) then trains an uninterrupted ``--counting`` run too, in
the same driver and Ray cluster (STORAGE and LOGDIR with ``-counting`` added), and writes its final model state to
OUT2: the tests' two references take one driver and cluster start instead of two.
"""
import argparse
import json
import logging
import os
import sys
import time

import ray
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from helpers import CountingOperator, FaultyOperator, seeding_hook  # noqa: E402

from raysgd import Callback, TorchTrainer  # noqa: E402

EPOCHS = 4


class PauseAtResult(Callback):
    """Writes the marker and waits to be killed at epoch ``epoch``'s train result (after the callbacks before it)."""

    def __init__(self, epoch, marker, pause_s):
        self.epoch, self.marker, self.pause_s = epoch, marker, pause_s

    def on_train_result(self, trainer, result):
        if result["epoch"] == self.epoch:
            with open(self.marker, "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(self.pause_s)  # the test kills this process group here
            os._exit(3)  # not killed in time (a raise would be logged and skipped)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("logdir")
    parser.add_argument("out")
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--pause-s", type=float, default=120)
    parser.add_argument("--counting", action="store_true")
    parser.add_argument("--config", default="{}")
    parser.add_argument("--mlflow", default=None)
    parser.add_argument("--pause-at-result", type=int, default=None)
    parser.add_argument("--wandb", default=None)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--and-counting", default=None)
    args = parser.parse_args()
    if args.and_counting and (args.counting or args.config != "{}" or args.mlflow or args.wandb
                              or args.pause_after is not None or args.pause_at_result is not None):
        parser.error("--and-counting is for an uninterrupted reference run (no faults, pauses or trackers)")
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    # The cluster's workers inherit this (no job runtime_env: see tests/conftest.py, which set the rest of it).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    train(args, args.counting, args.storage, args.logdir, args.out)
    if args.and_counting:
        train(args, True, args.storage + "-counting", args.logdir + "-counting", args.and_counting)


def train(args, counting, storage, logdir, out):
    """One run: ``while trainer.train()["epoch"] < 4`` from the newest checkpoint in ``storage``; the final model state
    to ``out``."""
    if counting:
        options = dict(training_operator_cls=CountingOperator, commit_every_n_steps=1000,
                       initialization_hook=seeding_hook, config={"n": 96, "batch_size": 4})
    else:
        options = dict(training_operator_cls=FaultyOperator,
                       config={"lr": 0.05, "momentum": 0.9, "shuffle": True, "batch_size": 8, "data_size": 64,
                               "input_dropout": 0.3})  # random draws every batch; validate() between
    options["config"].update(json.loads(args.config))
    callbacks = []
    if args.mlflow:
        from raysgd.loggers import MLflowLogger  # noqa: PLC0415 (mlflow only when asked)

        callbacks.append(MLflowLogger(tracking_uri=args.mlflow, experiment_name="durable"))
    if args.wandb:
        from raysgd.loggers import WandbLogger  # noqa: PLC0415 (wandb only when asked)

        callbacks.append(WandbLogger(project="durable", mode="offline", dir=args.wandb))
    if args.pause_at_result is not None:
        callbacks.append(PauseAtResult(args.pause_at_result, args.marker, args.pause_s))
    options["callbacks"] = callbacks
    trainer = TorchTrainer(num_workers=args.num_workers, strategy=args.strategy, storage_path=storage,
                           logdir=logdir, timeout_s=60, **options)
    while True:
        epoch = trainer.train()["epoch"]
        if not counting:
            trainer.validate()
        if args.pause_at_result is not None and epoch == args.pause_at_result - 1:
            # the previous epoch's checkpoint is durable before the paused one trains: the pause holds the callbacks,
            # and with them the writer's on_checkpoint (hooks never run at the same time)
            trainer.controller.durable.flush(timeout_s=60)
        if epoch == args.pause_after:
            trainer.controller.durable.flush(timeout_s=60)  # the checkpoint of this epoch is durable now
            with open(args.marker, "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(args.pause_s)  # the test kills this process group here
            raise SystemExit("not killed in time")
        if epoch >= EPOCHS:
            break
    torch.save(trainer.get_model().state_dict(), out)
    trainer.shutdown()


if __name__ == "__main__":
    main()
