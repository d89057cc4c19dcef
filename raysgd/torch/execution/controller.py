"""The run controller: the one owner of a trainer's run, from the first worker group to the last call's restart point.

Layer 5 (ray, layers 0-4). ``TorchTrainer`` (the facade) checks its options and hands every call here. The
:class:`RunController` owns the run's state: the worker group, the restart point (rank 0's state bytes, the
*snapshot*, and whether the workers may have moved on since: :mod:`raysgd.torch.execution.restart_points`), the
failures counted, the time of the last resize, the commit policy and the durable run's hooks. A ``train()`` or
``validate()`` call runs through its attempts (:meth:`RunController.run_call`):

- A :class:`~raysgd.torch.errors.WorkerFailure` counts as a failure (``num_failures``) and uses one of
  ``max_retries``: the group restarts on as many workers as fit (never below the minimum) from the
  call's latest commit, or from the snapshot taken at the call's start when there is none.
- While a committing call trains below the largest size, a :class:`~raysgd.torch.fault_tolerance.watches.GrowWatch`
  checks every ``SGD_GROW_CHECK_S`` seconds whether more workers fit (after the resize cooldown); when a worker's
  node is draining (a preemption notice), a :class:`~raysgd.torch.fault_tolerance.watches.DrainWatch` decides to
  leave it. Either way the ranks are asked to stop at their next agreed commit point, and the same call goes on
  from that commit at the new size (no failure, no retry used); between calls the group moves before the call.
- A user error ends the call; a ``train()`` puts the workers back to the call's starting state.

Starting and restarting the group are :mod:`raysgd.torch.execution.restarts`' functions; the sizes come from the
pure policies of :mod:`raysgd.torch.fault_tolerance`, as decision values (``FailureDecision``, ``ResizeDecision``)
the controller carries out and logs. The run's state is explicit (``status``, a
:class:`~raysgd.torch.execution.run_states.RunStatus`: starting, idle, running, restarting, resizing, errored,
finished, with its size and failures), changed only through the allowed moves and kept in ``history``. What it
reads and writes of the workers' state (``state_dict``, ``save``, ``load``...) is
:mod:`~raysgd.torch.execution.state_access`'s.

Example:
    >>> # controller = RunController(group, operator_cls=Op, ...); controller.start()
    >>> # stats = controller.run_call("train_epoch", max_retries=3, kwargs={"num_steps": None})
    >>> RunController.check_max_retries(-1)
    Traceback (most recent call last):
    ...
    ValueError: max_retries expects an int >= 0; got -1
"""
from __future__ import annotations

import dataclasses
import logging
import time
import types

from raysgd.base import environment, stateful
from raysgd.base.checks import expect, is_int
from raysgd.callbacks import Failure
from raysgd.torch import constants
from raysgd.torch.errors import WorkerFailure
from raysgd.torch.execution import restarts
from raysgd.torch.execution.restart_points import NoRestartPoints, RestartPoints
from raysgd.torch.execution.run_states import RunState, RunStatus, advance
from raysgd.torch.execution.state_access import StateAccess
from raysgd.torch.fault_tolerance import failure_policy, recovery, stops
from raysgd.torch.fault_tolerance.watches import DrainWatch, GrowWatch, StopWatch
from raysgd.torch.state import checkpoint, training_state
from raysgd.torch.restart_points.call_start import PendingPoint
from raysgd.torch.restart_points.restart_point import RestartPoint, RestartPointLost, ShardedPoint
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from raysgd.torch.execution.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


class ShutDownGroup:
    """Stands in for the worker group after ``shutdown()``: any use says the trainer is gone."""

    def __getattr__(self, name):
        raise RuntimeError("This TorchTrainer was shut down and its workers are gone: create a new TorchTrainer.")


