"""Maps every RaySGD 1.x module path under ``ray.util.sgd`` to the same path under ``raysgd``.

Outside the layers: imports the standard library and :mod:`raysgd.torch.constants`; the other
raysgd modules are imported when a legacy name is. :func:`install` puts a finder at the front of ``sys.meta_path``,
so it wins over Ray 2.x's own ``ray.util.sgd`` (which only raises ``DeprecationWarning``):

* ``ray.util.sgd.X.Y`` imports ``raysgd.X.Y`` and is the *same module object*, so classes keep
  their ``raysgd.*`` names and Ray pickles them by those names;
* a path that was removed (``ray.util.sgd.torch.torch_dataset``, ``ray.util.sgd.torch.torch_runner`` ...)
  raises ``ModuleNotFoundError`` saying what replaced it;
* it sets ``RAYSGD_LEGACY_IMPORTS=1`` in the environment, which Ray workers inherit (and which the
  worker group forwards to its actors), and ``import raysgd`` installs the mapping wherever that
  variable is set: modules a worker imports by name (a helper module of a legacy script holding
  its operator) resolve their ``ray.util.sgd`` imports too.

Example:
    >>> import raysgd.compat
    >>> raysgd.compat.install()
    >>> from ray.util.sgd.torch import TorchTrainer
    >>> import raysgd.torch
    >>> TorchTrainer is raysgd.torch.TorchTrainer
    True
    >>> raysgd.compat.uninstall()
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import pkgutil
import sys

from raysgd.base import environment
from raysgd.torch.constants import LEGACY_IMPORTS_ENV, TRAIN_IMPORTS_ENV

logger = logging.getLogger(__name__)

#: The 1.x package prefix that is mapped.
LEGACY_PREFIX = "ray.util.sgd"
#: The package it maps to.
TARGET_PREFIX = "raysgd"

_DATA_HINT = ("Pass a Ray Data Dataset to TorchTrainer.train(dataset=...) instead (ray.data.from_numpy, "
              "from_items, read_parquet ...): each worker iterates its own shard.")

#: 1.x module paths with no raysgd counterpart: what was there, and what to use now. Prefix match.
GONE = {
    "ray.util.sgd.torch.torch_dataset": "TorchMLDataset bridged MLDataset, which Ray removed. " + _DATA_HINT,
    "ray.util.sgd.torch.torch_runner": (
        "TorchRunner was an internal class: one worker is now raysgd.torch.execution.worker.TorchWorker, the same class "
        "as a Ray actor or in the driver (use_local=True)."),
    "ray.util.sgd.torch.distributed_torch_runner": (
        "DistributedTorchRunner/LocalDistributedRunner were internal classes: one worker is now "
        "raysgd.torch.execution.worker.TorchWorker, the same class as a Ray actor or in the driver (use_local=True)."),
    "ray.util.sgd.torch.utils": (
        "setup_address/setup_process_group are methods of raysgd.torch.execution.worker.TorchWorker now, and "
        "choose_amp_backend is replaced by raysgd.torch.operator.precision.Precision (use_fp16=False/True/'apex'/'bf16')."),
    "ray.util.sgd.torch.func_trainable": (
        "DistributedTrainableCreator moved to ray.tune.integration.torch in Ray 1.0 and was later removed: "
        "use TorchTrainer.as_trainable(...) with Ray Tune, or Ray Train's TorchTrainer."),
    "ray.util.sgd.tf": "The TensorFlow trainer (TFTrainer) is out of raysgd's scope: use Ray Train's "
                       "TensorflowTrainer (ray.train.tensorflow).",
    "ray.util.sgd.v2": "RaySGD v2 became Ray Train: use ray.train (e.g. ray.train.torch.TorchTrainer).",
}


def translate(name):
    """The raysgd module name for a 1.x module name (``ray.util.sgd.X`` -> ``raysgd.X``), else None.

    Example:
        >>> translate("ray.util.sgd.torch.training_operator")
        'raysgd.torch.training_operator'
        >>> translate("ray.util.sgdx") is None
        True
    """
    if name == LEGACY_PREFIX:
        return TARGET_PREFIX
    if name.startswith(LEGACY_PREFIX + "."):
        return TARGET_PREFIX + name[len(LEGACY_PREFIX):]
    return None


def _gone_reason(name):
    for prefix, reason in GONE.items():
        if name == prefix or name.startswith(prefix + "."):
            return reason
    return None


def _siblings(target):
    """Names of the modules next to ``target`` that do exist (for the error message)."""
    parent = target.rpartition(".")[0]
    try:
        path = importlib.import_module(parent).__path__
    except (ImportError, AttributeError):
        return []
    return sorted(info.name for info in pkgutil.iter_modules(path) if not info.name.startswith("_"))


class _AliasLoader(importlib.abc.Loader):
    """Imports the raysgd module and puts that very object in ``sys.modules`` under the legacy name."""

    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder: exec_module swaps in the real module

    def exec_module(self, module):
        # The import system returns whatever sys.modules holds under the name after exec_module, without
        # touching its attributes: so raysgd's module keeps its own __name__ and __spec__.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class LegacyFinder(importlib.abc.MetaPathFinder):
    """The ``sys.meta_path`` entry behind :func:`install` (see the module docstring).

    Example:
        >>> spec = LegacyFinder().find_spec("ray.util.sgd.utils")
        >>> spec.loader.target
        'raysgd.utils'
    """

    def find_spec(self, fullname, path=None, target=None):
        """A spec aliasing ``fullname`` to its raysgd module; None for names outside ``ray.util.sgd``."""
        raysgd_name = translate(fullname)
        if raysgd_name is None:
            return None
        reason = _gone_reason(fullname)
        if reason is not None:
            raise ModuleNotFoundError(f"{fullname} is gone in raysgd: {reason}", name=fullname)
        try:
            found = importlib.util.find_spec(raysgd_name)
        except ModuleNotFoundError:
            found = None
        if found is None:
            available = ", ".join(_siblings(raysgd_name)) or "none"
            raise ModuleNotFoundError(
                f"{fullname} has no raysgd counterpart (looked for {raysgd_name}; modules there: {available}). "
                "See docs/porting.md for what maps and what is gone.", name=fullname)
        is_package = found.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(raysgd_name), is_package=is_package)


_finder = LegacyFinder()


def is_installed():
    """Whether :func:`install` is in force in this process.

    Example:
        >>> isinstance(is_installed(), bool)
        True
    """
    return _finder in sys.meta_path


def install():
    """Make ``ray.util.sgd...`` imports resolve to ``raysgd...`` in this process and its Ray workers.

    Idempotent. Call it before the legacy imports (or run the script with ``python -m raysgd.legacy``).

    Example:
        >>> import raysgd.compat
        >>> raysgd.compat.install()
        >>> from ray.util.sgd.utils import BATCH_SIZE
        >>> BATCH_SIZE
        '*batch_size'
        >>> raysgd.compat.uninstall()
    """
    if not is_installed():
        sys.meta_path.insert(0, _finder)
        logger.debug("ray.util.sgd now maps to raysgd")
    os.environ[LEGACY_IMPORTS_ENV] = "1"


def uninstall():
    """Undo :func:`install`: remove the finder, the aliased ``sys.modules`` entries and the environment flag.

    Example:
        >>> install(); uninstall(); is_installed()
        False
    """
    while _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if translate(n) is not None]:
        del sys.modules[name]
    util = sys.modules.get("ray.util")
    if util is not None and "sgd" in vars(util):
        delattr(util, "sgd")
    os.environ.pop(LEGACY_IMPORTS_ENV, None)


def install_if_requested():
    """Call :func:`install` when ``RAYSGD_LEGACY_IMPORTS=1`` is set (how Ray workers get the mapping).

    Example:
        >>> install_if_requested()  # a no-op unless the variable is set
    """
    if environment.get(LEGACY_IMPORTS_ENV) and not is_installed():
        install()
    if environment.get(TRAIN_IMPORTS_ENV) and not train_is_installed():
        install_train()


# ----------------------------------------------------------------- ray.train -> raysgd.train
#: Ray Train's public modules and their raysgd.train counterparts (``install_train``).
#: ``ray.train.utils`` is there for Ray Data (``iter_torch_batches`` imports it inside a training function).
TRAIN_MODULES = {"ray.train": "raysgd.train", "ray.train.torch": "raysgd.train.torch",
                 "ray.train.lightning": "raysgd.train.lightning", "ray.train.utils": "raysgd.train.utils",
                 "ray.train.collective": "raysgd.train.collective"}


class TrainFinder(importlib.abc.MetaPathFinder):
    """The ``sys.meta_path`` entry behind :func:`install_train`: ``ray.train``, ``ray.train.torch`` and
    ``ray.train.lightning`` are raysgd.train's modules; any other ``ray.train.X`` says what to use instead.

    Example:
        >>> TrainFinder().find_spec("ray.train.torch").loader.target
        'raysgd.train.torch'
        >>> TrainFinder().find_spec("ray.train.tensorflow")
        Traceback (most recent call last):
        ...
        ModuleNotFoundError: ray.train.tensorflow is not supported by raysgd.train (python -m raysgd.legacy --train): raysgd.train runs PyTorch (and Lightning) training functions; use Ray Train itself (ray.train.tensorflow) for TensorFlow
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname in TRAIN_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(TRAIN_MODULES[fullname]),
                                                  is_package=fullname == "ray.train")
        if not fullname.startswith("ray.train."):
            return None
        from raysgd.train import UNSUPPORTED  # noqa: PLC0415 (the reasons live with the package)

        part = fullname.split(".")[2]
        reason = UNSUPPORTED.get(part, "raysgd.train maps only ray.train, ray.train.torch and ray.train.lightning; "
                                       "run the script without the mapping to use Ray Train itself")
        raise ModuleNotFoundError(f"{fullname} is not supported by raysgd.train (python -m raysgd.legacy --train): "
                                  f"{reason}", name=fullname)


