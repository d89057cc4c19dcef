"""raysgd: the RaySGD 1.x PyTorch API (``ray.util.sgd.torch``) on today's Ray and PyTorch.

Example:
    >>> from raysgd import TorchTrainer, TrainingOperator
    >>> from raysgd.utils import BATCH_SIZE
"""
import logging
import os

from raysgd.callbacks import Callback
from raysgd.torch import TorchTrainer, TrainingOperator
from raysgd.torch.constants import LEGACY_IMPORTS_ENV, TRAIN_IMPORTS_ENV

__version__ = "0.5.0.dev0"
__all__ = ["TorchTrainer", "TrainingOperator", "Callback", "PyTorchTrainer", "__version__"]

logging.getLogger(__name__).addHandler(logging.NullHandler())

if "1" in (os.environ.get(LEGACY_IMPORTS_ENV), os.environ.get(TRAIN_IMPORTS_ENV)):  # set by raysgd.compat's install()
    # or install_train() in the driver: a Ray worker
    from raysgd import compat as _compat  # imports the legacy script's modules, which need the mapping too

    _compat.install_if_requested()


def PyTorchTrainer(**kwargs):  # noqa: N802 (the 1.x name)
    """Removed in RaySGD 1.x: always raises, pointing at :class:`TorchTrainer`."""
    raise DeprecationWarning("PyTorchTrainer was renamed TorchTrainer: use raysgd.TorchTrainer.")
