"""What every experiment-tracker logger shares: a step per epoch, numbers only, local checkpoints as artifacts.

Layer 5 (the edge; the standard library and :mod:`raysgd.callbacks`). :class:`EpochLogger` is the base of
:class:`~raysgd.torch.integrations.mlflow_logger.MLflowLogger` and
:class:`~raysgd.torch.integrations.wandb_logger.WandbLogger`: a ``train()`` result is logged at
``step=result["epoch"]`` (the previous step + 1 when it has none), a ``validate()`` result at the epoch of the last
``train()`` (0 before any), and a durable checkpoint in a local folder goes to the tracker when the logger was
made with ``log_checkpoints=True``. A subclass logs (``log_result``) and stores checkpoints (``log_checkpoint``)
in its own tracker, and says whether its run has started (``started``).

Example:
    >>> class Steps(EpochLogger):
    ...     log_checkpoints, seen = False, []
    ...     def log_result(self, trainer, phase, result, step):
    ...         self.seen.append((phase, step, numbers(result)))
    >>> steps = Steps()
    >>> steps.on_train_result(None, {"epoch": 3, "train_loss": 0.5, "note": "x"})
    >>> steps.on_validate_result(None, {"val_loss": 0.7})
    >>> steps.seen
    [('train', 3, {'epoch': 3, 'train_loss': 0.5}), ('validate', 3, {'val_loss': 0.7})]
"""
import logging
import numbers as _numbers
import os

from raysgd.callbacks import Callback

logger = logging.getLogger(__name__)


def is_number(value):
    """A real number a tracker takes as a metric (a bool is not one)."""
    return isinstance(value, _numbers.Real) and not isinstance(value, bool)


def numbers(result):
    """The entries of ``result`` that are metrics (real numbers)."""
    return {key: value for key, value in result.items() if is_number(value)}


def local_folder(path):
    """The local folder a durable checkpoint ``path`` names (a plain path or ``file://``), else None.

    Example:
        >>> local_folder("s3://bucket/run/checkpoint_000001") is None
        True
    """
    local = path[len("file://"):] if path.startswith("file://") else path
    return local if "://" not in local and os.path.isdir(local) else None


class EpochLogger(Callback):
    """Base of the tracker loggers (see the module docstring); ``self.log_checkpoints`` is set by the subclass."""

    #: The step of the latest ``train()`` result: ``validate()`` results are logged at it.
    epoch = 0

    def log_result(self, trainer, phase, result, step):
        """Log ``result`` (a ``"train"`` or ``"validate"`` result) at ``step`` in the tracker."""
        raise NotImplementedError

    def log_checkpoint(self, folder, path):
        """Store the durable checkpoint in the local ``folder`` (``path`` as the trainer named it)."""
        raise NotImplementedError

    def started(self):
        """Whether the tracker's run has started (checkpoints are logged only then)."""
        return True

    def on_train_result(self, trainer, result):
        epoch = result.get("epoch")
        self.epoch = int(epoch) if is_number(epoch) else self.epoch + 1
        self.log_result(trainer, "train", result, self.epoch)

    def on_validate_result(self, trainer, result):
        self.log_result(trainer, "validate", result, self.epoch)

    def on_checkpoint(self, trainer, path):
        if not self.log_checkpoints or not self.started():
            return
        folder = local_folder(path)
        if folder is None:
            logger.info("%s(log_checkpoints=True) logs local checkpoints only; %s is not one", type(self).__name__,
                        path)
            return
        self.log_checkpoint(folder, path)
