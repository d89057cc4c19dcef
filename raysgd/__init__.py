"""raysgd: the RaySGD 1.x PyTorch API (``ray.util.sgd.torch``) on today's Ray and PyTorch.

Importing it gives the ``raysgd`` logger its console line on stderr (see :mod:`raysgd.logs`): warnings and the few
INFO lines a user needs are seen without any logging setup; :func:`set_log_level` (or ``RAYSGD_LOG_LEVEL``) quiets or
raises them. The package imports no torch until the trainer is asked for (``raysgd.TorchTrainer``, or any module
that uses torch): a process that runs only raysgd's torch-free code, such as a checkpoint file's write task on a
node, starts without torch's import (:mod:`raysgd.torch` loads lazily too).

Example:
    >>> from raysgd import TorchTrainer, TrainingOperator
    >>> from raysgd.utils import BATCH_SIZE
"""
from raysgd import logs
from raysgd.base import environment
from raysgd.callbacks import Callback
from raysgd.logs import set_log_level
from raysgd.torch.constants import LEGACY_IMPORTS_ENV, TRAIN_IMPORTS_ENV
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # for type checkers and the docs; at run time __getattr__ imports them on first use
    from raysgd.torch import TorchTrainer, TrainingOperator

__version__ = "0.5.0.dev0"
__all__ = ["TorchTrainer", "TrainingOperator", "Callback", "PyTorchTrainer", "set_log_level", "__version__"]

logs.install()  # raysgd's warnings and event lines on stderr while logging is unconfigured (see raysgd.logs)

if environment.get(LEGACY_IMPORTS_ENV) or environment.get(TRAIN_IMPORTS_ENV):  # set by raysgd.compat's install()
    # or install_train() in the driver: a Ray worker
    from raysgd import compat as _compat  # imports the legacy script's modules, which need the mapping too

    _compat.install_if_requested()


def __getattr__(name: str) -> Any:
    """``TorchTrainer`` and ``TrainingOperator``, imported (with torch) when first asked for."""
    if name in ("TorchTrainer", "TrainingOperator"):
        import raysgd.torch  # noqa: PLC0415 (torch's import waits for the first use: see the module docstring)

        return getattr(raysgd.torch, name)
    raise AttributeError(f"module 'raysgd' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the lazily imported ones (tab completion lists ``TorchTrainer`` before its import)."""
    return sorted({*globals(), *__all__})


def PyTorchTrainer(**kwargs: object) -> NoReturn:  # noqa: N802 (the 1.x name)
    """Removed in RaySGD 1.x: always raises, pointing at :class:`TorchTrainer`."""
    raise DeprecationWarning("PyTorchTrainer was renamed TorchTrainer: use raysgd.TorchTrainer.")
