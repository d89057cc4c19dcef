"""The worker pool: placement group, actors, rendezvous, fan-out under deadlines, failure detection, shutdown.

Layer 5: with :mod:`~raysgd.torch.execution.worker_handle`, the only module that touches Ray actor handles. Each
round of calls is collected by :func:`raysgd.torch.execution.calls.collect`, whose outcome the group acts on: a
dead actor, a lost node or a collective that timed out ends the attempt at once as
:class:`~raysgd.torch.errors.WorkerFailure`: ranks still stuck are killed, those whose call ended are kept for a
re-formed group. An exception raised by user code is re-raised with its original type. Re-forming the group from
its survivors after a failure, and a planned resize (a drain move, a grow) keeping the ranks on healthy nodes, are
:mod:`~raysgd.torch.execution.regrouping`'s (a part of this class, in its own module).

Example:
    >>> # group = WorkerGroup(worker_options, num_cpus_per_worker=1, num_gpus=0, use_local=False, timeout_s=60)
    >>> # group.start(2, operator_cls, config); group.run("train_epoch"); group.shutdown()
"""
from __future__ import annotations

import logging

import ray

from raysgd.base import environment
from raysgd.torch.errors import WorkerFailure, is_peer_gone
from raysgd.torch.execution import calls as _calls
from raysgd.torch.execution import cluster_state, diagnostics, placement, worker_handle
from raysgd.torch.execution import local_runner
from raysgd.torch.execution.local_runner import LocalRunner
from raysgd.torch.execution.placement import Placement
from raysgd.torch.execution.regrouping import Regrouping
from raysgd.torch.execution.spares import SparePool
from raysgd.torch.execution.worker import TorchWorker
from raysgd.torch.execution.worker_handle import Handle, start_actor
from raysgd.torch.fault_tolerance import recovery, reform
from typing import Any, Callable, Iterable

logger = logging.getLogger(__name__)


