"""``raysgd.train.lightning``: Ray Train's Lightning names for a Lightning ``Trainer`` inside the training function.

Part of :mod:`raysgd.train`. The process group is the worker group's (formed before the function runs), so
:class:`RayDDPStrategy` is Lightning's DDP strategy on this worker's device, :class:`RayLightningEnvironment`
reads the ranks from :func:`raysgd.train.get_context`, :class:`RayFSDPStrategy` is Lightning's FSDP strategy on the
same process group and device (torch's FSDP needs an accelerator: CUDA workers, ``ScalingConfig(use_gpu=True)``), and :class:`RayTrainReportCallback` saves Lightning's
checkpoint at every training epoch's end and reports it with ``trainer.callback_metrics``. Lightning shards its
own loaders (``DistributedSampler``): they have no raysgd data cursor, so a restart replays the epoch from its
start (resume with ``trainer.fit(model, ckpt_path=...)`` from ``get_checkpoint()``). The classes subclass the
Lightning package the process imported before their first use (``import pytorch_lightning as pl`` or
``import lightning.pytorch as pl``; ``lightning.pytorch`` when both or neither are imported yet, as in Ray Train).

Example:
    >>> from raysgd.train.lightning import RayDDPStrategy, RayFSDPStrategy, RayLightningEnvironment, RayTrainReportCallback
    >>> RayTrainReportCallback.CHECKPOINT_NAME
    'checkpoint.ckpt'
"""
import importlib
import logging
import os
import shutil
import sys
import tempfile

from raysgd import optional
from raysgd.base.checks import expect
from raysgd.train import session as _session
from raysgd.train.checkpoint import Checkpoint
from typing import Any

logger = logging.getLogger(__name__)

#: Lightning's two import names, the newer first.
LIGHTNING_NAMES = ("lightning.pytorch", "pytorch_lightning")
FEATURE = "raysgd.train.lightning (Ray Train's Lightning names)"
_CLASSES = ("RayDDPStrategy", "RayFSDPStrategy", "RayLightningEnvironment", "RayTrainReportCallback")
#: The strategies that run a Trainer on the worker group's process group (``prepare_trainer`` accepts these).
_STRATEGIES = ("RayDDPStrategy", "RayFSDPStrategy")
_defined: dict[str, type] = {}
#: Ray Train's Lightning names raysgd.train.lightning does not provide, and what to use instead.
UNSUPPORTED = {
    "RayDeepSpeedStrategy": "DeepSpeed is not supported: use RayFSDPStrategy (CUDA workers), or raysgd's operator "
                            "API with FSDP2",
}


def _lightning():
    """``(lightning.pytorch or pytorch_lightning, its LightningEnvironment)``: the package the training function
    already imported (``import pytorch_lightning as pl`` needs classes of that package: its ``Trainer`` refuses the
    other's strategies), else the first that imports; :class:`~raysgd.optional.MissingExtra` naming the extra when
    neither imports."""
    imported = [name for name in LIGHTNING_NAMES if sys.modules.get(name) is not None]
    for name in imported + [name for name in LIGHTNING_NAMES if name not in imported]:
        try:
            pl = importlib.import_module(name)
            return pl, importlib.import_module(f"{name}.plugins.environments").LightningEnvironment
        except ImportError:
            continue
    optional.require("pytorch_lightning", FEATURE)  # raises, naming the extra
    raise AssertionError("unreachable")


def __getattr__(name):
    """The Lightning classes, defined on first use (importing this module needs no Lightning)."""
    if name in UNSUPPORTED:
        raise ImportError(f"{__name__}.{name} is not supported: {UNSUPPORTED[name]}")
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _defined:
        pl, environment = _lightning()
        _defined.update(_define(pl, environment), Trainer=pl.Trainer)
    return _defined[name]


