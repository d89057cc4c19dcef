"""What ``TorchTrainer.fit()`` raises when a run fails: :class:`TrainingFailedError` and :class:`WorkerGroupError`.

Part of :mod:`raysgd.train` (Ray Train's ``ray.train.TrainingFailedError`` and ``ray.train.WorkerGroupError``).
``WorkerGroupError`` carries every failed rank's exception (``worker_failures``: ``{rank: exception}``), as Ray
Train's does; both keep raysgd's ``result`` (the :class:`~raysgd.train.result.Result` so far) and both pickle across
processes with everything they carry.

Example:
    >>> import pickle
    >>> error = WorkerGroupError("rank 1: ValueError: bad batch", {1: ValueError("bad batch")})
    >>> isinstance(error, TrainingFailedError), str(error).splitlines()[0]
    (True, 'Training failed due to worker errors:')
    >>> copy = pickle.loads(pickle.dumps(error))
    >>> copy.worker_failures
    {1: ValueError('bad batch')}
"""
from __future__ import annotations

from raysgd.base.checks import expect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysgd.train.result import Result


class TrainingFailedError(RuntimeError):
    """``fit()`` failed: the training function raised, or the workers failed more than ``max_failures`` times.

    ``result`` is the :class:`~raysgd.train.result.Result` so far (its ``error`` is the cause), or None.

    Example:
        >>> try:  # doctest: +SKIP
        ...     result = trainer.fit()
        ... except TrainingFailedError as failed:
        ...     result = failed.result  # result.checkpoint: the latest reported one, result.error: the cause
    """

    def __init__(self, message: str, result: Result | None = None) -> None:
        super().__init__(message)
        self.result = result  # pickled with the exception's __dict__


class WorkerGroupError(TrainingFailedError):
    """Training failed because of errors on the workers: ``worker_failures`` maps each failed world rank to its
    exception, ``error_message`` says what happened in words.

    Args:
        error_message: a human-readable account of the workers' failures.
        worker_failures: ``{world rank: exception}``.
        result: raysgd's addition: the :class:`~raysgd.train.result.Result` so far.

    Example:
        >>> error = WorkerGroupError("rank 0 ran out of memory", {0: MemoryError()})
        >>> error.worker_failures, error.error_message
        ({0: MemoryError()}, 'rank 0 ran out of memory')
    """

    def __init__(self, error_message: str, worker_failures: dict[int, BaseException],
                 result: Result | None = None) -> None:
        expect(isinstance(worker_failures, dict) and all(
            isinstance(rank, int) and isinstance(error, BaseException) for rank, error in worker_failures.items()),
            "worker_failures", "a dict {world rank: exception}", worker_failures, TypeError, "WorkerGroupError",
            call=True, typed=True)
        super().__init__("Training failed due to worker errors:\n" + str(error_message), result)
        self.error_message = str(error_message)
        self.worker_failures = dict(worker_failures)

    def __reduce__(self):
        return type(self), (self.error_message, self.worker_failures, self.result)


class ResourcesError(ValueError):
    """The cluster can never hold the workers ``ScalingConfig`` asks for: raised by ``fit()`` before any actor
    starts, naming what is missing (a cluster that can grow, with Ray's autoscaler, is waited for instead).

    Example:
        >>> issubclass(ResourcesError, ValueError)
        True
    """


#: ``TrainContext`` methods Ray Train 2.x deprecated (they raise :func:`context_deprecation`'s warning there).
DEPRECATED_CONTEXT_METHODS = ("get_metadata", "get_trial_name", "get_trial_id", "get_trial_resources", "get_trial_dir")


def context_deprecation(method):
    """The ``DeprecationWarning`` (to raise) of a ``TrainContext`` method that Ray Train 2.x deprecated: the Ray Tune
    trial's methods and ``get_metadata`` (``TorchTrainer(metadata=...)``'s).

    Example:
        >>> raise context_deprecation("get_trial_name")
        Traceback (most recent call last):
        ...
        DeprecationWarning: `get_trial_name` is deprecated because the concept of a `Trial` is gone from Ray Train 2.x (raysgd.train follows it): use get_experiment_name() for the run's name. See https://github.com/ray-project/ray/issues/49454
    """
    expect(method in DEPRECATED_CONTEXT_METHODS, "method", f"one of {DEPRECATED_CONTEXT_METHODS}", method,
           caller="context_deprecation", call=True)
    if method == "get_metadata":
        text = ("`get_metadata` was an experimental API that accessed the metadata passed to "
                "`TorchTrainer(metadata=...)`, deprecated in Ray Train 2.x: pass the metadata to the training function "
                "(train_loop_config) instead.")
    else:
        text = (f"`{method}` is deprecated because the concept of a `Trial` is gone from Ray Train 2.x (raysgd.train "
                f"follows it): use get_experiment_name() for the run's name.")
    return DeprecationWarning(f"{text} See https://github.com/ray-project/ray/issues/49454")


__all__ = ["DEPRECATED_CONTEXT_METHODS", "TrainingFailedError", "WorkerGroupError", "context_deprecation"]
