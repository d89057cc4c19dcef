"""The PyTorch side of raysgd (``ray.util.sgd.torch`` in RaySGD 1.x).

Example:
    >>> from raysgd.torch import TorchTrainer, TrainingOperator, BaseTorchTrainable
"""
from raysgd.torch.execution import shipping as _shipping
from raysgd.torch.torch_trainer import TorchTrainer
from raysgd.torch.training_operator import CreatorOperator, TrainingOperator

_shipping.install()  # torch's config modules pickle by name from here on (see raysgd.torch.execution.shipping)

__all__ = ["TorchTrainer", "TrainingOperator", "CreatorOperator", "BaseTorchTrainable"]


def __getattr__(name):
    if name == "BaseTorchTrainable":  # imports Ray Tune, which stays optional until used
        from raysgd.torch.integrations.tune import BaseTorchTrainable  # noqa: PLC0415

        return BaseTorchTrainable
    raise AttributeError(f"module 'raysgd.torch' has no attribute {name!r}")
