"""Where the workers go: their bundles, the placement group (the group's own or a Tune trial's), how many fit.

Layer 4 helper of :mod:`raysgd.torch.worker_group`: imports ray and layers 0-3. The strategy is
``TorchTrainer(placement_strategy=...)`` (1.x's ``"SPREAD"`` by default); inside a Tune trial the
trial's own placement group is used instead.

Example:
    >>> Placement(cpus=2, gpus=1, use_local=False, strategy="PACK").bundle(1)
    {'CPU': 2, 'GPU': 1}
"""
import logging
import time

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group

from raysgd.torch import cluster_state, constants
from raysgd.torch.fault_tolerance import recovery
from raysgd.torch.trial_placement import TrialPlacementWatch

logger = logging.getLogger(__name__)

#: How long a restart waits for Ray to report a node dead once its raylet stopped answering.
DYING_NODE_WAIT_S = constants.env_float("SGD_DYING_NODE_WAIT_S", 30)


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

    def reserve(self, n, pg_timeout_s):
        """``(placement group, first bundle index, owned)`` for ranks 0..n-1: the Tune trial's group, or a new one."""
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
        pg = placement_group([self.bundle(rank) for rank in range(n)], strategy=self.strategy)
        try:
            ray.get(pg.ready(), timeout=pg_timeout_s)
        except GetTimeoutError as err:
            remove_placement_group(pg)
            raise TimeoutError(f"{n} workers with {self.bundle(1)} each could not be placed ({self.strategy}) "
                               f"within {pg_timeout_s:.0f} s; free resources: {ray.available_resources()}") from err
        return pg, 0, True

    @staticmethod
    def remove(pg):
        """Remove a placement group this group created and wait (bounded) until Ray reports it removed."""
        remove_placement_group(pg)
        deadline = time.monotonic() + constants.SGD_PLACEMENT_GROUP_TIMEOUT_S
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
            cluster_state.wait_out_dying_nodes(DYING_NODE_WAIT_S)
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
    """The node ids holding ``pg``'s bundles (empty for None or an unknown group)."""
    if pg is None:
        return set()
    try:
        return set(ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).values())
    except Exception:  # noqa: BLE001 (a removed group: holds nothing)
        return set()
