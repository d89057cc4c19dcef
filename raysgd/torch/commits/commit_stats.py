"""A process's commit timings: what its committer took and stored, and when (:class:`CommitStats`).

Layer 4 (the standard library only). The worker's :class:`~raysgd.torch.commits.committer.Committer` records into
its process's :class:`CommitStats` (:func:`process_stats`); the worker reads it for its result (the driver's
``raysgd_commit_latency_s``), tests and benchmarks read it in the worker process (``apply_all_workers``).

Example:
    >>> from raysgd.torch.commits import commit_stats
    >>> trainer.apply_all_workers(lambda: commit_stats.process_stats().taken())  # doctest: +SKIP
    [[(1, 0, 4), (1, 0, 8)], [(1, 0, 4), (1, 0, 8)]]
"""
import collections
import threading


class CommitStats:
    """A process's latest commit timings, which its :class:`~raysgd.torch.commits.committer.Committer` records: for the worker's result (the
    driver's ``raysgd_commit_latency_s``), tests and benchmarks. A commit is taken in the training loop and stored
    in the background, so :attr:`count` may lag :meth:`taken` while one is in flight.

    Attributes:
        in_loop_s: the latest commit's serialisation, which the loop waits for (a wait for the previous one too).
        latency_s: the latest stored commit's time from its start until the store held it.
        bytes: its size (record and state); ``count``: the commits stored.

    Example:
        >>> stats = CommitStats()
        >>> stats.record_taken((1, 0, 4), in_loop_s=0.01); stats.record_stored(latency_s=0.05, size=1024)
        >>> stats.taken(), stats.count, stats.wait_stored(after=0, timeout_s=0)
        ([(1, 0, 4)], 1, True)
    """

    def __init__(self, keep=100):
        self.in_loop_s = self.latency_s = self.bytes = None
        self.count = 0
        self._taken: collections.deque[tuple] = collections.deque(maxlen=keep)  # the keys of the latest commits taken
        self._stored = threading.Condition()

    def record_taken(self, key, in_loop_s):
        """A commit ``key`` was taken in the loop, which waited ``in_loop_s`` for it."""
        self.in_loop_s = in_loop_s
        self._taken.append(key)

    def record_stored(self, latency_s, size):
        """The commit in flight is stored (``size`` bytes, ``latency_s`` after it started)."""
        with self._stored:
            self.latency_s, self.bytes, self.count = latency_s, size, self.count + 1
            self._stored.notify_all()

    def taken(self):
        """The keys of the latest commits taken (at most ``keep``), oldest first."""
        return list(self._taken)

    def wait_stored(self, after, timeout_s):
        """Wait (at most ``timeout_s``) until more than ``after`` commits are stored; whether they are."""
        with self._stored:
            return self._stored.wait_for(lambda: self.count > after, timeout=timeout_s)

    def snapshot(self):
        """``{"in_loop_s", "latency_s", "bytes", "count", "taken"}`` now."""
        return {"in_loop_s": self.in_loop_s, "latency_s": self.latency_s, "bytes": self.bytes, "count": self.count,
                "taken": self.taken()}


_PROCESS_STATS = CommitStats()


def process_stats():
    """This process's :class:`CommitStats`: what its committer records (a worker process runs one).

    Example:
        >>> process_stats().count >= 0
        True
    """
    return _PROCESS_STATS
