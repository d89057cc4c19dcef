"""raysgd: the RaySGD 1.x PyTorch API (``ray.util.sgd.torch``) on today's Ray and PyTorch.

Example:
    >>> from raysgd import TorchTrainer, TrainingOperator
    >>> from raysgd.utils import BATCH_SIZE
"""
import logging

from raysgd.torch import TorchTrainer, TrainingOperator

__version__ = "0.1.0"
__all__ = ["TorchTrainer", "TrainingOperator", "PyTorchTrainer", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())


def PyTorchTrainer(**kwargs):  # noqa: N802 (the 1.x name)
    """Removed in RaySGD 1.x: always raises, pointing at :class:`TorchTrainer`."""
    raise DeprecationWarning("PyTorchTrainer was renamed TorchTrainer: use raysgd.TorchTrainer.")
