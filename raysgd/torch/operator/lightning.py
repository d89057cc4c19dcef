"""The Lightning loops: what makes an operator train a LightningModule (``TrainingOperator.from_ptl``), as a mixin.

Layer 1 (torch; Lightning only once an operator is built, through :mod:`raysgd.torch.operator.lightning_bridge`).
:class:`LightningLoops` never imports the operator: ``LightningOperator`` is ``TrainingOperator`` with it mixed in,
and :func:`make_lightning_operator` builds the class for one module from the base it is given. On each worker the
module is built (with ``config`` when its ``__init__`` takes it), its hooks run in Lightning's order, its
``configure_optimizers`` result is registered like any model and optimizer (DDP-wrapped when distributed, so
``training_step`` runs through DDP's forward and gradients are averaged), and its loaders are sharded like any
registered loader. ``self.log`` values come back from ``train()``/``validate()`` reduced like raysgd's own metrics.

Example:
    >>> Operator = TrainingOperator.from_ptl(MyLightningModule)  # doctest: +SKIP
    >>> trainer = TorchTrainer(training_operator_cls=Operator, num_workers=2, config={"lr": 0.1})  # doctest: +SKIP
    >>> trainer.train()["train_loss"], trainer.validate()["val_loss"]  # doctest: +SKIP
    >>> module = trainer.get_model()  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from raysgd.base.checks import expect
from raysgd.meters import NUM_SAMPLES, AverageMeterCollection
from raysgd.torch.operator import lightning_bridge as lightning
from raysgd.torch.operator.registration import is_scheduler

if TYPE_CHECKING:
    from raysgd.torch.operator.precision import Precision

logger = logging.getLogger(__name__)


class LightningLoops:
    """An operator's ``setup``, epoch loops and state for the LightningModule class held in ``_lightning_module_cls``
    (a mixin over :class:`~raysgd.torch.training_operator.TrainingOperator`; built by
    :func:`make_lightning_operator`).

    ``self.model`` is the module as registered (DDP-wrapped when distributed), :meth:`get_model` the module
    itself; ``self.optimizers`` and ``self.scheduler_dicts`` hold what ``configure_optimizers`` returned.
    """

    # provided by the host class (TrainingOperator and its mixins)
    use_fp16: bool | str
    world_rank: int
    local_rank: int
    device: torch.device
    precision: Precision
    global_step: int
    _world_size: int
    _is_distributed: bool
    _schedulers: Any  # the host owns its type; setup() sets it to the list of schedulers
    _train_loader: Iterable[Any] | None
    _validation_loader: Iterable[Any] | None
    register: Callable[..., Any]
    register_data: Callable[..., None]
    autocast: Callable[[], Any]
    step: Callable[..., None]
    unscale_gradients: Callable[[Any], None]
    _set_mode: Callable[..., None]
    _report_progress: Callable[..., None]

    _lightning_module_cls = None
    _train_dataloader = _val_dataloader = _datamodule_spec = None
    _ddp_args = None

    # ----------------------------------------------------------------- set-up
    def setup(self, config):
        if self.use_fp16 == "apex":
            raise ValueError("from_ptl supports use_fp16=False, True or 'bf16'; got use_fp16='apex'")
        self._base = lightning.lightning_base(self._lightning_module_cls)
        self._module = module = lightning.build(self._lightning_module_cls, config)
        self._bridge = lightning.TrainerStandIn(
            self, self.world_rank, self.local_rank, self._world_size,
            lightning.precision_name(self.precision.autocast_dtype))
        spec = self._datamodule_spec
        self._datamodule = lightning.build(spec, config) if isinstance(spec, type) else spec
        self._bridge.datamodule = self._datamodule
        self._proxies, self._pending_plateau, self._train_started, self._unscaled = [], [], False, set()
        with self._attached():
            self._prepare_data()
            for obj in (self._datamodule, module):
                if obj is not None:
                    obj.setup("fit")
            if hasattr(module, "configure_model"):
                module.configure_model()
            module.to(self.device)
            optimizers, configs = lightning.parse_optimizers(module.configure_optimizers())
        self._check_optimization(optimizers, configs)
        ddp_args = {"find_unused_parameters": True} if not module.automatic_optimization else {}
        self.model, self.optimizers = self.register(models=module, optimizers=list(optimizers),
                                                    ddp_args={**ddp_args, **(self._ddp_args or {})})
        self.scheduler_dicts = configs
        self.schedulers = self._schedulers = [c.scheduler for c in configs]  # checkpointed by the worker
        self._proxies = [lightning.OptimizerProxy(opt, self._optimizer_step) for opt in self.optimizers]
        self._bridge.optimizers, self._bridge.lr_scheduler_configs = self._proxies, configs
        with self._attached():
            self.register_data(train_loader=self._loader("train"), validation_loader=self._loader("val"))
            module.on_fit_start()

    def _check_optimization(self, optimizers, configs):
        if self._module.automatic_optimization and len(optimizers) > 1:
            raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers: several optimizers "
                             "need manual optimization (self.automatic_optimization = False), as in Lightning 2.x")
        custom_step = lightning.is_overridden(self._module, "lr_scheduler_step", self._base)
        for config in configs:  # else it would fail once an epoch had trained, or at the first checkpoint
            scheduler = config.scheduler
            stateful = not isinstance(scheduler, type) and all(
                callable(getattr(scheduler, name, None)) for name in ("state_dict", "load_state_dict"))
            if not (is_scheduler(scheduler) or (custom_step and stateful)):
                raise TypeError("configure_optimizers: an lr_scheduler must be a learning-rate scheduler (with step(), "
                                "state_dict() and load_state_dict(); with an overridden lr_scheduler_step, the last "
                                f"two), as in Lightning; got {lightning.describe(scheduler)}")
            if config.reduce_on_plateau and config.interval == "step":
                raise ValueError("from_ptl steps ReduceLROnPlateau per epoch only (interval='epoch'); got "
                                 f"interval='step' for monitor {config.monitor!r}")

    def _prepare_data(self):
        """``prepare_data`` once per node (local rank 0), or once in all with ``prepare_data_per_node=False``."""
        for obj in (self._datamodule, self._module):
            if obj is None or not lightning.is_overridden(obj, "prepare_data", lightning.lightning_default_owner(obj)):
                continue
            per_node = getattr(obj, "prepare_data_per_node", True)
            if (self.local_rank if per_node else self.world_rank) == 0:
                obj.prepare_data()
        if self._is_distributed and dist.is_initialized():
            dist.barrier()  # the others wait for the data; the process group's timeout bounds the wait

    def _loader(self, which):
        """From ``from_ptl``'s arguments, else the datamodule, else the module's own ``*_dataloader()``."""
        name = f"{which}_dataloader"
        given = self._train_dataloader if which == "train" else self._val_dataloader
        if given is not None:
            return _one_loader(given, f"from_ptl({name}=...)")
        for obj in (self._datamodule, self._module):
            if obj is not None and lightning.is_overridden(obj, name, lightning.lightning_default_owner(obj)):
                return _one_loader(getattr(obj, name)(), f"{type(obj).__name__}.{name}()")
        return None

    def registered_loader(self, kind="train", required=True):
        """The registered loader, or an error naming what the LightningModule lacks (see the operator's)."""
        loader, hook = (self._train_loader, "train") if kind == "train" else (self._validation_loader, "val")
        if loader is None and required:
            need = "No training data" if kind == "train" else "validate() needs validation data"
            raise RuntimeError(f"{need} for {type(self._module).__name__}: define {hook}_dataloader() in the "
                               f"LightningModule or a datamodule, or pass from_ptl(..., {hook}_dataloader=...)")
        return loader

    @contextlib.contextmanager
    def _attached(self):
        """Point the module's ``trainer``/``fabric`` at the stand-in while its code runs; detach after.

        Detached, the module pickles and deep-copies cleanly (``get_model``, checkpoints).
        """
        module = self._module
        if module.fabric is not None:
            yield
            return
        module.trainer = module.fabric = self._bridge
        module._fabric_optimizers = list(self._proxies)
        if self._datamodule is not None:
            self._datamodule.trainer = self._bridge
        try:
            yield
        finally:
            module.fabric = module.trainer = None
            module._fabric_optimizers = []
            if self._datamodule is not None:
                self._datamodule.trainer = None

    @contextlib.contextmanager
    def _logging_to(self, sink):
        previous, self._bridge.sink = self._bridge.sink, sink
        try:
            yield sink
        finally:
            self._bridge.sink = previous

    # ----------------------------------------------------------------- training
    def train_epoch(self, iterator, info=None, num_steps=None, epoch_idx=0):
        """One epoch of ``training_step``; returns ``train_loss`` and every ``self.log`` name, sample-weighted."""
        info = dict(info or {})
        module, bridge = self._module, self._bridge
        epoch = info.get("epoch_idx", epoch_idx)
        bridge.current_epoch, bridge.training, bridge.validating = epoch, True, False
        self._set_mode(training=True)
        epoch_logs: dict[str, Any]
        meters, epoch_logs = AverageMeterCollection(), {}
        with self._attached(), torch.enable_grad():
            with self._logging_to(epoch_logs):
                if not self._train_started:
                    module.on_train_start()
                    self._train_started = True
                module.on_train_epoch_start()
            for batch_idx, batch in enumerate(iterator):
                batch = self._transfer(batch)
                with self._logging_to({}) as step_logs:
                    if module.on_train_batch_start(batch, batch_idx) == -1:  # the epoch ends (Lightning's rule)
                        getattr(iterator, "end_epoch", lambda: None)()
                        break
                    output, loss = self._training_step(batch, batch_idx, epoch)
                    module.on_train_batch_end(output, batch, batch_idx)
                metrics = {} if loss is None else {"train_loss": float(loss.detach())}
                metrics.update(step_logs)
                meters.update(metrics, n=lightning.batch_size_of(batch) or 1)
                self._step_schedulers_per_batch()
                self.global_step += 1
                self._report_progress(batch_idx, metrics, info)
            with self._logging_to(epoch_logs):
                module.on_train_epoch_end()
            stats = {**meters.summary(), **epoch_logs}
            self._step_schedulers_per_epoch(epoch, stats)
        return stats

    def _training_step(self, batch, batch_idx, epoch):
        """``(output, loss)`` of one training step, optimizing automatically or leaving it to the module."""
        module = self._module
        if not module.automatic_optimization:
            with self.autocast():
                output = self._through_ddp(batch, batch_idx)
            return output, lightning.loss_of(output, "training_step", required=False)
        optimizer = self._proxies[0] if self._proxies else None
        ran = {}

        def closure():
            with self.autocast():
                ran["output"] = output = self._through_ddp(batch, batch_idx)
            ran["loss"] = loss = lightning.loss_of(output, "training_step", required=True)
            if loss is None or optimizer is None:
                return loss
            module.on_before_zero_grad(optimizer)
            module.optimizer_zero_grad(epoch, batch_idx, optimizer)
            module.on_before_backward(loss)
            module.backward(loss)
            module.on_after_backward()
            return loss

        if optimizer is None:
            closure()
        else:
            module.optimizer_step(epoch, batch_idx, optimizer, closure)
        if "output" not in ran:
            raise RuntimeError("optimizer_step(epoch, batch_idx, optimizer, optimizer_closure) must call "
                               "optimizer.step(closure=optimizer_closure) (or the closure itself)")
        return ran["output"], ran["loss"]

    def _through_ddp(self, batch, batch_idx):
        """``training_step(batch, batch_idx)`` called through DDP's forward, so gradients are averaged.

        For this one call the module's ``forward`` is replaced by a function that restores it and runs
        ``training_step``: a ``self(x)`` inside the step reaches the real ``forward``.
        """
        module = self._module
        if self.model is module:
            return module.training_step(batch, batch_idx)

        def redirect(*args, **kwargs):
            module.__dict__.pop("forward", None)
            return module.training_step(*args, **kwargs)

        module.__dict__["forward"] = redirect
        try:
            return self.model(batch, batch_idx)
        finally:
            module.__dict__.pop("forward", None)

    def lightning_backward(self, loss, *args, **kwargs):
        """``backward``/``manual_backward`` of the module: scaled under fp16, synchronised under DDP."""
        if isinstance(self.model, DistributedDataParallel) and not self._module.automatic_optimization:
            lightning.prepare_ddp_for_backward(self.model, loss)
        self.precision.scaler.scale(loss).backward(*args, **kwargs)

    def unscale_once(self, optimizer):
        """Unscale ``optimizer``'s gradients if the scaler is on and they are still scaled."""
        if self.precision.scaler.is_enabled() and id(optimizer) not in self._unscaled:
            self.unscale_gradients(optimizer)
            self._unscaled.add(id(optimizer))

    def _optimizer_step(self, optimizer):
        """What ``optimizer.step()`` does for the module: unscale, hooks, clipping, the scaler's step."""
        self.unscale_once(optimizer)
        proxy = next((p for p in self._proxies if p.optimizer is optimizer), optimizer)
        self._module.on_before_optimizer_step(proxy)
        if self._module.automatic_optimization:
            self._module.configure_gradient_clipping(proxy)
        self.step(optimizer)
        self._unscaled.discard(id(optimizer))

    def _transfer(self, batch):
        module = self._module
        batch = module.on_before_batch_transfer(batch, 0)
        batch = module.transfer_batch_to_device(batch, self.device, 0)
        return module.on_after_batch_transfer(batch, 0)

    # ----------------------------------------------------------------- schedulers
    def _step_schedulers_per_batch(self):
        if not self._module.automatic_optimization:
            return
        for config in self.scheduler_dicts:
            if config.interval == "step" and (self.global_step + 1) % config.frequency == 0:
                self._module.lr_scheduler_step(config.scheduler, None)

    def _step_schedulers_per_epoch(self, epoch, stats):
        """Epoch schedulers at the end of ``train()``; a plateau whose metric training lacks waits for validate, once
        however many epochs it waits (it steps once per value of its metric, as under Lightning's Trainer)."""
        if not self._module.automatic_optimization:
            return
        for index, config in enumerate(self.scheduler_dicts):
            if config.interval != "epoch" or (epoch + 1) % config.frequency:
                continue
            if not config.reduce_on_plateau:
                self._module.lr_scheduler_step(config.scheduler, None)
            elif not self._step_plateau(config, stats) and index not in self._pending_plateau:
                self._pending_plateau.append(index)

    def _step_plateau(self, config, stats):
        """Step ``config``'s plateau scheduler with its metric reduced over workers; False if nobody has it."""
        value, weight = stats.get(config.monitor), stats.get(NUM_SAMPLES, 0)
        local = [value * weight, weight] if value is not None and weight else [0.0, 0.0]
        total = torch.tensor(local, dtype=torch.float64)
        if self._is_distributed and dist.is_initialized():
            dist.all_reduce(total)
        if total[1] <= 0:
            return False
        self._module.lr_scheduler_step(config.scheduler, float(total[0] / total[1]))
        return True

    # ----------------------------------------------------------------- validation
    def validate(self, val_iterator, info=None):
        """``validation_step`` over the shard; returns ``val_loss`` (if the step returns one) and logged names."""
        module, bridge = self._module, self._bridge
        if not lightning.is_overridden(module, "validation_step", self._base):
            raise NotImplementedError(f"validate() needs {type(module).__name__}.validation_step")
        bridge.training, bridge.validating = False, True
        self._set_mode(training=False)
        epoch_logs: dict[str, Any]
        meters, epoch_logs = AverageMeterCollection(), {}
        with self._attached(), torch.no_grad():
            with self._logging_to(epoch_logs):
                module.on_validation_epoch_start()
            for batch_idx, batch in enumerate(val_iterator):
                batch = self._transfer(batch)
                with self._logging_to({}) as step_logs:
                    module.on_validation_batch_start(batch, batch_idx)
                    with self.autocast():
                        output = module.validation_step(batch, batch_idx)
                    module.on_validation_batch_end(output, batch, batch_idx)
                loss = lightning.loss_of(output, "validation_step", required=False)
                metrics = {} if loss is None else {"val_loss": float(loss.detach())}
                metrics.update(step_logs)
                meters.update(metrics, n=lightning.batch_size_of(batch) or 1)
            with self._logging_to(epoch_logs):
                module.on_validation_epoch_end()
            bridge.validating = False
            stats = {**meters.summary(), **epoch_logs}
            self._step_pending_plateaus(stats)
        return stats

    def _step_pending_plateaus(self, stats):
        pending, self._pending_plateau = self._pending_plateau, []
        for index in pending:
            config = self.scheduler_dicts[index]
            if not self._step_plateau(config, stats):
                message = (f"ReduceLROnPlateau monitors {config.monitor!r}, which neither train() nor validate() "
                           f"reported; they reported {sorted(k for k in stats if not k.startswith('last_'))}")
                if config.strict:
                    raise KeyError(message)
                logger.warning("%s: not stepped (strict=False)", message)

    # ----------------------------------------------------------------- state and access
    def get_model(self):
        """The LightningModule itself (never the DDP wrapper)."""
        return self._module

    @property
    def lightning_module(self):
        """The LightningModule this worker trains (same as :meth:`get_model`)."""
        return self._module

    def state_dict(self):
        """The Lightning checkpoint extras: what ``on_save_checkpoint`` added, the datamodule's state."""
        checkpoint = {"epoch": self._bridge.current_epoch, "global_step": self.global_step,
                      "state_dict": self._module.state_dict()}
        with self._attached():
            self._module.on_save_checkpoint(checkpoint)
        checkpoint.pop("state_dict", None)  # the worker saves the weights itself
        state = {"checkpoint": checkpoint, "pending_plateau": list(self._pending_plateau)}
        if self._datamodule is not None:
            state["datamodule"] = self._datamodule.state_dict()
        return state

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` (the worker has loaded the weights): ``on_load_checkpoint`` runs."""
        if not state_dict:
            return
        checkpoint = {**state_dict.get("checkpoint", {}), "state_dict": self._module.state_dict()}
        with self._attached():
            self._module.on_load_checkpoint(checkpoint)
        self._pending_plateau = list(state_dict.get("pending_plateau", []))
        if self._datamodule is not None and "datamodule" in state_dict:
            self._datamodule.load_state_dict(state_dict["datamodule"])


def _one_loader(loader, source):
    """``loader``, unless it is Lightning's several loaders (a list, tuple or dict of DataLoaders), which raysgd
    would iterate as if each loader were a batch: a ``TypeError`` naming ``source``."""
    several = list(loader.values()) if isinstance(loader, dict) else loader if isinstance(loader, (list, tuple)) else []
    if several and all(isinstance(item, DataLoader) for item in several):
        raise TypeError(f"{source} returned a {type(loader).__name__} of {len(several)} DataLoaders; from_ptl runs "
                        "one loader per phase (Lightning's several loaders and dataloader_idx are not supported): "
                        "return one DataLoader, e.g. over a torch.utils.data.ConcatDataset")
    return loader


def make_lightning_operator(base, lightning_module_cls, train_dataloader=None, val_dataloader=None, datamodule=None,
                            ddp_args=None):
    """A subclass of ``base`` (a class with :class:`LightningLoops`) training ``lightning_module_cls``: the class
    behind ``TrainingOperator.from_ptl``.

    ``train_dataloader``/``val_dataloader`` (loaders) win over ``datamodule`` (a ``LightningDataModule``
    class, built on each worker with ``config`` when it takes it, or an instance), which wins over the
    module's own ``train_dataloader()``/``val_dataloader()``. ``ddp_args`` go to ``DistributedDataParallel``.

    Example:
        >>> Operator = TrainingOperator.from_ptl(MyLightningModule, datamodule=MyDataModule)  # doctest: +SKIP
    """
    if not issubclass(base, LightningLoops):
        raise TypeError(f"make_lightning_operator needs a base class with LightningLoops; got {base!r}")
    lightning.lightning_packages()  # ImportError saying what to install
    how = {"error": TypeError, "caller": "from_ptl", "call": True}
    expect(lightning.lightning_base(lightning_module_cls) is not None, "lightning_module_cls", "a subclass of "
           "LightningModule (pytorch_lightning.LightningModule or lightning.pytorch.LightningModule)",
           lightning_module_cls, got=lightning.describe(lightning_module_cls), **how)
    expect(datamodule is None or lightning.lightning_base(
        datamodule if isinstance(datamodule, type) else type(datamodule), "LightningDataModule") is not None,
        "datamodule", "a LightningDataModule subclass or instance", datamodule, got=lightning.describe(datamodule),
        **how)
    expect(ddp_args is None or isinstance(ddp_args, dict), "ddp_args", "a dict of DistributedDataParallel arguments",
           ddp_args, **how)
    return type(f"{lightning_module_cls.__name__}Operator", (base,), {
        "_lightning_module_cls": lightning_module_cls, "_train_dataloader": train_dataloader,
        "_val_dataloader": val_dataloader, "_datamodule_spec": datamodule, "_ddp_args": ddp_args})
