"""Waiting for one round of worker calls under deadlines, and reading how each ended: the group's call collection.

Layer 5 helper of :mod:`raysgd.torch.execution.worker_group` (ray, layers 0-1). :func:`collect` waits for every
call of a round (ObjectRefs of actors, a local rank 0's call in its thread, or calls already done), files each
answer as a result, a user error or a failure (:func:`classify`), and returns an :class:`Outcome` the group acts
on: the results in rank order (``DONE``), a user error to raise with its own type (``USER_ERROR``; the group kills
the ranks stuck waiting for the failed one), or a failure (``FAILED``: a dead actor, a lost node, a collective that
timed out, no answer within the deadline, ranks lagging ``timeout_s`` behind the first finished one; the group
takes the stacks of the silent ranks, kills all but the survivors in ``keep`` and raises
:class:`~raysgd.torch.errors.WorkerFailure`). A dead actor shows up as ``RayActorError``; a failed collective as
:class:`~raysgd.torch.errors.CollectiveError`. :func:`describe` is one line per failure; :func:`check_for_failure`
is RaySGD 1.x's ``ray.util.sgd.utils.check_for_failure``.

Example:
    >>> from raysgd.torch.errors import CollectiveError
    >>> describe(CollectiveError(1, "gloo timed out"))
    'gloo timed out'
    >>> describe(ValueError("bad\\nsecond line"))
    'ValueError: bad'
    >>> collect({0: Done(lambda: 1), 1: Done(lambda: 2)}, timeout_s=10).results
    [1, 2]
    >>> collect({0: Done(lambda: 1 / 0)}, timeout_s=10).kind
    'user error'
"""
import dataclasses
import logging
import time

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from raysgd.torch.errors import CollectiveError, first_line, is_peer_gone, mark_rank
from raysgd.torch.execution.local_runner import AbandonedCall, LocalCall
from raysgd.torch.fault_tolerance import reform

logger = logging.getLogger(__name__)

_TICK_S = 0.5
_USER_ERROR_GRACE_S = 2.0
_CAUSE_GRACE_S = 1.0
# The same when every failure says a peer's connection closed: a killed process is reported dead within ~0.1 s, and
# a process lost with its node only after Ray's health check, which a recovery must not wait for. A death reported
# after this grace is still named: the unanswered ranks' stacks are taken next, and a rank found dead then is named
# as such (``WorkerGroup._fail``).
_PEER_GONE_GRACE_S = 0.25
_LOCAL_TICK_S = 0.05  # how often a local rank 0's thread is checked while remote ranks are watched
DONE, USER_ERROR, FAILED = "done", "user error", "failed"


class Done:
    """A call the local worker already finished: its value or its exception."""

    def __init__(self, fn):
        try:
            self.value, self.error = fn(), None
        except Exception as err:  # noqa: BLE001 (sorted out by the caller, like a remote result)
            self.value, self.error = None, err


@dataclasses.dataclass
class Outcome:
    """How a round of calls ended (see the module docstring): ``kind`` is ``DONE``, ``USER_ERROR`` or ``FAILED``.

    ``results``: the values in rank order (``DONE``); ``error``: the user error to raise, and ``stuck``: whether
    ranks still wait for the failed one; ``failures`` (``{rank: error}``), ``unanswered`` (ranks that never
    answered), ``cause`` (the first death, else the first failure, else None), ``message`` and ``keep`` (the ranks
    whose call ended cleanly, kept for a re-formed group) for a failure.
    """

    kind: str
    results: list | None = None
    error: BaseException | None = None
    stuck: bool = False
    failures: dict = dataclasses.field(default_factory=dict)
    unanswered: list = dataclasses.field(default_factory=list)
    cause: object = None
    message: str = ""
    keep: list = dataclasses.field(default_factory=list)


def classify(rank, error):
    """How one finished call ended: ``None`` (it succeeded), ``("failure", error)`` (a death or a failed collective:
    retried) or ``("user", error)`` (user code raised: re-raised with its original type, the worker's traceback
    chained as its cause; an actor that could not be created is deterministic, not retried either)."""
    if error is None:
        return None
    if isinstance(error, RayActorError) and error.actor_init_failed:  # deterministic: not retried
        failed = RuntimeError(f"rank {rank} could not be created: {error}")
        failed.__cause__ = error  # the constructor's own error, with its traceback
        return "user", failed
    cause = error.cause if isinstance(error, RayTaskError) else error
    if isinstance(cause, (CollectiveError, AbandonedCall)) or (
            isinstance(error, RayError) and not isinstance(error, RayTaskError)):
        return "failure", cause if isinstance(cause, (CollectiveError, AbandonedCall)) else error
    if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        original = error.cause
        original.__cause__ = error  # keep the worker's traceback in the chain
        if error is not original and "__notes__" not in vars(error):  # Ray's error reads the original's attributes:
            try:  # its notes (the rank's, the user's) are told once, under the original
                setattr(error, "__notes__", [])  # (typeshed: only add_note)
            except (AttributeError, TypeError):
                pass
        return "user", original
    return "user", error


