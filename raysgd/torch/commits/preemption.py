"""Stopping a call at a commit point: a SIGTERM (preemption) or the driver's request to grow the group.

A SIGTERM to a worker process becomes a commit at a step every rank agrees on, then an exit.

Layer 4, the workers' side of the commits (torch.distributed, signals; no Ray), called by
:mod:`raysgd.torch.commits.committer` at every step boundary and by the worker. What a stopped call's errors say
(the marks, and whether a failure was a preemption or a resize) is a pure policy's: :mod:`raysgd.torch.fault_tolerance.stops`. :func:`install` runs in the actor's
``__init__``, which Ray runs on the process's main thread (the only thread where Python can set a
signal handler; training calls run in another thread because of the ``"control"`` concurrency group).
The handler only sets a flag. At each step boundary of a committing ``train()`` call the ranks agree
whether any of them was signalled (:func:`exchange`: one asynchronous ``all_reduce`` MAX of two CPU numbers,
the flag and the rank's step time, on a gloo group, no GPU sync, read at the next boundary); if so every rank
commits at that step and waits until the commit is stored, then the
signalled rank hands the signal to Ray's own handler (the process exits as Ray would have) and every
rank raises :class:`~raysgd.torch.errors.CollectiveError`, so the trainer recovers from that commit (and,
with a ``storage_path``, writes it there: :meth:`raysgd.torch.storage.durable.DurableRun.on_recovery`).

Every rank marks a preemption commit in the store before it sends its record, and no rank ends the call (or
exits) before the store holds the whole commit (every rank's record): the driver, which kills the group at
the first error, never cuts a slower rank's send short, and it finds the preemption from the store even when
a process's death (the platform's SIGKILL after its grace) reaches it before the marked errors do. A stop to
resize waits the same way.

A SIGTERM outside a committing call (an idle worker, or commits off) goes to Ray's handler at once. A
signalled worker that reaches no agreed step boundary within ``SGD_PREEMPT_GRACE_S`` seconds (default 20)
exits anyway, at once (Ray's own handler would wait for the running call to end); the latest regular commit
then applies, as after a SIGKILL. That timer stops once the agreed commit starts: the commit then runs to
its end (a large state's send takes what it takes), bounded by ``SGD_PREEMPT_COMMIT_S`` (default 120), after
which the ranks end the call anyway. The platform's own grace period (its SIGKILL) bounds both.

The driver's request to grow (:func:`request_resize`, sent while the call trains, when more workers
fit) rides on the same agreement at a lower level: every rank commits at the agreed step and raises
:class:`~raysgd.torch.errors.CollectiveError` marked ``RESIZE_MARK``; no process exits, and the
trainer restarts at the larger size from that commit (:func:`~raysgd.torch.fault_tolerance.stops.was_resize`). SIGTERM wins over a resize.

Example:
    >>> requested(), resize_requested()
    (False, False)
"""
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from raysgd.base import environment
from raysgd.torch.errors import CollectiveError
from raysgd.torch.fault_tolerance.stops import MARK, PREEMPTION, RESIZE_MARK

logger = logging.getLogger(__name__)

#: Agreement levels (the all-reduce takes the maximum): go on, stop to resize, stop for a SIGTERM.
GO_ON, RESIZE, PREEMPT = 0, 1, 2


def check_every():
    """``SGD_PREEMPT_CHECK_STEPS``: step boundaries between two agreements (default 1: every step)."""
    return environment.get("SGD_PREEMPT_CHECK_STEPS")


def grace_s():
    """``SGD_PREEMPT_GRACE_S``: how long a signalled worker waits for the agreed step boundary before it exits."""
    return environment.get("SGD_PREEMPT_GRACE_S")


def commit_s():
    """``SGD_PREEMPT_COMMIT_S``: how long the agreed commit may take to be stored (complete) before the ranks end
    the call anyway (its send is never cut short by :func:`grace_s`'s timer)."""
    return environment.get("SGD_PREEMPT_COMMIT_S")


