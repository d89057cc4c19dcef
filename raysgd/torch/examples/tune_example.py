"""The 1.x Tune example: ``tune_example``, ``tune_example_manual`` and ``get_custom_training_operator``.

A grid search over the learning rate of a linear regression on
:class:`raysgd.torch.examples.train_example.LinearDataset`, each trial a ``TorchTrainer`` under Ray Tune
(``tune.run``, as in RaySGD 1.x; ``examples/tune_example.py`` shows the same with ``tune.Tuner``).
The creators are this module's own, as in RaySGD 1.12: the loaders read ``config[BATCH_SIZE]`` (the
worker's share of the global batch; ``tune_example`` passes ``{BATCH_SIZE: 128}``), SGD's ``lr`` defaults
to 1e-4, and the scheduler is ``ReduceLROnPlateau(mode="min")`` with torch's patience (10).

Run it: ``python -m raysgd.torch.examples.tune_example --smoke-test [--manual]``.

Example:
    >>> from raysgd.torch.examples.tune_example import get_custom_training_operator, tune_example
    >>> best = tune_example(get_custom_training_operator(), num_workers=1, num_samples=1)  # doctest: +SKIP
    >>> sorted(best)  # doctest: +SKIP
    ['lr']
"""
import argparse
import logging

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from raysgd import optional
from raysgd.torch import TorchTrainer, TrainingOperator
from raysgd.torch.examples.train_example import LinearDataset
from raysgd.utils import BATCH_SIZE

logger = logging.getLogger(__name__)


def model_creator(config):
    """``nn.Linear(1, 1)``."""
    return nn.Linear(1, 1)


def optimizer_creator(model, config):
    """SGD with ``config["lr"]`` (default 1e-4, as in 1.12; Tune's grid sets it)."""
    return torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-4))


def data_creator(config):
    """Loaders of ``y = 2x + 5`` (1,000 training and 400 validation points) with batches of ``config[BATCH_SIZE]``.

    ``config[BATCH_SIZE]`` is the worker's share of the global batch size (1.12 read the same key); a config
    without it is a ``KeyError`` that says so.

    Example:
        >>> train, val = data_creator({BATCH_SIZE: 128})
        >>> train.batch_size, len(train.dataset), len(val.dataset)
        (128, 1000, 400)
    """
    if BATCH_SIZE not in config:
        raise KeyError(f"the Tune example's data_creator reads config[BATCH_SIZE] (the global batch size, split "
                       f"among the workers: config={{BATCH_SIZE: 128}}); the config has {sorted(map(str, config))}")
    return (DataLoader(LinearDataset(2, 5), batch_size=config[BATCH_SIZE]),
            DataLoader(LinearDataset(2, 5, size=400), batch_size=config[BATCH_SIZE]))


def scheduler_creator(optimizer, config):
    """``ReduceLROnPlateau(mode="min")`` on the validation loss, stepped by hand (``scheduler_step_freq="manual"``).

    ``config["patience"]`` sets its patience (default torch's 10, as in 1.12).
    """
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", patience=config.get("patience", 10))


def get_custom_training_operator(lr_reduce_on_plateau=False):
    """The linear-regression operator (``from_creators``), with ``ReduceLROnPlateau`` when asked."""
    return TrainingOperator.from_creators(
        model_creator=model_creator, optimizer_creator=optimizer_creator, data_creator=data_creator,
        loss_creator=nn.MSELoss, scheduler_creator=scheduler_creator if lr_reduce_on_plateau else None)


def manual_step(trainer, info):
    """A custom Tune step (``override_tune_step``): train, validate, then step the scheduler on ``val_loss``."""
    train_stats = trainer.train()
    validation_stats = trainer.validate()
    trainer.update_scheduler(validation_stats["val_loss"])
    lr = trainer.apply_all_operators(lambda operator: operator.optimizer.param_groups[0]["lr"])[0]
    return {**train_stats, **validation_stats, "lr": lr, "step": info["iteration"]}


def tune_example(operator_cls, num_workers=1, use_gpu=False, num_samples=3, storage_path=None):
    """Grid search over ``lr`` (2 iterations a trial); returns the best config by ``val_loss``."""
    tune = optional.require("ray.tune", "the Tune example")

    TorchTrainable = TorchTrainer.as_trainable(  # noqa: N806 (a class)
        training_operator_cls=operator_cls, num_workers=num_workers, use_gpu=use_gpu, config={BATCH_SIZE: 128})
    analysis = tune.run(TorchTrainable, num_samples=num_samples, config={"lr": tune.grid_search([1e-4, 1e-3])},
                        stop={"training_iteration": 2}, storage_path=storage_path, verbose=1)
    return analysis.get_best_config(metric="val_loss", mode="min")


def tune_example_manual(operator_cls, num_workers=1, use_gpu=False, num_samples=3, storage_path=None):
    """As :func:`tune_example`, stepping ``ReduceLROnPlateau`` by hand in a custom step."""
    tune = optional.require("ray.tune", "the Tune example")

    TorchTrainable = TorchTrainer.as_trainable(  # noqa: N806
        training_operator_cls=operator_cls, num_workers=num_workers, use_gpu=use_gpu, config={BATCH_SIZE: 128},
        scheduler_step_freq="manual", override_tune_step=manual_step)
    analysis = tune.run(TorchTrainable, num_samples=num_samples, config={"lr": tune.grid_search([1e-4, 1e-3])},
                        stop={"training_iteration": 2}, storage_path=storage_path, verbose=1)
    return analysis.get_best_config(metric="val_loss", mode="min")


def main(argv=None):
    """Command line: ``--smoke-test`` runs one sample per grid point; ``--manual`` the scheduler variant."""
    parser = argparse.ArgumentParser(description="RaySGD + Tune: grid search over the learning rate")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    parser.add_argument("--num-workers", "-n", type=int, default=1)
    parser.add_argument("--use-gpu", action="store_true", default=False)
    parser.add_argument("--manual", action="store_true", help="ReduceLROnPlateau stepped in a custom step")
    parser.add_argument("--smoke-test", action="store_true", help="one sample per grid point")
    parser.add_argument("--storage-path", default=None, help="where Tune writes results (default ~/ray_results)")
    args = parser.parse_args(argv)
    optional.require("ray.tune", "the Tune example")  # without Tune, say what to install before Ray starts
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        ray.init(address=args.address or "local", num_cpus=4 if args.smoke_test and not args.address else None,
                 include_dashboard=False)
    operator_cls = get_custom_training_operator(lr_reduce_on_plateau=args.manual)
    run = tune_example_manual if args.manual else tune_example
    best = run(operator_cls, num_workers=args.num_workers, use_gpu=args.use_gpu,
               num_samples=1 if args.smoke_test else 3, storage_path=args.storage_path)
    logger.info("Best config: %s", best)
    return best


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
