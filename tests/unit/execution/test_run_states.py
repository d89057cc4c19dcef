"""The run's explicit states and the resize decisions: pure values, and the controller's moves with stand-ins for
the worker group and the commits; no cluster."""
import pytest

from raysgd.torch.execution.run_states import TRANSITIONS, InvalidTransition, RunState, RunStatus, advance
from raysgd.torch.execution.controller import RunController
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


def test_a_resize_at_a_commit_point_is_progress_and_the_backoff_starts_again(monkeypatch):
    # a failure after a grow (or a drain move) from a commit point waited as if the failures before the commit were
    # still in a row: the resize's commit is progress, so the next failure restarts at once
    from raysgd.torch.errors import WorkerFailure
    from raysgd.torch.execution import controller as controller_module
    from raysgd.torch.fault_tolerance import stops

    monkeypatch.setenv("SGD_GROW_CHECK_S", "0")
    sleeps = []
    monkeypatch.setattr(controller_module.time, "sleep", sleeps.append)
    # each attempt: how it ends (None: it finishes), and whether it stored a commit of its own
    attempts = iter([("failure", False), ("failure", False), ("resize", True), ("failure", False), (None, False)])

    class Commits:
        active, attempt, committed = True, 0, False

        def begin_call(self, trains=True, replay=False):
            return True

        def with_plan(self, kwargs, nodes=(), standby=()):
            return kwargs

        def check_store(self):
            pass

        def committed_this_attempt(self):
            return (1, self.attempt) if self.committed else None

        def running_attempt(self):
            return 1, self.attempt

        def restart_state(self, kwargs):
            self.attempt += 1
            return None

        def finish(self, results):
            return results

    class Group:
        broken, num_workers = False, 2

        def how_many_fit(self, limit, settle_s=0.0):
            return limit

        def rank_nodes(self):
            return []

        spare_nodes = rank_nodes

        def request_resize(self, call_id, attempt, ranks=None):
            return {}

        def run(self, method, on_tick=None, **kwargs):
            end, commits.committed = next(attempts)
            if end == "resize":
                on_tick()  # the grow watch decides: every rank stops at its next commit point
                raise WorkerFailure("stopped", {0: f"{stops.RESIZE_MARK}; committed at step 4 of the call"})
            if end == "failure":
                raise WorkerFailure("a worker died", {1: "killed"})
            return [{}]

    commits = Commits()
    controller = RunController(Group(), operator_cls=object, initialization_hook=None, config={}, split=None,
                               worker_range=(1, 4), is_range=True, timeout_s=10, commits=commits, durable=None,
                               resize_cooldown_s=0, stateless=True)
    controller.status = RunStatus(state=RunState.IDLE, size=2)
    controller._restart = lambda state, max_retries=None, target=None: 2  # no workers: the restarts stand in
    controller.run_call("train_epoch", 5, {})
    assert sleeps == [1.0]  # the second failure in a row waits 1 s; the one after the resize's commit none
