"""The Lightning-facing parts of :mod:`raysgd.torch.operator.lightning`: what a LightningModule talks to.

Layer 1 (torch): Lightning is imported only when these functions run, under either of its
names (``pytorch_lightning`` or ``lightning.pytorch``). Here: finding Lightning, parsing
``configure_optimizers``, the stand-in a module reaches as ``self.trainer`` (``self.log``,
``self.optimizers()``, ``manual_backward``), the mapping from Lightning's ``precision`` setting to
raysgd's ``use_fp16``, and reading a batch's sample count and a step's loss.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    >>> optimizers, configs = parse_optimizers({"optimizer": opt, "lr_scheduler": {"scheduler": sched,
    ...                                                                        "interval": "step"}})
    >>> len(optimizers), configs[0].interval, configs[0].frequency
    (1, 'step', 1)
    >>> use_fp16_for_precision("bf16-mixed")
    'bf16'
"""
import dataclasses
import importlib
import inspect
import logging
import sys
from typing import Any

import torch

from raysgd import optional
from raysgd.base.checks import is_whole

logger = logging.getLogger(__name__)

#: The import names Lightning is found under, in order of preference.
LIGHTNING_NAMES = ("pytorch_lightning", "lightning.pytorch")
INSTALL_HINT = (f'TrainingOperator.from_ptl needs PyTorch Lightning 2.x: {optional.install_hint("pytorch_lightning")} '
                '(or pip install "pytorch-lightning>=2" / "lightning>=2")')

# Lightning's precision values and the use_fp16 that gives the same training.
_PRECISION_TO_FP16 = {"32": False, "32-true": False, "16": True, "16-mixed": True, "bf16": "bf16",
                      "bf16-mixed": "bf16"}


def lightning_packages():
    """The Lightning packages in use: those already imported, else the first of :data:`LIGHTNING_NAMES` found.

    Importing Lightning takes seconds, so a second import name is never loaded needlessly (a module
    class can only derive from a package that is already imported). Raises ``ImportError`` saying what
    to install when there is none.
    """
    loaded = [sys.modules[name] for name in LIGHTNING_NAMES if sys.modules.get(name) is not None]
    if loaded:
        return loaded
    first_error = None
    for name in LIGHTNING_NAMES:
        try:
            return [importlib.import_module(name)]
        except ImportError as err:
            first_error = first_error or err
    raise optional.MissingExtra(INSTALL_HINT, name=LIGHTNING_NAMES[0],
                                extra=optional.extra_of(LIGHTNING_NAMES[0])) from first_error


def lightning_base(cls, kind="LightningModule"):
    """The Lightning ``kind`` class (``LightningModule`` or ``LightningDataModule``) that ``cls`` derives from.

    None when ``cls`` is not a class or derives from neither package's ``kind``.
    """
    if not isinstance(cls, type):
        return None
    for package in lightning_packages():
        base = getattr(package, kind)
        if issubclass(cls, base):
            return base
    return None


def is_overridden(obj, name, base):
    """Whether ``type(obj)`` defines hook ``name`` itself rather than inheriting Lightning's default."""
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def use_fp16_for_precision(precision):
    """The ``TorchTrainer(use_fp16=...)`` value matching Lightning's ``Trainer(precision=...)``.

    ``32``/``"32-true"`` -> ``False``; ``16``/``"16-mixed"`` -> ``True``; ``"bf16"``/``"bf16-mixed"``
    -> ``"bf16"``. The others (``"64-true"``, ``"16-true"``, ``"bf16-true"``, ``"transformer-engine"``)
    have no raysgd equivalent and raise ``ValueError``.

    Example:
        >>> use_fp16_for_precision(32), use_fp16_for_precision("16-mixed")
        (False, True)
    """
    key = str(precision)
    if key not in _PRECISION_TO_FP16:
        raise ValueError(f"Lightning precision {precision!r} has no raysgd use_fp16 equivalent; expected one of "
                         f"{sorted(_PRECISION_TO_FP16)}")
    return _PRECISION_TO_FP16[key]


def precision_name(autocast_dtype):
    """Lightning's name for the precision raysgd runs with (what ``self.trainer.precision`` reports)."""
    return {torch.float16: "16-mixed", torch.bfloat16: "bf16-mixed"}.get(autocast_dtype, "32-true")


def batch_size_of(batch):
    """The number of samples in ``batch``: the first dimension of its first tensor (None if it has none).

    Example:
        >>> batch_size_of((torch.zeros(5, 2), torch.zeros(5))), batch_size_of({"x": [torch.zeros(3)]})
        (5, 3)
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.size(0)) if batch.dim() > 0 else 1
    if isinstance(batch, dict):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for item in items:
        size = batch_size_of(item)
        if size is not None:
            return size
    return None


def build(cls, config):
    """``cls(config=config)`` when its ``__init__`` takes ``config``, else ``cls()`` (as RaySGD 1.x did)."""
    return cls(config=config) if "config" in inspect.signature(cls.__init__).parameters else cls()


def loss_of(output, step_name, required):
    """The loss in a step's output: the tensor itself, or ``output["loss"]``; None when there is none."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if output is None or not required:
        return None
    raise TypeError(f"{step_name} must return a loss tensor, a dict with 'loss', or None; got "
                    f"{type(output).__name__}" + (f" with keys {sorted(output)}" if isinstance(output, dict) else ""))


