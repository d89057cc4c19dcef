"""Re-forming a group from the survivors of a failure: which processes stay, which bundles take a replacement,
the new ranks. The plan only: the worker group carries it out (:meth:`raysgd.torch.execution.worker_group.WorkerGroup.reform`,
which reads the placement group's bundles from Ray in :mod:`raysgd.torch.execution.placement`).

Layer 1: the standard library and layer 0. When a worker dies, the ranks
whose call ended cleanly (finished, or with a :class:`~raysgd.torch.errors.CollectiveError` because their
peer vanished) keep their processes: they leave the old process group and join a new one, so only a
replacement, if one is needed, pays the start-up of a worker process (``import torch``, ``torch._dynamo``).
A replacement goes into the dead rank's bundle of the group's placement group when that bundle is still
placed on a live node that Ray is not draining. A bundle lost with its node (or on a draining node) is not
waited for: the group goes on without it, unless a fresh placement group could hold more workers (then the
whole group restarts, as before), or fewer than the minimum would remain. ``SGD_KEEP_SURVIVORS=0`` turns re-forming off (every failure restarts every worker).

Example:
    >>> # bundles 0 and 1 on live nodes; rank 1 died, rank 0 survived: rank 1's bundle takes a replacement
    >>> plan({0: "a", 1: "a"}, {"a"}, kept={0: "survivor"}, min_size=1, fit_elsewhere=0)
    [(0, 'survivor'), (1, None)]
    >>> # rank 1's node is gone and nothing fits elsewhere: go on with the survivor alone
    >>> plan({0: "a"}, {"a"}, kept={0: "survivor"}, size=2, min_size=1, fit_elsewhere=0)
    [(0, 'survivor')]
    >>> plan({0: "a"}, {"a"}, kept={0: "survivor"}, size=2, min_size=1, fit_elsewhere=1) is None  # restart: 2 fit
    True
    >>> # with a warm spare (``TorchTrainer(num_spares=1)``), it takes the rank the lost node held
    >>> plan({0: "a"}, {"a"}, kept={0: "survivor"}, size=2, min_size=1, fit_elsewhere=1, spares=1)
    [(0, 'survivor'), (1, 'spare')]

A warm spare (:mod:`raysgd.torch.execution.spares`) takes a vacant rank before a new process would: first the
ranks whose bundle was lost (nothing else could replace them), then those whose bundle is free on a live node.

A planned resize (a drain move, or a grow, at a commit point every rank stopped at: :func:`resize_plan`) keeps the
ranks whose bundle is on a usable node in their processes and fills the rest: a moved rank's place with a warm
spare, else a free bundle of the group's, else a bundle of a new placement group; an added rank's with a free
bundle, else a new placement group's (docs/fault-tolerance/spares.md, "Partial moves and grows").

    >>> # rank 1's node drains; a spare is ready: rank 0 stays, the spare takes rank 1 (bundle 1 goes to the pool)
    >>> resize_plan([(0, "r0"), (1, "r1")], usable={0, 2}, target=2, spares=1, free=[])
    ([(0, 'r0'), (1, 'spare')], ['r1'], 0)
    >>> # a grow from 2 to 3 with no free bundle of the group's: one bundle of a new placement group
    >>> resize_plan([(0, "r0"), (1, "r1")], usable={0, 1}, target=3, spares=1, free=[])
    ([(0, 'r0'), (1, 'r1'), (None, None)], [], 1)
"""
from raysgd.base import environment
from raysgd.torch.errors import CollectiveError
from raysgd.torch.fault_tolerance import stops

#: In a :func:`plan`, the rank a warm spare takes (instead of a handle, or None for a new process).
SPARE = "spare"


def enabled():
    """``SGD_KEEP_SURVIVORS`` (default 1): whether survivors keep their processes after a failure."""
    return environment.get("SGD_KEEP_SURVIVORS")


def survivor_grace_s():
    """``SGD_SURVIVOR_GRACE_S`` (default 2): how long a survivor's call gets to end with an error after a death."""
    return environment.get("SGD_SURVIVOR_GRACE_S")


