"""Where the workers go: their bundles, the placement group (the group's own or a Tune trial's), how many fit,
which nodes hold them.

Layer 5 helper of :mod:`raysgd.torch.execution.worker_group`: imports ray and layers 0-4. The strategy is
``TorchTrainer(placement_strategy=...)`` (1.x's ``"SPREAD"`` by default); inside a Tune trial the
trial's own placement group is used instead, watched by :class:`TrialPlacementWatch`: when a node holding some
of the trial's bundles is lost, Ray marks the group RESCHEDULING, and if nothing can take those bundles, actors
scheduled into them would wait forever. Only Tune can place the trial elsewhere, so after
``2 x SGD_PLACEMENT_GROUP_TIMEOUT_S`` unplaced the watch raises :class:`~raysgd.torch.errors.PlacementUnavailable`,
which the trainer does not retry: the trial fails and ``FailureConfig(max_failures=...)`` restores it (the timing
policy is :class:`raysgd.torch.fault_tolerance.recovery.PlacementWatch`, pure). After a failure, the bundles a
re-formed group can use come from Ray's view of the placement group (:func:`reform_plan`).

A group of its own may gain a placement group per partial move or grow (:meth:`Placement.reserve_more`: the ranks
that join while the others keep their processes: docs/fault-tolerance/spares.md, "Partial moves and grows");
:class:`Bundles` numbers the bundles of all of them as one list (the first group's first), so a bundle index names one bundle of the run.

Example:
    >>> Placement(cpus=2, gpus=1, use_local=False, strategy="PACK").bundle(1)
    {'CPU': 2, 'GPU': 1}
"""
import logging
import time

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group

from raysgd.base import environment
from raysgd.torch.errors import PlacementUnavailable
from raysgd.torch.execution import cluster_state
from raysgd.torch.fault_tolerance import recovery, reform

logger = logging.getLogger(__name__)



