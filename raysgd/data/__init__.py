"""RaySGD 1.x's ``ray.util.sgd.data``: the sharded :class:`Dataset` for ``TorchTrainer.train(dataset=...)``.

Example:
    >>> from raysgd.data import Dataset
    >>> Dataset([(1.0, 2.0)], batch_size=1).batch_size
    1
"""
from raysgd.data.dataset import Dataset

__all__ = ["Dataset"]
