"""TrainingOperator: what users subclass to register models and data, and the default epoch and batch loops.

Layer 2: imports torch and layers 0-1. One operator lives in every worker; ``setup(config)``
calls :meth:`TrainingOperator.register` and :meth:`TrainingOperator.register_data`. The operator's helpers are
mixins of :mod:`raysgd.torch.operator` (precision, accumulation); RaySGD 1.x's :class:`CreatorOperator` and the
Lightning operator are this class with the creator or Lightning loops of that folder mixed in.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> from raysgd.torch.examples.train_example import LinearDataset
    >>> class MyOperator(TrainingOperator):
    ...     def setup(self, config):
    ...         model = torch.nn.Linear(1, 1)
    ...         optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))
    ...         self.model, self.optimizer, self.criterion = self.register(
    ...             models=model, optimizers=optimizer, criterion=torch.nn.MSELoss())
    ...         self.register_data(train_loader=DataLoader(LinearDataset(2, 5), batch_size=32),
    ...                            validation_loader=DataLoader(LinearDataset(2, 5, size=100), batch_size=32))
"""
from __future__ import annotations

import functools
import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from raysgd.meters import NUM_SAMPLES, AverageMeterCollection
from raysgd.timers import TimerCollection
from raysgd.torch.constants import DATA_SEED, SCHEDULER_STEP_BATCH, SCHEDULER_STEP_EPOCH
from raysgd.torch.operator import compiled as _compiled
from raysgd.torch.operator import creators as _creators
from raysgd.torch.operator import lightning as _lightning
from raysgd.torch.operator import registration as _registration
from raysgd.torch.operator.accumulation import AccumulationHelpers, zero_grad_now
from raysgd.torch.operator.fsdp import Sharding, ShardingHelpers
from raysgd.torch.operator.creators import get_test_metrics_operator, get_test_operator  # noqa: F401 (1.x's names)
from raysgd.torch.operator.precision import LegacyAmp, Precision, PrecisionHelpers
from raysgd.torch.sharding import loaders as _data
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)


