"""A seeded driver script with a durable run, for the driver-crash test (tests/test_durable_driver.py).

    python tests/durable_driver.py STORAGE LOGDIR OUT [--pause-after N --marker PATH]

Trains 2 workers with ``storage_path=STORAGE`` and ``logdir=LOGDIR`` in the loop
``while trainer.train()["epoch"] < 4``, then writes the final model state to OUT. With
``--pause-after N`` it waits, after epoch N's checkpoint is durable, until it is killed (writing
``--marker`` first, so the test knows when to kill it).
"""
import argparse
import logging
import os
import sys
import time

import ray
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)

from helpers import FaultyOperator  # noqa: E402 (LinearOperator's loops, with input dropout)

from raysgd import TorchTrainer  # noqa: E402

EPOCHS = 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("logdir")
    parser.add_argument("out")
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--marker", default=None)
    parser.add_argument("--pause-s", type=float, default=120)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    pythonpath = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    trainer = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, storage_path=args.storage,
                           logdir=args.logdir, timeout_s=60,
                           config={"lr": 0.05, "momentum": 0.9, "shuffle": True, "batch_size": 8, "data_size": 64,
                                   "input_dropout": 0.3})  # random draws every batch; validate() between
    while True:
        epoch = trainer.train()["epoch"]
        trainer.validate()
        if epoch == args.pause_after:
            trainer._durable.flush(timeout_s=60)  # the checkpoint of this epoch is durable now
            with open(args.marker, "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(args.pause_s)  # the test kills this process group here
            raise SystemExit("not killed in time")
        if epoch >= EPOCHS:
            break
    torch.save(trainer.get_model().state_dict(), args.out)
    trainer.shutdown()


if __name__ == "__main__":
    main()
