"""The creator loop of RaySGD 1.x (``TrainingOperator.from_creators``) as a mixin, and the 1.x test helpers.

Layer 1 (torch, filelock): :class:`CreatorLoops` is a mixin that never imports the operator:
:class:`~raysgd.torch.training_operator.CreatorOperator` is ``TrainingOperator`` with it mixed in, and
:func:`make_creator_operator` builds the class from the base it is given.

Example:
    >>> from raysgd.torch import TrainingOperator
    >>> from raysgd.torch.examples import train_example as ex
    >>> Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator, ex.data_creator,
    ...                                     loss_creator=torch.nn.MSELoss)
"""
import copy
import inspect
import os
import tempfile
from typing import Any, Callable, Optional, cast

import torch
from filelock import FileLock

from raysgd.meters import NUM_SAMPLES

#: Lock serialising data creation among the workers of one node (``serialize_data_creation=True``).
DATA_LOCK_PATH = os.path.join(tempfile.gettempdir(), ".raydata.lock")


class CreatorLoops:
    """The ``setup`` of an operator built from creator functions held as class attributes (a mixin: the operator's
    ``register`` and ``register_data`` do the rest).

    After setup, ``models``/``optimizers``/``schedulers`` hold what ``register`` returned and
    ``model``/``optimizer``/``scheduler``/``criterion`` the first (or only) one; an attribute whose
    creator was not given is absent, and so are ``schedulers``/``scheduler`` when ``scheduler_creator`` returned None
    or an empty list (a conditional scheduler).

    Example:
        >>> class Op(CreatorLoops):
        ...     _data_creator = staticmethod(lambda config: ([1, 2], [3]))
        >>> Op()._create_loaders({})
        ([1, 2], [3])
    """

    # provided by the host class (TrainingOperator)
    register: Callable[..., Any]
    register_data: Callable[..., None]

    _model_creator: Optional[Callable[..., Any]] = None
    _optimizer_creator: Optional[Callable[..., Any]] = None
    _data_creator: Optional[Callable[..., Any]] = None
    _loss_creator: Optional[Callable[..., Any]] = None
    _scheduler_creator: Optional[Callable[..., Any]] = None
    _serialize_data_creation = True

    def _create_loaders(self, config):
        if self._data_creator is None:
            return None, None
        if self._serialize_data_creation:
            with FileLock(DATA_LOCK_PATH):
                loaders = self._data_creator(config)
        else:
            loaders = self._data_creator(config)
        if loaders is None or (isinstance(loaders, (list, tuple)) and not loaders):  # bool(DataLoader) calls len()
            raise ValueError(f"data_creator must return a loader or (train_loader[, val_loader]); got {loaders!r}")
        if isinstance(loaders, (list, tuple)):
            if len(loaders) > 2:
                raise ValueError(f"data_creator returned {len(loaders)} loaders; expected 1 or 2 "
                                 "(train_loader[, validation_loader])")
            return loaders[0], (loaders[1] if len(loaders) == 2 else None)
        return loaders, None

    def setup(self, config):
        train_loader, val_loader = self._create_loaders(config)
        # make_creator_operator sets both creators (checked callable) on the class it builds
        models = cast(Callable[..., Any], self._model_creator)(config)
        optimizers = cast(Callable[..., Any], self._optimizer_creator)(models, config)
        kwargs = {"models": models, "optimizers": optimizers}
        if self._loss_creator is not None:
            kwargs["criterion"] = _create_loss(self._loss_creator, config)
            if kwargs["criterion"] is None:  # register would leave it out, and the schedulers be taken for it
                raise ValueError(f"from_creators: loss_creator {self._loss_creator!r} returned None; expected the "
                                 "loss (a module such as torch.nn.MSELoss() or a function of (output, target))")
        schedulers = self._scheduler_creator(optimizers, config) if self._scheduler_creator is not None else None
        if schedulers is not None and not (isinstance(schedulers, (list, tuple)) and not schedulers):
            kwargs["schedulers"] = schedulers  # None or none at all (a conditional scheduler): as without a creator
        registered = list(self.register(**kwargs))
        self.models, self.optimizers = registered[0], registered[1]
        rest = registered[2:]
        if "criterion" in kwargs:
            self.criterion = rest.pop(0)
        if "schedulers" in kwargs:
            self.schedulers = rest.pop(0)
            self.scheduler = _first(self.schedulers)
        self.model = _first(self.models)
        self.optimizer = _first(self.optimizers)
        self.register_data(train_loader=train_loader, validation_loader=val_loader)

    def _component(self, attr, registered):
        """The operator's own (see TrainingOperator), saying which creator is missing when it has none."""
        try:
            return super()._component(attr, registered)  # type: ignore[misc]  # the host class's
        except RuntimeError as err:
            if attr != "criterion" or self._loss_creator is not None:
                raise
            raise RuntimeError("The default train_batch/validate_batch need a loss: pass loss_creator= to "
                               "TrainingOperator.from_creators (a torch loss class such as torch.nn.MSELoss, or a "
                               "function of config returning one), or override train_batch/validate_batch.") from err

    def registered_loader(self, kind="train", required=True):
        """The operator's own (see TrainingOperator), saying which creator is missing when no loader was created."""
        try:
            return cast(Any, super()).registered_loader(kind, required)
        except RuntimeError as err:
            if self._data_creator is not None:  # it returned no validation loader
                if kind == "train":
                    raise
                raise RuntimeError("validate() needs a validation loader: the data_creator given to "
                                   "TrainingOperator.from_creators returned only a training loader; return "
                                   "(train_loader, validation_loader).") from err
            creator = ("pass data_creator= to TrainingOperator.from_creators (a function of config returning "
                       "train_loader or (train_loader, validation_loader))")
            if kind == "train":
                raise RuntimeError(f"No training loader: {creator}, or pass train(dataset=...).") from err
            raise RuntimeError(f"validate() needs a validation loader: {creator}.") from err


