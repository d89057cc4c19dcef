"""Operators for tests/test_tune.py (workers import them by name: tests/ is on their PYTHONPATH)."""
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from raysgd.torch import TrainingOperator
from raysgd.torch.examples.train_example import LinearDataset
from raysgd.utils import BATCH_SIZE


class LinearOperator(TrainingOperator):
    """Linear regression on LinearDataset(2, 5); config: lr, BATCH_SIZE or batch_size, data_size, val_size."""

    def setup(self, config):
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.MSELoss())
        batch = config.get(BATCH_SIZE, config.get("batch_size", 16))
        self.register_data(
            train_loader=DataLoader(LinearDataset(2, 5, size=config.get("data_size", 64)), batch_size=batch),
            validation_loader=DataLoader(LinearDataset(2, 5, size=config.get("val_size", 32)), batch_size=batch))


class CrashingOperator(LinearOperator):
    """Kills its own worker process at the start of epoch ``crash_epoch`` until ``crashes`` files are in ``crash_dir``.

    Each crash leaves one file in ``crash_dir``, so the count of crashes survives restarts.
    """

    def train_epoch(self, iterator, info=None, num_steps=None, epoch_idx=0):
        crash_dir = self.config.get("crash_dir")
        if crash_dir and (info or {}).get("epoch_idx") == self.config.get("crash_epoch", 1):
            done = len(os.listdir(crash_dir))
            if done < self.config.get("crashes", 1):
                with open(os.path.join(crash_dir, f"crash-{done}"), "w", encoding="utf-8") as handle:
                    handle.write(str(os.getpid()))
                os._exit(1)
        return super().train_epoch(iterator, info)