def prepare_ddp_for_backward(ddp, loss):
    """Arm DDP's gradient hooks for a backward run inside the forward (manual optimization).

    DDP arms its reducer after ``forward`` returns; ``manual_backward`` runs while ``training_step`` (the
    forward) is still running, so without this the backward would not be averaged as a round of its own.
    Uses DDP's reducer directly, as Lightning's own DDP strategy does for manual optimization.
    """
    if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
        return
    ddp.require_forward_param_sync = True
    outputs = [loss] if ddp.find_unused_parameters and not getattr(ddp, "static_graph", False) else []
    ddp.reducer._rebuild_buckets()
    ddp.reducer.prepare_for_backward(outputs)


def lightning_default_owner(obj):
    """The Lightning class whose default ``*_dataloader``/``prepare_data`` ``obj`` may override."""
    return lightning_base(type(obj)) or lightning_base(type(obj), "LightningDataModule")


def describe(value):
    """``value`` for an error message: ``class module.Name`` for a class, else a shortened repr."""
    return f"class {value.__module__}.{value.__qualname__}" if isinstance(value, type) else repr(value)[:200]


@dataclasses.dataclass
class SchedulerConfig:
    """One scheduler and how to step it: Lightning's ``lr_scheduler`` dict (``self.lr_schedulers()`` reads it)."""

    scheduler: object
    name: str | None = None
    interval: str = "epoch"
    frequency: int = 1
    reduce_on_plateau: bool = False
    monitor: str | None = None
    strict: bool = True


def _scheduler_config(item, monitor):
    if isinstance(item, dict):
        unknown = set(item) - {f.name for f in dataclasses.fields(SchedulerConfig)}
        if unknown:
            logger.warning("configure_optimizers: ignoring unknown lr_scheduler keys %s", sorted(unknown))
        if "scheduler" not in item:
            raise ValueError(f"configure_optimizers: an lr_scheduler dict needs the key 'scheduler'; got keys "
                             f"{sorted(item)}")
        fields = {k: v for k, v in item.items() if k not in unknown}
        fields.setdefault("monitor", monitor)
        config = SchedulerConfig(**fields)
    else:
        config = SchedulerConfig(item, monitor=monitor)
    if config.interval not in ("step", "epoch"):
        raise ValueError(f"configure_optimizers: lr_scheduler 'interval' must be 'step' or 'epoch'; got "
                         f"{config.interval!r}")
    if not is_whole(config.frequency, minimum=1):  # numpy's int (or 2.0) counts as Python's
        raise ValueError(f"configure_optimizers: lr_scheduler 'frequency' must be an int >= 1; got "
                         f"{config.frequency!r}")
    config.frequency = int(config.frequency)
    plateau = isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    config.reduce_on_plateau = bool(config.reduce_on_plateau or plateau)
    if config.reduce_on_plateau and not config.monitor:
        raise ValueError("configure_optimizers: a ReduceLROnPlateau scheduler needs a 'monitor', e.g. "
                         "{'optimizer': opt, 'lr_scheduler': {'scheduler': sched, 'monitor': 'val_loss'}}")
    return config


def _is_optimizer(value):
    return isinstance(value, torch.optim.Optimizer)


def _from_dict(conf):
    if "optimizer" not in conf:
        raise ValueError(f"configure_optimizers returned a dict without 'optimizer' (keys: {sorted(conf)})")
    schedulers = [conf["lr_scheduler"]] if conf.get("lr_scheduler") is not None else []
    return [conf["optimizer"]], schedulers, conf.get("monitor")


def parse_optimizers(conf):
    """``(optimizers, scheduler_configs)`` from whatever ``configure_optimizers`` returned.

    Accepts every Lightning form: ``None`` (no optimizer), an optimizer, a list or tuple of optimizers,
    ``([optimizers], [schedulers])``, a dict ``{"optimizer", "lr_scheduler", "monitor"}`` whose
    ``lr_scheduler`` is a scheduler or a dict ``{"scheduler", "interval", "frequency", "monitor", "name",
    "strict"}``, or a list of such dicts. Anything else raises ``TypeError``.
    """
    monitor = None
    schedulers: list[Any]
    if conf is None:
        optimizers, schedulers = [], []
    elif _is_optimizer(conf):
        optimizers, schedulers = [conf], []
    elif isinstance(conf, dict):
        optimizers, schedulers, monitor = _from_dict(conf)
    elif (isinstance(conf, (list, tuple)) and len(conf) == 2 and isinstance(conf[0], (list, tuple))
          and all(_is_optimizer(o) for o in conf[0])):
        optimizers = list(conf[0])
        schedulers = list(conf[1]) if isinstance(conf[1], (list, tuple)) else [conf[1]]
    elif isinstance(conf, (list, tuple)) and conf and all(isinstance(d, dict) for d in conf):
        optimizers, schedulers = [], []
        for item in conf:
            opts, scheds, item_monitor = _from_dict(item)
            optimizers += opts
            schedulers += [s if isinstance(s, dict) else {"scheduler": s} for s in scheds]
            if item_monitor and scheds:  # this dict's own schedulers ([-0:] would be every earlier one)
                schedulers[-len(scheds):] = [{"monitor": item_monitor, **s} for s in schedulers[-len(scheds):]]
    elif isinstance(conf, (list, tuple)) and all(_is_optimizer(o) for o in conf):
        optimizers, schedulers = list(conf), []
    else:
        raise TypeError("configure_optimizers must return an optimizer, a list/tuple of optimizers, "
                        "([optimizers], [schedulers]), a dict with 'optimizer' (and 'lr_scheduler'), or a list of "
                        f"such dicts; got {type(conf).__name__}: {conf!r:.200}")
    for optimizer in optimizers:
        if not _is_optimizer(optimizer):
            raise TypeError(f"configure_optimizers: expected torch.optim.Optimizer objects; got "
                            f"{type(optimizer).__name__}")
    return optimizers, [_scheduler_config(item, monitor) for item in schedulers]


