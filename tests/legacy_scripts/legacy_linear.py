"""A RaySGD 1.x program, unchanged: every raysgd name comes from ray.util.sgd.

Run by tests/api/test_compat.py as ``python -m raysgd.legacy legacy_linear.py --num-workers 2 --out result.json``.
"""
import argparse
import json
import os
import sys

import ray
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from ray.util.sgd import TorchTrainer
from ray.util.sgd.torch import TrainingOperator
from ray.util.sgd.torch.examples.train_example import LinearDataset
from ray.util.sgd.utils import BATCH_SIZE

import legacy_helpers  # next to this script; it imports from ray.util.sgd too, and the workers import it


class LinearOperator(TrainingOperator):
    def setup(self, config):
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=optimizer, criterion=nn.MSELoss())
        self.register_data(
            train_loader=DataLoader(LinearDataset(2, 5, size=256), batch_size=config[BATCH_SIZE]),
            validation_loader=DataLoader(LinearDataset(2, 5, size=100), batch_size=50))
        self.where = legacy_helpers.describe_process()  # runs on the worker


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=args.num_workers,
                           config={"lr": 1e-2, BATCH_SIZE: 32})
    losses = [trainer.train()["train_loss"] for _ in range(3)]
    validation = trainer.validate()
    workers = trainer.apply_all_operators(lambda operator: operator.where)
    trainer.shutdown()
    ray.shutdown()
    with open(args.out, "w") as handle:
        json.dump({"argv": sys.argv, "name": __name__, "losses": losses, "val_num_samples": validation["num_samples"],
                   "workers": workers, "driver_pid": os.getpid()}, handle)
