"""Exceptions that cross process boundaries: a lost worker, a failed collective, an unplaceable trial group.

Layer 0: standard library only. Both pickle (Ray ships them from workers to the driver).

Example:
    >>> err = WorkerFailure("rank 1 died", causes={1: "actor died"}, unresponsive=[])
    >>> err.ranks
    [1]
"""


class CollectiveError(RuntimeError):
    """A collective (allreduce, barrier, rendezvous) failed or timed out on ``rank``.

    Raised inside a worker when torch.distributed reports a timeout or a lost peer; the
    driver treats it like a worker death (retried), unlike an error raised by user code.
    """

    def __init__(self, rank, message):
        super().__init__(rank, message)
        self.rank = rank
        self.message = message

    def __str__(self):
        return f"collective failed on rank {self.rank}: {self.message}"


class WorkerFailure(RuntimeError):
    """One or more workers died, stopped answering, or lost their process group.

    Attributes:
        causes: ``{rank: description}`` for each rank that failed.
        unresponsive: ranks that never answered before the attempt was ended.
        stacks: ``{rank: text}``: each live rank's Python stacks, taken before the group was killed
            when some rank did not answer (or why no stack could be taken); empty otherwise.
    """

    def __init__(self, message, causes=None, unresponsive=None, stacks=None):
        super().__init__(message, causes, unresponsive, stacks)
        self.message = message
        self.causes = dict(causes or {})
        self.unresponsive = list(unresponsive or [])
        self.stacks = dict(stacks or {})

    @property
    def ranks(self):
        """Every rank involved: the failed ones, then the unresponsive ones."""
        return sorted(self.causes) + [r for r in self.unresponsive if r not in self.causes]

    def __str__(self):
        parts = [self.message]
        parts += [f"rank {rank}: {cause}" for rank, cause in sorted(self.causes.items())]
        if self.unresponsive:
            parts.append("did not answer: rank " + ", rank ".join(map(str, self.unresponsive)))
        text = "; ".join(parts)
        if self.stacks:
            text += "\nWhere each rank was (Python stacks taken before the workers were stopped):\n" + "\n".join(
                f"--- rank {rank} ---\n{stack.rstrip()}" for rank, stack in sorted(self.stacks.items()))
        return text

    def summary(self, width=160):
        """One line for the log: the ranks that failed (those whose peer's connection closed last, in a few words: they
        are the lost rank's victims), each cause's first line cut to ``width`` characters, then the ranks that did not
        answer. The stacks stay in ``str()``.

        Example:
            >>> WorkerFailure("worker failure", {0: "RuntimeError: [pair.cc:537] Read error: Connection reset by peer",
            ...                                  1: "worker process died (The actor died unexpectedly.)"}).summary()
            "rank 1: worker process died (The actor died unexpectedly.); rank 0: its peer's connection closed"
        """
        def cut(text):
            line = first_line(text)
            return line if len(line) <= width else line[:width - 3] + "..."

        victims = {rank for rank, cause in self.causes.items()
                   if any(marker in str(cause) for marker in _PEER_GONE_MARKERS)}
        parts = [f"rank {rank}: {cut(cause)}" for rank, cause in sorted(self.causes.items()) if rank not in victims]
        parts += [f"rank {rank}: its peer's connection closed" for rank in sorted(victims)]
        if self.unresponsive:
            parts.append("did not answer: rank " + ", rank ".join(map(str, self.unresponsive)))
        return "; ".join(parts) or cut(self.message)


def first_line(text):
    """The first line of ``text`` (an error or a string) that is not blank, for a one-line report; ``""`` if none: an
    error whose message starts with a line break is still told by its message.

    Example:
        >>> first_line(RuntimeError("\\nNCCL error: remote process exited\\nLast error: ...")), first_line("")
        ('NCCL error: remote process exited', '')
    """
    return next((line.rstrip() for line in str(text).splitlines() if line.strip()), "")


