"""The worker pool: placement group, actors, rendezvous, fan-out under deadlines, failure detection, shutdown.

Layer 4: the only module that touches Ray actor handles. A dead actor, a lost node or a collective
that timed out ends the attempt at once as :class:`~raysgd.torch.errors.WorkerFailure` (the whole
group is killed, since survivors may be stuck in a collective); an exception raised by user code is
re-raised with its original type.

Example:
    >>> # group = WorkerGroup(worker_options, num_cpus_per_worker=1, use_gpu=False, use_local=False, timeout_s=60)
    >>> # group.start(2, operator_cls, config); group.run("train_epoch"); group.shutdown()
"""
import logging
import os
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysgd.torch import constants, placement, recovery
from raysgd.torch.errors import CollectiveError, WorkerFailure
from raysgd.torch.worker import TorchWorker

logger = logging.getLogger(__name__)

_TICK_S = 0.5
_USER_ERROR_GRACE_S = 2.0
_CAUSE_GRACE_S = 1.0
_RemoteWorker = None


def _remote_worker_cls():
    global _RemoteWorker
    if _RemoteWorker is None:
        _RemoteWorker = ray.remote(TorchWorker)
    return _RemoteWorker


def _legacy_runtime_env():
    """Actor options carrying ``raysgd.compat``'s flag, so actors map ``ray.util.sgd`` imports too."""
    if os.environ.get(constants.LEGACY_IMPORTS_ENV) != "1":
        return {}
    return {"runtime_env": {"env_vars": {constants.LEGACY_IMPORTS_ENV: "1"}}}


class _Done:
    """A call the local worker already finished: its value or its exception."""

    def __init__(self, fn):
        try:
            self.value, self.error = fn(), None
        except Exception as err:  # noqa: BLE001 (sorted out by the caller, like a remote result)
            self.value, self.error = None, err


class _Handle:
    """A worker as the group sees it: ``call`` returns an ObjectRef (actor) or a :class:`_Done` (local)."""

    def __init__(self, rank, actor=None, local=None):
        self.rank, self.actor, self.local = rank, actor, local

    def call(self, method, *args, **kwargs):
        if self.local is not None:  # resolve ObjectRef arguments as Ray does for actors
            args = [ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args]
            return _Done(lambda: getattr(self.local, method)(*args, **kwargs))
        return getattr(self.actor, method).remote(*args, **kwargs)

    def kill(self):
        if self.local is not None:
            self.local.shutdown()
        else:
            ray.kill(self.actor, no_restart=True)