def _create_loss(loss_creator, config):
    """The criterion ``loss_creator`` gives (as in RaySGD 1.x, a function or class is called with ``config``), except:
    a torch loss class (``torch.nn.MSELoss``), or a class whose constructor takes no config (a module with only a
    ``forward``), is instantiated with no argument, and a loss module (``torch.nn.MSELoss()``) is used as it is (a
    copy: the worker moves it to its device)."""
    if isinstance(loss_creator, torch.nn.Module):
        return copy.deepcopy(loss_creator)
    if isinstance(loss_creator, type) and (issubclass(loss_creator, torch.nn.modules.loss._Loss)
                                           or not _takes_config(loss_creator)):
        return loss_creator()
    return loss_creator(config)


def _takes_config(cls):
    """Whether class ``cls`` is built with one positional argument (the config); nn.Module's own constructor is not."""
    if cls.__init__ is torch.nn.Module.__init__:  # its (*args, **kwargs) refuses any argument
        return False
    try:
        inspect.signature(cls).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature to read: as 1.x, call it with the config
        return True
    return True


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def make_creator_operator(base, model_creator, optimizer_creator, data_creator=None, loss_creator=None,
                          scheduler_creator=None, serialize_data_creation=True):
    """The class behind ``TrainingOperator.from_creators``: ``base`` (a class with :class:`CreatorLoops`) holding the
    creators; they are checked first."""
    for name, creator in (("model_creator", model_creator), ("optimizer_creator", optimizer_creator)):
        if not callable(creator):
            raise ValueError(f"from_creators needs a callable {name}; got {creator!r}")
    for name, creator in (("data_creator", data_creator), ("loss_creator", loss_creator),
                          ("scheduler_creator", scheduler_creator)):
        if creator is not None and not callable(creator):
            raise ValueError(f"from_creators: {name} must be callable or None; got {creator!r}")
    if not issubclass(base, CreatorLoops):
        raise TypeError(f"make_creator_operator needs a base class with CreatorLoops; got {base!r}")
    return type("CustomCreatorOperator", (base,), {
        "_model_creator": staticmethod(model_creator),
        "_optimizer_creator": staticmethod(optimizer_creator),
        "_data_creator": staticmethod(data_creator) if data_creator is not None else None,
        "_loss_creator": loss_creator if isinstance(loss_creator, type) else (
            staticmethod(loss_creator) if loss_creator is not None else None),  # a loss module too (bool() may len())
        "_scheduler_creator": staticmethod(scheduler_creator) if scheduler_creator is not None else None,
        "_serialize_data_creation": serialize_data_creation,
    })


def get_test_operator(operator_cls: Any):
    """An operator whose ``train_epoch``/``validate`` call ``config["custom_func"](op, iterator, info)``.

    Without ``custom_func`` they return ``{"done": 1}``.
    """

    class _TestingOperator(operator_cls):
        def train_epoch(self, iterator, info=None, num_steps=None, epoch_idx=0):
            func = self.config.get("custom_func")
            return func(self, iterator, info) if callable(func) else {"done": 1}

        def validate(self, val_iterator, info=None):
            return self.train_epoch(val_iterator, info)

    return _TestingOperator


def get_test_metrics_operator(operator_cls: Any):
    """An operator whose batches report the next of ``config["scores"]`` (train) or ``config["val_scores"]``.

    As in 1.12, each batch reports its score divided by that batch's ``num_samples`` under
    ``config["key"]``, next to the default loop's own metrics (``train_loss``, ``val_loss``, ...).
    """

    class _TestMetricsOperator(operator_cls):
        def setup(self, config):
            super().setup(config)
            self._train_scores = list(config["scores"])
            self._val_scores = list(config["val_scores"])
            self.key = config["key"]

        def train_batch(self, batch, batch_info):
            metrics = dict(super().train_batch(batch, batch_info))
            metrics[self.key] = self._train_scores.pop(0) / metrics[NUM_SAMPLES]
            return metrics

        def validate_batch(self, batch, batch_info):
            metrics = dict(super().validate_batch(batch, batch_info))
            metrics[self.key] = self._val_scores.pop(0) / metrics[NUM_SAMPLES]
            return metrics

    return _TestMetricsOperator
