"""Driver-side callbacks: the :class:`Callback` base class and the :class:`CallbackList` that calls them safely.

Layer 0: the standard library only. ``TorchTrainer(callbacks=[...])`` calls every callback's hooks on the driver,
in the order given: after each reduced ``train()``/``validate()`` result, after each durable checkpoint is written
(``storage_path``), when the run controller meets a worker failure (recovered from or given up on), when the
worker group changes size, and at ``shutdown()``. Every hook is a no-op by default: override the ones you need.

A hook that raises is logged (``logging.warning`` naming the callback's class and the hook, with the traceback)
and skipped: training goes on and the next hook is called as usual. A callback that wants to survive a driver
crash with a durable run returns a JSON-able dict from :meth:`Callback.state_dict`; it is saved in every
checkpoint's marker and handed back to :meth:`Callback.load_state_dict` when the run resumes; one whose run can
start again from its beginning in the same driver (a training function restarted before its first checkpoint)
goes back to its start in :meth:`Callback.rewind`.

Example:
    >>> class PrintLoss(Callback):
    ...     def on_train_result(self, trainer, result):
    ...         print("loss", result["train_loss"])
    >>> callbacks = CallbackList([PrintLoss()])
    >>> callbacks.call("on_train_result", None, {"train_loss": 0.5})
    loss 0.5
    >>> trainer = TorchTrainer(training_operator_cls=MyOperator, callbacks=[PrintLoss()])  # doctest: +SKIP
"""
from __future__ import annotations

import collections
import logging
import threading

from raysgd.base.checks import argument_error, expect, plain_json
from typing import Any, Iterable

logger = logging.getLogger(__name__)

#: The hooks a :class:`Callback` may override, in the order a run meets them.
HOOKS = ("on_train_result", "on_validate_result", "on_checkpoint", "on_failure", "on_resize", "on_shutdown")


#: What ``on_failure`` gets: the :class:`~raysgd.torch.errors.WorkerFailure` (``error``), the call's method
#: (``"train_epoch"``, ``"validate"``...), the retry it starts (1-based; 0 when none), ``max_retries``, and
#: ``gave_up`` (True when the call fails with it).
Failure = collections.namedtuple("Failure", ["error", "method", "retry", "max_retries", "gave_up"])


