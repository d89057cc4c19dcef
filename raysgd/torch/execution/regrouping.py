"""Re-forming a worker group from the processes it has: after a failure (the survivors), and at a planned resize.

Layer 5, a part of :class:`~raysgd.torch.execution.worker_group.WorkerGroup` (a mixin, in a module of its own: the
group's start-up, fan-out and teardown are there, its re-forming here). After a failure, :meth:`Regrouping.reform`
keeps the survivors in their processes (they join the new group, build the operator again), warm spares take
the vacant ranks first, new processes only for what is left (:func:`raysgd.torch.fault_tolerance.reform`'s plans).
A planned resize, :meth:`Regrouping.resize` (a drain move or a grow, at a commit point or between calls), keeps the
ranks on usable nodes the same way; the ranks on draining nodes are released, a ready spare takes a moved rank's
place, and new processes start in free bundles or in a new placement group
(:meth:`~raysgd.torch.execution.placement.Placement.reserve_more`).

Example:
    >>> # size = group.reform(operator_cls, config_for, min_size)  # None: restart every worker instead
"""
from __future__ import annotations

import logging

from raysgd.torch.execution import placement
from raysgd.torch.execution import local_runner
from raysgd.torch.execution.local_runner import LocalRunner
from raysgd.torch.execution.placement import Placement
from raysgd.torch.fault_tolerance import recovery, reform
from typing import TYPE_CHECKING, Any, Callable, cast

if TYPE_CHECKING:
    from raysgd.torch.execution.spares import SparePool
    from raysgd.torch.execution.worker_handle import Handle

logger = logging.getLogger(__name__)