class RunController(StateAccess):
    """Owns one trainer's run (see the module docstring).

    Args:
        group: the :class:`~raysgd.torch.execution.worker_group.WorkerGroup` (not started yet).
        operator_cls, initialization_hook: what every worker builds and runs.
        config: the trainer config as given; ``split(config, n, warn)`` gives the config of each of ``n`` workers
            and the effective global batch size (:mod:`raysgd.torch.sharding.batch_split`).
        worker_range: ``(min, max)`` workers; ``is_range``: ``num_workers`` was given as a range.
        timeout_s: the process-group timeout, also the deadline of a call's single answers.
        commits: the :class:`~raysgd.torch.commits.commit_policy.CommitPolicy`; ``durable``: the durable run
            (:func:`raysgd.torch.storage.durable.open_run`).
        on_event: ``on_event(kind, *args)`` hears the run's events: ``("failure", Failure)`` for every worker failure
            met (a :class:`~raysgd.callbacks.Failure`, recovered from or not), ``("resize", old, new)`` whenever
            the group's size changes and ``("state", old, new, why)`` at every move of the run
            (:class:`~raysgd.torch.execution.run_states.RunState`). Its errors are logged, never raised.
        components: the driver-side :class:`~raysgd.base.stateful.Stateful` components kept with every durable
            checkpoint, by name (the trainer's callbacks and result log): their ``state_dict()`` goes into each
            checkpoint's marker under its name when it is submitted, and a resume hands each its state back
            (:meth:`start`); storage never calls into them.
        stateless: the workers' code keeps its state itself, so the run takes no restart points and a restart loads
            nothing (a training function: it reads its latest checkpoint, which ``commits`` hands it on each
            attempt); else the workers' state is snapshotted, committed and loaded (an operator).

    ``last_commit_latency_s``: the latest commit's latency (seconds from its start until the store held every
    rank's record, the slowest rank's) stored during the last ``train()`` call that stored one; None before.
    """

    def __init__(self, group: WorkerGroup, *, operator_cls: type | Callable, initialization_hook: Callable | None,
                 config: dict | None, split: Callable, worker_range: tuple[int, int], is_range: bool,
                 timeout_s: float, commits: Any, durable: Any, resize_cooldown_s: float | None = None,
                 on_event: Callable[..., Any] | None = None, stateless: bool = False,
                 components: Mapping[str, Any] | None = None) -> None:
        self.group, self.commits, self.durable = group, commits, durable
        self.components = stateful.check_components(components, "RunController")
        self._operator_cls, self.initialization_hook = operator_cls, initialization_hook  # settable: later starts
        self._requested_config, self._config, self._split = dict(config or {}), dict(config or {}), split
        self.min_workers, self.max_workers = worker_range
        self._split_warned = {self.max_workers}  # sizes whose uneven split was reported (the first, when checked)
        self._is_range, self._timeout_s = is_range, timeout_s
        self._on_event = on_event
        self.status = RunStatus()  # the run's state, size, failures and last resize (raysgd.torch.execution.run_states)
        self.history = [(self.status.state, self.status.why)]  # every state the run went through, and why
        self.stateless = stateless  # the workers' code keeps its state itself (a training function's checkpoints)
        self.points = NoRestartPoints() if stateless else RestartPoints(self.ask_restarting, timeout_s)  # and whether stale
        self.last_commit_latency_s = None  # the slowest rank's latest stored commit of the last train() call
        self._resize_cooldown_s = environment.get("SGD_RESIZE_COOLDOWN_S") \
            if resize_cooldown_s is None else resize_cooldown_s

    # ----------------------------------------------------------------- the group
    @property
    def config(self) -> Mapping[str, Any]:
        """The trainer config, read-only, with ``BATCH_SIZE`` as it is divided among the current workers."""
        return types.MappingProxyType(self._config)

    @property
    def num_failures(self) -> int:
        """How many worker failures the calls have recovered from (or met) so far."""
        return self.status.failures

    @property
    def state(self) -> RunState:
        """The run's :class:`~raysgd.torch.execution.run_states.RunState` now."""
        return self.status.state

    def _enter(self, state, why, **changes):
        """Move the run to ``state`` (:func:`~raysgd.torch.execution.run_states.advance`), logged and told to
        ``on_event`` (``("state", old, new, why)``)."""
        old = self.status.state
        self.status = advance(self.status, state, why, **changes)
        if state is not old:
            self.history.append((state, why))
            logger.debug("run: %s -> %s (%s)", old.value, state.value, why)
            self._emit("state", old, state, why)

    def start(self) -> None:
        """Start the first group, then load ``storage_path``'s newest checkpoint (if resuming) and hand the driver-side
        ``components`` their states from its marker. A worker death while starting raises ``RuntimeError`` from the
        :class:`WorkerFailure`."""
        try:
            restarts.start_first_group(self._start_workers, self.group.how_many_fit, self.min_workers,
                                       self.max_workers, self._is_range, environment.get("SGD_PLACEMENT_GROUP_TIMEOUT_S"))
            restored = self.durable.resume(self.load_checkpoint, self._timeout_s)  # storage_path's newest (checked)
            if restored is not None:  # e.g. the result log drops the rows logged after it: they are redone
                stateful.load_state_dicts(self.components, restored.marker)
        except WorkerFailure as err:
            self._enter(RunState.ERRORED, "a worker died while starting")
            raise RuntimeError("Worker startup failed: a worker died while starting (see the cause).") from err
        except BaseException:
            self._enter(RunState.ERRORED, "the start failed")
            raise
        self._enter(RunState.IDLE, f"started {self.group.num_workers} worker(s)", size=self.group.num_workers)

    def worker_config(self, num_workers: int) -> dict:
        """The config each of ``num_workers`` workers gets (the batch size divided among them)."""
        worker_config, effective = self._split(self._requested_config, num_workers,
                                               warn=num_workers not in self._split_warned)
        self._split_warned.add(num_workers)
        self._config = dict(self._requested_config)
        if effective is not None:
            self._config[constants.BATCH_SIZE] = effective
        return worker_config

    def _start_workers(self, num_workers, pg_timeout_s=None):
        """Start ``num_workers`` workers with the batch size divided among them; returns the count."""
        return self.group.start(num_workers, self._operator_cls, self.worker_config(num_workers), pg_timeout_s,
                                initialization_hook=self.initialization_hook)

    def _restart(self, state, max_retries=None, target=None):
        """Restart the group loading ``state`` (a :class:`RestartPoint`, a state dict or its bytes; None for a
        stateless run), which becomes the snapshot; returns the size (see
        :func:`raysgd.torch.execution.restarts.restart_group`)."""
        state = self.as_point(state) if state is not None else None
        started = restarts.restart_group(
            self.group, state, start=lambda n, timeout_s: self._start_workers(n, pg_timeout_s=timeout_s),
            config_for=self.worker_config, operator_cls=self._operator_cls, initialization_hook=self.initialization_hook,
            low=self.min_workers, high=self.max_workers, timeout_s=self._timeout_s, target=target,
            max_retries=max_retries)
        self.points.current = state
        old = self.status.size
        self.status = dataclasses.replace(self.status, size=self.group.num_workers, last_resize=time.monotonic())
        if old != self.status.size:
            self._emit("resize", old, self.status.size)
        return started

    def _emit(self, kind, *args):
        """Tell ``on_event`` (see the class docstring); its error is logged."""
        if self._on_event is None:
            return
        try:
            self._on_event(kind, *args)
        except Exception:  # noqa: BLE001 (an event listener never changes the run)
            logger.warning("The run's event listener raised on %r", kind, exc_info=True)

    def _failed(self, failure, method, retry=0, max_retries=0, gave_up=False):
        self.status = dataclasses.replace(self.status, failures=self.status.failures + 1)
        self._emit("failure", Failure(failure, method, retry, max_retries, gave_up))

    def ensure_workers(self) -> None:
        """Restart a group torn down by a failure (from the last snapshot) before using it."""
        group = self.group  # raises after shutdown()
        if group.broken or group.num_workers == 0:
            if self.points.current is None and not self.stateless:
                raise RuntimeError("The workers were lost and no state snapshot exists to restart them from.")
            before = self.status.state
            self._enter(RunState.RESTARTING, "the workers were lost between calls")
            self._restart(self.points.current)
            self._enter(before if before in (RunState.IDLE, RunState.RUNNING) else RunState.IDLE,
                        f"restarted with {self.group.num_workers} worker(s)")

    @staticmethod
    def as_point(state: RestartPoint | dict | bytes) -> RestartPoint:
        """``state`` (a :class:`RestartPoint`, a state dict or its bytes) as a :class:`RestartPoint` (state the driver
        holds is put into the object store once)."""
        if isinstance(state, (RestartPoint, ShardedPoint)):
            return state
        return RestartPoint.of_bytes(checkpoint.state_to_bytes(state) if isinstance(state, dict) else state)

    def ask_restarting(self, ask, method):
        """``ask()`` (one rank's answer); when every worker was lost between calls, they restart from the last
        restart point (what they trained since is lost: logged, counted as a failure) and are asked again."""
        try:
            return ask()
        except WorkerFailure as failure:
            if not self.group.broken or self.points.current is None:
                raise
            self._failed(failure, method)
            logger.warning("Every worker was lost between calls (%s); restarting them from the state at the start "
                           "of the last call: what they trained since is lost", failure.summary())
            self.ensure_workers()
            return ask()

    def first_answer(self, method: str, *args: Any) -> Any:
        """The group's ``first_answer`` (see :meth:`ask_restarting`)."""
        return self.ask_restarting(lambda: self.group.first_answer(method, *args, deadline_s=self._timeout_s), method)

    def take_snapshot(self) -> Any:
        """The current restart point, taken now when the state moved on (:meth:`RestartPoints.take`)."""
        return self.points.take(self.group)

    def _settle(self, state, fallback=True):
        """``state`` (the call's point) stored and made the restart point (:meth:`RestartPoints.settle`)."""
        return self.points.settle(self.group, state, fallback)

    def _scale_up_target(self, quiet=False):
        """The larger size to restart at now (resources returned, cooldown passed), or None to stay (the resize
        policy's :class:`~raysgd.torch.fault_tolerance.recovery.ResizeDecision`)."""
        current = self.group.num_workers
        if current >= self.max_workers:
            return None
        extra = self.group.how_many_fit(self.max_workers - current)
        logger.debug("scale-up check: %d of %d workers, %d more fit, %.1f s since the last resize", current,
                     self.max_workers, extra, time.monotonic() - self.status.last_resize)
        decision = recovery.grow_decision(current, self.max_workers, extra, time.monotonic(),
                                          self.status.last_resize, self._resize_cooldown_s)
        if decision is None:
            return None
        if not quiet:
            logger.info("Workers: %s", decision.describe())
        return decision.size

    def _move_size(self, ranks):
        decision = recovery.move_decision(self.group.num_workers, len(ranks), self.group.how_many_can_move,
                                          self.min_workers, self.max_workers)
        return None if decision is None else decision.size

    def _resize_between_calls(self, size, why):
        """A planned resize before a call (a grow, a move off draining nodes) from a snapshot of the state now."""
        self._enter(RunState.RESIZING, why)
        self._restart(self.take_snapshot(), target=size)
        self._enter(RunState.IDLE, f"resized to {self.group.num_workers} worker(s)")

    def _move_off_draining(self):
        """Before a call: restart the group off draining nodes from a snapshot of the call's starting state when a
        worker sits on one and the group can move; returns whether it moved."""
        try:
            ranks = restarts.leaving(self.group)
        except Exception as err:  # noqa: BLE001 (a failed check: the node's loss is recovered from as a failure)
            logger.debug("drain check failed: %s", err)
            return False
        if not ranks:
            return False
        size = self._move_size(ranks)
        if size is None:
            logger.warning(DrainWatch.STAY, restarts.describe_draining(ranks))
            return False
        logger.warning("Draining node(s) %s: restarting the workers elsewhere (%d) before the call",
                       restarts.describe_draining(ranks), size)
        self._resize_between_calls(size, "to leave draining nodes")
        return True

    # ----------------------------------------------------------------- calls
    @staticmethod
    def check_max_retries(max_retries: Any) -> None:
        """``max_retries`` of ``train()``/``validate()``: an int >= 0, else ``ValueError``."""
        expect(is_int(max_retries, 0), "max_retries", "an int >= 0", max_retries)

    def run_call(self, method: str, max_retries: Any, kwargs: dict, replay: bool = False,
                 on_tick: Callable | None = None, limits: Any = None) -> list:
        """Run ``method`` on every worker through its attempts (see the module docstring); returns per-worker stats.

        ``kwargs`` go to the group's ``run`` (and the workers' method); ``replay``: the call's input has no data
        cursor (it takes no commits); ``on_tick()`` runs while the group waits for the workers. After a failed
        attempt the :mod:`~raysgd.torch.fault_tolerance.failure_policy` decides: ``max_retries`` failures (or
        preemptions) of this call are recovered from and a user error is raised, or ``limits`` (a
        :class:`~raysgd.torch.fault_tolerance.failure_policy.FailureLimits`) says otherwise (a training function's
        ``FailureConfig``)."""
        if limits is None:
            self.check_max_retries(max_retries)
            limits = failure_policy.FailureLimits(max_failures=max_retries)  # the backoff's cap: SGD_BACKOFF_CAP_S
        self.ensure_workers()
        self.commits.begin_call(method == "train_epoch", replay=replay)  # its store answers during the call (check_store)
        if not self._move_off_draining():
            target = self._scale_up_target()
            if target is not None:
                self._resize_between_calls(target, "to grow")
        state = self.points.begin(self.group)  # the restart point, even with max_retries=0 (for the next call)
        first = dict(kwargs, snapshot=state.plan(self._timeout_s)) if isinstance(state, PendingPoint) else kwargs
        counts = failure_policy.Counts()
        self._enter(RunState.RUNNING, method)
        while True:
            requests: list
            watches, requests = self._watches(), []
            try:
                results = self.group.run(method, on_tick=self._ticks(watches, requests, on_tick, state),
                                         **self.commits.with_plan(first, self.group.rank_nodes(),
                                                                  standby=self.group.spare_nodes()))
                self._settle(state)
                self.points.stale = True  # train and validate (custom ones too) may change the state
                self._take_commit_latency(results)
                finished = self.commits.finish(results)
                self._enter(RunState.IDLE, f"{method} finished")
                return finished
            except WorkerFailure as failure:
                state, first = self._settle(state), kwargs
                stop = next((w for w in watches if w.requested), None)
                if stop is not None and stops.was_resize(failure):
                    self._enter(RunState.RESIZING, f"stopped at a commit point {stop.reason}")
                    counts = failure_policy.decide(failure_policy.RESIZE, counts, limits).counts  # its commit: progress
                    logger.debug("Restarting at %d workers from the commit point (%s)", stop.size, stop.reason)
                    self._restart_in_call(state, kwargs, failure, stop.size)
                    self._enter(RunState.RUNNING, f"{method} goes on at {self.group.num_workers} worker(s)")
                    continue
                kind = failure_policy.PREEMPTION if stops.was_preempted(failure) else failure_policy.FAILURE
                decision = self._decide(kind, counts, limits, failure, method)
                if decision.gave_up:
                    self._enter(RunState.ERRORED, f"{method}: {decision.describe()}")
                    raise RuntimeError(f"Training run failed: {method} did not succeed after {decision.limit} "
                                       f"retries; the last failure is the cause.") from failure
                counts = decision.counts
                self._enter(RunState.RESTARTING, f"{method}: {decision.describe()}")
                logger.warning("%s failed (%s); restarting workers, retry %d of %s", method, failure.summary(),
                               decision.retry, "any" if decision.limit == failure_policy.UNLIMITED else decision.limit)
                self._restart_in_call(state, kwargs, failure, None, decision.delay_s)
                self._enter(RunState.RUNNING, f"{method} again on {self.group.num_workers} worker(s)")
            except Exception as error:
                if not limits.retry_user_errors:
                    self._enter(RunState.ERRORED, f"{method} raised {type(error).__name__}")
                    state = self._settle(state, fallback=False)  # a call that failed before its capture changed nothing
                    if method == "train_epoch" and state is not None:
                        self._undo_partial_call(state)
                    raise
                decision = self._decide(failure_policy.USER_ERROR, counts, limits, error, method)
                if decision.gave_up:
                    self._enter(RunState.ERRORED, f"{method}: {decision.describe()}")
                    raise
                counts, first = decision.counts, kwargs
                self._enter(RunState.RESTARTING, f"{method}: {decision.describe()}")
                logger.warning("%s raised (%s: %s); restarting it from the latest commit, retry %d of %s", method,
                               type(error).__name__, error, decision.retry,
                               "any" if decision.limit == failure_policy.UNLIMITED else decision.limit)
                self._restart_in_call(state, kwargs, error, self.group.num_workers or None, decision.delay_s)
                self._enter(RunState.RUNNING, f"{method} again on {self.group.num_workers} worker(s)")

    def _decide(self, kind, counts, limits, error, method):
        """The failure policy's decision after ``error`` of ``kind`` (counted and told to ``on_event``)."""
        progressed = self.commits.committed_this_attempt() is not None if self.commits.active else False
        decision = failure_policy.decide(kind, counts, limits, progressed=progressed)
        self._failed(error, method, decision.retry, decision.limit, gave_up=decision.gave_up)
        logger.debug("failure policy: %s -> %s", kind, decision)
        return decision

    def _take_commit_latency(self, results):
        """Take the workers' commit latencies out of their results (``COMMIT_LATENCY``): a commit is complete once
        every rank stored its record, so the slowest rank's is the call's ``last_commit_latency_s`` (kept when no
        rank stored one during the call)."""
        latencies = [r.pop(constants.COMMIT_LATENCY, None) for r in results if isinstance(r, dict)]
        latencies = [seconds for seconds in latencies if seconds is not None]
        if latencies:
            self.last_commit_latency_s = max(latencies)

    def _watches(self):
        """The watches of the next attempt: to grow (below the largest size) and to leave draining nodes, only while
        the call commits."""
        if not self.commits.active:
            return []
        watches: list[StopWatch] = []
        if self.group.num_workers < self.max_workers:
            watches.append(GrowWatch(lambda: self._scale_up_target(quiet=True), self.commits.committed_this_attempt))
        watches.append(DrainWatch(lambda: restarts.leaving(self.group), self._move_size,
                                  self.commits.running_attempt, describe=restarts.describe_draining))
        return watches

    def _ticks(self, watches, requests, on_tick, state):
        """The group's ``on_tick`` for an attempt: the store's answer to the call's start read once there (a lost store
        replaced), the call's point (``state``) made the restart point once stored
        (the previous one's bytes freed then); each watch's decision becomes a request to the ranks to stop, asked
        again while unanswered; then the caller's ``on_tick``."""
        def tick():
            self.commits.check_store()
            self.points.settle_if_stored(state)
            for request in list(requests):  # sent at an earlier tick: ask again where unanswered
                request.tick()
            for watch in watches:
                stop = watch.tick()
                if stop is not None:
                    requests.append(restarts.StopRequest(self.group, stop).send())
            if on_tick is not None:
                on_tick()

        return tick

    def _restart_in_call(self, state, kwargs, failure, size, delay_s=0.0):
        """Restart for the rest of the call: from its latest commit (or its start, ``state``), at ``size`` (a resize)
        or as many as fit (a failure: a preemption commit goes to ``storage_path`` too), after ``delay_s`` (the
        failure policy's backoff)."""
        if delay_s:
            logger.warning("Waiting %.0f s before restarting (failures in a row without progress)", delay_s)
            time.sleep(delay_s)
        try:
            resumed = self.commits.restart_state(kwargs)  # the latest commit (a RestartPoint), or None
            if size is None and resumed is not None:
                epoch = resumed.overlay[training_state.CURSOR]["epoch"]
                self.durable.on_recovery(failure, lambda: self._part_of(resumed), epoch=epoch,
                                         preempted=self.commits.resumed_preemption, states=self.component_states)
            try:
                self._restart(resumed if resumed is not None else state, target=size)
            except RestartPointLost as lost:
                if resumed is None:
                    raise
                logger.warning("The commit's state is lost on every node that held it (%s); the call restarts from "
                               "its start instead", lost)
                self.commits.abandon_restart(kwargs)
                self._restart(state, target=size)
            self.points.current = state  # a commit is a restart point inside this call only
        except recovery.RestartGaveUp as err:
            self._enter(RunState.ERRORED, f"the workers could not be restarted ({err})")
            raise RuntimeError(f"Training run failed: the workers could not be restarted ({err}).") from failure

    def _undo_partial_call(self, state):
        """After user code raised mid-call, put the workers back to the call's starting state."""
        try:  # a torn-down group restarts from the snapshot at the next call
            if not self.group.broken:
                self.group.run("load_restart_point", *state.load_args(), deadline_s=self._timeout_s)
        except Exception as err:  # noqa: BLE001 (the user's error is the one to raise)
            logger.warning("Could not restore the state after a failed call: %s", err)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Run ``method`` everywhere (outside train/validate); a lost worker restarts from the last snapshot at the
        next call."""
        self.ensure_workers()
        self.take_snapshot()  # a current restart point before anything can change the state
        try:
            result = self.group.run(method, *args, **kwargs)
            self.points.stale = True
            return result
        except WorkerFailure as failure:
            self._failed(failure, method, gave_up=True)
            raise RuntimeError(f"{method} failed: a worker was lost (it restarts at the next call).") from failure

    def take_traces(self) -> dict[int, bytes]:
        """``{rank: trace bytes}`` of the last call recorded with ``trace=True``, from every rank that has one (a
        rank replaced during the call has none)."""
        answers = self.group.answers("take_trace", deadline_s=self._timeout_s)
        return {rank: trace for rank, trace in answers.items() if trace is not None}

    # ----------------------------------------------------------------- the end
    def shutdown(self, force: bool = False) -> None:
        """Stop the workers (their resources are free when it returns, bounded); the group is gone afterwards."""
        group, self.group = self.group, ShutDownGroup()  # type: ignore[assignment]  # a stand-in: each use raises
        if not isinstance(group, ShutDownGroup):
            try:
                group.shutdown(force=force)
            finally:
                self._enter(RunState.FINISHED, "shut down")

    def close(self) -> None:
        """Close the durable run (waiting for its last upload, at most ``SGD_CHECKPOINT_FLUSH_S``) and the commit
        store; the durable run's failure, if any, is raised once both are closed."""
        upload_error = None
        for name, part in (("_durable", self.durable), ("_commits", self.commits)):
            try:
                part.close()
            except Exception as err:  # noqa: BLE001 (close the other anyway)
                logger.warning("Closing %s at shutdown failed: %s", name, err)
                upload_error = err if name == "_durable" else upload_error
        if upload_error is not None:
            raise upload_error
