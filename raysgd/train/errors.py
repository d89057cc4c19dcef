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


class TrainingFailedError(RuntimeError):
    """``fit()`` failed: the training function raised, or the workers failed more than ``max_failures`` times.

    ``result`` is the :class:`~raysgd.train.result.Result` so far (its ``error`` is the cause), or None.

    Example:
        >>> try:  # doctest: +SKIP
        ...     result = trainer.fit()
        ... except TrainingFailedError as failed:
        ...     result = failed.result  # result.checkpoint: the latest reported one, result.error: the cause
    """

    def __init__(self, message, result=None):
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

    def __init__(self, error_message, worker_failures, result=None):
        if not isinstance(worker_failures, dict) or not all(
                isinstance(rank, int) and isinstance(error, BaseException) for rank, error in worker_failures.items()):
            raise TypeError(f"WorkerGroupError(worker_failures=...) expects a dict {{world rank: exception}}; got "
                            f"{type(worker_failures).__name__} {worker_failures!r}")
        super().__init__("Training failed due to worker errors:\n" + str(error_message), result)
        self.error_message = str(error_message)
        self.worker_failures = dict(worker_failures)

    def __reduce__(self):
        return type(self), (self.error_message, self.worker_failures, self.result)


__all__ = ["TrainingFailedError", "WorkerGroupError"]