class OptimizerProxy:
    """An optimizer as a LightningModule sees it under raysgd: ``step`` goes through the operator.

    ``step(closure)`` runs the closure (Lightning's training step and backward), then the operator's
    optimizer step (scaler, hooks, clipping); a closure returning None skips the step, as in Lightning.
    It passes ``isinstance`` checks for the wrapped optimizer's class, like Lightning's own wrappers.
    """

    def __init__(self, optimizer, step_fn):
        self._optimizer = optimizer
        self._step_fn = step_fn
        self.__class__ = type("RaySGD" + type(optimizer).__name__, (OptimizerProxy, type(optimizer)), {})

    @property
    def optimizer(self):
        """The wrapped ``torch.optim.Optimizer``."""
        return self._optimizer

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is None:
                return None
        self._step_fn(self._optimizer)
        return loss

    def zero_grad(self, set_to_none=True):
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._optimizer.load_state_dict(state_dict)

    def __getattr__(self, name):
        if name == "_optimizer":  # not set yet (e.g. while copying): no recursion
            raise AttributeError(name)
        return getattr(self._optimizer, name)


class TrainerStandIn:
    """What a LightningModule reaches as ``self.trainer`` (and Lightning's ``self.fabric`` hook) under raysgd.

    Lightning routes ``self.log``/``self.log_dict``, ``self.optimizers()``, ``manual_backward`` and
    ``clip_gradients`` to a module's ``fabric`` when one is set; this object takes those calls and hands
    them to the operator. ``self.trainer.<attr>`` reads the attributes below (``current_epoch``,
    ``global_step``, ``global_rank``, ``local_rank``, ``world_size``, ``is_global_zero``, ``precision``,
    ``datamodule``, ``optimizers``, ``lr_scheduler_configs``, ``training``, ``validating``); anything
    else raises ``AttributeError`` naming the attribute.
    """

    def __init__(self, operator, global_rank=0, local_rank=0, world_size=1, precision="32-true"):
        self._operator = operator
        self.global_rank, self.local_rank, self.world_size = global_rank, local_rank, world_size
        self.num_devices, self.num_nodes = world_size, 1
        self.precision = precision
        self.datamodule = None
        self.logger, self.loggers, self.progress_bar_callback = None, [], None
        self.optimizers, self.lr_scheduler_configs = [], []
        self.current_epoch = 0
        self.training = self.validating = self.sanity_checking = False
        self.sink = None  # the dict that self.log values go to now; None drops them

    @property
    def global_step(self):
        return self._operator.global_step

    @property
    def is_global_zero(self):
        return self.global_rank == 0

    def log_dict(self, metrics, step=None):
        """Where ``LightningModule.log``/``log_dict`` land: scalars are recorded for the running phase."""
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"self.log({name!r}, ...) needs a number or a one-element tensor; got a "
                                     f"tensor of shape {tuple(value.shape)}")
                value = value.detach().float().item()
            if self.sink is None:
                logger.debug("self.log(%r) outside a training or validation epoch is dropped", name)
            else:
                self.sink[name] = float(value)

    def log(self, name, value, step=None):
        self.log_dict({name: value}, step)

    def backward(self, tensor, *args, model=None, **kwargs):
        """``manual_backward``/``backward``: the operator's scaled (and, under DDP, synchronised) backward."""
        self._operator.lightning_backward(tensor, *args, **kwargs)

    def clip_gradients(self, module, optimizer, clip_val=None, max_norm=None, norm_type=2.0,
                       error_if_nonfinite=False):
        """``LightningModule.clip_gradients``: by value (``clip_val``) or by norm (``max_norm``), unscaled first.

        As under Lightning's ``Trainer``: a value of 0 (or below) clips nothing, and a non-finite norm (an fp16
        overflow, whose step the scaler skips) is no error.
        """
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self._operator.unscale_once(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if clip_val is not None and clip_val > 0:
            torch.nn.utils.clip_grad_value_(params, clip_val)
        if max_norm is not None and max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                                  error_if_nonfinite=error_if_nonfinite)
        return None
