"""Checking what an operator's ``setup()`` passes to ``register()``, before anything is trained.

Layer 1: imports torch and layer 0. :meth:`~raysgd.torch.training_operator.TrainingOperator.register`
calls these; each error names the argument, what was expected and what was given.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(1, 1)
    >>> items, restore = as_list((model,), "models", torch.nn.Module)
    >>> items == [model], type(restore(items)).__name__
    (True, 'tuple')
    >>> plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> check_schedulers([plateau], "manual") == [plateau]
    True
    >>> check_schedulers(plateau, "epoch")
    Traceback (most recent call last):
    ...
    ValueError: register(schedulers=...): ReduceLROnPlateau.step() needs a metric, ...
"""
import torch

from raysgd.base.checks import argument_error, expect
from raysgd.torch.constants import SCHEDULER_STEP_BATCH, SCHEDULER_STEP_EPOCH


def as_list(value, kind, item_type):
    """``(items, restore)``: the items as a list, and a function giving back the caller's container shape."""
    if isinstance(value, item_type):
        items, restore = [value], (lambda xs: xs[0])
    elif isinstance(value, (list, tuple)):
        items = list(value)
        restore = tuple if isinstance(value, tuple) else list
    else:
        raise argument_error(kind, f"a {item_type.__name__} or a list/tuple of them", value, TypeError,
                             caller="register", call=True, got=type(value).__name__)
    for item in items:
        expect(isinstance(item, item_type), kind, f"{item_type.__name__} items", item, TypeError, caller="register",
               call=True, got=type(item).__name__)
    return items, restore


def check_dict(name, value):
    """``value`` (a dict of keyword arguments, or None) as a dict."""
    expect(value is None or isinstance(value, dict), name, "a dict of keyword arguments", value, caller="register",
           call=True)
    return value or {}


def is_scheduler(value):
    """Whether ``value`` is a scheduler instance the trainer can step and checkpoint: ``step()``, ``state_dict()``
    and ``load_state_dict()`` (torch's, or one of your own); an optimizer (it has all three) or a class is not.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        >>> is_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1)), is_scheduler(optimizer)
        (True, False)
        >>> is_scheduler(torch.optim.lr_scheduler.StepLR), is_scheduler("StepLR")
        (False, False)
    """
    return (not isinstance(value, (type, torch.optim.Optimizer))
            and all(callable(getattr(value, name, None)) for name in ("step", "state_dict", "load_state_dict")))


def _what(value):
    """How a refused item is shown: the class ``StepLR``, an instance of ``SGD``, ``str 'x'``."""
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance)"
    if isinstance(value, (str, int, float)) or value is None:
        return f"{type(value).__name__} {value!r}"
    return f"an instance of {type(value).__name__}"


def check_schedulers(schedulers, step_freq):
    """The schedulers as a list (None when none), refusing those the trainer could not step.

    A scheduler needs ``scheduler_step_freq``; a ``ReduceLROnPlateau`` needs a metric at each step, which
    only ``"manual"`` (``trainer.update_scheduler(metric)``) gives: stepped per batch or epoch, it would fail
    only once the first epoch had been trained. So would anything that is no scheduler (:func:`is_scheduler`),
    and an optimizer passed as one would be stepped again, silently: both are a ``TypeError``.
    """
    if schedulers is None:
        return None
    if not step_freq:
        raise ValueError("register(schedulers=...) needs TorchTrainer(scheduler_step_freq=...) set to "
                         "'batch', 'epoch' or 'manual'; got scheduler_step_freq=None")
    several = isinstance(schedulers, (list, tuple))
    items = list(schedulers) if several else [schedulers]
    for index, item in enumerate(items):
        expect(is_scheduler(item), "schedulers", "a learning-rate scheduler (with step(), state_dict() and "
               "load_state_dict()) or a list/tuple of them", schedulers, TypeError, caller="register", call=True,
               got=f"a {type(schedulers).__name__} whose item {index} is {_what(item)}" if several else _what(item))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if step_freq in (SCHEDULER_STEP_BATCH, SCHEDULER_STEP_EPOCH) and any(isinstance(s, plateau) for s in items):
        raise ValueError(f"register(schedulers=...): ReduceLROnPlateau.step() needs a metric, which "
                         f"scheduler_step_freq={step_freq!r} cannot give. Use TorchTrainer(scheduler_step_freq="
                         f"\"manual\") and call trainer.update_scheduler(metric) after validate(), e.g. "
                         f"trainer.update_scheduler(trainer.validate()[\"val_loss\"]).")
    return items
