"""Callbacks of a function run: Ray Train's :class:`UserCallback`, its run context, and the check of ``callbacks``.

Part of :mod:`raysgd.train`. ``RunConfig(callbacks=[...])`` takes two kinds, both called on the driver:

- :class:`UserCallback` (Ray Train's): ``after_report(run_context, metrics, checkpoint)`` once every rank has
  reported (``metrics[i]``: rank ``i``'s dict), ``after_exception(run_context, worker_exceptions)`` when ranks
  raised (``{rank: exception}``);
- raysgd's :class:`raysgd.callbacks.Callback` and its loggers (``raysgd.loggers.MLflowLogger``,
  ``WandbLogger``): the hooks of the operator API.

:func:`check_callbacks` refuses anything else when the ``RunConfig`` is made (before any actor starts) and
:func:`split_callbacks` sorts a list into the two kinds; :class:`UserCallbacks` calls the first kind as raysgd calls
its own: in order, a hook that raises is logged with its traceback and skipped (a callback never ends a run).

Example:
    >>> class Losses(UserCallback):
    ...     def __init__(self):
    ...         self.seen = []
    ...     def after_report(self, run_context, metrics, checkpoint):
    ...         self.seen.append(metrics[0]["loss"])
    >>> losses = Losses()
    >>> UserCallbacks([losses]).after_report(None, [{"loss": 0.5}, {"loss": 0.5}], None)
    >>> losses.seen
    [0.5]
"""
from __future__ import annotations

import dataclasses
import logging
import uuid

from raysgd.base.checks import argument_error, expect
from raysgd.callbacks import Callback
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from raysgd.train.checkpoint import Checkpoint

logger = logging.getLogger(__name__)


class UserCallback:
    """Ray Train's callback: hooks called on the driver during a function run (every hook does nothing by default).

    Example:
        >>> class Alert(UserCallback):
        ...     def after_exception(self, run_context, worker_exceptions):
        ...         print("ranks that raised:", sorted(worker_exceptions))
        >>> Alert().after_exception(None, {1: ValueError("x")})
        ranks that raised: [1]
    """

    def after_report(self, run_context: TrainRunContext, metrics: list[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        """Every rank called ``raysgd.train.report``: ``metrics[i]`` is rank ``i``'s dict, ``checkpoint`` the
        :class:`~raysgd.train.Checkpoint` written to storage (None when no rank reported one)."""

    def after_exception(self, run_context: TrainRunContext, worker_exceptions: dict[int, BaseException]) -> None:
        """One or more ranks raised: ``worker_exceptions`` is ``{world rank: exception}``."""


@dataclasses.dataclass
class TrainRunContext:
    """What a :class:`UserCallback` is told about the run: its configs and a unique ``run_id``.

    Example:
        >>> context = TrainRunContext(run_config="a RunConfig", train_loop_config={"lr": 0.1})
        >>> context.get_run_config(), len(context.run_id)
        ('a RunConfig', 32)
    """

    run_config: object = None
    train_loop_config: dict | None = None
    scaling_config: object = None
    torch_config: object = None
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    def get_run_config(self) -> Any:
        """The run's ``RunConfig``."""
        return self.run_config


def check_callbacks(callbacks: list | tuple | None, owner: str = "RunConfig") -> list:
    """``callbacks`` as a list: None, or a list/tuple of :class:`UserCallback` and :class:`raysgd.callbacks.Callback`
    instances; else a ``TypeError`` naming the item.

    Example:
        >>> check_callbacks(None)
        []
        >>> check_callbacks([UserCallback])
        Traceback (most recent call last):
        ...
        TypeError: RunConfig(callbacks=...) expects a list of raysgd.train.UserCallback or raysgd.Callback instances (raysgd.loggers.MLflowLogger, WandbLogger); got [<class '...UserCallback'>] (item 0 is a class, not an instance: UserCallback)
    """
    expected = ("a list of raysgd.train.UserCallback or raysgd.Callback instances (raysgd.loggers.MLflowLogger, "
                "WandbLogger)")
    if callbacks is None:
        return []
    how = {"error": TypeError, "caller": owner, "call": True}
    expect(isinstance(callbacks, (list, tuple)), "callbacks", expected, callbacks, typed=True, **how)
    for index, callback in enumerate(callbacks):
        if isinstance(callback, (UserCallback, Callback)):
            continue
        if isinstance(callback, type):
            what = f"a class, not an instance: {callback.__name__}"
        elif any(cls.__module__.startswith("ray.tune") for cls in type(callback).__mro__):
            what = (f"a Ray Tune callback ({type(callback).__name__}), which Ray Train 2.x no longer takes either: "
                    f"run the trainer inside Tune (raysgd's TorchTrainer.as_trainable) for Tune's callbacks")
        else:
            what = f"{type(callback).__name__} {callback!r}"
        raise argument_error("callbacks", expected, callbacks, got=f"{callbacks!r} (item {index} is {what})", **how)
    return list(callbacks)


def split_callbacks(callbacks):
    """``(user callbacks, raysgd callbacks)``: the :class:`UserCallback` ones and the :class:`raysgd.callbacks.Callback`
    ones, each in the given order.

    Example:
        >>> user, operator_style = split_callbacks([UserCallback(), Callback()])
        >>> len(user), len(operator_style)
        (1, 1)
    """
    callbacks = check_callbacks(callbacks)
    return ([c for c in callbacks if isinstance(c, UserCallback)],
            [c for c in callbacks if isinstance(c, Callback)])


class UserCallbacks:
    """The run's :class:`UserCallback` list, called in order; a hook that raises is logged and skipped.

    Example:
        >>> class Broken(UserCallback):
        ...     def after_report(self, run_context, metrics, checkpoint):
        ...         raise RuntimeError("boom")
        >>> UserCallbacks([Broken()]).after_report(None, [{}], None)  # logged as a warning, not raised
    """

    def __init__(self, callbacks: Iterable[UserCallback] = ()) -> None:
        self.callbacks = [c for c in check_callbacks(list(callbacks)) if isinstance(c, UserCallback)]

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _call(self, hook, *args):
        for callback in self.callbacks:
            if getattr(getattr(callback, hook), "__func__", None) is getattr(UserCallback, hook):
                continue  # the base class's no-op (a function set on the instance is called)
            try:
                getattr(callback, hook)(*args)
            except Exception:  # noqa: BLE001 (a callback never ends the run, as raysgd's callbacks)
                logger.warning("Callback %s.%s raised; training goes on without it for this event",
                               type(callback).__name__, hook, exc_info=True)

    def after_report(self, run_context: TrainRunContext, metrics: Iterable[dict[str, Any]],
                     checkpoint: Checkpoint | None) -> None:
        """Call every callback's ``after_report(run_context, metrics, checkpoint)`` (``metrics``: a list per rank)."""
        self._call("after_report", run_context, list(metrics), checkpoint)

    def after_exception(self, run_context: TrainRunContext, worker_exceptions: dict[int, BaseException]) -> None:
        """Call every callback's ``after_exception(run_context, {rank: exception})``."""
        self._call("after_exception", run_context, dict(worker_exceptions))


__all__ = ["TrainRunContext", "UserCallback", "UserCallbacks", "check_callbacks", "split_callbacks"]
