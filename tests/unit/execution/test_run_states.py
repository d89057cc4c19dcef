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


def test_a_resize_that_could_not_restart_the_workers_leaves_a_run_the_next_call_restarts():
    # a grow or move between calls whose restart gave up left the run "resizing"; the next call's restart of the
    # lost group then raised InvalidTransition ("the run cannot go from resizing to restarting")
    from raysgd.torch.execution.controller import RunController

    class Group:
        broken, num_workers = False, 2

    class Commits:
        active = False

    group, targets = Group(), []

    def restart(state, max_retries=None, target=None):
        targets.append(target)
        if len(targets) == 1:
            group.broken, group.num_workers = True, 0
            raise recovery.RestartGaveUp("could not start any worker after 10 tries")
        group.broken, group.num_workers = False, 2
        return 2

    controller = RunController(group, operator_cls=object, initialization_hook=None, config={}, split=None,
                               worker_range=(1, 4), is_range=True, timeout_s=10, commits=Commits(), durable=None,
                               stateless=True)
    controller.status = RunStatus(state=RunState.IDLE, size=2)
    controller._restart, controller.take_snapshot = restart, lambda: None  # no workers: the restarts stand in
    with pytest.raises(recovery.RestartGaveUp):
        controller._resize_between_calls(4, "to grow")  # what a call does first when more workers fit
    controller.ensure_workers()  # the next call
    assert (controller.state, targets) == (RunState.IDLE, [4, None])
    assert [state for state, _ in controller.history][-3:] == [RunState.RESIZING, RunState.RESTARTING, RunState.IDLE]
