"""At the edge: Ray Tune, Ray Data input, the driver's progress bar and result logs.

Layer 6: nothing in the core (layers 0-5) imports these; the facade (:mod:`raysgd.torch.torch_trainer`) wires
them in, and what a worker needs of them arrives as an object (a Ray Data shard to iterate, a progress reporter
to call). :mod:`~raysgd.torch.integrations.tune` (``TorchTrainer.as_trainable``, ``BaseTorchTrainable``; imports
Ray Tune, so it is imported on first use), :mod:`~raysgd.torch.integrations.ray_data` (``train(dataset=...)``),
:mod:`~raysgd.torch.integrations.progress` with its :mod:`~raysgd.torch.integrations.mailbox`
(``use_tqdm=True``), :mod:`~raysgd.torch.integrations.results` (``logdir=...``).

Example:
    >>> from raysgd.torch.integrations import DatasetInput, ResultLogger, read_results
    >>> callable(read_results)
    True
"""
from raysgd.torch.integrations.ray_data import DatasetInput
from raysgd.torch.integrations.results import ResultLogger, read_results

__all__ = ["DatasetInput", "ResultLogger", "read_results", "BaseTorchTrainable"]


def __getattr__(name):
    """``BaseTorchTrainable``: :mod:`raysgd.torch.integrations.tune` imports Ray Tune, so on first use."""
    if name == "BaseTorchTrainable":
        from raysgd.torch.integrations.tune import BaseTorchTrainable  # noqa: PLC0415 (Tune stays optional)

        return BaseTorchTrainable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
