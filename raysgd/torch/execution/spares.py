"""Warm spares: idle worker processes, ready to take the rank of a worker that died (``TorchTrainer(num_spares=k)``).

Layer 5 helper of :mod:`raysgd.torch.execution.worker_group`, which owns the pool (the spares live in bundles of the
group's placement group) and alone asks it for a spare. A spare is a worker actor that has imported torch,
``torch._dynamo`` and DDP's module (all that made the first DDP wrap slow) and run the trainer's
``initialization_hook`` (:meth:`~raysgd.torch.execution.worker.TorchWorker.warm_up`); it holds no
rank, joins no process group and has not built the operator (``setup()`` may read the rank). When a rank dies,
:meth:`SparePool.take` hands the group a spare, which joins the re-formed group as a survivor does
(:meth:`~raysgd.torch.execution.worker.TorchWorker.take_rank`), and the dead rank's bundle becomes a spare's bundle:
:meth:`SparePool.tend`, called at every call and every tick of the group's wait, starts its refill there
``SGD_SPARE_REFILL_DELAY_S`` (1 s) later, never waiting for it. It also notices a spare that died while idle (its
warm-up or its latest ping ended with the actor's death) and refills it; that is not a failure of the run.

Nothing here blocks: a spare's actor and its warm-up start without waiting, and their answers are read with
``ray.wait(timeout=0)``; only :meth:`SparePool.wait_ready` waits, with a deadline.

Example:
    >>> pool = SparePool(start=None, hook=None)  # no bundle for a spare: an empty pool
    >>> pool.available(), pool.bundles, pool.actors
    (0, set(), [])
"""
import logging
import time

import ray
from ray.exceptions import RayActorError

from raysgd.base import environment
from raysgd.torch.execution import diagnostics

logger = logging.getLogger(__name__)

_PING_S = 0.5  # how often an idle spare is asked whether it lives


def warm_limit_s():
    """``SGD_SPARE_WARM_S`` (default 120): a spare not warm by then (its actor never placed, or stuck) is killed, its
    stacks logged, and another started in its bundle."""
    return environment.get("SGD_SPARE_WARM_S")


def refill_delay_s():
    """``SGD_SPARE_REFILL_DELAY_S`` (default 1): how long after a spare took a rank its refill starts (its ``import
    torch`` would otherwise compete for the CPUs with the re-formed group's first steps)."""
    return environment.get("SGD_SPARE_REFILL_DELAY_S")


class Spare:
    """One idle worker: its :class:`~raysgd.torch.execution.worker_handle.Handle` (its bundle; no rank), the
    warm-up call (its answer: the process id and the node id), the hook it ran, when it started and whether it is a
    refill."""

    def __init__(self, handle, hook, clock, refill=False):
        self.handle, self.hook, self.started, self.refill = handle, hook, clock(), refill
        self.warm = handle.call("warm_up", hook)
        self.ping, self.pid, self.node, self.ready_s = None, None, None, None

    def state(self):
        """``"ready"``, ``"warming"``, ``"dead"`` or ``"broken"`` (its warm-up raised: the hook's error), never
        waiting."""
        call = self.warm if self.pid is None else self.ping
        if call is None or not ray.wait([call], timeout=0)[0]:
            return "warming" if self.pid is None else "ready"
        try:
            answer = ray.get(call, timeout=0)
        except RayActorError:
            return "dead"
        except Exception:  # noqa: BLE001 (the hook or the warm-up raised: sorted out by the pool)
            return "broken"
        if self.pid is None:
            self.pid, self.node = answer
        self.ping = None
        return "ready"


