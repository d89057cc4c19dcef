"""A side channel from one worker to the driver: a 0-CPU actor next to the driver holding the latest post.

Layer 6, like :mod:`raysgd.torch.execution.worker_group` (the only other module touching actor handles).
Rank 0's progress bar updates travel through it (:mod:`raysgd.torch.integrations.progress`).

Example:
    >>> # box = Mailbox(); box.post({"n": 3}, tag=1); ray.get(box.read()) -> ({'n': 3}, 1, 1)
"""
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysgd.torch.restart_points.transport import by_value


class _MailboxActor:
    def __init__(self):
        self._newest = (None, None, 0)  # value, tag, how many posts under that tag

    def post(self, value, tag):
        self._newest = (value, tag, self._newest[2] + 1 if tag == self._newest[1] else 1)

    def read(self):
        return self._newest


class Mailbox:
    """A side channel from a worker to the driver (rank 0's progress): a 0-CPU actor next to the driver.

    It keeps the latest value posted and how many posts came under its tag. Pickled to a worker, the
    object is the sending end. Both calls return an ObjectRef and never wait.

    Example:
        >>> # box = Mailbox(); box.post({"n": 3}, tag=1); ray.get(box.read()) -> ({'n': 3}, 1, 1)
    """

    def __init__(self):
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        # by value: its process imports neither raysgd nor torch, so it serves within a second, not after the
        # seconds of torch's import (rank 0's posts and the driver's reads of the first call would wait for it)
        self._actor = ray.remote(num_cpus=0)(by_value(_MailboxActor)).options(scheduling_strategy=here).remote()

    def post(self, value, tag):
        return self._actor.post.remote(value, tag)

    def read(self):
        return self._actor.read.remote()

    def close(self):
        ray.kill(self._actor, no_restart=True)
