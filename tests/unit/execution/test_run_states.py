"""The run's explicit states and the resize decisions: pure values, no cluster."""
import pytest

from raysgd.torch.execution.run_states import TRANSITIONS, InvalidTransition, RunState, RunStatus, advance
from raysgd.torch.fault_tolerance import recovery


def test_every_state_but_finished_can_finish_and_finished_is_final():
    assert all(RunState.FINISHED in moves for state, moves in TRANSITIONS.items() if state is not RunState.FINISHED)
    assert TRANSITIONS[RunState.FINISHED] == set()
    status = advance(RunStatus(), RunState.FINISHED, "shut down before it started")
    with pytest.raises(InvalidTransition, match="from finished to idle"):
        advance(status, RunState.IDLE, "again")


def test_a_run_moves_through_a_failure_and_a_resize_carrying_its_numbers():
    status = advance(RunStatus(), RunState.IDLE, "started", size=2, last_resize=1.0)
    for state in (RunState.RUNNING, RunState.RESTARTING, RunState.RESTARTING, RunState.RUNNING, RunState.RESIZING,
                  RunState.RUNNING, RunState.IDLE):
        status = advance(status, state, state.value, failures=status.failures + (state is RunState.RESTARTING))
    assert (status.state, status.size, status.failures, status.last_resize) == (RunState.IDLE, 2, 2, 1.0)
    with pytest.raises(InvalidTransition, match="from idle to starting"):
        advance(status, RunState.STARTING, "a second start")


def test_resize_decisions_are_values_with_their_reason():
    assert recovery.grow_decision(2, 4, extra_fit=5, now=20.0, last_resize=0.0, cooldown_s=10) == \
        recovery.ResizeDecision(4, "to grow", 2)  # never past the largest size
    assert recovery.grow_decision(4, 4, extra_fit=1, now=20.0, last_resize=0.0, cooldown_s=10) is None
    assert recovery.grow_decision(2, 4, extra_fit=0, now=20.0, last_resize=0.0, cooldown_s=10) is None
    move = recovery.move_decision(3, leaving=2, fit=lambda limit: 1, low=2, high=3)
    assert move == recovery.ResizeDecision(2, "to leave draining nodes", 3) and "from 3 to 2" in move.describe()
    assert recovery.move_decision(2, leaving=2, fit=lambda limit: 1, low=2, high=2) is None  # stays until they go