class Regrouping:
    """The re-forming half of :class:`~raysgd.torch.execution.worker_group.WorkerGroup` (see the module docstring);
    it works on the group's own state."""

    # What it uses of the group's state and methods (provided by the host class, WorkerGroup):
    _handles: list[Handle]
    _kept: list[Handle]
    _rank_bundles: list[int]
    _spares: SparePool
    _pg: Any
    _own_pg: bool
    _extra: list[tuple[Any, int]]
    _placement: Placement
    _runner: LocalRunner | None
    _use_local: bool
    _worker_options: dict[str, Any]
    _cpus: float
    _timeout_s: float
    broken: bool
    generation: int
    _bundles: Callable[[], placement.Bundles]
    how_many_fit: Callable[..., int]
    _start_in: Callable[..., Handle]
    _collect: Callable[..., Any]
    _connect: Callable[[int], None]
    _ordered: Callable[[], list[Handle]]
    _drain_submitted: Callable[[], None]
    _kill_all: Callable[..., None]

    def reform(self, operator_cls, config_for, min_size, initialization_hook=None):
        """Re-form the group from the survivors of the last failure (see :mod:`raysgd.torch.fault_tolerance.reform`),
        warm spares taking vacant ranks first; returns the size, or None when the whole group must restart instead.
        ``config_for(n)``: the worker config at ``n``."""
        kept = {h.bundle: h for h in self._kept}
        spares = self._spares.available() if self._own_pg and self._pg is not None else 0
        new = None
        if (kept or spares) and self._own_pg and self._pg is not None and (not self._use_local or 0 in kept):
            bundles = self._bundles()
            order = self._rank_bundles + sorted(bundles.live() - set(self._rank_bundles) - self._spares.bundles)
            new = placement.reform_plan(bundles, kept, min_size, self.how_many_fit, order=order, spares=spares)
        taken = {bundle: self._spares.take() for bundle, handle in new or () if handle == reform.SPARE}
        if new is None or None in taken.values():  # no plan, or a spare it counted on died meanwhile
            for spare in taken.values():
                if spare is not None:
                    spare.handle.kill()
            self._kill_all()
            return None
        return self._form(new, taken, operator_cls, config_for, initialization_hook)

    def resize(self, target, operator_cls, config_for, initialization_hook=None):
        """Re-form at ``target`` workers keeping the ranks on usable nodes in their processes, after every rank stopped
        at a commit point (or between calls, idle): a drain move or a grow
        (:func:`~raysgd.torch.fault_tolerance.reform.resize_plan`). The ranks on draining or lost nodes are released,
        a ready warm spare takes a moved rank's place, and new processes start in free bundles of the group's or in a
        new placement group (:meth:`Placement.reserve_more`). Returns the size, or None (the reason logged) when the
        whole group must restart instead (the caller's :meth:`shutdown` then releases it all)."""
        why = self._why_not_partial()
        if why is None and not self.broken:  # between calls: every rank stays where it is, idle
            self._drain_submitted()
            self._kept, self._handles, self.broken = self._handles, [], True
        ranks = sorted(self._kept, key=lambda h: h.rank)
        if why is None and self._use_local and not (ranks and ranks[0].local is not None):
            why = "rank 0 (in this process) did not stop cleanly"
        found = None
        if why is None:
            bundles = self._bundles()
            usable = placement.usable_bundles(bundles)
            used = {h.bundle for h in ranks} | self._spares.bundles
            free = [bundle for bundle in range(bundles.size) if bundle in usable and bundle not in used]
            found = reform.resize_plan([(None if h.actor is None else h.bundle, h) for h in ranks], usable, target,
                                       self._spares.available(usable), free)
            why = None if found is not None else f"no rank stays on a usable node below {target} workers"
        plan, leaving, more = found if found is not None else (None, None, 0)
        if more:  # the ranks no free bundle takes: a placement group of their own, placed within the try
            pg = self._placement.reserve_more(more, recovery.placement_try_s())
            if pg is None:
                why = f"{more} more bundle(s) could not be placed as a second placement group"
            else:
                numbers = iter(range(bundles.size, bundles.size + more))
                self._extra.append((pg, more))
                plan = [(next(numbers), None) if entry == (None, None) else entry
                        for entry in cast("list", plan)]  # (a plan: more > 0 only when found is not None)
        if why is not None:
            logger.debug("Not keeping the healthy ranks for this resize (%s): every worker restarts", why)
            return None
        leaving = cast("list[Handle]", leaving)  # found is not None once why is None
        plan = self._refill_elsewhere(plan)
        taken = {bundle: self._spares.take(usable) for bundle, handle in plan if handle == reform.SPARE}
        if None in taken.values():  # a spare it counted on died meanwhile
            for spare in taken.values():
                if spare is not None:
                    spare.handle.kill()
            logger.debug("Not keeping the healthy ranks for this resize (a spare died): every worker restarts")
            return None
        self._kept = [h for h in self._kept if h not in leaving]
        for handle in leaving:  # their nodes drain: they go now, the others stay
            handle.kill()
        size = self._form(plan, taken, operator_cls, config_for, initialization_hook)
        self._release_unused()
        logger.debug("Resized to %d worker(s) keeping %d in their processes (%d left draining nodes)", size,
                    len(ranks) - len(leaving), len(leaving))
        return size

    def _refill_elsewhere(self, plan):
        """``plan`` with each spare's entry naming a bundle of a new placement group for its refill (not placed yet,
        never waited for), instead of the moved rank's bundle on a draining node, where Ray places nothing until the
        node is gone; unchanged for a strict strategy (the refill then waits for that bundle)."""
        moved = sum(1 for _, handle in plan if handle == reform.SPARE)
        pg = self._placement.reserve_more(moved, timeout_s=None) if moved else None
        if pg is None:
            return plan
        numbers = iter(range(self._bundles().size, self._bundles().size + moved))
        self._extra.append((pg, moved))
        return [(next(numbers), handle) if handle == reform.SPARE else (bundle, handle) for bundle, handle in plan]

    def _why_not_partial(self):
        """Why a resize cannot keep the healthy ranks (None: it can)."""
        if not self._own_pg or self._pg is None:
            return "the placement group is a Tune trial's, which cannot grow" if self._pg is not None else "no group"
        if not reform.enabled():
            return "SGD_KEEP_SURVIVORS=0"
        if self.broken and not self._kept:
            return "no rank stopped cleanly"
        return None

    def _release_unused(self):
        """Remove the added placement groups that no rank or spare uses any longer (their ranks moved on)."""
        used = {h.bundle for h in self._handles} | self._spares.bundles
        bundles = self._bundles()
        for index, (pg, count) in enumerate(self._extra):
            if pg is not None and not set(bundles.of(pg)) & used:
                Placement.remove(pg)
                self._extra[index] = (None, count)

    def how_many_can_move(self, limit):
        """How many ranks could move off draining nodes now: the ready warm spares on usable nodes, then
        :meth:`how_many_fit`; at most ``limit``."""
        spares = 0
        if self._own_pg and self._pg is not None and not self.broken and self._spares.bundles:
            spares = self._spares.available(placement.usable_bundles(self._bundles()))
        return min(limit, spares + self.how_many_fit(max(0, limit - spares)))

    def _form(self, new, taken, operator_cls, config_for, initialization_hook):
        """Carry out a re-form plan (``[(bundle, handle | SPARE | None)]`` in rank order, ``taken``: ``{bundle: Spare}``
        of its spares): kept ranks rejoin, spares take their ranks, new processes start; then the rendezvous."""
        n, config, fresh = len(new), config_for(len(new)), set()
        kept = [handle for _, handle in new if handle is not None and handle != reform.SPARE]
        self._kept, self._handles, self.broken = [], [], False
        self.generation += 1
        self._spares.hook = initialization_hook  # refills run the hook of now
        calls: dict[int, Callable[..., Any]] = {}
        for rank, (bundle, handle) in enumerate(new):
            if handle is None:
                handle = self._start_in(rank, bundle, operator_cls, config,
                                        dict(self._worker_options, num_cpus=self._cpus, world_size=n))
                fresh.add(rank)
                calls[rank] = lambda h: h.call("run_hook", initialization_hook)
            elif handle == reform.SPARE:
                spare, handle = taken[bundle], taken[bundle].handle
                self._spares.give(bundle)  # the vacated bundle takes a refill
                hook = initialization_hook if spare.hook is not initialization_hook else None
                calls[rank] = lambda h, hook=hook: h.call("take_rank", config, h.rank, n, hook)
            else:
                calls[rank] = lambda h: h.call("rejoin", config, h.rank, n)
            handle.rank = rank
            self._handles.append(handle)
        local = self._handles[0] if self._handles[0].local is not None else None
        if local is not None and (n > 1) != (local.runner is not None):  # rank 0's thread only beside others
            if local.runner is not None:
                local.runner.stop(local_runner.STOP_S)
            local.runner = self._runner = LocalRunner() if n > 1 else None
        self._collect({h.rank: calls[h.rank](h) for h in self._ordered()}, deadline_s=self._timeout_s + 60)
        self._connect(n)
        self._rank_bundles = [h.bundle for h in self._handles]
        logger.info("Workers now %d: %d kept their process, %d warm spare(s) took a rank, %d new", n, len(kept),
                    len(taken), len(fresh))
        return n
