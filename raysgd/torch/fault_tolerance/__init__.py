"""Fault tolerance as pure policies: facts in, decisions out, never an actor handle or a worker group.

Layer 1 (the standard library only): the backoff and the counts of workers that fit
(:mod:`~raysgd.torch.fault_tolerance.recovery`), retry or raise (:mod:`~raysgd.torch.fault_tolerance.failure_policy`),
re-forming from survivors (:mod:`~raysgd.torch.fault_tolerance.reform`), grow and drain watches
(:mod:`~raysgd.torch.fault_tolerance.watches`), and what a call stopped at a commit point tells
(:mod:`~raysgd.torch.fault_tolerance.stops`: a preemption or a resize). The controller
(:mod:`raysgd.torch.execution`) asks them and acts on their answers; they are tested with fake clocks and no
cluster. The workers' side of a preemption (signal handlers, the per-step agreement) is
:mod:`raysgd.torch.commits.preemption`.

Example:
    >>> from raysgd.torch.fault_tolerance.recovery import backoff_delays
    >>> list(backoff_delays(tries=4, base_s=1, cap_s=4))
    [1.0, 2.0, 4.0, 4.0]
"""
