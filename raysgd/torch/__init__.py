"""The PyTorch side of raysgd (``ray.util.sgd.torch`` in RaySGD 1.x).

Its names are imported when first asked for, so importing a torch-free module of the package (a checkpoint file's
write task, :mod:`raysgd.torch.storage.parts`, runs in a process of its own) does not import torch.

Example:
    >>> from raysgd.torch import TorchTrainer, TrainingOperator, BaseTorchTrainable
"""
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and the docs; at run time __getattr__ imports them on first use
    from raysgd.torch.integrations.tune import BaseTorchTrainable
    from raysgd.torch.torch_trainer import TorchTrainer
    from raysgd.torch.training_operator import CreatorOperator, TrainingOperator

__all__ = ["TorchTrainer", "TrainingOperator", "CreatorOperator", "BaseTorchTrainable"]

#: Where each name lives; BaseTorchTrainable's module imports Ray Tune, which stays optional until used.
_HOMES = {"TorchTrainer": "raysgd.torch.torch_trainer", "TrainingOperator": "raysgd.torch.training_operator",
          "CreatorOperator": "raysgd.torch.training_operator", "BaseTorchTrainable": "raysgd.torch.integrations.tune"}


def __getattr__(name: str) -> Any:
    """The package's names, each imported from its module (with torch) when first asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module 'raysgd.torch' has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    from raysgd.torch.execution import shipping  # noqa: PLC0415

    value = getattr(importlib.import_module(_HOMES[name]), name)
    shipping.install()  # torch's config modules pickle by name from here on (see raysgd.torch.execution.shipping)
    globals()[name] = value  # the next lookup finds it without this function
    return value


def __dir__() -> list[str]:
    """The package's names with the lazily imported ones (tab completion lists them before their import)."""
    return sorted({*globals(), *__all__})