_COLLECTIVE_MARKERS = ("Timed out", "Connection closed by peer", "Connection reset by peer", "NCCL", "Broken pipe")
#: An NCCL error that a lost or stuck peer (or a failing GPU or link) causes, in lower case.
_NCCL_FAILURE_MARKERS = ("remote process", "remoteerror", "system error", "systemerror", "abort", "timed out",
                         "timeout", "connection", "closed", "watchdog", "unhandled cuda error", "internal error")
#: An NCCL error that the program's own misuse causes (a retry repeats it), in lower case.
_NCCL_MISUSE_MARKERS = ("invalid usage", "invalidusage", "invalid argument", "invalidargument")


def is_collective_failure(err):
    """True if ``err`` looks like a torch.distributed timeout or lost peer rather than a user bug.

    Example:
        >>> is_collective_failure(RuntimeError("NCCL error: remote process exited or there was a network error"))
        True
        >>> is_collective_failure(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage"))
        False
    """
    text = str(err)
    lower = text.lower()
    if "nccl" in lower and any(marker in lower for marker in _NCCL_MISUSE_MARKERS):
        return False  # the program's bug, even inside a DistBackendError: never retried
    try:
        import torch.distributed as dist  # noqa: PLC0415 (keeps this module torch-free)

        dist_error = getattr(dist, "DistError", None)
        if dist_error is not None and isinstance(err, dist_error):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(err, RuntimeError) and (
        ("gloo" in lower and any(m in text for m in _COLLECTIVE_MARKERS))
        or ("nccl" in lower and any(marker in lower for marker in _NCCL_FAILURE_MARKERS)))


_PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_peer_gone(err):
    """True if ``err`` is a :class:`CollectiveError` saying a peer's connection closed (its process ended, or its
    machine closed the socket), as opposed to a timeout (a peer that may be stuck but alive).

    Example:
        >>> is_peer_gone(CollectiveError(0, "[pair.cc:553] Connection closed by peer [10.0.0.2]:4321"))
        True
        >>> is_peer_gone(CollectiveError(0, "Timed out waiting 30000ms for recv operation to complete"))
        False
    """
    return isinstance(err, CollectiveError) and any(marker in err.message for marker in _PEER_GONE_MARKERS)


def mark_rank(error, rank):
    """Note on a user error which rank raised it (:func:`rank_of` reads it): the driver re-raises the error itself,
    with its own type, and a caller may still want the rank (Ray Train's ``WorkerGroupError.worker_failures``). Its
    traceback says it too, in a note under the message (``str(error)`` is left as raised).

    Example:
        >>> mark_rank(ValueError("bad batch"), 3).__notes__
        ['(raised by the worker of rank 3)']
    """
    note = f"(raised by the worker of rank {rank})"
    try:
        error.raysgd_rank = rank
        if note not in getattr(error, "__notes__", ()):
            error.add_note(note)
    except (AttributeError, TypeError):  # an exception type without a __dict__
        pass
    return error


def rank_of(error):
    """The world rank whose code raised ``error`` (see :func:`mark_rank`), or None.

    Example:
        >>> rank_of(mark_rank(ValueError("bad batch"), 3)), rank_of(ValueError())
        (3, None)
    """
    return getattr(error, "raysgd_rank", None)


class PlacementUnavailable(RuntimeError):
    """The workers' bundles of the enclosing (Tune trial's) placement group cannot be placed: a node is gone.

    Not retried by the trainer: a trial raising it fails at once, and Tune's ``FailureConfig`` restores
    it in a new placement group. ``unplaced_s`` is how long the bundles had been waiting.

    Example:
        >>> str(PlacementUnavailable("bundles 1, 2 unplaced", 20.0))
        "bundles 1, 2 unplaced (unplaced for 20 s); not retried: the trial's placement group lost its node"
    """

    def __init__(self, message, unplaced_s):
        super().__init__(message, unplaced_s)
        self.message = message
        self.unplaced_s = unplaced_s

    def __str__(self):
        return (f"{self.message} (unplaced for {self.unplaced_s:.0f} s); not retried: the trial's placement group "
                f"lost its node")


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupted, or holds objects that a safe load refuses."""