def can_stay(error):
    """Whether a rank whose call ended with ``error`` (None: it finished) can join a re-formed group.

    Its peer's loss broke its collective (a :class:`CollectiveError`), or it finished; a rank that was
    sent SIGTERM is leaving, and any other error (a death, a user error) is no clean end.
    """
    if error is None:
        return True
    return isinstance(error, CollectiveError) and not error.message.startswith(stops.MARK)


def plan(bundles_to_node, alive_nodes, kept, min_size, fit_elsewhere, size=None, order=None, spares=0):
    """The new group as ``[(bundle, kept handle, None for a new process or SPARE), ...]`` in rank order, or None.

    Args:
        bundles_to_node: ``{bundle index: node id}`` of the placed bundles (``placement_group_table``).
        alive_nodes: ids of the live nodes.
        kept: ``{bundle index: handle}`` of the survivors.
        min_size: the trainer's minimum; fewer gives None.
        fit_elsewhere: how many workers fit outside the placement group now; when a lost bundle could be
            replaced by a fresh placement group, None (restart the whole group instead, at a larger size).
        size: the number of bundles (default: those in ``bundles_to_node`` and ``kept``).
        order: the bundles the ranks may use, in rank order (default ``range(size)``; a spare's bundle is not one).
        spares: how many warm spares may take vacant ranks: a lost bundle's rank first, then a new process's. The
            entry keeps the vacated bundle (it goes to the spares' pool); the spare keeps its own.
    """
    size = size if size is not None else max([*bundles_to_node, *kept], default=-1) + 1
    order = list(range(size)) if order is None else list(order)
    vacant = [bundle for bundle in order if bundle not in kept]
    lost_bundles = [bundle for bundle in vacant if bundles_to_node.get(bundle) not in alive_nodes]
    live = [bundle for bundle in vacant if bundle not in lost_bundles]
    by_spare = set(lost_bundles[:spares]) | set(live[:max(0, spares - len(lost_bundles))])
    new, lost = [], 0
    for bundle in order:
        if bundle in kept:
            new.append((bundle, kept[bundle]))
        elif bundle in by_spare:
            new.append((bundle, SPARE))
        elif bundle in live:
            new.append((bundle, None))
        else:
            lost += 1
    if not (kept or by_spare) or len(new) < min_size or (lost and fit_elsewhere > 0):
        return None
    return new


def resize_plan(ranks, usable, target, spares, free):
    """A planned resize keeping the ranks on usable nodes: ``(plan, leaving, more)``, or None when it cannot keep any
    rank or would shrink below the ranks that stay (then every worker restarts).

    Args:
        ranks: ``[(bundle, handle), ...]`` of the stopped group in rank order (a bundle of None always stays: rank 0
            in the driver).
        usable: the bundles placed on live nodes that Ray is not draining.
        target: the size to re-form at.
        spares: how many ready warm spares in usable bundles may take a moved rank's place.
        free: usable bundles of the group that no rank or spare holds, in the order to use them.

    ``plan`` is ``[(bundle, handle | SPARE | None), ...]`` in rank order, as :func:`plan`'s: a kept rank's entry holds
    its handle, a spare's the vacated bundle (which goes to the spares' pool), a new process's its bundle, or None
    for a bundle of the new placement group; ``leaving`` the handles to release (their nodes drain or are gone);
    ``more`` how many bundles the new placement group needs. The moved ranks keep their places; added ranks follow.
    """

    def stays(bundle):
        return bundle is None or bundle in usable

    open_places = target - sum(1 for bundle, _ in ranks if stays(bundle))
    if open_places < 0 or open_places >= target:  # it would shrink below those that stay, or keep none
        return None
    free, plan, leaving, more = list(free), [], [], 0

    def fill(vacated):
        nonlocal spares, more
        if vacated is not None and spares > 0:  # a moved rank's place: a warm spare first
            spares -= 1
            return vacated, SPARE
        if free:
            return free.pop(0), None
        more += 1
        return None, None

    for bundle, handle in ranks:
        if stays(bundle):
            plan.append((bundle, handle))
            continue
        leaving.append(handle)
        if open_places > 0:  # else this rank's place is dropped: fewer fit
            open_places -= 1
            plan.append(fill(bundle))
    plan.extend(fill(None) for _ in range(open_places))  # added ranks
    return plan, leaving, more