class Placement:
    """Bundles of ``cpus``/``gpus`` per worker in one placement group of ``strategy`` (see the module docstring)."""

    def __init__(self, cpus, gpus, use_local, strategy="SPREAD"):
        self._cpus, self._gpus, self._use_local, self.strategy = cpus, gpus, use_local, strategy
        self.watch = None  # a TrialPlacementWatch on the Tune trial's group, while one is used

    def bundle(self, rank):
        bundle = {"CPU": self._cpus}
        if self._gpus:
            bundle["GPU"] = self._gpus
        if rank == 0 and self._use_local:
            bundle[f"node:{ray.util.get_node_ip_address()}"] = 0.001  # rank 0 is this process: this node
        return bundle

    @staticmethod
    def in_trial():
        """Whether this process runs inside a Tune trial's placement group (the workers then use the trial's)."""
        return get_current_placement_group() is not None

    def reserve(self, n, pg_timeout_s, spares=0):
        """``(placement group, first bundle index, owned)`` for ranks 0..n-1: the Tune trial's group, or a new one
        whose bundles ``n..n+spares-1`` are for warm spares (:mod:`raysgd.torch.execution.spares`; none in a trial's)."""
        trial_pg = get_current_placement_group()
        if trial_pg is not None:
            offset = 0 if self._use_local else 1  # bundle 0 is the trainable (which is rank 0 with use_local)
            if len(trial_pg.bundle_specs) < offset + n:
                raise ValueError(f"The enclosing placement group has {len(trial_pg.bundle_specs)} bundles; "
                                 f"{n} workers need {offset + n}. Use TorchTrainer.as_trainable's resource request.")
            self.watch = TrialPlacementWatch(trial_pg)  # a lost node's bundles: fail, and Tune restores the trial
            self.watch.wait()
            return trial_pg, offset, False
        self.watch = None
        total = ray.cluster_resources()
        if total.get("CPU", 0) < n * self._cpus or total.get("GPU", 0) < n * self._gpus:
            logger.warning("%d workers with %s each exceed the whole cluster (%s): waiting up to %.0f s for it to "
                           "grow", n, self.bundle(1), total, pg_timeout_s)
        pg = placement_group([self.bundle(rank) for rank in range(n)] + [self.bundle(n) for _ in range(spares)],
                             strategy=self.strategy)
        try:
            ray.get(pg.ready(), timeout=pg_timeout_s)
        except GetTimeoutError as err:
            remove_placement_group(pg)
            with_spares = f" and {spares} spare(s)" if spares else ""
            raise TimeoutError(f"{n} workers{with_spares} with {self.bundle(1)} each could not be placed "
                               f"({self.strategy}) within {pg_timeout_s:.0f} s; free resources: "
                               f"{ray.available_resources()}") from err
        return pg, 0, True

    def reserve_more(self, n, timeout_s):
        """A new placement group of ``n`` bundles for ranks that join a running group (a partial move or grow), of
        this strategy, or None when it is not placed within ``timeout_s`` (removed then) or the strategy is strict
        (``STRICT_SPREAD``/``STRICT_PACK`` constrain the bundles against each other: a second group cannot keep
        that promise, so the whole group restarts instead). ``timeout_s`` None: returned at once, placed when Ray
        can (for spares' refills, which never hold a rank up)."""
        if self.strategy.startswith("STRICT_"):
            logger.debug("A %s group cannot gain a second placement group and keep its promise", self.strategy)
            return None
        pg = placement_group([self.bundle(1) for _ in range(n)], strategy=self.strategy)
        if timeout_s is None:
            return pg
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            logger.debug("%d more bundle(s) of %s were not placed within %.1f s", n, self.bundle(1), timeout_s)
            self.remove(pg)
            return None
        return pg

    @staticmethod
    def remove(pg):
        """Remove a placement group this group created and wait (bounded) until Ray reports it removed."""
        remove_placement_group(pg)
        deadline = time.monotonic() + environment.get("SGD_PLACEMENT_GROUP_TIMEOUT_S")
        while time.monotonic() < deadline:
            if ray.util.placement_group_table(pg).get("state") == "REMOVED":
                break
            time.sleep(0.05)

    def how_many_fit(self, limit, settle_s=0.0, own_pg=None):
        """How many workers fit now (counting CPUs and GPUs per worker on each node), at most ``limit``.

        Ray's resource view lags a release by a moment: with ``settle_s`` (a restart after a failure)
        it first waits until Ray reports dead every node whose raylet is gone (so no worker is placed
        on a node that is going away), then polls for up to ``settle_s`` until ``limit`` workers fit,
        and returns the latest count (a node Ray reports dead meanwhile stops counting). A node Ray is draining holds no room. The strategy counts (``STRICT_SPREAD``: a node per worker, ``STRICT_PACK``:
        one node), with ``own_pg``, the group's current placement group, telling which nodes it holds already.
        """
        trial_pg = get_current_placement_group()
        if trial_pg is not None:
            return min(limit, len(trial_pg.bundle_specs) - (0 if self._use_local else 1))
        if settle_s > 0:
            cluster_state.wait_out_dying_nodes(environment.get("SGD_DYING_NODE_WAIT_S"))
        deadline = time.monotonic() + settle_s
        while True:
            try:
                from ray._private.state import state  # noqa: PLC0415 (per-node view; no public equivalent)

                nodes = dict(state.available_resources_per_node())
                for node in cluster_state.draining_nodes():  # free, but Ray places nothing new there
                    nodes.pop(node, None)
            except Exception:  # noqa: BLE001 (fall back to the cluster-wide sum)
                nodes = {None: ray.available_resources()}
            fit = recovery.fit_for_strategy(nodes, _nodes_of(own_pg), self.strategy, self._cpus, self._gpus, limit)
            if fit >= limit or time.monotonic() >= deadline:
                return fit
            time.sleep(0.1)


def _nodes_of(pg):
    """The node ids holding the bundles of ``pg`` (a placement group or :class:`Bundles`; empty for None or a removed
    group)."""
    if pg is None:
        return set()
    try:
        return set(_as_bundles(pg).table().values())
    except Exception:  # noqa: BLE001 (a removed group: holds nothing)
        return set()


class Bundles:
    """The bundles of a worker group's placement groups as one numbered list: the first group's ``0..n-1``, then those
    of each group added for ranks that joined later, in order. ``groups``: ``[(placement group, bundle count)]``; a
    removed group's entry is ``(None, count)``, so the numbers of the others never change.

    Example:
        >>> Bundles([]).size, Bundles([(None, 2), (None, 1)]).size
        (0, 3)
    """

    def __init__(self, groups):
        self.groups = list(groups)

    @property
    def size(self):
        return sum(count for _, count in self.groups)

    def locate(self, bundle):
        """``(placement group, its bundle index)`` of ``bundle``; ``IndexError`` for a removed group's or none."""
        for pg, count in self.groups:
            if bundle < count:
                if pg is None:
                    raise IndexError(f"bundle {bundle}'s placement group was removed")
                return pg, bundle
            bundle -= count
        raise IndexError(f"no bundle {bundle}")

    def live(self):
        """The numbers of the bundles of the groups not removed."""
        numbers: set[int] = set()
        base = 0
        for pg, count in self.groups:
            if pg is not None:
                numbers.update(range(base, base + count))
            base += count
        return numbers

    def of(self, pg):
        """The numbers of ``pg``'s bundles."""
        base = 0
        for group, count in self.groups:
            if group is pg:
                return range(base, base + count)
            base += count
        return range(0)

    def table(self):
        """``{bundle: node id}`` of the placed bundles, as Ray sees them now."""
        placed, base = {}, 0
        for pg, count in self.groups:
            if pg is not None:
                for bundle, node in ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).items():
                    placed[base + int(bundle)] = node
            base += count
        return placed


