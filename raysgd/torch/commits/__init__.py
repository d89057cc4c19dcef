"""Commits: restart points taken inside a call at steps every rank agrees on, kept with the workers, resumed by the driver.

Layer 4 (ray, torch; layers 0-3). Each worker takes them (:mod:`~raysgd.torch.commits.committer`, timed by
:mod:`~raysgd.torch.commits.commit_stats`); their small records go to a store beside the driver
(:mod:`~raysgd.torch.commits.commit_store`), their state parts to a holder on the committing rank's node with a copy on
a buddy node (:mod:`~raysgd.torch.commits.part_holders`); the driver plans them per attempt and, after a failure,
turns the latest complete one into a restart point (:mod:`~raysgd.torch.commits.commit_policy`). The state's format
is :mod:`raysgd.torch.state`'s, the restart points :mod:`raysgd.torch.restart_points`'.

Example:
    >>> from raysgd.torch.commits.part_holders import buddies
    >>> buddies(["b", "a"])
    {'a': 'b', 'b': 'a'}
"""