def _define(pl: Any, LightningEnvironment: Any):  # noqa: N803 (a class)
    """Define the classes over Lightning's (``pl``: its package)."""

    class RayDDPStrategy(pl.strategies.DDPStrategy):
        """Lightning's DDP on the worker group's process group and this worker's device.

        Example:
            >>> def train_func():  # doctest: +SKIP
            ...     trainer = pl.Trainer(strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
            ...                          callbacks=[RayTrainReportCallback()], devices="auto", accelerator="auto")
        """

        @property
        def root_device(self):
            return _session.current("lightning.RayDDPStrategy").device

        @property
        def distributed_sampler_kwargs(self):
            """The ``DistributedSampler`` arguments of this worker: ``num_replicas`` and ``rank``."""
            return {"num_replicas": self.world_size, "rank": self.global_rank}

    class RayFSDPStrategy(pl.strategies.FSDPStrategy):
        """Lightning's FSDP (fully sharded data parallel) on the worker group's process group and this worker's
        device; takes Lightning's ``FSDPStrategy`` arguments (``sharding_strategy``, ``auto_wrap_policy``,
        ``state_dict_type``, ...). torch's FSDP needs an accelerator: use it on CUDA workers.

        Example:
            >>> def train_func():  # doctest: +SKIP
            ...     trainer = pl.Trainer(strategy=RayFSDPStrategy(), plugins=[RayLightningEnvironment()],
            ...                          callbacks=[RayTrainReportCallback()], devices="auto", accelerator="auto")
        """

        @property
        def root_device(self):
            return _session.current("lightning.RayFSDPStrategy").device

        @property
        def distributed_sampler_kwargs(self):
            """The ``DistributedSampler`` arguments of this worker: ``num_replicas`` and ``rank``."""
            return {"num_replicas": self.world_size, "rank": self.global_rank}

    class RayLightningEnvironment(LightningEnvironment):
        """The ranks of :func:`raysgd.train.get_context` (Lightning starts no process of its own).

        Example:
            >>> RayLightningEnvironment().creates_processes_externally
            True
        """

        @property
        def creates_processes_externally(self):
            return True  # the worker group started them: Lightning launches none

        def _context(self):
            return _session.current("lightning.RayLightningEnvironment").context

        def world_size(self):
            return self._context().get_world_size()

        def global_rank(self):
            return self._context().get_world_rank()

        def local_rank(self):
            return self._context().get_local_rank()

        def node_rank(self):
            return self._context().get_node_rank()

        def set_world_size(self, size):
            """Ignored: the worker group sets the world size."""

        def set_global_rank(self, rank):
            """Ignored: the worker group sets the ranks."""

        def teardown(self):
            pass


    class RayTrainReportCallback(pl.callbacks.Callback):
        """At every training epoch's end: Lightning's checkpoint (``checkpoint.ckpt``) and ``trainer.callback_metrics``
        (with ``epoch`` and ``step``) reported with :func:`raysgd.train.report`.

        Example:
            >>> callbacks = [RayTrainReportCallback()]  # pl.Trainer(..., callbacks=callbacks)
        """

        CHECKPOINT_NAME = "checkpoint.ckpt"

        def on_train_epoch_end(self, trainer, pl_module):
            metrics = {name: value.item() if hasattr(value, "item") else value
                       for name, value in trainer.callback_metrics.items()}
            metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
            folder = tempfile.mkdtemp(prefix="raysgd-lightning-")
            try:
                trainer.save_checkpoint(os.path.join(folder, self.CHECKPOINT_NAME), weights_only=False)
                _session.report(metrics, checkpoint=Checkpoint.from_directory(folder))
                trainer.strategy.barrier()
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    classes = {"RayDDPStrategy": RayDDPStrategy, "RayFSDPStrategy": RayFSDPStrategy,
               "RayLightningEnvironment": RayLightningEnvironment, "RayTrainReportCallback": RayTrainReportCallback}
    for name, cls in classes.items():  # pickled by reference, as a module-level class is
        cls.__qualname__ = name
    return classes


def prepare_trainer(trainer: Any) -> Any:
    """Check that a Lightning ``Trainer`` runs on raysgd.train (``RayDDPStrategy`` or ``RayFSDPStrategy``, or a
    single worker, and ``RayLightningEnvironment``); returns it.

    Example:
        >>> def train_func():  # doctest: +SKIP
        ...     trainer = prepare_trainer(pl.Trainer(strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()]))
    """
    strategies = tuple(__getattr__(name) for name in _STRATEGIES)
    environment_cls = __getattr__("RayLightningEnvironment")
    trainer_cls = _defined["Trainer"]
    package = trainer_cls.__module__.split(".trainer")[0]
    expect(isinstance(trainer, trainer_cls), "trainer", f"a {package}.Trainer (the Lightning package of "
           f"RayDDPStrategy and the others)", trainer, TypeError, "prepare_trainer", call=True,
           got=f"{type(trainer).__module__}.{type(trainer).__name__}")
    context = _session.current("lightning.prepare_trainer()").context
    strategy = trainer.strategy
    if context.get_world_size() > 1 and not isinstance(strategy, strategies):
        raise ValueError(f"prepare_trainer: with {context.get_world_size()} workers the Trainer needs "
                         f"strategy=RayDDPStrategy() or RayFSDPStrategy(); got {type(strategy).__name__}")
    environment = getattr(strategy, "cluster_environment", None)
    if environment is not None and not isinstance(environment, environment_cls):
        raise ValueError(f"prepare_trainer: the Trainer needs plugins=[RayLightningEnvironment()]; got "
                         f"{type(environment).__name__}")
    return trainer


__all__ = ["RayDDPStrategy", "RayFSDPStrategy", "RayLightningEnvironment", "RayTrainReportCallback", "prepare_trainer"]