class Callback:
    """Hooks the trainer calls on the driver; subclass it and override what you need (every hook does nothing).

    Example:
        >>> class Count(Callback):
        ...     def __init__(self):
        ...         self.results = 0
        ...     def on_train_result(self, trainer, result):
        ...         self.results += 1
        >>> count = Count(); CallbackList([count]).call("on_train_result", None, {}); count.results
        1
    """

    def on_train_result(self, trainer: Any, result: Any) -> None:
        """After ``train()``: ``result`` is the reduced result dict (``epoch``, ``train_loss``, ``num_samples``...)."""

    def on_validate_result(self, trainer: Any, result: Any) -> None:
        """After ``validate()``: the reduced result dict."""

    def on_checkpoint(self, trainer: Any, path: str) -> None:
        """A durable checkpoint (``storage_path``) was written completely to ``path`` (its directory or URI).

        Called on the checkpoint writer's thread, never at the same time as another hook."""

    def on_failure(self, trainer: Any, failure: Any) -> None:
        """The controller met a worker failure: ``failure`` is a :data:`Failure` (``gave_up`` says whether the call
        fails with it, else it restarts the workers)."""

    def on_resize(self, trainer: Any, old: int, new: int) -> None:
        """The worker group went from ``old`` to ``new`` workers (a failure, a grow, a move off a draining node)."""

    def on_shutdown(self, trainer: Any) -> None:
        """At ``trainer.shutdown()``, once the workers stopped and the last durable checkpoint is written."""

    def state_dict(self) -> dict | None:
        """A JSON-able dict kept with every durable checkpoint (``storage_path``), or None (nothing to keep).

        It is kept as JSON holds it (:func:`raysgd.base.checks.plain_json`): numpy and torch scalars as Python
        numbers, tuples as lists, keys as strings, any other object (a tensor of several values, a path) as its
        repr."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """A resumed durable run hands back what :meth:`state_dict` returned when its checkpoint was written."""

    def rewind(self) -> None:
        """The run starts again from its beginning in this driver: a ``raysgd.train`` training function restarted
        after a failure with no checkpoint of its run folder to resume from, so its reports come again from the
        first. Go back to the run's start, keeping what this run made (an experiment tracker's run, whose steps
        are kept). The default does nothing; ``TorchTrainer``'s restarts resume from restart points and never
        call it.

        Example:
            >>> class Step(Callback):
            ...     step = 3
            ...     def rewind(self):
            ...         self.step = 0
            >>> at = Step(); CallbackList([at]).rewind(); at.step
            0
        """


class CallbackList:
    """The trainer's callbacks, called in order; a raising hook is logged and skipped (see the module docstring).

    Example:
        >>> class Broken(Callback):
        ...     def on_shutdown(self, trainer):
        ...         raise RuntimeError("boom")
        >>> CallbackList([Broken()]).call("on_shutdown", None)  # logged as a warning, not raised
    """

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)
        self._lock = threading.RLock()  # on_checkpoint comes from the writer thread: one hook at a time

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def add(self, callback: Callback) -> None:
        """Append ``callback`` (called after the others)."""
        self.callbacks.append(callback)

    def call(self, hook: str, *args: Any) -> None:
        """Call ``hook(*args)`` on every callback that overrides it; a raising one is logged and the rest run."""
        if hook not in HOOKS:
            raise ValueError(f"CallbackList.call: unknown hook {hook!r}; the hooks are {HOOKS}")
        with self._lock:
            for callback in self.callbacks:
                method = getattr(callback, hook, None)
                if method is None or _is_base_hook(method, Callback, hook):
                    continue  # the base class's no-op: skip the call
                try:
                    method(*args)
                except Exception:  # noqa: BLE001 (a callback never corrupts the run)
                    logger.warning("Callback %s.%s raised; training goes on without it for this event",
                                   type(callback).__name__, hook, exc_info=True)

    def state_dict(self) -> dict | None:
        """``{key: state}`` of the callbacks with a state (key: position and class name), or None."""
        states = {}
        with self._lock:
            for index, callback in enumerate(self.callbacks):
                try:
                    state = callback.state_dict()
                except Exception:  # noqa: BLE001
                    logger.warning("Callback %s.state_dict raised; its state is not saved", type(callback).__name__,
                                   exc_info=True)
                    continue
                if state is None:
                    continue
                states[f"{index}:{type(callback).__name__}"] = plain_json(state)  # as the marker keeps it
        return states or None

    def load_state_dict(self, states: dict | None) -> None:
        """Hand each callback its saved state (matched by position and class name); missing ones get nothing."""
        for index, callback in enumerate(self.callbacks):
            state = (states or {}).get(f"{index}:{type(callback).__name__}")
            if state is None:
                continue
            try:
                callback.load_state_dict(state)
            except Exception:  # noqa: BLE001
                logger.warning("Callback %s.load_state_dict raised; it starts afresh", type(callback).__name__,
                               exc_info=True)

    def rewind(self) -> None:
        """Call every callback's :meth:`Callback.rewind` (the run starts again from its beginning); a raising one is
        logged and the rest are rewound."""
        with self._lock:
            for callback in self.callbacks:
                if _is_base_hook(callback.rewind, Callback, "rewind"):
                    continue
                try:
                    callback.rewind()
                except Exception:  # noqa: BLE001 (a callback never corrupts the run)
                    logger.warning("Callback %s.rewind raised; it goes on as it is", type(callback).__name__,
                                   exc_info=True)


def _is_base_hook(method, base, hook):
    """Whether the bound ``method`` is ``base``'s own no-op ``hook`` (neither overridden in a subclass nor replaced on
    the instance: ``callback.on_train_result = function``)."""
    return getattr(method, "__func__", None) is getattr(base, hook)


def check_callbacks(callbacks: list | tuple | None, caller: str = "TorchTrainer") -> list[Callback]:
    """``callbacks``: None or a list/tuple of :class:`Callback` instances; returns a list, else ``TypeError``.

    Example:
        >>> check_callbacks(None)
        []
        >>> check_callbacks([Callback])
        Traceback (most recent call last):
        TypeError: TorchTrainer: callbacks expects a list of raysgd.Callback instances; got [<class 'raysgd.callbacks.Callback'>] (item 0 is a class, not an instance)
    """
    expected = "a list of raysgd.Callback instances"
    if callbacks is None:
        return []
    expect(isinstance(callbacks, (list, tuple)), "callbacks", expected, callbacks, TypeError, caller)
    for index, callback in enumerate(callbacks):
        if not isinstance(callback, Callback):
            what = "a class, not an instance" if isinstance(callback, type) else f"of type {type(callback).__name__}"
            raise argument_error("callbacks", expected, callbacks, TypeError, caller=caller,
                                 got=f"{callbacks!r} (item {index} is {what})")
    return list(callbacks)
