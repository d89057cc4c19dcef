"""RaySGD 1.x's ``ray.util.sgd.torch.lightning_operator``: the operator class that trains a LightningModule.

Package glue (1.x's path): :class:`LightningOperator` is defined with the other operators in
:mod:`raysgd.torch.training_operator` (``TrainingOperator`` with :mod:`raysgd.torch.operator.lightning`'s loops
mixed in); ``TrainingOperator.from_ptl(module_cls)`` returns a subclass of it. See docs/lightning.md.

Example:
    >>> from raysgd.torch.training_operator import TrainingOperator
    >>> issubclass(LightningOperator, TrainingOperator)
    True
"""
from raysgd.torch.training_operator import LightningOperator

__all__ = ["LightningOperator"]
