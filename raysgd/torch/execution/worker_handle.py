"""A worker as the worker group sees it: a Ray actor, or rank 0 in the driver (``use_local``), behind one ``call``.

Layer 5 helper of :mod:`raysgd.torch.execution.worker_group`, which alone uses it: with the group, the only
code that touches actor handles. ``call`` returns an ObjectRef for an actor, a
:class:`~raysgd.torch.execution.local_runner.LocalCall` for a local rank 0 running in its thread beside
remote ranks, or a finished :class:`Done` for a local rank 0 alone. Actors get a second Ray
concurrency group (``"control"``) that answers stack requests while they train.

Example:
    >>> done = Done(lambda: 1 / 0)
    >>> done.value, type(done.error).__name__
    (None, 'ZeroDivisionError')
"""
from __future__ import annotations

import threading

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysgd import logs
from raysgd.base import environment
from raysgd.torch import constants
from raysgd.torch.execution import diagnostics
from raysgd.torch.execution import shipping
from raysgd.torch.execution.calls import Done
from raysgd.torch.execution.local_runner import LocalCall
from raysgd.torch.execution.worker import TorchWorker
from typing import Any, Callable

_REMOTE_CLASSES: dict[type, object] = {}  # worker class -> its Ray actor class (made once per process)


def _remote_worker_cls(worker_cls: type = TorchWorker) -> Any:
    if worker_cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[worker_cls] = ray.remote(  # type: ignore[call-overload]  # ray's stubs lack this actor option
            concurrency_groups=diagnostics.CONCURRENCY_GROUPS)(worker_cls)
    return _REMOTE_CLASSES[worker_cls]


def _legacy_runtime_env():
    """Actor options carrying ``raysgd.compat``'s flags, so actors map ``ray.util.sgd`` (and ``ray.train``) imports
    too."""
    flags = {name: "1" for name in (constants.LEGACY_IMPORTS_ENV, constants.TRAIN_IMPORTS_ENV)
             if environment.get(name)}
    return {"runtime_env": {"env_vars": flags}} if flags else {}


class Handle:
    """A worker as the group sees it: ``call`` returns an ObjectRef (actor), or for the local rank a
    :class:`LocalCall` running in its thread (beside remote ranks) or a finished :class:`Done` (alone)."""

    def __init__(self, rank: int, actor: Any = None, local: TorchWorker | None = None, runner: Any = None,
                 bundle: int | None = None) -> None:
        self.rank, self.actor, self.local, self.runner = rank, actor, local, runner
        self.bundle = rank if bundle is None else bundle  # its bundle of the placement group (kept when re-ranked)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.local is not None:  # resolve ObjectRef arguments as Ray does for actors
            args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
            run = lambda: getattr(self.local, method)(*args, **kwargs)  # noqa: E731
            return self.runner.submit(run) if self.runner is not None else Done(run)
        return getattr(self.actor, method).remote(*args, **kwargs)

    def call_with_data(self, method: str, *args: Any, group: str | None = None) -> tuple[Any, Any]:
        """``(call, data ref)`` of ``method`` returning ``(answer, data)``: ``call`` gives the small answer (see
        :meth:`answer`); the data stays in the object store of this worker's node, owned by the driver, unfetched
        (the local rank's is put into the driver's node's store). ``group``: the actor's concurrency group to run
        it in (an actor's only)."""
        if self.local is not None:
            done = Done(lambda: getattr(self.local, method)(*args))
            if done.error is not None:
                return done, None
            answer, data = done.value
            return Done(lambda: answer), ray.put(data)
        options = {"concurrency_group": group} if group is not None else {}
        return getattr(self.actor, method).options(num_returns=2, **options).remote(*args)

    def answer(self, call: Any, deadline_s: float | None) -> tuple[Any, BaseException | None]:
        """``(value, None)`` of a ``call`` of this worker, or ``(None, error)`` when it is dead or silent past
        ``deadline_s``; an error raised by the method itself (user code) is raised here."""
        if isinstance(call, LocalCall) and not call.wait(deadline_s):
            return None, GetTimeoutError(f"rank {self.rank} did not answer within {deadline_s} s")
        if isinstance(call, (Done, LocalCall)):
            if call.error is not None:
                raise call.error
            return call.value, None
        try:
            return ray.get(call, timeout=deadline_s), None
        except (RayActorError, GetTimeoutError) as err:
            return None, err

    def control(self, method: str, *args: Any) -> Any:
        """Call ``method`` beside a running call: in the actor's ``"control"`` group, or at once for the local rank."""
        if self.local is not None:
            return Done(lambda: getattr(self.local, method)(*args))
        return getattr(self.actor, method).options(concurrency_group=diagnostics.CONTROL_GROUP).remote(*args)

    def stacks_request(self) -> str | tuple[Any, str]:
        """Text (the local rank's thread) or ``(ObjectRef, actor id)`` of the stacks its control thread takes."""
        if self.local is not None:
            ident = self.runner.ident if self.runner is not None else None
            return diagnostics.format_stacks(only=[ident or threading.main_thread().ident], skip_current=False)
        ref = self.actor.apply.options(concurrency_group=diagnostics.CONTROL_GROUP).remote(diagnostics.format_stacks)
        return ref, self.actor._actor_id.hex()

    def kill(self) -> None:
        if self.local is not None:
            self.local.shutdown()
        else:
            ray.kill(self.actor, no_restart=True)



def answered(call: Any) -> bool | None:
    """Whether a :meth:`Handle.control` call was answered: True, False (it failed: a lost or refused request),
    or None (no answer yet). Never waits.

    Example:
        >>> answered(Done(lambda: None)), answered(Done(lambda: 1 / 0))
        (True, False)
    """
    if isinstance(call, Done):
        return call.error is None
    if not ray.wait([call], timeout=0)[0]:
        return None
    try:
        ray.get(call, timeout=0)
    except Exception:  # noqa: BLE001 (any failure: the request may not have arrived)
        return False
    return True


def start_actor(rank: int, pg: Any, bundle_index: int, cpus: float, gpus: float, operator_cls: type | Callable,
                config: dict, options: dict[str, Any], worker_cls: type = TorchWorker) -> Handle:
    """A :class:`Handle` of a new worker actor (a ``worker_cls``, :class:`TorchWorker` or a subclass such as
    raysgd.train's function worker) in bundle ``bundle_index`` of ``pg``."""
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index)
    options = dict(options, log_levels=logs.forwarded_env())  # the driver's log levels where they are not the defaults
    shipping.install()  # config modules imported since: the operator class may go by value
    actor = _remote_worker_cls(worker_cls).options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy,
                                         **_legacy_runtime_env()).remote(operator_cls, config, **options)
    return Handle(rank, actor=actor, bundle=bundle_index)