class _Round:
    """The calls of one round still running and what the finished ones gave (the bookkeeping of :func:`collect`)."""

    def __init__(self, calls):
        self.results, self.failures, self.user_error, self.first_success = {}, {}, None, None
        self.pending, self.local = {}, {}
        for rank, call in calls.items():
            if isinstance(call, Done):
                self.file(rank, call.value, call.error)
            elif isinstance(call, LocalCall):
                self.local[rank] = call
            else:
                self.pending[call] = rank

    def file(self, rank, value, error):
        found = classify(rank, error)
        if found is None:
            self.results[rank] = value
            if self.first_success is None:
                self.first_success = time.monotonic()
        elif found[0] == "failure":
            self.failures[rank] = found[1]
        else:  # the latest user error is the one raised
            self.user_error = (mark_rank(found[1], rank), time.monotonic(), rank)

    def file_ready(self, refs):
        for ref in refs:
            rank = self.pending.pop(ref)
            try:
                self.file(rank, ray.get(ref), None)
            except RayError as err:
                self.file(rank, None, err)

    def poll_local(self):
        for rank, call in list(self.local.items()):
            if call.done():
                del self.local[rank]
                self.file(rank, call.value, call.error)

    def running(self):
        return bool(self.pending or self.local)

    def unanswered(self):
        return sorted([*self.pending.values(), *self.local])

    def wait(self, timeout_s, every=False):
        """Wait up to ``timeout_s`` for one call (``every``: for all) to end, filing what ended."""
        self.poll_local()
        if self.pending:
            self.file_ready(ray.wait(list(self.pending), num_returns=len(self.pending) if every else 1,
                                    timeout=_LOCAL_TICK_S if self.local or every else timeout_s)[0])
        elif self.local:
            next(iter(self.local.values())).wait(_LOCAL_TICK_S if every else timeout_s)
        self.poll_local()

    def wait_rest(self, timeout_s):
        """The calls still running get up to ``timeout_s`` to end."""
        end = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < end:
            self.wait(_LOCAL_TICK_S, every=True)


def collect(calls, *, timeout_s, deadline_s=None, on_tick=None, lockstep=False, survivor_grace_s=None):
    """Wait for every call of ``{rank: call}``; the first death or collective failure ends the wait: an
    :class:`Outcome`. ``timeout_s``: the process group's; with ``lockstep`` (train and validate) the others must
    finish within it (and 5 s) of the first; ``deadline_s``: how long the whole round may take; ``on_tick()`` runs between two waits;
    ``survivor_grace_s``: when survivors are kept, how long their calls get to end once a rank died (None: none
    are kept). Ctrl-C propagates (the group stops every worker)."""
    start = time.monotonic()
    round_ = _Round(calls)
    while round_.running() and not round_.failures:
        now = time.monotonic()
        if round_.user_error is not None and now - round_.user_error[1] > _USER_ERROR_GRACE_S:
            break
        if deadline_s is not None and now - start > deadline_s:
            return Outcome(FAILED, unanswered=round_.unanswered(), message=f"no answer within {deadline_s:.0f} s")
        if lockstep and round_.first_success is not None and now - round_.first_success > timeout_s + 5:
            return Outcome(FAILED, unanswered=round_.unanswered(), message="workers did not finish after rank "
                           f"{min(round_.results)} did (timeout_s={timeout_s})")
        round_.wait(_TICK_S)
        if on_tick is not None:
            on_tick()
    failures = round_.failures  # filled further by the waits below
    if failures and round_.running() and all(isinstance(c, CollectiveError) for c in failures.values()):
        # A survivor's collective often fails just before the dead peer is reported: wait a moment
        # for the real cause, so that the error names the rank that died rather than its victim.
        # A user error found meanwhile is kept: it is the cause (see below).
        peer_gone = all(is_peer_gone(c) for c in failures.values())
        round_.wait_rest(_PEER_GONE_GRACE_S if peer_gone else _CAUSE_GRACE_S)
    deaths = [c for c in failures.values() if not isinstance(c, CollectiveError)]
    if deaths and survivor_grace_s is not None:  # a survivor's call ends once its collective meets the dead peer
        round_.wait_rest(survivor_grace_s)
    user_error = round_.user_error
    if user_error is not None and not deaths:  # collective errors are the user error's victims
        return Outcome(USER_ERROR, error=user_error[0], stuck=bool(round_.unanswered() or failures))
    if failures:
        if user_error is not None:
            logger.warning("rank %d raised %r while another rank died; retrying for the death", user_error[2],
                           user_error[0])
            failures.setdefault(user_error[2], user_error[0])
        keep = [r for r in [*round_.results, *failures] if survivor_grace_s is not None and
                reform.can_stay(failures.get(r))]
        return Outcome(FAILED, failures=failures, unanswered=[] if deaths else round_.unanswered(),
                       cause=(deaths or list(failures.values()))[0], message="worker failure", keep=keep)
    return Outcome(DONE, results=[round_.results[rank] for rank in sorted(round_.results)])


def describe(err):
    """One line saying how a worker's call failed (a ``WorkerFailure`` cause)."""
    if isinstance(err, CollectiveError):
        return err.message
    if isinstance(err, RayActorError):
        return "worker process died (" + first_line(err)[:200] + ")"
    return f"{type(err).__name__}: {first_line(err)[:200]}"


def check_for_failure(remote_values):
    """Wait for every ObjectRef in ``remote_values``; True if all succeeded, False (logged) if an actor died.

    RaySGD 1.x's ``ray.util.sgd.utils.check_for_failure``, kept for programs that call it on their own
    remote calls. An exception raised by the called code propagates (as ``ray.get`` raises it). Like 1.x
    it waits without a deadline; the trainer itself watches its workers under deadlines instead.

    Example:
        >>> refs = start_steps(actors)  # your actors' calls (ObjectRefs)  # doctest: +SKIP
        >>> if not check_for_failure(refs):  # doctest: +SKIP
        ...     restart(actors)
    """
    unfinished = list(remote_values)
    try:
        while unfinished:
            finished, unfinished = ray.wait(unfinished)  # one at a time: a death is seen at once
            ray.get(finished)
        return True
    except RayActorError as err:
        logger.warning("check_for_failure: a worker died: %s", describe(err))
    return False
