"""Shared fixtures: one real local Ray cluster per test module, multi-node clusters, and clean-up checks."""
import contextlib
import os
import sys

import pytest

import s3_server

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# The test S3 server's (fake) credentials, set before any Ray cluster starts: checkpoint parts are written and read
# by tasks on the workers' nodes, which need the bucket's credentials as the driver does (a real cluster's nodes get
# them from their environment or instance role).
for _key, _value in s3_server.CREDENTIALS.items():
    os.environ.setdefault(_key, _value)


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)


def _test_folders():
    """tests/ (the shared support modules: helpers.py, train_functions.py, s3_server.py, ...) and every folder below
    it holding test modules (tests/README.md maps them)."""
    folders = [TESTS_DIR]
    for area in ("unit", "cluster", "api", "repo"):
        for folder, _, names in sorted(os.walk(os.path.join(TESTS_DIR, area))):
            if any(name.startswith("test_") and name.endswith(".py") for name in names):
                folders.append(folder)
    return folders


#: Pytest imports a test module by its basename, so a function or class defined in one is pickled by that name:
#: Ray's workers import it from these folders (``worker_env``), and a test imports another's helpers
#: (``from test_durable_driver import ...``) whichever folder pytest collected first.
TEST_FOLDERS = _test_folders()
for _folder in reversed(TEST_FOLDERS):
    if _folder not in sys.path:
        sys.path.insert(0, _folder)


def worker_env(extra_paths=()):
    """runtime_env letting workers import the test helpers (tests/helpers.py) and test modules by name."""
    paths = [*extra_paths, *TEST_FOLDERS, os.environ.get("PYTHONPATH", "")]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}


def start_ray(num_cpus, runtime_env=None, **kwargs):
    """Start a fresh local cluster (never attach to another one).

    No dashboard (no test needs it; with ``ray[default]``, which the test extra brings, a cluster's head would start
    it: about 7 s more per multi-node cluster here); every node's metrics agent still runs and exports
    ``ray.util.metrics`` (tests/cluster/integrations/test_ray_metrics.py)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env or worker_env(),
             **kwargs)
    return ray


#: Node deaths noticed in about 2 s (Ray's default health check takes much longer).
FAST_HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}


@contextlib.contextmanager
def local_cluster(head_node_args, nodes, runtime_env=None):
    """A real multi-node ``ray.cluster_utils.Cluster`` on this machine, Ray attached: yields ``(cluster, nodes)``."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head_node_args,
                                                            "_system_config": FAST_HEALTH_CHECK})  # no dashboard: see start_ray
    try:
        added = [cluster.add_node(**node) for node in nodes]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env=runtime_env or worker_env())
        yield cluster, added
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def two_node_cluster():
    """A 0-CPU head and two 1-CPU worker nodes: ``(cluster, [node_a, node_b])``."""
    with local_cluster({"num_cpus": 0}, [{"num_cpus": 1}, {"num_cpus": 1}]) as made:
        yield made


@pytest.fixture(scope="module")
def ray_2cpus():
    ray = start_ray(2)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_4cpus():
    ray = start_ray(4)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _driver_process_group():
    """use_local puts rank 0 in this process: leave no process group behind for the next test."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def live_actors():
    """Actors of this job that are not dead."""
    from ray._private.state import state

    return [a for a in state.actor_table(None).values() if a["State"] != "DEAD"]


def live_placement_groups():
    import ray

    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def assert_released(timeout_s=10):
    """No live actor or placement group is left, and every CPU is free again."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        actors, pgs = live_actors(), live_placement_groups()
        free = ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0)
        if (not actors and not pgs and free) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not actors, f"actors left behind: {actors}"
    assert not pgs, f"placement groups left behind: {pgs}"
    assert free, f"CPUs not released: {ray.available_resources()} of {ray.cluster_resources()}"


@pytest.fixture
def trainer_factory():
    """``make(**kwargs)`` builds a TorchTrainer (defaults: ``timeout_s=60``); all are shut down afterwards."""
    from raysgd import TorchTrainer

    made = []

    def make(**kwargs):
        kwargs.setdefault("timeout_s", 60)
        trainer = TorchTrainer(**kwargs)
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.shutdown()