class WorkerGroup:
    """``num_workers`` replicas: rank 0 optionally in the driver, the rest Ray actors in one placement group.

    Args:
        worker_options: keyword arguments for every :class:`TorchWorker` (backend, fp16, ...).
        num_cpus_per_worker, use_gpu: resources of each worker.
        use_local: run rank 0 in this process.
        timeout_s: process-group timeout; also how long the rest may lag once one worker finished.
        placement_strategy: of the placement group this group creates (not used inside a Tune trial).
    """

    def __init__(self, worker_options, *, num_cpus_per_worker=1, use_gpu=False, use_local=False, timeout_s=1800,
                 placement_strategy="SPREAD"):
        self._worker_options = worker_options
        self._cpus = num_cpus_per_worker
        self._gpus = 1 if use_gpu else 0
        self._use_local = use_local
        self._timeout_s = timeout_s
        self._strategy = placement_strategy
        self._handles = []
        self._pg = None
        self._own_pg = False
        self._submitted = None
        self._watch = None  # a placement.TrialPlacementWatch on the Tune trial's group
        self.broken = False
        self.generation = 0  # counts start(): per-rank inputs built for one generation die with it

    @property
    def num_workers(self):
        return len(self._handles)

    @property
    def remote_workers(self):
        """The actor handles (1.x name)."""
        return [h.actor for h in self._handles if h.actor is not None]

    @property
    def local_worker(self):
        """The :class:`TorchWorker` living in the driver (``use_local``), else None."""
        return self._handles[0].local if self._handles and self._handles[0].local is not None else None

    # ----------------------------------------------------------------- placement
    def _bundle(self, rank):
        bundle = {"CPU": self._cpus}
        if self._gpus:
            bundle["GPU"] = self._gpus
        if rank == 0 and self._use_local:
            bundle[f"node:{ray.util.get_node_ip_address()}"] = 0.001  # rank 0 is this process: this node
        return bundle

    def _placement(self, n, pg_timeout_s):
        """``(placement group, first bundle index)`` for ranks 0..n-1: the Tune trial's group, or a new one."""
        trial_pg = get_current_placement_group()
        if trial_pg is not None:
            offset = 0 if self._use_local else 1  # bundle 0 is the trainable (which is rank 0 with use_local)
            if len(trial_pg.bundle_specs) < offset + n:
                raise ValueError(f"The enclosing placement group has {len(trial_pg.bundle_specs)} bundles; "
                                 f"{n} workers need {offset + n}. Use TorchTrainer.as_trainable's resource request.")
            self._watch = placement.TrialPlacementWatch(trial_pg)  # a lost node's bundles: fail, Tune restores
            self._watch.wait()
            return trial_pg, offset, False
        total = ray.cluster_resources()
        if total.get("CPU", 0) < n * self._cpus or total.get("GPU", 0) < n * self._gpus:
            logger.warning("%d workers with %s each exceed the whole cluster (%s): waiting up to %.0f s for it to "
                           "grow", n, self._bundle(1), total, pg_timeout_s)
        pg = placement_group([self._bundle(rank) for rank in range(n)], strategy=self._strategy)
        try:
            ray.get(pg.ready(), timeout=pg_timeout_s)
        except GetTimeoutError as err:
            remove_placement_group(pg)
            raise TimeoutError(f"{n} workers with {self._bundle(1)} each could not be placed within "
                               f"{pg_timeout_s:.0f} s; free resources: {ray.available_resources()}") from err
        return pg, 0, True

    def how_many_fit(self, limit, settle_s=0.0):
        """How many workers fit now (counting CPUs and GPUs per worker on each node), at most ``limit``.

        Ray's resource view lags a release by a moment: with ``settle_s`` it is polled for up to that
        long until ``limit`` workers fit, and the best count seen is returned.
        """
        trial_pg = get_current_placement_group()
        if trial_pg is not None:
            return min(limit, len(trial_pg.bundle_specs) - (0 if self._use_local else 1))
        deadline = time.monotonic() + settle_s
        best = 0
        while True:
            try:
                from ray._private.state import state  # noqa: PLC0415 (per-node view; no public equivalent)

                nodes = list(state.available_resources_per_node().values())
            except Exception:  # noqa: BLE001 (fall back to the cluster-wide sum)
                nodes = [ray.available_resources()]
            best = max(best, recovery.workers_that_fit(nodes, self._cpus, self._gpus, limit))
            if best >= limit or time.monotonic() >= deadline:
                return best
            time.sleep(0.1)

    # ----------------------------------------------------------------- start-up
    def start(self, n, operator_cls, config, pg_timeout_s=None, initialization_hook=None):
        """Start ``n`` workers running ``operator_cls(config)``; raises WorkerFailure if one dies meanwhile.

        ``initialization_hook`` runs on every worker before the process group is set up.
        """
        if self._handles:
            raise RuntimeError("WorkerGroup.start called on a running group; shut it down first")
        pg_timeout_s = constants.SGD_PLACEMENT_GROUP_TIMEOUT_S if pg_timeout_s is None else pg_timeout_s
        self.broken = False
        self.generation += 1
        self._watch = None
        self._pg, offset, self._own_pg = self._placement(n, pg_timeout_s)
        options = dict(self._worker_options, num_cpus=self._cpus, world_size=n)
        for rank in range(n):
            if rank == 0 and self._use_local:
                local = TorchWorker(operator_cls, config, is_local=True, **options)
                self._handles.append(_Handle(0, local=local))
                continue
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=offset + rank)
            actor = _remote_worker_cls().options(num_cpus=self._cpus, num_gpus=self._gpus, scheduling_strategy=strategy,
                                                 **_legacy_runtime_env()).remote(operator_cls, config, **options)
            self._handles.append(_Handle(rank, actor=actor))
        deadline = self._timeout_s + 60
        self.run("run_hook", initialization_hook, deadline_s=deadline,
                 on_tick=self._watch.check if self._watch is not None else None)
        local_ranks = [0] * n
        if n > 1:
            url = self._collect({0: self._handles[0].call("setup_address")}, deadline_s=deadline)[0]
            self._collect({h.rank: h.call("setup_process_group", url, h.rank, n, self._timeout_s)
                           for h in self._ordered()}, deadline_s=deadline)
            ips = self.run("node_ip", deadline_s=deadline)
            local_ranks = [ips[:rank].count(ip) for rank, ip in enumerate(ips)]
        self._collect({h.rank: h.call("setup_operator", local_ranks[h.rank]) for h in self._ordered()})
        logger.info("Started %d worker(s)%s", n, " (rank 0 local)" if self._use_local else "")
        return n

    # ----------------------------------------------------------------- calls
    def run(self, method, *args, deadline_s=None, on_tick=None, lockstep=False, rank_kwargs=None, **kwargs):
        """Call ``method`` on every worker and return the results in rank order.

        Remote calls are sent first, then the local worker's runs in this thread. With ``lockstep``
        (train and validate), the others must finish within ``timeout_s`` of the first.
        ``rank_kwargs(num_workers)``, if given, returns one dict of extra keyword arguments per rank
        (e.g. each rank's data shard); it is called for every run, so a retry gets fresh ones.
        """
        self._drain_submitted()
        handles = self._ordered()
        extra = rank_kwargs(len(handles)) if rank_kwargs is not None else None
        calls = {h.rank: h.call(method, *args, **kwargs, **(extra[h.rank] if extra else {})) for h in handles}
        return self._collect(calls, deadline_s=deadline_s, on_tick=on_tick, lockstep=lockstep)

    def submit(self, method, *args, **kwargs):
        """Call ``method`` on every worker without waiting; errors surface at the next :meth:`run`."""
        self._drain_submitted()
        self._submitted = {h.rank: h.call(method, *args, **kwargs) for h in self._ordered()}

    def first_answer(self, method, *args, deadline_s=None, **kwargs):
        """Call ``method`` on rank 0, or the next rank while the ones before are dead; returns one result.

        Dead workers are skipped here and not torn down (the next :meth:`run` finds them).
        """
        self._drain_submitted()
        lost = {}
        for handle in self._handles:
            call = handle.call(method, *args, **kwargs)
            if isinstance(call, _Done):
                if call.error is not None:
                    raise call.error
                return call.value
            try:
                return ray.get(call, timeout=deadline_s)
            except (RayActorError, GetTimeoutError) as err:
                lost[handle.rank] = err
        raise WorkerFailure(f"no worker answered {method}", {r: _describe(e) for r, e in lost.items()})

    def _ordered(self):
        if self.broken:
            raise RuntimeError("the worker group was torn down after a failure; it must be restarted")
        return list(reversed(self._handles))  # the local rank 0 runs last: it blocks this thread

    def _drain_submitted(self):
        submitted, self._submitted = self._submitted, None
        if submitted:
            self._collect(submitted, deadline_s=self._timeout_s)

    def _collect(self, calls, deadline_s=None, on_tick=None, lockstep=False):
        """Wait for every call; the first death or collective failure kills the group (WorkerFailure)."""
        start = time.monotonic()
        results, failures, user_error, first_success = {}, {}, None, None
        pending = {}
        for rank, call in calls.items():
            if isinstance(call, _Done):
                user_error = self._sort(rank, call.value, call.error, results, failures) or user_error
                first_success = time.monotonic() if call.error is None else first_success
            else:
                pending[call] = rank
        while pending and not failures:
            now = time.monotonic()
            if user_error is not None and now - user_error[1] > _USER_ERROR_GRACE_S:
                break
            if deadline_s is not None and now - start > deadline_s:
                return self._fail(failures, sorted(pending.values()), None, f"no answer within {deadline_s:.0f} s")
            if lockstep and first_success is not None and now - first_success > self._timeout_s + 5:
                return self._fail({}, sorted(pending.values()), None, "workers did not finish after rank "
                                  f"{min(results)} did (timeout_s={self._timeout_s})")
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=_TICK_S)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    value, error = ray.get(ref), None
                except RayError as err:
                    value, error = None, err
                user_error = self._sort(rank, value, error, results, failures) or user_error
                if error is None and first_success is None:
                    first_success = time.monotonic()
            if on_tick is not None:
                on_tick()
        if failures and pending and all(isinstance(c, CollectiveError) for c in failures.values()):
            # A survivor's collective often fails just before the dead peer is reported: wait a moment
            # for the real cause, so that the error names the rank that died rather than its victim.
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_CAUSE_GRACE_S)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    self._sort(rank, ray.get(ref), None, results, failures)
                except RayError as err:
                    self._sort(rank, None, err, results, failures)
        if failures:
            collective_only = all(isinstance(c, CollectiveError) for c in failures.values())
            root = [c for c in failures.values() if not isinstance(c, CollectiveError)] or list(failures.values())
            return self._fail(failures, sorted(pending.values()) if collective_only else [], root[0],
                              "worker failure")
        if user_error is not None:
            if pending:  # the others are stuck waiting for the failed rank: the group is unusable
                self._kill_all()
            raise user_error[0]
        return [results[rank] for rank in sorted(results)]

    def _sort(self, rank, value, error, results, failures):
        """File one finished call; returns ``(user_error, time)`` when user code raised."""
        if error is None:
            results[rank] = value
            return None
        if isinstance(error, RayActorError) and error.actor_init_failed:  # deterministic: not retried
            return RuntimeError(f"rank {rank} could not be created: {error}"), time.monotonic()
        cause = error.cause if isinstance(error, RayTaskError) else error
        if isinstance(cause, CollectiveError) or (isinstance(error, RayError) and not isinstance(error, RayTaskError)):
            failures[rank] = cause if isinstance(cause, CollectiveError) else error
            return None
        if isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
            original = error.cause
            original.__cause__ = error  # keep the worker's traceback in the chain
            return original, time.monotonic()
        return error, time.monotonic()

    def _fail(self, failures, unresponsive, cause, message):
        self._kill_all()
        descriptions = {rank: _describe(err) for rank, err in failures.items()}
        failure = WorkerFailure(message, descriptions, unresponsive)
        logger.warning("Ending the attempt: %s", failure)
        raise failure from (cause if isinstance(cause, BaseException) else None)  # a timeout's cause is text

    # ----------------------------------------------------------------- teardown
    def _kill_all(self):
        for handle in self._handles:
            try:
                handle.kill()
            except Exception as err:  # noqa: BLE001 (already gone)
                logger.debug("kill rank %d: %s", handle.rank, err)
        self._handles = []
        self._submitted = None
        self.broken = True
        self._remove_pg()

    def _remove_pg(self):
        if self._pg is not None and self._own_pg:
            remove_placement_group(self._pg)
            deadline = time.monotonic() + constants.SGD_PLACEMENT_GROUP_TIMEOUT_S
            while time.monotonic() < deadline:
                table = ray.util.placement_group_table(self._pg)
                if table.get("state") == "REMOVED":
                    break
                time.sleep(0.05)
        self._pg = None

    def shutdown(self, force=False):
        """Stop every worker (gracefully unless ``force``) and release the placement group."""
        if self._handles and not force and not self.broken:
            try:
                self.run("shutdown", deadline_s=constants.SGD_SHUTDOWN_TIMEOUT_S)
            except (WorkerFailure, RayError) as err:
                logger.info("Graceful shutdown failed (%s); killing the workers", err)
            except RuntimeError as err:
                logger.info("Graceful shutdown failed (%s); killing the workers", err)
        self._kill_all()
        self.broken = False


def _describe(err):
    if isinstance(err, CollectiveError):
        return err.message
    if isinstance(err, RayActorError):
        return "worker process died (" + str(err).splitlines()[0][:200] + ")"
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
