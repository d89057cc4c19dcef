"""RaySGD 1.x's ``ray.util.sgd.data.examples.mlp_identity``: an MLP learns f(x) = x from a sharded ``Dataset``.

The 1.x names are kept (``Net``, ``model_creator``, ``optimizer_creator``, ``to_mat``,
``dataset_creator``); the data are the numbers in [0, 1), turned into ``(x, x)`` pairs by the
dataset's ``download_func``, and every ``train(dataset=..., num_steps=...)`` call trains that many
batches on each worker, from its own shard.

Run it: ``python -m raysgd.data.examples.mlp_identity --num-workers 2`` (or ``--smoke-test``).

Example:
    >>> float(Net()(to_mat(0.5)).shape[1])
    1.0
    >>> dataset_creator(num_points=64).batch_size
    32
"""
import argparse
import logging
import os
import random

import torch
import torch.nn.functional as F
from torch import nn

from raysgd.data.dataset import Dataset

logger = logging.getLogger(__name__)


class Net(nn.Module):
    """1 -> 128 -> 1 with a ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(1, 128)
        self.fc2 = nn.Linear(128, 1)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def model_creator(config):
    """A :class:`Net` (seeded from ``config["seed"]``, default 0)."""
    torch.manual_seed(config.get("seed", 0))
    return Net()


def optimizer_creator(model, config):
    """SGD with ``config["lr"]`` (1.x default 1e-4)."""
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-4))


def to_mat(x):
    """``x`` as a float tensor of shape (1, 1)."""
    return torch.tensor([[x]]).float()


def _identity_pair(x):
    return to_mat(x), to_mat(x)


def dataset_creator(num_points=32 * 100 * 2, batch_size=32, max_concurrency=2, seed=0):
    """The sharded dataset of ``(x, x)`` for ``num_points`` values of x evenly spread over [0, 1), in a seeded shuffle.

    Shuffled because a shard is read in order: trained last on the largest x, the model would lean to them.
    """
    data = [i * (1 / num_points) for i in range(num_points)]
    random.Random(seed).shuffle(data)
    return Dataset(data, batch_size=batch_size, max_concurrency=max_concurrency, download_func=_identity_pair)


def train_example(num_workers=2, use_local=False, num_epochs=5, num_steps=100, lr=1e-2, num_points=6400):
    """Train on the identity for ``num_epochs`` calls of ``num_steps`` batches each; returns (trainer, f(0.5))."""
    from raysgd.torch import TorchTrainer, TrainingOperator  # noqa: PLC0415

    operator_cls = TrainingOperator.from_creators(model_creator=model_creator, optimizer_creator=optimizer_creator,
                                                  loss_creator=nn.MSELoss)
    trainer = TorchTrainer(training_operator_cls=operator_cls, num_workers=num_workers, use_local=use_local,
                           use_gpu=False, config={"lr": lr})
    dataset = dataset_creator(num_points=num_points)
    for epoch in range(num_epochs):
        stats = trainer.train(dataset=dataset, num_steps=num_steps)
        logger.info("call %d: train_loss %.5f on %d samples", epoch + 1, stats["train_loss"], stats["num_samples"])
    with torch.no_grad():
        prediction = float(trainer.get_model()(to_mat(0.5))[0][0])
    logger.info("f(0.5) = %.4f", prediction)
    return trainer, prediction


def main(argv=None):
    """The command line: ``--smoke-test``, ``--num-workers``, ``--address``; returns f(0.5).

    Example:
        >>> main(["--smoke-test"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description="RaySGD 1.x mlp_identity: train(dataset=...) on a sharded Dataset")
    parser.add_argument("--smoke-test", action="store_true", help="2 calls of 25 steps on 1,600 points")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-workers", "-n", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import ray  # noqa: PLC0415

    started = not ray.is_initialized()
    if started and args.address:
        ray.init(address=args.address, include_dashboard=False)
    elif started:  # one CPU beyond the workers' for Ray Data's download_func tasks, even on a 2-core machine
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.num_workers + 1), include_dashboard=False)
    sizes = dict(num_epochs=2, num_steps=25, num_points=1600) if args.smoke_test else {}
    trainer, prediction = train_example(num_workers=args.num_workers, **sizes)
    print(f"f(0.5) = {prediction:.4f}")  # noqa: T201 (the example's output)
    trainer.shutdown()
    if started:
        ray.shutdown()
    return prediction


if __name__ == "__main__":
    main()