_train_finder = TrainFinder()


def train_is_installed():
    """Whether :func:`install_train` is in force in this process.

    Example:
        >>> isinstance(train_is_installed(), bool)
        True
    """
    return _train_finder in sys.meta_path


def install_train():
    """Make ``ray.train``, ``ray.train.torch`` and ``ray.train.lightning`` resolve to ``raysgd.train...`` in this
    process and its Ray workers, so a Ray Train guide script runs on raysgd unchanged. Opt-in (Ray Tune imports
    Ray Train's internals, which this hides): ``python -m raysgd.legacy --train script.py``.

    Example:
        >>> install_train()
        >>> import ray.train
        >>> ray.train.ScalingConfig.__module__
        'raysgd.train.config'
        >>> uninstall_train()
    """
    if not train_is_installed():
        sys.meta_path.insert(0, _train_finder)
    for name in [n for n in sys.modules if n == "ray.train" or n.startswith("ray.train.")]:
        if not getattr(sys.modules[name], "__name__", "").startswith("raysgd."):
            del sys.modules[name]  # Ray Train's own, imported before: the next import finds raysgd's
    os.environ[TRAIN_IMPORTS_ENV] = "1"
    import ray  # noqa: PLC0415

    for name in ("ray.train", "ray.train.torch"):  # attributes of ray now (a pickled function's ray.train.report)
        importlib.import_module(name)
    ray.train = sys.modules["ray.train"]


def uninstall_train():
    """Undo :func:`install_train`.

    Example:
        >>> install_train(); uninstall_train(); train_is_installed()
        False
    """
    while _train_finder in sys.meta_path:
        sys.meta_path.remove(_train_finder)
    for name in [n for n in sys.modules if n == "ray.train" or n.startswith("ray.train.")]:
        del sys.modules[name]
    ray = sys.modules.get("ray")
    if ray is not None and "train" in vars(ray):
        delattr(ray, "train")
    os.environ.pop(TRAIN_IMPORTS_ENV, None)