class WorkerGroup(Regrouping):
    """``num_workers`` replicas: rank 0 optionally in the driver, the rest Ray actors in one placement group.

    Args:
        worker_options: keyword arguments for every :class:`TorchWorker` (backend, fp16, ...).
        num_cpus_per_worker, num_gpus: resources of each worker (``num_gpus`` may be a fraction of one GPU).
        use_local: run rank 0 in this process.
        timeout_s: process-group timeout; also how long the rest may lag once one worker finished.
        placement_strategy: of the placement group this group creates (not used inside a Tune trial).
        worker_cls: the class each worker is (:class:`TorchWorker`, or a subclass with the same start-up methods,
            such as :class:`raysgd.train.function_worker.FunctionWorker`).
        num_spares: warm spares kept beside the workers, each in a bundle of the group's placement group (see
            :mod:`raysgd.torch.execution.spares`); none inside a Tune trial (logged).
    """

    _extra: list[tuple[Any, int]]  # (set in __init__: typed here)
    _nodes: list[str]
    _submitted: dict[int, Any] | None

    def __init__(self, worker_options: dict[str, Any], *, num_cpus_per_worker: float = 1, num_gpus: float = 0,
                 use_local: bool = False, timeout_s: float = 1800, placement_strategy: str = "SPREAD",
                 worker_cls: type = TorchWorker, num_spares: int = 0) -> None:
        self._worker_cls = worker_cls
        self._worker_options, self._cpus, self._gpus = worker_options, num_cpus_per_worker, num_gpus
        self._use_local, self._timeout_s = use_local, timeout_s
        self._placement = Placement(num_cpus_per_worker, self._gpus, use_local, placement_strategy)
        self._handles = []
        self._kept = []  # survivors of a failure, waiting for reform() (or the next start, which kills them)
        self._pg, self._own_pg = None, False
        self._extra = []  # [(placement group, bundles)] added by partial moves and grows; (None, n) once removed
        self._submitted = None
        self._runner = None  # rank 0's thread (use_local with remote ranks)
        self.broken = False
        self.generation = 0  # counts start(): per-rank inputs built for one generation die with it
        self._nodes = []  # each rank's node id, learnt at the rendezvous
        self._beside_answer = None  # rank 0's answer of the latest call beside a call (the call-start snapshot)
        self._setup_report: dict[str, Any] = {}  # what rank 0 told when its operator was set up
        self._num_spares, self._spares = num_spares, SparePool(start=None, hook=None)
        self._rank_bundles = []  # each rank's bundle, in rank order (a spare that took a rank keeps its own)

    @property
    def num_workers(self) -> int:
        return len(self._handles)

    @property
    def remote_workers(self) -> list:
        """The actor handles (1.x name)."""
        return [h.actor for h in self._handles if h.actor is not None]

    @property
    def local_worker(self) -> TorchWorker | None:
        """The :class:`TorchWorker` living in the driver (``use_local``), else None."""
        return self._handles[0].local if self._handles and self._handles[0].local is not None else None

    @property
    def worker_cls(self) -> type:
        """The class each worker is (:class:`TorchWorker`, or a subclass such as a training function's worker)."""
        return self._worker_cls

    @property
    def setup_report(self) -> dict:
        """What rank 0 told when its operator was set up: its strategy's word on the state (a :class:`TorchWorker`:
        ``{"sharded_state": bool}``); empty before the group started, or for a worker class that tells nothing."""
        return dict(self._setup_report)

    @property
    def spares(self) -> SparePool:
        """The :class:`~raysgd.torch.execution.spares.SparePool` of the running group (empty without spares)."""
        return self._spares

    def how_many_fit(self, limit: int, settle_s: float = 0.0) -> int:
        """How many workers fit now, at most ``limit`` (:meth:`Placement.how_many_fit`), plus the group's own
        placed bundles no worker or spare uses (a lost node's, placed again): growing frees them."""
        used = {h.bundle for h in self._handles} | self._spares.bundles
        spare = placement.spare_bundles(self._bundles(), used) if self._own_pg and not self.broken else 0
        own = self._bundles() if self._own_pg and not self.broken else None
        return min(limit, spare + self._placement.how_many_fit(max(0, limit - spare), settle_s, own_pg=own))

    def rank_nodes(self) -> list[str]:
        """The node id of each rank of the running group, in rank order (empty before it started)."""
        return list(self._nodes) if not self.broken else []

    def spare_nodes(self) -> list[str]:
        """The node ids of the ready warm spares (none while the group is broken)."""
        return self._spares.nodes() if not self.broken else []

    def placed_on(self) -> dict[int, str]:
        """``{rank: node id}`` of the remote workers a restart could place elsewhere (none inside a Tune trial)."""
        return placement.nodes_of(self._bundles(), self._handles) if self._own_pg and not self.broken else {}

    def _bundles(self):
        """The bundles of the group's placement groups, numbered as one list (:class:`placement.Bundles`)."""
        return placement.Bundles([(self._pg, len(self._pg.bundle_specs))] + self._extra if self._pg is not None else [])

    def _start_in(self, rank, bundle, operator_cls, config, options):
        """A new worker actor in ``bundle`` (a number of :meth:`_bundles`)."""
        pg, index = self._bundles().locate(bundle)
        handle = start_actor(rank, pg, index, self._cpus, self._gpus, operator_cls, config, options, self._worker_cls)
        handle.bundle = bundle
        return handle

    # ----------------------------------------------------------------- start-up
    def start(self, n: int, operator_cls: type | Callable, config: dict, pg_timeout_s: float | None = None,
              initialization_hook: Callable | None = None) -> int:
        """Start ``n`` workers running ``operator_cls(config)``; raises WorkerFailure if one dies meanwhile.

        ``initialization_hook`` runs on every worker before the process group is set up.
        """
        if self._handles:
            raise RuntimeError("WorkerGroup.start called on a running group; shut it down first")
        if self._kept or self._pg is not None:  # survivors, or spares, of a group that did not re-form
            self._kill_all()
        pg_timeout_s = environment.get("SGD_PLACEMENT_GROUP_TIMEOUT_S") if pg_timeout_s is None else pg_timeout_s
        self.broken = False
        self.generation += 1
        spares = self._spares_that_fit(n)
        try:
            self._pg, offset, self._own_pg = self._placement.reserve(
                n, min(pg_timeout_s, recovery.placement_try_s()) if spares else pg_timeout_s, spares)
        except TimeoutError as err:
            if not spares:
                raise
            logger.warning("%d workers and %d spare(s) could not be placed (%s); starting without spares", n, spares,
                           err)
            spares = 0
            self._pg, offset, self._own_pg = self._placement.reserve(n, pg_timeout_s)
        options = dict(self._worker_options, num_cpus=self._cpus, world_size=n)
        for rank in range(n):
            if rank == 0 and self._use_local:
                local = self._worker_cls(operator_cls, config, is_local=True, **options)
                self._runner = LocalRunner() if n > 1 else None  # the driver watches the others meanwhile
                self._handles.append(Handle(0, local=local, runner=self._runner))
                continue
            self._handles.append(start_actor(rank, self._pg, offset + rank, self._cpus, self._gpus, operator_cls,
                                             config, options, self._worker_cls))
        self.run("run_hook", initialization_hook, deadline_s=self._timeout_s + 60,
                 on_tick=self._placement.watch.check if self._placement.watch is not None else None)
        self._connect(n)
        self._rank_bundles = [h.bundle for h in self._handles]
        self._spares = SparePool(lambda bundle: self._start_in(None, bundle, operator_cls, config, options),
                                 initialization_hook)
        self._spares.fill(range(offset + n, offset + n + spares))
        logger.debug("Started %d worker(s)%s%s", n, " (rank 0 local)" if self._use_local else "",
                    f" and {spares} warm spare(s) beside them" if spares else "")
        return n

    def _spares_that_fit(self, n):
        """How many of ``num_spares`` to reserve bundles for beside ``n`` workers: none in a Tune trial's placement
        group (logged), else as many as fit now (fewer logged)."""
        if not self._num_spares:
            return 0
        if self._placement.in_trial():
            logger.warning("num_spares=%d is ignored inside a Tune trial: its placement group holds the trial's "
                           "workers only (a dead rank is replaced by a new process)", self._num_spares)
            return 0
        fit = max(0, min(self._num_spares, self._placement.how_many_fit(n + self._num_spares) - n))
        if fit < self._num_spares:
            logger.warning("Only %d of num_spares=%d fit beside %d workers now; the group runs with %d (the next "
                           "restart of every worker tries again)", fit, self._num_spares, n, fit)
        return fit

    def _connect(self, n):
        """Rendezvous (the process group) and each rank's operator."""
        deadline = self._timeout_s + 60
        if n > 1:
            url = self._collect({0: self._handles[0].call("setup_address")}, deadline_s=deadline)[0]
            self._collect({h.rank: h.call("setup_process_group", url, h.rank, n, self._timeout_s)
                           for h in self._ordered()}, deadline_s=deadline)
        places = self.run("place", deadline_s=deadline)
        ips, self._nodes = [ip for ip, _ in places], [node for _, node in places]
        local_ranks = [ips[:rank].count(ip) for rank, ip in enumerate(ips)]
        reports = self._collect({h.rank: h.call("setup_operator", local_ranks[h.rank]) for h in self._ordered()})
        self._setup_report = dict(reports[0] or {}) if reports else {}

    # ----------------------------------------------------------------- calls
    def run(self, method: str, *args: Any, deadline_s: float | None = None, on_tick: Callable | None = None,
            lockstep: bool = False, rank_kwargs: Callable[[int], dict[int, dict]] | None = None,
            **kwargs: Any) -> list:
        """Call ``method`` on every worker and return the results in rank order.

        Remote calls are sent first, then the local worker's (in its own thread when remote ranks run
        beside it, so this thread keeps watching them; in this thread when it is alone). With ``lockstep``
        (train and validate), the others must finish within ``timeout_s`` of the first.
        ``rank_kwargs(num_workers)``, if given, returns one dict of extra keyword arguments per rank
        (e.g. each rank's data shard); it is called for every run, so a retry gets fresh ones.
        """
        self._drain_submitted()
        handles = self._ordered()
        extra = rank_kwargs(len(handles)) if rank_kwargs is not None else None
        calls = {h.rank: h.call(method, *args, **kwargs, **(extra[h.rank] if extra else {})) for h in handles}
        self._tend_spares()
        ticks = self._tend_spares if on_tick is None else lambda: (self._tend_spares(), on_tick())
        return self._collect(calls, deadline_s=deadline_s, on_tick=ticks, lockstep=lockstep)

    def _tend_spares(self):
        """The spares' upkeep (:meth:`SparePool.tend`): never waits, and its errors never end a call."""
        try:
            self._spares.tend()
        except Exception as err:  # noqa: BLE001 (the spares are a help, never a reason to fail)
            logger.warning("Tending the spares failed: %s: %s", type(err).__name__, err)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> None:
        """Call ``method`` on every worker without waiting; errors surface at the next :meth:`run`."""
        self._drain_submitted()
        self._submitted = {h.rank: h.call(method, *args, **kwargs) for h in self._ordered()}

    def first_answer(self, method: str, *args: Any, deadline_s: float | None = None, with_data: bool = False,
                     **kwargs: Any) -> Any:
        """Call ``method`` on rank 0, or the next rank while the ones before are dead; returns one result, or with
        ``with_data`` (``method`` returning ``(answer, data)``) ``(answer, data ref)`` (:meth:`Handle.call_with_data`:
        the data stays in that worker's node's object store, unfetched).

        Dead workers are skipped here and not torn down (the next :meth:`run` finds them). Raises
        :class:`WorkerFailure` when no rank answers (the group is then broken).
        """
        self._drain_submitted()
        lost = {}
        for handle in self._handles:
            call, data = handle.call_with_data(method, *args, **kwargs) if with_data else \
                (handle.call(method, *args, **kwargs), None)
            value, error = handle.answer(call, deadline_s)
            if error is None:
                return (value, data) if with_data else value
            lost[handle.rank] = error
        self.broken = True  # every rank is gone: the next call restarts the group
        raise WorkerFailure(f"no worker answered {method}", {r: _calls.describe(e) for r, e in lost.items()})

    def run_with_data(self, method: str, *args: Any, deadline_s: float | None = None) -> list[tuple[Any, Any]]:
        """``[(answer, data ref)]`` in rank order of ``method`` called on every rank at once (a collective), each
        returning ``(answer, data)`` (:meth:`Handle.call_with_data`: the data stays in its worker's node's object
        store, unfetched). A lost rank ends it as :meth:`run` does."""
        self._drain_submitted()
        calls = {h.rank: h.call_with_data(method, *args) for h in self._ordered()}
        answers = self._collect({rank: call for rank, (call, _) in calls.items()}, deadline_s=deadline_s)
        return [(answer, calls[rank][1]) for rank, answer in enumerate(answers)]

    def call_beside(self, method: str, *args: Any, every_rank: bool = False) -> list[tuple[Any, Any, Any]] | None:
        """Start ``method`` (returning ``(answer, data)``) on rank 0, or on every rank, in the workers'
        ``"snapshot"`` concurrency group beside the running call, without waiting: ``[(answer ref, data ref, node)]``
        in rank order, or None where nothing can run beside a call: a local rank 0 (it runs in the driver), or a
        broken or empty group. Before a failed call's workers are killed, rank 0's answer is given
        ``SGD_SNAPSHOT_FINISH_S`` (default 120 s) to arrive (:meth:`_let_beside_finish`)."""
        if self.broken or not self._handles or self._handles[0].local is not None:
            return None
        self._drain_submitted()
        handles = self._handles if every_rank else self._handles[:1]
        calls = [handle.call_with_data(method, *args, group=diagnostics.SNAPSHOT_GROUP) for handle in handles]
        self._beside_answer = calls[0][0]
        return [(answer, data, self._nodes[rank] if rank < len(self._nodes) else None)
                for rank, (answer, data) in enumerate(calls)]

    def survivor_answer(self, method: str, *args: Any, deadline_s: float | None = None) -> tuple[Any, Any] | None:
        """``(answer, data ref)`` of ``method`` (as :meth:`run_with_data`'s) from the first survivor of a failure, kept
        for :meth:`reform`, that answers it; None when none does."""
        for handle in self._kept:
            call, data = handle.call_with_data(method, *args)
            try:
                answer, error = handle.answer(call, deadline_s)
            except Exception as err:  # noqa: BLE001 (this survivor cannot answer: try the next)
                logger.debug("rank %d did not answer %s: %s", handle.rank, method, err)
                continue
            if error is None:
                return answer, data
        return None

    def _let_beside_finish(self):
        """Before a failed call's workers are killed (a failure, or a user error leaving the others stuck): give rank
        0's call beside it (:meth:`call_beside`: the call-start snapshot, the restart point) time to finish (at most
        ``SGD_SNAPSHOT_FINISH_S``, default 120 s)."""
        answer, self._beside_answer = self._beside_answer, None
        if answer is not None:
            ray.wait([answer], timeout=environment.get("SGD_SNAPSHOT_FINISH_S"))

    def answers(self, method: str, *args: Any, deadline_s: float | None = None, **kwargs: Any) -> dict[int, Any]:
        """``{rank: result}`` of ``method`` from every rank that answers (sent to all at once); like
        :meth:`first_answer`, dead or silent ranks are left out, not torn down."""
        self._drain_submitted()
        calls = [(handle, handle.call(method, *args, **kwargs)) for handle in self._handles]
        found = {handle.rank: handle.answer(call, deadline_s) for handle, call in calls}
        return {rank: value for rank, (value, error) in found.items() if error is None}

    def _ordered(self):
        if self.broken:
            raise RuntimeError("the worker group was torn down after a failure; it must be restarted")
        return list(reversed(self._handles))  # the local rank 0 runs last: it blocks this thread

    def _drain_submitted(self):
        submitted, self._submitted = self._submitted, None
        if submitted:
            self._collect(submitted, deadline_s=self._timeout_s)

    def _collect(self, calls, deadline_s=None, on_tick=None, lockstep=False):
        """Wait for every call (:func:`~raysgd.torch.execution.calls.collect`) and act on the outcome: the results in
        rank order, the user error raised (ranks stuck waiting for the failed one killed first), or a failure: the
        group is killed but for the survivors kept for :meth:`reform`, and :class:`WorkerFailure` raised. Ctrl-C
        stops every worker."""
        try:
            outcome = _calls.collect(calls, timeout_s=self._timeout_s, deadline_s=deadline_s, on_tick=on_tick,
                                     lockstep=lockstep,
                                     survivor_grace_s=reform.survivor_grace_s() if self._can_keep() else None)
        except KeyboardInterrupt:
            logger.warning("Interrupted: stopping the workers (the next call restarts them)")
            self._kill_all()
            raise
        if outcome.kind == _calls.DONE:
            return outcome.results
        if outcome.kind == _calls.USER_ERROR:
            if outcome.stuck:  # the others are stuck waiting for the failed rank
                self._let_beside_finish()
                self._kill_all()
            raise outcome.error
        return self._fail(outcome.failures, outcome.unanswered, outcome.cause, outcome.message, outcome.keep)

    def _can_keep(self):
        return self._own_pg and reform.enabled()

    def _fail(self, failures, unresponsive, cause, message, keep=()):
        stacks = {}
        if unresponsive:  # where is everyone? taken before the kill, while they are stuck
            peer_gone = failures and all(is_peer_gone(err) for err in failures.values())
            try:
                stacks = self.stack_traces(diagnostics.PEER_GONE_STACK_TIMEOUT_S if peer_gone else
                                           diagnostics.STACK_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 (the failure matters more than its forensics)
                stacks = {rank: f"no stack: {type(err).__name__}: {err}" for rank in unresponsive}
        dead = [rank for rank in unresponsive if stacks.get(rank) == diagnostics.DEAD]  # reported meanwhile
        unresponsive = [rank for rank in unresponsive if rank not in dead]
        self._let_beside_finish()
        self._kill_all(keep, spares_stay=self._can_keep() and self._spares.available() > 0)
        descriptions = {rank: _calls.describe(err) for rank, err in failures.items()}
        descriptions.update({rank: "worker process died (found while the stacks were taken)" for rank in dead})
        failure = WorkerFailure(message, descriptions, unresponsive, stacks)
        logger.log(logging.WARNING if failure.stacks else logging.DEBUG,  # the controller logs the failure's summary
                   "Ending the attempt: %s", failure)
        raise failure from (cause if isinstance(cause, BaseException) else None)  # a timeout's cause is text

    def request_resize(self, call_id: Any, attempt: int, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """Ask every rank (or ``ranks``) to end the call at its next agreed commit point; ``{rank: call}``, unread."""
        return {h.rank: h.control("request_resize", call_id, attempt) for h in list(self._handles)
                if ranks is None or h.rank in ranks}

    def poll_first(self, method: str, pending: Any = None) -> tuple[Any, Any]:
        """Ask rank 0 ``method`` beside its running call (its ``"control"`` concurrency group), never waiting:
        ``(value, pending)`` where ``value`` is the answer to ``pending`` (the previous ask) once it arrived, else
        None, and ``pending`` the ask now outstanding (a new one once the previous was answered or lost); ``(None,
        None)`` while the group is broken or empty. A training function's reports reach the driver this way."""
        if self.broken or not self._handles:
            return None, None
        if pending is not None:
            state = worker_handle.answered(pending)
            if state is None:
                return None, pending
            value = (pending.value if isinstance(pending, _calls.Done) else ray.get(pending, timeout=0)) \
                if state else None
            return value, self._handles[0].control(method)
        return None, self._handles[0].control(method)

    def stack_traces(self, timeout_s: float | None = diagnostics.STACK_TIMEOUT_S) -> dict[int, str]:
        """``{rank: text}``: every rank's Python stacks now (callable from another thread while a call runs);
        remote ranks answer from their ``"control"`` concurrency group, or py-spy dumps them (same machine)."""
        return diagnostics.gather_stacks({h.rank: h.stacks_request() for h in list(self._handles)}, timeout_s)

    # ----------------------------------------------------------------- teardown
    def _kill_all(self, keep=(), spares_stay=False):
        """Kill every worker but the ranks in ``keep`` (kept for :meth:`reform`); the placement group (and the spares
        in it) stays for them, or with ``spares_stay`` for the spares to re-form the group alone."""
        handles = [h for h in self._handles if h.rank not in keep] + self._kept
        self._kept, self._handles = [h for h in self._handles if h.rank in keep], []
        self._submitted = None
        self.broken = True
        for handle in sorted(handles, key=lambda h: h.local is not None):  # remote ranks first: closing their
            if handle.runner is not None:  # connections ends rank 0's collective, so its thread can end
                self._runner = None
                handle.runner.stop(local_runner.STOP_S)
            try:
                handle.kill()
            except Exception as err:  # noqa: BLE001 (already gone)
                logger.debug("kill rank %d: %s", handle.rank, err)
        if not self._kept and not spares_stay:
            self._remove_pg()

    def _remove_pg(self):
        self._spares.clear()
        pgs, self._pg, self._extra = [self._pg, *(pg for pg, _ in self._extra)], None, []
        for pg in pgs:
            if pg is not None and self._own_pg:
                Placement.remove(pg)

    def shutdown(self, force: bool = False) -> None:
        """Stop every worker (gracefully unless ``force``) and release the placement group.

        Whatever fails on the way (a pending non-blocking call that raised, a dead worker), every actor
        is killed and the placement group removed; it returns once Ray shows them released (bounded
        wait), so ``ray.available_resources()`` right after counts them free.
        """
        actor_ids = [h.actor._actor_id.hex() for h in self._handles + self._kept if h.actor is not None]
        actor_ids += [actor._actor_id.hex() for actor in self._spares.actors]
        pgs = [pg for pg in [self._pg, *(pg for pg, _ in self._extra)] if pg is not None] if self._own_pg else []
        before = ray.available_resources() if pgs else {}
        held = cluster_state.held_by([bundle for pg in pgs if pg is self._pg or placement.placed(pg)  # a refill's
                                      for bundle in pg.bundle_specs])  # group may still wait for room
        try:
            if self._handles and not force and not self.broken:
                self.run("shutdown", deadline_s=environment.get("SGD_SHUTDOWN_TIMEOUT_S"))
        except Exception as err:  # noqa: BLE001 (a pending call's error must not stop the release)
            logger.warning("Graceful shutdown failed (%s: %s); killing the workers", type(err).__name__, err)
        finally:
            self._kill_all()
            self.broken = False
            if actor_ids or pgs:
                cluster_state.wait_until_released(
                    actor_ids, [pg.id.hex() for pg in pgs],
                    {key: before.get(key, 0) + amount for key, amount in held.items()},
                    timeout_s=environment.get("SGD_SHUTDOWN_TIMEOUT_S"))

