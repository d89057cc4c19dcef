"""raysgd: the RaySGD 1.x PyTorch API (``ray.util.sgd.torch``) on today's Ray and PyTorch.

Importing it gives the ``raysgd`` logger its console line on stderr (see :mod:`raysgd.logs`): warnings and the few
INFO lines a user needs are seen without any logging setup; :func:`set_log_level` (or ``RAYSGD_LOG_LEVEL``) quiets or
raises them.

Example:
    >>> from raysgd import TorchTrainer, TrainingOperator
    >>> from raysgd.utils import BATCH_SIZE
"""
from raysgd import logs
from raysgd.base import environment
from raysgd.callbacks import Callback
from raysgd.torch import TorchTrainer, TrainingOperator
from raysgd.logs import set_log_level
from raysgd.torch.constants import LEGACY_IMPORTS_ENV, TRAIN_IMPORTS_ENV
from typing import NoReturn

__version__ = "0.5.0.dev0"
__all__ = ["TorchTrainer", "TrainingOperator", "Callback", "PyTorchTrainer", "set_log_level", "__version__"]

logs.install()  # raysgd's warnings and event lines on stderr while logging is unconfigured (see raysgd.logs)

if environment.get(LEGACY_IMPORTS_ENV) or environment.get(TRAIN_IMPORTS_ENV):  # set by raysgd.compat's install()
    # or install_train() in the driver: a Ray worker
    from raysgd import compat as _compat  # imports the legacy script's modules, which need the mapping too

    _compat.install_if_requested()


def PyTorchTrainer(**kwargs: object) -> NoReturn:  # noqa: N802 (the 1.x name)
    """Removed in RaySGD 1.x: always raises, pointing at :class:`TorchTrainer`."""
    raise DeprecationWarning("PyTorchTrainer was renamed TorchTrainer: use raysgd.TorchTrainer.")
