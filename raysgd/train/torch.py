"""``raysgd.train.torch``: Ray Train's ``ray.train.torch`` names (TorchTrainer, prepare_model, prepare_data_loader).

Part of :mod:`raysgd.train`: the public names only (the trainer is :mod:`raysgd.train.trainer`, the preparation
functions :mod:`raysgd.train.prepare`).

Example:
    >>> from raysgd.train.torch import TorchTrainer, prepare_data_loader, prepare_model
    >>> TorchTrainer.__name__
    'TorchTrainer'
"""
from raysgd.train.config import TorchConfig
from raysgd.train.prepare import PreparedLoader, get_device, prepare_data_loader, prepare_model
from raysgd.train.trainer import TorchTrainer


def get_devices():
    """This worker's devices (one): ``[get_device()]``.

    Example:
        >>> def train_func():  # doctest: +SKIP
        ...     (device,) = raysgd.train.torch.get_devices()
    """
    return [get_device()]


def enable_reproducibility(seed=0):
    """Seed torch, numpy and random, and make torch's algorithms deterministic where it can.

    Example:
        >>> enable_reproducibility(0)
    """
    import random  # noqa: PLC0415

    import numpy  # noqa: PLC0415
    import torch  # noqa: PLC0415

    torch.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


__all__ = ["TorchTrainer", "TorchConfig", "prepare_model", "prepare_data_loader", "get_device", "get_devices",
           "enable_reproducibility", "PreparedLoader"]
