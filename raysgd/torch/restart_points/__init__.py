"""Restart points in Ray's object store: the state a worker group restarts from, kept near the workers with a copy on
another node, never in the driver.

Layer 3 (ray, torch; layers 0-2). A point (:mod:`~raysgd.torch.restart_points.restart_point`: a whole state, or one
part per rank of a sharded one) and its copies and ranged reads; the call-start snapshot that rank 0 serialises
beside a ``train()``/``validate()`` call (:mod:`~raysgd.torch.restart_points.call_start`); how bytes and the 0-CPU
helpers' code are handed to Ray (:mod:`~raysgd.torch.restart_points.transport`). The controller's side, which
point is current, is :mod:`raysgd.torch.execution.restart_points`; commits (:mod:`raysgd.torch.commits`) become
restart points after a failure.

Example:
    >>> from raysgd.torch.restart_points.restart_point import part_file_name
    >>> part_file_name(1)
    '__1_0.distcp'
"""