def _as_bundles(pg):
    return pg if isinstance(pg, Bundles) else Bundles([(pg, len(pg.bundle_specs))])


def placed(pg):
    """Whether Ray has placed (reserved) ``pg``'s bundles: a refill's group may still wait for room."""
    try:
        return ray.util.placement_group_table(pg).get("state") == "CREATED"
    except Exception:  # noqa: BLE001 (a removed group holds nothing)
        return False


def usable_bundles(bundles):
    """The bundles of ``bundles`` (a :class:`Bundles`) placed on a live node that Ray is not draining and that still
    answers: where a rank may stay or start."""
    alive = _alive_nodes(skip_dying=True)
    return {bundle for bundle, node in bundles.table().items() if node in alive}


def unplaced_limit_s():
    """Seconds a trial's bundles may stay unplaced: twice ``SGD_PLACEMENT_GROUP_TIMEOUT_S`` (read now)."""
    return 2 * environment.get("SGD_PLACEMENT_GROUP_TIMEOUT_S")


class TrialPlacementWatch:
    """Looks at a placement group's state; raises once it has been unplaced for ``limit_s``.

    Args:
        pg: the enclosing ``PlacementGroup``.
        limit_s: default :func:`unplaced_limit_s`.
        poll_s: pause between looks in :meth:`wait`.
    """

    def __init__(self, pg, limit_s=None, poll_s=0.2):
        self.pg = pg
        self.poll_s = poll_s
        self._watch = recovery.PlacementWatch(unplaced_limit_s() if limit_s is None else limit_s)

    def check(self):
        """One look: True if every bundle is placed, False if not (yet); raises PlacementUnavailable at the limit."""
        state = ray.util.placement_group_table(self.pg).get("state")
        placed = state == "CREATED"
        if self._watch.observe(placed):
            raise PlacementUnavailable(f"the workers' bundles of the enclosing placement group {self.pg.id.hex()} "
                                       f"cannot be placed (state {state})", self._watch.unplaced_s)
        return placed

    def wait(self):
        """Return once the group is placed; raise PlacementUnavailable if it stays unplaced for the limit."""
        while not self.check():
            time.sleep(self.poll_s)


# ----------------------------------------------------------------- the nodes of the bundles
def _alive_nodes(skip_dying=False):
    """Ids of the live nodes that are not draining (Ray would never place a replacement there); with ``skip_dying``,
    without those whose raylet is already gone either (Ray's health check reports a lost node dead only after
    a few seconds, and a replacement placed there would be lost)."""
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]} - set(cluster_state.draining_nodes())
    return alive - set(cluster_state.dying_nodes()) if skip_dying else alive


def reform_plan(pg, kept, min_size, how_many_fit, order=None, spares=0):
    """:func:`~raysgd.torch.fault_tolerance.reform.plan` for placement group ``pg`` (or :class:`Bundles`) as Ray sees it
    now (``how_many_fit(n)``: workers that fit outside; ``order``: the bundles ranks may use, in rank order, default
    all; ``spares``: how many warm spares may take vacant ranks)."""
    bundles = _as_bundles(pg)
    placed = bundles.table()
    alive, size = _alive_nodes(skip_dying=True), bundles.size
    order = list(range(size)) if order is None else list(order)
    lost = max(0, sum(1 for b in order if b not in kept and placed.get(b) not in alive) - spares)
    return reform.plan(placed, alive, kept, min_size, how_many_fit(lost) if lost else 0, size=size, order=order,
                       spares=spares)


def nodes_of(pg, handles):
    """``{rank: node id}`` of the workers of ``handles`` that are actors in bundles of ``pg`` (or :class:`Bundles`)."""
    placed = _as_bundles(pg).table() if pg is not None else {}
    return {h.rank: placed.get(h.bundle) for h in handles if h.actor is not None}


def spare_bundles(pg, used):
    """How many bundles of ``pg`` (or :class:`Bundles`) are placed on a live node and not in ``used`` (the bundles of
    the workers and of the warm spares)."""
    bundles = _as_bundles(pg) if pg is not None else None
    if bundles is None or len(used) >= bundles.size:
        return 0
    placed = bundles.table()
    alive = _alive_nodes()
    return sum(1 for b, node in placed.items() if b not in used and node in alive)