class SparePool:
    """The group's warm spares (see the module docstring).

    Args:
        start: ``start(bundle)`` starts a worker actor in that bundle of the group's placement group and returns its
            :class:`~raysgd.torch.execution.worker_handle.Handle`.
        hook: the ``initialization_hook`` each spare runs.
        clock: the time source.

    ``last_refill_s``: seconds from a refill's start to its spare being ready (the latest; None before one);
    ``refills``: how many spares were started to replace one that took a rank or died.
    """

    def __init__(self, start, hook, clock=time.monotonic):
        self._start, self.hook, self._clock = start, hook, clock
        self._spares = {}  # bundle -> Spare
        self._refill_at = {}  # bundle -> when its refill starts
        self._next_ping, self._broken = 0.0, None
        self.last_refill_s, self.refills = None, 0
        self._announce = None  # (how many, since when) of the last fill, until the log said they are ready

    @property
    def bundles(self):
        """The bundles the pool holds (a spare's, or one waiting for its refill)."""
        return set(self._spares) | set(self._refill_at)

    @property
    def actors(self):
        """The spares' actor handles."""
        return [spare.handle.actor for spare in self._spares.values()]

    def fill(self, bundles):
        """Start a spare in each of ``bundles`` (the group's new placement group's spare bundles); once they are all
        ready, :meth:`tend` says so in the log (once)."""
        bundles = list(bundles)
        for bundle in bundles:
            self._begin(bundle)
        self._announce = (len(bundles), self._clock()) if bundles else None

    def _begin(self, bundle, refill=False):
        if self._broken is not None:
            return
        try:
            self._spares[bundle] = Spare(self._start(bundle), self.hook, self._clock, refill)
        except Exception as err:  # noqa: BLE001 (no spare there now: tried again at the next tend)
            logger.warning("Starting a spare in bundle %d failed (%s: %s); trying again", bundle, type(err).__name__,
                           err)
            self._refill_at[bundle] = self._clock() + refill_delay_s()

    def available(self, usable=None):
        """How many spares are ready (warm, and alive as far as the pool knows now), only those in ``usable`` bundles
        when given (not on a draining node, say). A spare still warming is not counted: its actor may wait for a
        bundle Ray cannot place (a lost node's), and a rank must never wait for it."""
        ready = sum(1 for bundle, spare in self._spares.items()
                    if (usable is None or bundle in usable) and spare.state() == "ready")
        self._say_ready(self._clock())  # state() noticed who is warm: the log says so as soon as the count does
        return ready

    def take(self, usable=None):
        """A ready spare leaving the pool (one in ``usable`` bundles when given), or None; its bundle leaves the pool
        with it."""
        self.tend(force=True)
        for bundle, spare in list(self._spares.items()):
            if (usable is None or bundle in usable) and spare.state() == "ready":
                del self._spares[bundle]
                return spare
        return None

    def give(self, bundle):
        """``bundle`` was a rank's: a refill starts there ``SGD_SPARE_REFILL_DELAY_S`` from now."""
        self._refill_at[bundle] = self._clock() + refill_delay_s()

    def tend(self, force=False):
        """Without waiting: record the spares that became ready, refill the dead ones and the bundles whose time
        came, and ping the idle ones (at most every ``_PING_S`` unless ``force``)."""
        now = self._clock()
        if not force and now < self._next_ping and not self._refill_at:
            self._say_ready(now)
            return
        for bundle, spare in list(self._spares.items()):
            was_ready = spare.pid is not None
            state = spare.state()
            if state == "dead":
                logger.warning("Spare in bundle %d died while idle; starting another (not a failure of the run)",
                               bundle)
                del self._spares[bundle]
                self._begin(bundle, refill=True)
                self.refills += 1
            elif state == "broken":
                self._give_up(bundle, spare)
            elif state == "warming" and now - spare.started > warm_limit_s():
                self._restart_stuck(bundle, spare)
            elif state == "ready" and not was_ready and spare.refill:
                self.last_refill_s = now - spare.started
                logger.debug("Spare refilled in bundle %d in %.2f s", bundle, self.last_refill_s)
            elif state == "ready" and spare.ping is None and now >= self._next_ping:
                spare.ping = spare.handle.call("apply", int)  # any answer: it lives
        for bundle, when in list(self._refill_at.items()):
            if now >= when:
                del self._refill_at[bundle]
                self.refills += 1
                self._begin(bundle, refill=True)
        if now >= self._next_ping:
            self._next_ping = now + _PING_S
        self._say_ready(now)

    def _say_ready(self, now):
        """Log once when every spare of the last :meth:`fill` is ready: until then a lost rank waits for a new process
        (seconds), from then on a spare takes it (well under a second)."""
        if self._announce is None or self._broken is not None:
            return
        count, since = self._announce
        ready = sum(1 for spare in self._spares.values() if spare.pid is not None)
        if ready >= count:
            self._announce = None
            logger.info("%d warm spare(s) ready, %.1f s after they started: a lost worker's rank is now taken over "
                        "by a warm process", ready, now - since)

    def _restart_stuck(self, bundle, spare):
        """A spare still warming after ``SGD_SPARE_WARM_S``: log where it is, kill it, start another in its bundle."""
        try:
            stacks = diagnostics.gather_stacks({bundle: spare.handle.stacks_request()}, timeout_s=5).get(bundle)
        except Exception as err:  # noqa: BLE001 (the stacks are forensics only)
            stacks = f"no stacks: {type(err).__name__}: {err}"
        logger.warning("Spare in bundle %d is not warm after %.0f s; starting another. Its stacks:\n%s", bundle,
                       warm_limit_s(), stacks)
        spare.handle.kill()
        del self._spares[bundle]
        self.refills += 1
        self._begin(bundle, refill=True)

    def _give_up(self, bundle, spare):
        """A spare's warm-up raised (the hook's error, which a refill would meet again): no more spares."""
        try:
            ray.get(spare.warm, timeout=0)
        except Exception as err:  # noqa: BLE001 (logged with its cause; the run goes on without spares)
            self._broken = err
        logger.warning("A spare's warm-up failed (%s); the run goes on without spares (a dead rank is replaced by a "
                       "new process, as with num_spares=0)", self._broken)
        self.clear()

    def wait_ready(self, count, timeout_s):
        """Tend the pool until ``count`` spares are ready or ``timeout_s`` passed; returns how many are ready."""
        deadline = self._clock() + timeout_s
        while True:
            self.tend(force=True)
            ready = sum(1 for spare in self._spares.values() if spare.pid is not None)
            if ready >= count or self._clock() >= deadline or self._broken is not None:
                return ready
            time.sleep(0.05)

    def nodes(self):
        """The node ids of the ready spares (their nodes' commit holders start before a spare takes a rank)."""
        return [spare.node for spare in self._spares.values() if spare.node is not None]

    def pids(self):
        """The process ids of the ready spares."""
        return [spare.pid for spare in self._spares.values() if spare.pid is not None]

    def clear(self):
        """Kill every spare (the group's placement group is going, or the pool gave up); the pool is empty."""
        spares, self._spares, self._refill_at, self._announce = self._spares, {}, {}, None
        for spare in spares.values():
            try:
                spare.handle.kill()
            except Exception as err:  # noqa: BLE001 (already gone)
                logger.debug("kill spare: %s", err)
