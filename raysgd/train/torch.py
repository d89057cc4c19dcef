"""``raysgd.train.torch``: Ray Train's ``ray.train.torch`` names (TorchTrainer, prepare_model, TorchCheckpoint, ...).

Part of :mod:`raysgd.train`: the public names (the trainer is :mod:`raysgd.train.trainer`, the preparation
functions :mod:`raysgd.train.prepare`), :class:`TorchCheckpoint` (a checkpoint of one ``model.pt``), and Ray
Train's deprecated ``accelerate``, ``backward`` and ``prepare_optimizer``, which raise its ``DeprecationWarning``.

Example:
    >>> from raysgd.train.torch import TorchTrainer, prepare_data_loader, prepare_model
    >>> TorchTrainer.__name__
    'TorchTrainer'
"""
from __future__ import annotations

import os
import tempfile

import torch

from raysgd.base.checks import expect
from raysgd.train.checkpoint import Checkpoint
from raysgd.train.config import TorchConfig
from raysgd.train.prepare import PreparedLoader, get_device, prepare_data_loader, prepare_model
from raysgd.train.trainer import TorchTrainer
from typing import Any

_AMP_DEPRECATED = ("The `accelerate`, `backward`, and `prepare_optimizer` utility methods in the `ray.train.torch` "
                   "module are deprecated (as in Ray Train 2.x): use PyTorch's mixed precision API directly "
                   "(torch.autocast and torch.amp.GradScaler), or Lightning. See "
                   "https://github.com/ray-project/ray/issues/49454")


def get_devices() -> list[torch.device]:
    """This worker's devices (one): ``[get_device()]``.

    Example:
        >>> def train_func():  # doctest: +SKIP
        ...     (device,) = raysgd.train.torch.get_devices()
    """
    return [get_device()]


def enable_reproducibility(seed: int = 0) -> None:
    """Seed torch, numpy and random, and make torch's algorithms deterministic where it can: as Ray Train, turn
    cuDNN's benchmarking off and set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS is deterministic only with it; a
    value already set is kept).

    Example:
        >>> enable_reproducibility(0)
    """
    import random  # noqa: PLC0415

    import numpy  # noqa: PLC0415

    torch.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False  # it picks the fastest kernels, not always deterministic ones
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def accelerate(amp: bool = False) -> None:
    """Deprecated in Ray Train 2.x: raises its ``DeprecationWarning``."""
    raise DeprecationWarning(_AMP_DEPRECATED)


def backward(tensor: torch.Tensor) -> None:
    """Deprecated in Ray Train 2.x: raises its ``DeprecationWarning``."""
    raise DeprecationWarning(_AMP_DEPRECATED)


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Deprecated in Ray Train 2.x: raises its ``DeprecationWarning``."""
    raise DeprecationWarning(_AMP_DEPRECATED)


class TorchCheckpoint(Checkpoint):
    """A checkpoint holding one ``model.pt``: a model's state dict (:meth:`from_state_dict`) or a whole model
    (:meth:`from_model`); :meth:`get_model` loads it.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> restored = TorchCheckpoint.from_state_dict(model.state_dict()).get_model(torch.nn.Linear(2, 1))
        >>> torch.equal(restored.weight, model.weight)
        True
    """

    MODEL_FILENAME = "model.pt"

    @classmethod
    def _write(cls, value, preprocessor):
        if preprocessor is not None:
            raise NotImplementedError("TorchCheckpoint(preprocessor=...) is not supported by raysgd.train (Ray "
                                      "Train 2.x dropped preprocessors too): keep it in train_loop_config")
        folder = tempfile.mkdtemp(prefix="raysgd-torch-checkpoint-")
        torch.save(value, os.path.join(folder, cls.MODEL_FILENAME))
        return cls.from_directory(folder)

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, Any], *, preprocessor: object = None) -> TorchCheckpoint:
        """A checkpoint of ``state_dict`` (a DDP ``module.`` prefix is taken off), in a new temporary directory."""
        expect(isinstance(state_dict, dict), "state_dict", "a dict", state_dict, TypeError,
               "TorchCheckpoint.from_state_dict", call=True, got=type(state_dict).__name__)
        if state_dict and all(isinstance(key, str) and key.startswith("module.") for key in state_dict):
            state_dict = type(state_dict)((key[len("module."):], value) for key, value in state_dict.items())
        return cls._write(state_dict, preprocessor)

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, preprocessor: object = None) -> TorchCheckpoint:
        """A checkpoint of the whole ``model`` (pickled: :meth:`get_model` needs ``weights_only=False``)."""
        expect(isinstance(model, torch.nn.Module), "model", "a torch.nn.Module", model, TypeError,
               "TorchCheckpoint.from_model", call=True, got=type(model).__name__)
        return cls._write(model, preprocessor)

    def get_model(self, model: torch.nn.Module | None = None, *, weights_only: bool = True) -> torch.nn.Module:
        """The model of the checkpoint: ``model`` with the state dict loaded, or the whole model it holds.

        ``weights_only=True`` (raysgd's default) loads tensors and containers only, safe from any source; a whole
        model (:meth:`from_model`) is pickled code and loads only with ``weights_only=False``, for a checkpoint
        you trust.
        """
        with self.as_directory() as folder:
            path = os.path.join(folder, self.MODEL_FILENAME)
            if not os.path.exists(path):
                raise FileNotFoundError(f"TorchCheckpoint.get_model: {self.MODEL_FILENAME} is not in {self.path} "
                                        f"(make the checkpoint with from_state_dict or from_model)")
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=weights_only)
            except Exception as err:  # noqa: BLE001 (torch's unpickler raises several kinds)
                if not weights_only:
                    raise
                raise ValueError(f"TorchCheckpoint.get_model: {path} holds more than tensors (a whole model, from "
                                 f"from_model?); if you trust it, load it with get_model(weights_only=False)") from err
        if isinstance(loaded, torch.nn.Module):
            return loaded
        if model is None:
            raise ValueError("TorchCheckpoint.get_model: the checkpoint holds a state dict; pass the model to load "
                             "it into: get_model(model)")
        model.load_state_dict(loaded)
        return model


__all__ = ["TorchTrainer", "TorchConfig", "TorchCheckpoint", "prepare_model", "prepare_data_loader", "get_device",
           "get_devices", "enable_reproducibility", "PreparedLoader", "accelerate", "backward", "prepare_optimizer"]
