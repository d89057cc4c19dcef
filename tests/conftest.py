"""Shared fixtures: one real local Ray cluster per test module, and clean-up checks."""
import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def worker_env(extra_paths=()):
    """runtime_env letting workers import the test helpers (tests/helpers.py) by name."""
    paths = [*extra_paths, TESTS_DIR, os.environ.get("PYTHONPATH", "")]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}


def start_ray(num_cpus, runtime_env=None, **kwargs):
    """Start a fresh local cluster (never attach to another one)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env or worker_env(),
             **kwargs)
    return ray


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