class TrainingOperator(PrecisionHelpers, AccumulationHelpers, ShardingHelpers):
    """Defines the training components of one worker and how an epoch and a batch are run.

    Subclass it and implement :meth:`setup`; override :meth:`train_batch`, :meth:`train_epoch`,
    :meth:`validate_batch` or :meth:`validate` for custom loops. The constructor is internal: the
    trainer builds one operator per worker, and the worker reads it through the methods under "what the
    worker reads" (:meth:`state_parts`, :meth:`registered_models`, :meth:`registered_loader`,
    :meth:`metrics_so_far`, :meth:`at_step_boundary`) and ``progress_reporter``.

    Example:
        >>> class Op(TrainingOperator):
        ...     def setup(self, config):
        ...         ...  # self.register(...) and self.register_data(...)
    """

    _train_loader: Iterable | None  # set in __init__ and register_data
    _validation_loader: Iterable | None
    _running_meters: AverageMeterCollection | None

    def __init__(self, config: dict, world_rank: int = 0, local_rank: int = 0, is_distributed: bool = False,
                 use_gpu: bool = False, device: torch.device | str | None = None, use_fp16: bool | str = False,
                 use_tqdm: bool = False, wrap_ddp: bool = False, add_dist_sampler: bool = False,
                 scheduler_step_freq: str | None = None, world_size: int = 1, strategy: str = "ddp",
                 fsdp_args: dict | None = None) -> None:
        self._config = config
        self._world_rank = world_rank
        self._local_rank = local_rank
        self._world_size = world_size if is_distributed else 1
        self._is_distributed = is_distributed
        self._use_gpu = bool(use_gpu) and torch.cuda.is_available()
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._use_tqdm = use_tqdm
        self._wrap_ddp = wrap_ddp and is_distributed and strategy != "fsdp"
        self._add_dist_sampler = add_dist_sampler  # also at world size 1: the data cursor needs a seeded order
        self._scheduler_step_freq = scheduler_step_freq
        self._precision = Precision(use_fp16, self._device)
        self._sharding = Sharding(strategy, fsdp_args, self._precision, self._device, self._world_size)
        self._registered = False
        self._schedulers: list[Any] | None = None  # set by register (check_schedulers' list)
        self._train_loader = self._validation_loader = None
        self.timers = TimerCollection()
        self.global_step, self._running_meters = 0, None  # the meters of the running default-loop epoch
        self.progress_reporter = None  # set by the worker while rank 0 feeds the driver's progress bar
        self.setup(config)
        self._check_models_registered()

    # ----------------------------------------------------------------- user hooks
    def setup(self, config: dict) -> None:
        """Create models, optimizers, criterion, schedulers and loaders, and register them. Override this."""
        raise NotImplementedError("Subclass TrainingOperator and implement setup(self, config), calling "
                                  "self.register(...) and self.register_data(...) in it.")

    def register(self, *, models: Any, optimizers: Any, criterion: Any = None, schedulers: Any = None,
                 ddp_args: dict | None = None, apex_args: dict | None = None) -> Any:
        """Register the training components; returns them moved, patched and (when distributed) DDP-wrapped, or
        sharded in place with ``TorchTrainer(strategy="fsdp")`` (see :mod:`raysgd.torch.operator.fsdp`).

        Returns ``(models, optimizers[, criterion][, schedulers])``, each in the shape given:
        a single object stays single, a tuple stays a tuple, a list stays a list.

        Example:
            >>> # inside setup():
            >>> # self.model, self.optimizer, self.criterion = self.register(
            >>> #     models=model, optimizers=optimizer, criterion=torch.nn.MSELoss())
        """
        ddp_args = _registration.check_dict("ddp_args", ddp_args)
        apex_args = _registration.check_dict("apex_args", apex_args)
        model_list, model_shape = _registration.as_list(models, "models", torch.nn.Module)
        optim_list, optim_shape = _registration.as_list(optimizers, "optimizers", torch.optim.Optimizer)
        sched_list = _registration.check_schedulers(schedulers, self._scheduler_step_freq)
        self._given_models = list(model_list)  # the caller's objects: self.model may still be one of them
        model_list = [model.to(self._device) for model in model_list]
        if criterion is not None and hasattr(criterion, "to"):
            criterion = criterion.to(self._device)
        model_list, optim_list = self._precision.initialize(model_list, optim_list, apex_args)
        self._original_models = [_compiled.original(m) for m in model_list]  # torch.compile'd: the plain module
        self._optimizers = optim_list
        self._criterion = criterion
        if self._wrap_ddp:
            self._models = [_compiled.wrap_ddp(m, lambda inner: DistributedDataParallel(
                inner, device_ids=self.device_ids, **ddp_args)) for m in model_list]
        else:  # sharded in place under strategy="fsdp" (the optimizers follow); else as given
            self._models = self._sharding.shard(list(model_list), optim_list, ddp_args)
        self._registered = True
        returns = [model_shape(self._models), optim_shape(optim_list)]
        if criterion is not None:
            returns.append(criterion)
        if schedulers is not None:
            self._schedulers = sched_list
            returns.append(schedulers if not isinstance(schedulers, (list, tuple)) else type(schedulers)(sched_list))
        return tuple(returns)

    def register_data(self, *, train_loader: Iterable | None = None, validation_loader: Iterable | None = None) -> None:
        """Register the loaders (any iterables); map-style DataLoaders are sharded by their own samplers."""
        if self._add_dist_sampler:  # seeded by config[DATA_SEED]: see raysgd.torch.sharding.loaders.resolve_seed
            shard = functools.partial(_data.shard_loader, rank=self._world_rank, world_size=self._world_size,
                                      seed=self._config.get(DATA_SEED))
            train_loader, validation_loader = shard(train_loader, training=True), shard(validation_loader,
                                                                                        training=False)
        self._train_loader = train_loader
        self._validation_loader = validation_loader

    def train_epoch(self, iterator: Iterable, info: dict | None = None, num_steps: int | None = None,
                    epoch_idx: int = 0) -> dict[str, Any]:
        """Run :meth:`train_batch` over ``iterator`` and return the batch-averaged metrics.

        Steps the registered schedulers per batch or per epoch as ``scheduler_step_freq`` says.
        """
        info = dict(info or {})
        self._set_mode(training=True)
        meters = self._running_meters = AverageMeterCollection()
        accumulation = self._begin_accumulation()  # micro-batches per optimizer step (1 unless fixed_worker_batch)
        for batch_idx, batch in enumerate(iterator):
            batch_info = {"batch_idx": batch_idx, "global_step": self.global_step, **accumulation.next_info(), **info}
            metrics = dict(self.train_batch(batch, batch_info))
            accumulation.done(batch_info)
            if batch_info["step_now"]:
                self._after_optimizer_step()
            meters.update(metrics, n=metrics.pop(NUM_SAMPLES, 1))
            self._report_progress(batch_idx, metrics, info)
        if self._flush_accumulation():  # an optimizer step left partial by the end of the epoch or call
            self._after_optimizer_step()
        if self._scheduler_step_freq == SCHEDULER_STEP_EPOCH:
            self._step_schedulers()
        self._running_meters = None
        return meters.summary()

    def train_batch(self, batch: Any, batch_info: dict) -> dict[str, Any]:
        """One optimization step on ``batch`` (``*features, target``); returns ``train_loss`` and ``num_samples``.

        ``train_loss`` stays a 0-d tensor on the device (no sync per step); the epoch's meters read it once."""
        model = self._component("model", "_models")
        optimizer = self._component("optimizer", "_optimizers")
        criterion = self._component("criterion", "_criterion")
        *features, target = _data.to_device(batch, self._device if self._use_gpu else None)
        step_now = batch_info.get("step_now", True)
        with self.accumulate(step_now):
            with self.timers.record("fwd"), self.autocast():
                output = model(*features)
                loss = criterion(output, target)
            with self.timers.record("grad"):
                if zero_grad_now(batch_info):
                    optimizer.zero_grad()
                self.backward(self._scale_for_accumulation(loss), optimizer)
        if step_now:
            with self.timers.record("apply"):
                self.step(optimizer)
        return {"train_loss": loss.detach(), NUM_SAMPLES: target.size(0)}

    def validate(self, val_iterator: Iterable, info: dict | None = None) -> dict[str, Any]:
        """Run :meth:`validate_batch` over ``val_iterator`` without gradients; returns averaged metrics."""
        info = dict(info or {})
        self._set_mode(training=False)
        meters = AverageMeterCollection()
        with torch.no_grad():
            for batch_idx, batch in enumerate(val_iterator):
                metrics = dict(self.validate_batch(batch, {"batch_idx": batch_idx, **info}))
                meters.update(metrics, n=metrics.pop(NUM_SAMPLES, 1))
        return meters.summary()

    def validate_batch(self, batch: Any, batch_info: dict) -> dict[str, Any]:
        """Loss and argmax accuracy of one batch: ``val_loss``, ``val_accuracy`` (0-d tensors), ``num_samples``."""
        model = self._component("model", "_models")
        criterion = self._component("criterion", "_criterion")
        *features, target = _data.to_device(batch, self._device if self._use_gpu else None)
        with self.timers.record("eval_fwd"), self.autocast():
            output = model(*features)
            loss = criterion(output, target)
        num_samples = target.size(0)
        accuracy = 0.0  # only for (N, C) scores and N class indices: a regression target (N, k) gets none
        if output.dim() == 2 and output.size(0) == target.numel() == num_samples and not target.is_floating_point():
            correct = (output.argmax(dim=1) == target.view(-1).to(output.device)).sum()
            accuracy = correct.double() / max(num_samples, 1)  # stays on the device: no sync per batch
        return {"val_loss": loss.detach(), "val_accuracy": accuracy, NUM_SAMPLES: num_samples}

    def state_dict(self) -> Any:
        """Extra state of your own to checkpoint (stored under ``"operator"``). Override it; default None."""
        return None

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore what :meth:`state_dict` returned. Override it; the default does nothing."""

    # ----------------------------------------------------------------- internals
    def _component(self, attr, registered):
        """``self.<attr>`` if the user set it, else the single registered component of that kind.

        A ``self.model`` that is a module given to ``register`` (its return value not kept) is its registered
        (DDP-wrapped) form: the plain module would train without synchronising gradients."""
        value = getattr(self, attr, None)
        if value is not None:
            for index, given in enumerate(getattr(self, "_given_models", ()) if attr == "model" else ()):
                if value is given or value is self._original_models[index]:
                    return self._models[index]
            return value
        items = getattr(self, registered, None)
        if registered == "_criterion" and items is not None:
            return items
        if isinstance(items, list) and len(items) == 1:
            return items[0]
        raise RuntimeError(f"The default loop needs self.{attr}: set it in setup() (e.g. from register's return "
                           f"value), or override train_batch/validate_batch for several or no {attr}s.")

    def _set_mode(self, training):
        """``train()`` or ``eval()`` on ``self.model`` (if set) and every registered model."""
        models = list(getattr(self, "_models", None) or [])
        own = getattr(self, "model", None)
        if isinstance(own, torch.nn.Module):
            models.append(own)
        for model in models:
            model.train(training)

    def _after_optimizer_step(self):
        if self._scheduler_step_freq == SCHEDULER_STEP_BATCH:
            self._step_schedulers()
        self.global_step += 1

    def _step_schedulers(self):
        for scheduler in self._schedulers or ():
            scheduler.step()

    def _report_progress(self, batch_idx, metrics, info):
        """Hook for the driver's progress bar: calls ``progress_reporter`` (set by the worker with ``use_tqdm``)."""
        reporter = getattr(self, "progress_reporter", None)
        if reporter is not None:
            reporter(batch_idx, metrics, info)

    # ----------------------------------------------------------------- what the worker reads
    def state_parts(self):
        """What this operator owns of the training state, for :mod:`raysgd.torch.state.training_state` (its one
        reader): ``{"models" (unwrapped), "optimizers", "precision", "schedulers"}``."""
        self._require_registered()
        return dict(models=self._original_models, optimizers=self._optimizers, precision=self._precision,
                    schedulers=self._schedulers)

    def metrics_so_far(self) -> dict[str, Any] | None:
        """The default loop's metrics of the running epoch so far (what a commit stores), else None."""
        return self._running_meters.summary() if self._running_meters is not None else None

    def registered_models(self) -> list[torch.nn.Module]:
        """The registered models, unwrapped (no DDP, no ``torch.compile`` wrapper): what checkpoints hold."""
        self._require_registered()
        return self._original_models

    def registered_loader(self, kind: str = "train", required: bool = True) -> Any:
        """The registered ``"train"`` or ``"validation"`` loader (as sharded); None when there is none and not
        ``required``, else a ``RuntimeError`` saying how to register one."""
        loader = self._train_loader if kind == "train" else self._validation_loader
        if loader is None and required:
            if kind == "train":
                raise RuntimeError("No training loader: call self.register_data(train_loader=...) in setup(), "
                                   "or pass train(dataset=...).")
            raise RuntimeError("validate() needs a validation loader: call "
                               "self.register_data(validation_loader=...) in your operator's setup().")
        return loader

    def _check_models_registered(self):
        """Refuse an operator whose ``setup`` registered no model: the state, ``get_model()`` and DDP need one."""
        if not self._registered or not self._original_models:
            given = "register(models=[])" if self._registered else "no register() call"
            owner = next(c for c in type(self).__mro__ if "setup" in vars(c)).__name__  # whose setup() ran
            raise ValueError(f"{owner}.setup() registered no model ({given}): call "
                             f"self.register(models=..., optimizers=...) in setup(), also when you override "
                             f"train_epoch or train_batch (checkpoints, get_model() and DDP use the registered "
                             f"models)")

    def _require_registered(self):
        if not self._registered:
            raise RuntimeError("Nothing registered: call self.register(models=..., optimizers=...) in setup().")

    # ----------------------------------------------------------------- properties
    @property
    def config(self) -> dict:
        """This worker's copy of the trainer config (``BATCH_SIZE`` already divided)."""
        return self._config

    @property
    def world_rank(self) -> int:
        """This worker's rank among all workers (0 .. world size - 1)."""
        return self._world_rank

    @property
    def local_rank(self) -> int:
        """This worker's rank among the workers of its node."""
        return self._local_rank

    @property
    def device(self) -> torch.device:
        """The worker's ``torch.device`` (``cpu``, or ``cuda:<index>`` with ``use_gpu``)."""
        return self._device

    @property
    def device_ids(self) -> list[int] | None:
        """``[cuda index]`` with ``use_gpu`` (DistributedDataParallel's ``device_ids``), else None."""
        return [self._device.index or 0] if self._use_gpu else None

    @property
    def use_gpu(self) -> bool:
        """True when this worker trains on a GPU."""
        return self._use_gpu

    @property
    def use_fp16(self) -> bool | str:
        """The requested ``use_fp16`` value (truthy when mixed precision was asked for)."""
        return self._precision.requested

    @property
    def use_fp16_native(self) -> bool:
        """True when ``use_fp16`` asks for ``torch.amp`` (``True`` or ``"bf16"``)."""
        return bool(self._precision.requested) and self._precision.requested != "apex"

    @property
    def use_fp16_apex(self) -> bool:
        """True when ``use_fp16="apex"`` (NVIDIA apex)."""
        return self._precision.requested == "apex"

    @property
    def precision(self) -> Precision:
        """The :class:`~raysgd.torch.operator.precision.Precision` object behind the fp16 helpers."""
        return self._precision

    @property
    def _amp(self):
        return LegacyAmp(self._precision) if self._precision.requested else None

    @property
    def _amp_scaler(self):
        return self._precision.scaler

    @property
    def use_tqdm(self) -> bool:
        """True when the trainer draws a progress bar (``use_tqdm=True``)."""
        return self._use_tqdm

    @property
    def scheduler_step_freq(self) -> str | None:
        """``"batch"``, ``"epoch"``, ``"manual"`` or None: when the registered schedulers step."""
        return self._scheduler_step_freq

    @classmethod
    def from_creators(cls, model_creator: Callable, optimizer_creator: Callable, data_creator: Callable | None = None,
                      loss_creator: Callable | type | None = None, scheduler_creator: Callable | None = None,
                      serialize_data_creation: bool = True) -> type[CreatorOperator]:
        """Build an operator class from 1.x creator functions: a :class:`CreatorOperator` (this class, when it is not
        one yet, with the creator loop mixed in; see :mod:`raysgd.torch.operator.creators`)."""
        base = cls if issubclass(cls, CreatorOperator) else type("CreatorOperator", (CreatorOperator, cls), {})
        return _creators.make_creator_operator(base, model_creator, optimizer_creator, data_creator, loss_creator,
                                               scheduler_creator, serialize_data_creation)

    @classmethod
    def from_ptl(cls, lightning_module_cls: type, train_dataloader: Any = None, val_dataloader: Any = None,
                 **options: Any) -> type[LightningOperator]:
        """An operator class training a LightningModule: a :class:`LightningOperator` (see
        :mod:`raysgd.torch.operator.lightning`; Lightning is imported only here)."""
        return _lightning.make_lightning_operator(LightningOperator, lightning_module_cls, train_dataloader,
                                                  val_dataloader, **options)


class CreatorOperator(_creators.CreatorLoops, TrainingOperator):
    """A :class:`TrainingOperator` whose ``setup`` calls the creator functions held as class attributes (RaySGD 1.x's
    class; :meth:`TrainingOperator.from_creators` builds one).

    After setup, ``models``/``optimizers``/``schedulers`` hold what ``register`` returned and
    ``model``/``optimizer``/``scheduler``/``criterion`` the first (or only) one; an attribute whose
    creator was not given is absent.
    """


class LightningOperator(_lightning.LightningLoops, TrainingOperator):
    """A :class:`TrainingOperator` training the LightningModule class held in ``_lightning_module_cls``
    (:meth:`TrainingOperator.from_ptl` builds one; RaySGD 1.x's ``lightning_operator.LightningOperator``).

    ``self.model`` is the module as registered (DDP-wrapped when distributed), :meth:`get_model` the module
    itself; ``self.optimizers`` and ``self.scheduler_dicts`` hold what ``configure_optimizers`` returned.
    Subclass the class that ``from_ptl`` returns to change a loop.
    """

    _schedulers: list[Any] | None  # TrainingOperator's (LightningLoops.setup sets it too)
