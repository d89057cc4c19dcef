"""Fault tolerance as pure policies: facts in, decisions out, never an actor handle or a worker group.

Layer 1 (the standard library; torch.distributed for the preemption agreement): the backoff and the counts of
workers that fit (:mod:`~raysgd.torch.fault_tolerance.recovery`) and the preemption agreement, a per-step
all-reduce of each rank's signal flag (:mod:`~raysgd.torch.fault_tolerance.preemption`). The controller
(:mod:`raysgd.torch.execution`) asks them and acts on their answers; they are tested with fake clocks and no
cluster.

Example:
    >>> from raysgd.torch.fault_tolerance.recovery import backoff_delays
    >>> list(backoff_delays(tries=4, base_s=1, cap_s=4))
    [1, 2, 4, 4]
"""
