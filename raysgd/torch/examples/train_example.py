"""The 1.x linear-regression example: ``LinearDataset``, the creator functions and ``train_example``.

Run it: ``python -m raysgd.torch.examples.train_example --num-workers 2``.

Example:
    >>> ds = LinearDataset(2, 5, size=4)
    >>> len(ds), ds[1][0].tolist(), ds[1][1].tolist()
    (4, [2.5], [10.0])
"""
import argparse
import logging

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from raysgd.base.checks import is_whole
from raysgd.torch import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

logger = logging.getLogger(__name__)


class LinearDataset(torch.utils.data.Dataset):
    """``y = a * x + b`` for ``size`` points ``x`` evenly spaced in ``[0, 10)``."""

    def __init__(self, a, b, size=1000):
        x = np.arange(0, 10, 10 / size, dtype=np.float32)
        self.x = torch.from_numpy(x)
        self.y = torch.from_numpy(a * x + b)

    def __getitem__(self, index):
        return self.x[index, None], self.y[index, None]

    def __len__(self):
        return len(self.x)


def model_creator(config):
    return nn.Linear(1, config.get("hidden_size", 1))


def optimizer_creator(model, config):
    """Returns an optimizer (or multiple)."""
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))


def scheduler_creator(optimizer, config):
    """Returns a learning rate scheduler wrapping the optimizer."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)


def loader_batch_size(config, default=32):
    """The batch size of a 1.x example loader that reads ``config["batch_size"]`` (this module's, the DCGAN's).

    ``config["batch_size"]`` as in RaySGD 1.12, else the worker's share of ``config[BATCH_SIZE]`` (1.12 ignored
    it here and silently trained with 32), else ``default``.

    Example:
        >>> loader_batch_size({"batch_size": 4}), loader_batch_size({BATCH_SIZE: 64}), loader_batch_size({})
        (4, 64, 32)
    """
    size = config["batch_size"] if "batch_size" in config else config.get(BATCH_SIZE, default)
    return int(size) if is_whole(size, 1) else size  # numpy's (a Tune sample) or 8.0: DataLoader takes only an int


def data_creator(config):
    """Returns training and validation loaders (``data_size``/``val_size`` points, :func:`loader_batch_size`)."""
    train_dataset = LinearDataset(2, 5, size=config.get("data_size", 1000))
    val_dataset = LinearDataset(2, 5, size=config.get("val_size", 400))
    train_loader = DataLoader(train_dataset, batch_size=loader_batch_size(config))
    validation_loader = DataLoader(val_dataset, batch_size=loader_batch_size(config))
    return train_loader, validation_loader


def train_example(num_workers=1, use_gpu=False):
    """Five epochs of linear regression with ``from_creators``; returns the trained model."""
    CustomTrainingOperator = TrainingOperator.from_creators(  # noqa: N806
        model_creator=model_creator, optimizer_creator=optimizer_creator, data_creator=data_creator,
        scheduler_creator=scheduler_creator, loss_creator=nn.MSELoss)
    trainer = TorchTrainer(training_operator_cls=CustomTrainingOperator, num_workers=num_workers,
                           use_gpu=use_gpu, config={"lr": 1e-2, "hidden_size": 1, "batch_size": 4},
                           backend="gloo", scheduler_step_freq="epoch")
    for i in range(5):
        stats = trainer.train()
        logger.info("epoch %d: %s", i, stats)
    logger.info("validation: %s", trainer.validate())
    model = trainer.get_model(to_cpu=True)
    logger.info("trained weight %s, bias %s", model.weight.item(), model.bias.item())
    trainer.shutdown()
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="RaySGD linear regression")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    parser.add_argument("--num-workers", "-n", type=int, default=1)
    parser.add_argument("--use-gpu", action="store_true", default=False)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    import ray

    ray.init(address=args.address or "local", include_dashboard=False)
    train_example(num_workers=args.num_workers, use_gpu=args.use_gpu)
