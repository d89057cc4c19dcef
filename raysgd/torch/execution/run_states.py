"""The run's states and the moves between them: what the controller is doing now, as a value to log and test.

Layer 5 by its folder, pure by its code (the standard library only): the
:class:`~raysgd.torch.execution.controller.RunController` holds one :class:`RunStatus` and changes it only through
:func:`advance`, which refuses a move the table does not allow (a bug, never a user's error). The states:

- ``STARTING``: the first group is being placed and started (and a durable run's checkpoint loaded);
- ``IDLE``: between calls (the operator API's ``train()``/``validate()``), the group formed, or broken by a loss
  between calls (the next call restarts it);
- ``RUNNING``: a call's attempt runs on the group;
- ``RESTARTING``: after a failure, the group is re-formed (or restarted) from the latest commit;
- ``RESIZING``: a planned change of size: a grow, or a move off draining nodes (no failure counted);
- ``ERRORED``: the last call failed and its error was raised (the operator API may call again; the function API's
  run is over);
- ``FINISHED``: the workers were shut down.

The decisions that move the run are values too: the failure policy's
:class:`~raysgd.torch.fault_tolerance.failure_policy.FailureDecision`, and the resize policy's
:class:`~raysgd.torch.fault_tolerance.recovery.ResizeDecision`.

Example:
    >>> status = RunStatus()
    >>> status = advance(status, RunState.IDLE, "started 2 workers", size=2, last_resize=5.0)
    >>> status.state, status.size
    (<RunState.IDLE: 'idle'>, 2)
    >>> advance(status, RunState.STARTING, "again")
    Traceback (most recent call last):
    ...
    raysgd.torch.execution.run_states.InvalidTransition: the run cannot go from idle to starting (again)
"""
import dataclasses
import enum


class RunState(enum.Enum):
    """What the run is doing (see the module docstring)."""

    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    RESTARTING = "restarting"
    RESIZING = "resizing"
    ERRORED = "errored"
    FINISHED = "finished"


_S = RunState
#: The moves the controller may make, from each state.
TRANSITIONS = {
    _S.STARTING: {_S.IDLE, _S.ERRORED, _S.FINISHED},
    _S.IDLE: {_S.RUNNING, _S.RESTARTING, _S.RESIZING, _S.ERRORED, _S.FINISHED},
    _S.RUNNING: {_S.IDLE, _S.RESTARTING, _S.RESIZING, _S.ERRORED, _S.FINISHED},
    _S.RESTARTING: {_S.RUNNING, _S.IDLE, _S.ERRORED, _S.FINISHED},
    _S.RESIZING: {_S.RUNNING, _S.IDLE, _S.RESTARTING, _S.ERRORED, _S.FINISHED},  # a failed resize: restart next
    _S.ERRORED: {_S.IDLE, _S.RUNNING, _S.RESTARTING, _S.RESIZING, _S.FINISHED},
    _S.FINISHED: set(),
}


class InvalidTransition(RuntimeError):
    """The controller tried a move :data:`TRANSITIONS` does not allow (a bug in raysgd)."""


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """The run's state and what goes with it: the group's ``size`` as last reported, the ``failures`` met so far,
    when the group last changed size (``last_resize``, a ``time.monotonic()`` value; -inf before any), and why it
    is in this state."""

    state: RunState = RunState.STARTING
    size: int = 0
    failures: int = 0
    last_resize: float = float("-inf")
    why: str = "created"


def advance(status, state, why, **changes):
    """``status`` moved to ``state`` because of ``why``, with ``changes`` to its other fields;
    :class:`InvalidTransition` when the table does not allow the move. Staying in a state is always allowed (a second
    restart in a row, say)."""
    if state is not status.state and state not in TRANSITIONS[status.state]:
        raise InvalidTransition(f"the run cannot go from {status.state.value} to {state.value} ({why})")
    return dataclasses.replace(status, state=state, why=why, **changes)
