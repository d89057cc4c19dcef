"""Watching the Tune trial's placement group: give up on bundles that a lost node leaves unplaceable.

Layer 4 (ray): used by the worker group when it runs inside an enclosing placement group (a Tune
trial's). When a node holding some of the trial's bundles is lost, Ray marks the group
RESCHEDULING; if nothing can take those bundles, actors scheduled into them wait forever, and each
restart try would wait ``timeout_s`` for them. Only Tune can place the trial elsewhere, so after
``2 x SGD_PLACEMENT_GROUP_TIMEOUT_S`` unplaced the watch raises
:class:`~raysgd.torch.errors.PlacementUnavailable`, which the trainer does not retry: the trial
fails and ``FailureConfig(max_failures=...)`` restores it. The timing policy is
:class:`raysgd.torch.fault_tolerance.recovery.PlacementWatch` (pure).

Example:
    >>> watch = TrialPlacementWatch(pg)  # doctest: +SKIP
    >>> watch.wait()  # returns once placed, or raises PlacementUnavailable  # doctest: +SKIP
"""
import time

import ray

from raysgd.torch import constants
from raysgd.torch.fault_tolerance import recovery
from raysgd.torch.errors import PlacementUnavailable


def unplaced_limit_s():
    """Seconds a trial's bundles may stay unplaced: twice ``SGD_PLACEMENT_GROUP_TIMEOUT_S`` (read now)."""
    return 2 * constants.env_float("SGD_PLACEMENT_GROUP_TIMEOUT_S", constants.SGD_PLACEMENT_GROUP_TIMEOUT_S)


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