class PreemptionState:
    """One process's side of the agreement: whether it was sent SIGTERM, whether a committing call runs, the
    driver's request to stop, the agreement in flight. A worker process has one (:func:`process_state`, which the
    module's functions act on: a signal handler is the whole process's); a test may make its own.

    Attributes:
        requested: this process was sent SIGTERM during a committing call and has not left yet.
        active: a committing ``train()`` call runs (a SIGTERM outside one exits at once).
        resize: ``(call_id, attempt)`` the driver asked to stop at the next agreed commit point, or None.
        pending: the agreement in flight, ``(work, tensor)`` of its asynchronous ``all_reduce``, or None.

    Example:
        >>> from types import SimpleNamespace
        >>> state, one_rank = PreemptionState(), SimpleNamespace(world_size=1)
        >>> state.request_resize(4, 1)
        >>> state.resize_wanted(4, 1), state.resize_wanted(4, 2), state.agree(one_rank, resize=True)
        (True, False, 1)
    """

    def __init__(self):
        self.requested = False
        self.active = False
        self.resize = None
        self.pending = None
        self._exit_now = False  # leaving: the next SIGTERM goes to Ray's handler
        self._previous = None  # the SIGTERM handler before ours (Ray's)
        self._group = None  # (process group, its gloo twin) of the agreements under nccl
        self._timer = None  # the grace timer of a SIGTERM

    def install(self):
        """Route SIGTERM through this state (:func:`_on_sigterm`); False (nothing done) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous is _on_sigterm:
            return True
        self._previous = previous
        signal.signal(signal.SIGTERM, _on_sigterm)
        return True

    def request_resize(self, call_id, attempt):
        """The driver asks this rank to stop attempt ``attempt`` of call ``call_id`` at the next agreed commit point.

        A request for another call or attempt (one that arrived late) is never acted on; see :meth:`resize_wanted`.
        """
        self.resize = (call_id, attempt)
        logger.debug("The driver asks to stop call %s (attempt %s) at the next step boundary to grow", call_id,
                     attempt)

    def resize_wanted(self, call_id, attempt):
        """Whether :meth:`request_resize` asked for this call and attempt."""
        return self.resize == (call_id, attempt)

    def set_active(self, active):
        """Mark the span of a committing ``train()`` call (a SIGTERM outside it exits at once).

        A rank signalled too late for the call's last agreement exits when the call ends.
        """
        self.active = bool(active)
        if active:  # an agreement belongs to one call: one left by an aborted call waits on a dead process group
            self.pending = None
        if not active and self.requested and not self._exit_now:
            self._exit_now = True
            threading.Thread(target=self._leave_now, daemon=True).start()

    def on_sigterm(self, signum, frame):
        """The SIGTERM handler: exit at once outside a committing call, else commit at the next agreed step."""
        if self._exit_now or not self.active:
            self._exit_now = True
            self._exit(signum, frame)
            return
        if self.requested:
            return
        self.requested = True
        logger.warning("SIGTERM: committing at the next agreed step boundary (within %.0f s), then exiting",
                       grace_s())
        timer = threading.Timer(grace_s(), _exit_hard, args=(f"no agreed step boundary within {grace_s():.0f} s of "
                                                             "SIGTERM (SGD_PREEMPT_GRACE_S)",))
        timer.daemon = True
        self._timer = timer
        timer.start()

    def _exit(self, signum, frame):
        previous = self._previous
        if previous is signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)  # Ray's: raises SystemExit in the main thread, the actor exits
        sys.exit(1)

    def _leave_now(self):
        """Exit through the signal handler (Ray's, in the main thread)."""
        self._exit_now = True
        os.kill(os.getpid(), signal.SIGTERM)

    def stopping(self, level=PREEMPT, sink=None, key=None):
        """The ranks agreed to stop at this step, where they commit under ``key``: a SIGTERM's grace timer has done
        its job (the commit is never cut short by it), and a preemption commit is marked in the store (``sink``)
        before any record of it is sent, so a complete commit is always a marked one. Returns the
        ``time.monotonic()`` deadline for the commit to be stored (``SGD_PREEMPT_COMMIT_S``)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if level == PREEMPT and sink is not None:
            try:
                sink.mark(key, PREEMPTION)
            except Exception as err:  # noqa: BLE001 (the marked errors still tell the driver)
                logger.warning("Could not mark the preemption commit %s in the store: %s", key, err)
        return time.monotonic() + commit_s()

    def _gloo_group(self, worker):
        if worker.backend == "gloo":
            return None  # the default group is already on CPU
        world = dist.group.WORLD
        if self._group is None or self._group[0] is not world:  # new (or re-formed) process group
            self._group = (world, dist.new_group(backend="gloo"))  # every rank is at the same boundary
        return self._group[1]

    def exchange(self, worker, last=False, resize=False, trained_s=0.0):
        """``(level, slowest_s)``, agreed one step late by every rank, which calls it at every step boundary:
        ``level`` is the highest any rank asks for (:data:`GO_ON`, :data:`RESIZE` or :data:`PREEMPT`; ``resize``:
        this rank was asked to stop for a resize), ``slowest_s`` the most training time (``trained_s``, seconds
        spent in steps since this rank's previous exchange) any rank reported. Every rank gets the same pair
        at the same boundary, so decisions made from it (stop here, commit here) are the same everywhere.

        Each call starts an asynchronous ``all_reduce`` (MAX) of this rank's two numbers and returns the result
        of the previous call's, which finished during the step in between: the training loop does not wait for
        the network. ``last=True`` (after the call's last batch) waits for the one it starts.
        """
        level = PREEMPT if self.requested else RESIZE if resize else GO_ON
        if worker.world_size == 1:
            return level, float(trained_s)
        mine = torch.tensor([level, trained_s], dtype=torch.float64)
        previous = self.pending
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._gloo_group(worker), async_op=True)
        self.pending = (work, mine)
        if previous is not None:
            previous[0].wait()
        if last:
            self.pending = None
            work.wait()
            previous = (work, mine)
        if previous is None:
            return GO_ON, 0.0
        agreed = previous[1].tolist()
        return int(agreed[0]), agreed[1]

    def agree(self, worker, last=False, resize=False):
        """The level of :meth:`exchange` alone."""
        return self.exchange(worker, last, resize)[0]

    def leave(self, worker, step, level=PREEMPT, sink=None, key=None, deadline=None):
        """After this rank's record of the agreed commit is stored: when ``sink`` and ``key`` name the commit, wait
        until it is complete; then a signalled rank exits and every rank ends the call."""
        signalled = self.requested
        if sink is not None and key is not None:
            _settle(sink, key, time.monotonic() + commit_s() if deadline is None else deadline)
        if level == RESIZE and not signalled:
            self.resize = None
            message = f"{RESIZE_MARK}; committed at step {step} of the call"
        elif signalled:
            self._exit_now = True
            threading.Thread(target=self._leave_now, daemon=True).start()
            message = f"{MARK}; committed at step {step} of the call"
        else:
            message = f"a peer was {MARK}; committed at step {step} of the call"
        logger.warning("Rank %d: %s", worker.world_rank, message)
        raise CollectiveError(worker.world_rank, message)


_PROCESS = PreemptionState()


def process_state():
    """This process's :class:`PreemptionState` (the one the SIGTERM handler and the functions below act on).

    Example:
        >>> process_state().requested
        False
    """
    return _PROCESS


def _on_sigterm(signum, frame):
    _PROCESS.on_sigterm(signum, frame)


def _exit_hard(why):
    """End this process now. Ray's own SIGTERM handling waits for the running call to end, which a rank stuck
    inside a step never does; nothing is lost that a SIGKILL would keep (the latest commit is in the store)."""
    logger.error("Exiting now: %s", why)
    os._exit(1)


# ----------------------------------------------------------------- the process's state, as the worker uses it
def install():
    """Route this process's SIGTERM through its :class:`PreemptionState` (see :meth:`PreemptionState.install`)."""
    return _PROCESS.install()


def requested():
    """Whether this process was sent SIGTERM and has not left yet."""
    return _PROCESS.requested


def request_resize(call_id, attempt):
    """:meth:`PreemptionState.request_resize` of this process."""
    _PROCESS.request_resize(call_id, attempt)


def resize_requested():
    """Whether the driver asked this rank to stop at its next commit point (to grow or move) and it has not yet.

    Example:
        >>> resize_requested()
        False
    """
    return _PROCESS.resize is not None


def resize_wanted(call_id, attempt):
    """:meth:`PreemptionState.resize_wanted` of this process."""
    return _PROCESS.resize_wanted(call_id, attempt)


def set_active(active):
    """:meth:`PreemptionState.set_active` of this process."""
    _PROCESS.set_active(active)


def stopping(level=PREEMPT, sink=None, key=None):
    """:meth:`PreemptionState.stopping` of this process."""
    return _PROCESS.stopping(level, sink, key)


def exchange(worker, last=False, resize=False, trained_s=0.0):
    """:meth:`PreemptionState.exchange` of this process."""
    return _PROCESS.exchange(worker, last, resize, trained_s)


def agree(worker, last=False, resize=False):
    """The level of :func:`exchange` alone.

    Example:
        >>> from types import SimpleNamespace
        >>> agree(SimpleNamespace(world_size=1))
        0
    """
    return _PROCESS.agree(worker, last, resize)


def drop_pending():
    """Forget an agreement still in flight (the call ended with an error: its process group is going away)."""
    _PROCESS.pending = None


def leave(worker, step, level=PREEMPT, sink=None, key=None, deadline=None):
    """:meth:`PreemptionState.leave` of this process."""
    _PROCESS.leave(worker, step, level, sink, key, deadline)


def _settle(sink, key, deadline):
    """Wait (until ``deadline``) until the store holds every rank's record of the commit ``key``: no rank ends the
    call (whereupon the driver kills the group) or exits before then."""
    try:
        if not sink.wait_complete(key, max(0.0, deadline - time.monotonic())):
            logger.warning("The commit %s was not complete by its deadline (SGD_PREEMPT_COMMIT_S)", key)
    except Exception as err:  # noqa: BLE001 (the latest complete commit applies)
        logger.warning("Could not learn whether the commit %s is complete: %s", key, err)
