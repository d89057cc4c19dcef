"""The failure policy: after an attempt of a run's work ended badly, restart the workers or raise, and after how long.

Layer 1: the standard library and layer 0 (no Ray, no torch), so every rule is tested with plain values. The controller
(:mod:`raysgd.torch.execution.controller`) says what happened (:data:`FAILURE`: a worker died or a collective broke;
:data:`PREEMPTION`: a worker was preempted (SIGTERM) after committing; :data:`RESIZE`: the ranks stopped at a commit
point because the driver asked them to grow or move; :data:`USER_ERROR`: the user's code raised), how many of each it
counted so far, and whether the failed attempt made progress (a commit or a report stored); :func:`decide` returns a
:class:`FailureDecision`, a value the controller carries out and logs, and tests compare.

Both front doors use it: ``TorchTrainer.train(max_retries=N)`` (a worker failure or preemption uses one of the call's
``N`` retries; user errors are raised with their own type, as in RaySGD 1.x) and ``raysgd.train.TorchTrainer``
(``FailureConfig(max_failures, max_preemption_failures)`` as in Ray Train: a user error is retried too, and
preemptions have a budget of their own). A resize never uses a retry. The backoff is one schedule for both: the first
failure after progress restarts at once; each further one in a row without progress waits twice as long as the one
before (1 s, 2 s, 4 s, ... at most ``cap_s``), so a function that fails at once on every start does not spin.

Example:
    >>> limits = FailureLimits(max_failures=1)
    >>> decide(FAILURE, Counts(), limits)
    FailureDecision(action='restart', kind='failure', retry=1, limit=1, delay_s=0.0, counts=Counts(failures=1, preemptions=0, in_a_row=1))
    >>> decide(FAILURE, Counts(failures=1, in_a_row=1), limits).action
    'raise'
    >>> decide(USER_ERROR, Counts(), limits).action  # the operator API never retries the user's own errors
    'raise'
"""
from __future__ import annotations

import dataclasses

from raysgd.base import environment

FAILURE, PREEMPTION, RESIZE, USER_ERROR = "failure", "preemption", "resize", "user error"
RESTART, RAISE = "restart", "raise"
UNLIMITED = -1


@dataclasses.dataclass(frozen=True)
class FailureLimits:
    """What a run tolerates.

    Args:
        max_failures: failures to recover from (-1: no limit).
        max_preemptions: preemptions to recover from, counted apart from ``max_failures`` (-1: no limit); None:
            a preemption counts as a failure.
        retry_user_errors: whether an error of the user's code is recovered from like a failure (Ray Train's
            ``max_failures``) or raised at once (RaySGD's ``train()``).
        base_s, cap_s: the backoff's first delay and its cap (see the module docstring; by default
            ``SGD_BACKOFF_CAP_S``, read when the limits are made, for both APIs).
    """

    max_failures: int = 0
    max_preemptions: int | None = None
    retry_user_errors: bool = False
    base_s: float = 1.0
    cap_s: float = dataclasses.field(default_factory=lambda: environment.get("SGD_BACKOFF_CAP_S"))


@dataclasses.dataclass(frozen=True)
class Counts:
    """What a run met so far: ``failures`` and ``preemptions`` counted against their limits, and ``in_a_row``:
    failures since the last attempt that made progress (the backoff's exponent)."""

    failures: int = 0
    preemptions: int = 0
    in_a_row: int = 0


@dataclasses.dataclass(frozen=True)
class FailureDecision:
    """What to do: ``action`` (:data:`RESTART` or :data:`RAISE`), for an event of ``kind``; ``retry``: which recovery
    of its budget this is (1-based; 0 when raising or for a resize), ``limit`` that budget (-1: none), ``delay_s``
    how long to wait before restarting, ``counts`` the counts after this event."""

    action: str
    kind: str
    retry: int
    limit: int
    delay_s: float
    counts: Counts

    @property
    def gave_up(self) -> bool:
        """Whether the run fails with this event."""
        return self.action == RAISE

    def describe(self) -> str:
        """One line for the log.

        Example:
            >>> decide(FAILURE, Counts(), FailureLimits(max_failures=-1)).describe()
            'restart (failure 1 of any)'
        """
        if self.kind == RESIZE:
            return "restart at the new size (a resize uses no retry)"
        limit = "any" if self.limit == UNLIMITED else self.limit
        if self.action == RAISE:
            if self.kind == USER_ERROR and self.limit == 0 and self.retry == 0:
                return "raise (the user's code raised: not retried)"
            return f"raise ({self.kind}s exceeded {limit})"
        delay = f", after {self.delay_s:.0f} s" if self.delay_s else ""
        return f"restart ({self.kind} {self.retry} of {limit}{delay})"


#: Doublings past which a backoff is the cap anyway (2.0 ** 1000 is a float; 2 ** 1025 as one overflows).
_MAX_DOUBLINGS = 1000


def backoff_s(in_a_row: int, base_s: float = 1.0, cap_s: float = 60.0) -> float:
    """The wait before a restart after ``in_a_row`` failures without progress: none after the first, then ``base_s``,
    doubling, at most ``cap_s``.

    Example:
        >>> [backoff_s(n, 1, 4) for n in (1, 2, 3, 4, 5)]
        [0.0, 1.0, 2.0, 4.0, 4.0]
    """
    if in_a_row <= 1:
        return 0.0
    # a float power, its exponent bounded: an unlimited run's thousandth failure in a row raised OverflowError
    return float(min(cap_s, base_s * 2.0 ** min(in_a_row - 2, _MAX_DOUBLINGS)))


def _exceeded(used, limit):
    return limit != UNLIMITED and used > limit


def decide(kind: str, counts: Counts, limits: FailureLimits, progressed: bool = False) -> FailureDecision:
    """The :class:`FailureDecision` after an event of ``kind`` when the run has met ``counts`` so far (see the module
    docstring); ``progressed``: the failed attempt stored a commit or a report (the backoff starts again)."""
    if kind == RESIZE:
        return FailureDecision(RESTART, kind, 0, UNLIMITED, 0.0, dataclasses.replace(counts, in_a_row=0))
    in_a_row = 1 if progressed else counts.in_a_row + 1
    if kind == USER_ERROR and not limits.retry_user_errors:
        return FailureDecision(RAISE, kind, 0, 0, 0.0, dataclasses.replace(counts, in_a_row=in_a_row))
    if kind == PREEMPTION and limits.max_preemptions is not None:
        used, limit = counts.preemptions + 1, limits.max_preemptions
        after = dataclasses.replace(counts, preemptions=used, in_a_row=in_a_row)
    else:
        used, limit = counts.failures + 1, limits.max_failures
        after = dataclasses.replace(counts, failures=used, in_a_row=in_a_row)
    if _exceeded(used, limit):
        return FailureDecision(RAISE, kind, 0, limit, 0.0, after)
    return FailureDecision(RESTART, kind, used, limit, backoff_s(in_a_row, limits.base_s, limits.cap_s), after)
