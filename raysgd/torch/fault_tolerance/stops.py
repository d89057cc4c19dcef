"""What a call stopped at a commit point tells: the marks its ranks' errors carry, and whether a failure was a
preemption or a resize the driver asked for.

Layer 1, a pure policy (the standard library only): the ranks that stop at an agreed commit point
(:mod:`raysgd.torch.commits.preemption`, the workers' side) raise errors carrying :data:`MARK` (a SIGTERM) or
:data:`RESIZE_MARK` (the driver's request to grow or move) and mark a preemption commit in the store with
:data:`PREEMPTION`; the controller, the durable run and the re-forming of a group read a failure through
:func:`was_preempted` and :func:`was_resize`.

Example:
    >>> from raysgd.torch.errors import WorkerFailure
    >>> was_preempted(WorkerFailure("ended", {1: f"{MARK}; committed at step 6 of the call"}))
    True
    >>> was_resize(WorkerFailure("ended", {0: f"{RESIZE_MARK}; committed at step 9 of the call"}))
    True
"""

#: In the message of each rank's error after a preemption commit (see :func:`was_preempted`).
MARK = "preempted (SIGTERM)"
#: In the message of each rank's error after a commit the driver asked for to grow (see :func:`was_resize`).
RESIZE_MARK = "stopped at a commit point to grow the group"
#: What the ranks mark a preemption commit with in the commit store.
PREEMPTION = "preemption"


def was_preempted(failure):
    """Whether a :class:`~raysgd.torch.errors.WorkerFailure` ended a call at a preemption commit."""
    return any(MARK in str(cause) for cause in getattr(failure, "causes", {}).values())


def was_resize(failure):
    """Whether a :class:`~raysgd.torch.errors.WorkerFailure` ended a call at a commit the driver asked for."""
    causes = getattr(failure, "causes", {}).values()
    return bool(causes) and all(RESIZE_MARK in str(cause) for cause in causes)
