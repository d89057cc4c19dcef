"""Shared fixtures: real local Ray clusters (one per size, shared by the modules that ask for it in turn),
multi-node clusters, and clean-up checks."""
import contextlib
import logging
import multiprocessing
import os
import sys
import tempfile

import pytest

import s3_server

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# A child process of the test process (a DataLoader's workers, say) starts by forkserver, never by forking pytest:
# its other threads (Ray's driver threads, loggers' writers) may hold a lock at the fork, and a forked loader once
# hung until pytest's 600 s timeout. Python 3.14 makes forkserver the default on Linux too.
multiprocessing.set_start_method("forkserver", force=True)
# Each test lane (pytest-xdist) keeps its clusters' session folders and ``ray_current_cluster`` in a folder of its
# own, so a bare ``ray.init()`` in one lane never attaches to the other's cluster: tests/README.md says why.
LANE = os.environ.get("PYTEST_XDIST_WORKER", "")
if LANE:
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=f"ray-{LANE}-", dir=os.environ.get("RAY_TMPDIR"))
# The clusters' workers run at niceness 0, not Ray's 15: beside the other lane's busy processes a worker at 15 got
# about 4% of a core (tests/README.md).
os.environ.setdefault("RAY_worker_niceness", "0")
# A Ray worker whose raylet has gone (a killed driver's cluster, a removed node) ends itself when its check of the
# raylet's process next runs: every 100 ms here instead of Ray's 1 s, so a test that waits for those processes to end
# (test_durable_driver.kill_driver) waits less. It is a check by process id, which load cannot make fail early.
os.environ.setdefault("RAY_raylet_death_check_interval_milliseconds", "100")
# The test S3 server's (fake) credentials, set before any Ray cluster starts: checkpoint parts are written and read
# by tasks on the workers' nodes, which need the bucket's credentials as the driver does (a real cluster's nodes get
# them from their environment or instance role).
for _key, _value in s3_server.CREDENTIALS.items():
    os.environ.setdefault(_key, _value)


_log = logging.getLogger("tests.conftest")
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


def _pythonpath(extra_paths=()):
    paths = [*extra_paths, *TEST_FOLDERS, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in paths if p))


#: The clusters the tests start inherit this process's environment, so their workers import the test helpers and
#: test modules by name without a job ``runtime_env``: with one, the workers Ray prestarts fit no actor
#: (ray-project/ray#33621) and each worker, commit store and part holder waits for a new process (0.8 s against
#: 0.16 s; benchmarks/README.md), in every trainer the suite starts.
os.environ["PYTHONPATH"] = _pythonpath()


def worker_env(extra_paths=()):
    """A job runtime_env putting ``extra_paths`` before the test folders on the workers' ``PYTHONPATH`` (the clusters
    inherit the test folders without one; a test that needs more, such as a fake module, passes this)."""
    return {"env_vars": {"PYTHONPATH": _pythonpath(extra_paths)}}


def start_ray(num_cpus, runtime_env=None, **kwargs):
    """Start a fresh local cluster (never attach to another one), or reuse the shared one.

    No dashboard (no test needs it; with ``ray[default]``, which the test extra brings, a cluster's head would start
    it: about 7 s more per multi-node cluster here); every node's metrics agent still runs and exports
    ``ray.util.metrics`` (tests/cluster/integrations/test_ray_metrics.py).

    A plain cluster (``num_cpus`` only: the default runtime_env, no other argument) is shared by the modules that ask
    for one of the same size, one after another: starting and stopping a cluster costs ~5 s, and ~30 modules ask.
    It is reused only when it is the cluster this function started, still has its one node and its CPUs, and the
    module before left nothing behind (no live actor or placement group, every CPU free, waited for as
    ``assert_released`` does); otherwise a fresh one starts. Anything else (a runtime_env, GPUs, a system config)
    gets a cluster of its own."""
    import ray

    shareable = runtime_env is None and not kwargs
    if shareable and _reusable(num_cpus):
        _log.info("reusing the shared %d-CPU cluster", num_cpus)
        return ray
    _log.info("starting a %d-CPU cluster (%s)", num_cpus, "shared" if shareable else "its own")
    _SHARED.clear()
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env, **kwargs)
    if shareable:
        _SHARED.update(num_cpus=num_cpus, node=ray.get_runtime_context().get_node_id())
    return ray


#: The plain cluster start_ray left running for the next module of its size: its CPUs and its head node's id.
_SHARED = {}


def _reusable(num_cpus, settle_s=5.0):
    """Whether the running cluster is the shared one of ``num_cpus`` CPUs, whole and left clean (see start_ray)."""
    import time

    import ray

    if not ray.is_initialized() or _SHARED.get("num_cpus") != num_cpus:
        return False
    if ray.get_runtime_context().get_node_id() != _SHARED.get("node"):  # someone re-initialised Ray in between
        return False
    if sum(1 for node in ray.nodes() if node["Alive"]) != 1 or ray.cluster_resources().get("CPU") != num_cpus:
        return False
    deadline = time.monotonic() + settle_s  # Ray's view of a release lags it by up to ~0.25 s
    while time.monotonic() < deadline:
        if not live_actors() and not live_placement_groups() and ray.available_resources().get("CPU") == num_cpus:
            return True
        time.sleep(0.1)
    return False


#: The shared clusters' fixtures, by their CPUs (see start_ray).
SHARED_FIXTURES = {"ray_2cpus": 2, "ray_4cpus": 4}


def _shared_size(items):
    """The CPUs of the shared cluster a module's tests ask for (through ``ray_2cpus``/``ray_4cpus``), else 0."""
    return max((SHARED_FIXTURES.get(name, 0) for item in items for name in getattr(item, "fixturenames", ())),
               default=0)


#: The modules that took a minute or more in CI (2026-11-30's run, slowest first). Each starts first among the
#: modules of its shared-cluster size, so that with two test lanes the last modules to run are short ones and neither
#: lane waits long for the other at the end. A stale list costs only that balance, never a result.
LONG_MODULES = ("test_benchmarks", "test_fault_tolerance", "test_examples", "test_mlflow", "test_fsdp_state",
                "test_durable_driver", "test_commits", "test_trainer", "test_restart_copies", "test_train_runtime",
                "test_preemption", "test_console_logs", "test_tune", "test_repository", "test_bad_input")


def pytest_collection_modifyitems(session, config, items):
    """Modules that share a cluster of one size run one after another, so each size starts once instead of once
    per module (per lane, with two lanes). The 4-CPU modules come first, then the 2-CPU ones, then the modules
    without a shared cluster, where the many short unit and repository modules end the run; within a size the
    ``LONG_MODULES`` start first, and the others keep the collected order."""
    modules = {}
    for item in items:
        modules.setdefault(_module_name(item), []).append(item)
    _MODULE_SIZES.update({name: _shared_size(module) for name, module in modules.items()})

    def place(name):
        long_rank = LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)
        return -_MODULE_SIZES[name], long_rank

    order = sorted(modules, key=place)  # stable: the collected order within a size, after the long modules
    items[:] = [item for name in order for item in modules[name]]


#: Each collected module's shared-cluster size (pytest_collection_modifyitems).
_MODULE_SIZES = {}


def _module_name(item):
    module = getattr(item, "module", None)
    return module.__name__ if module is not None else item.nodeid.split("::")[0]


@pytest.fixture(scope="module", autouse=True)
def _no_cluster_left_from_another_module(request):
    """A module that asks for no shared cluster starts with none running, as when every module stopped its own:
    the shared one left by the module before is stopped first."""
    if _SHARED and not _MODULE_SIZES.get(request.module.__name__, 0):
        import ray

        _SHARED.clear()
        ray.shutdown()
    yield


@pytest.fixture(scope="session", autouse=True)
def _stop_the_shared_cluster():
    """The shared cluster (see start_ray) is stopped once, after the last module."""
    yield
    if _SHARED:
        import ray

        ray.shutdown()


#: The multi-node clusters' system config. Node deaths are noticed in about 2 s (Ray's default health check takes
#: much longer), and Ray's metrics are off: after a test removes a node, the driver's ``ray.shutdown()`` otherwise
#: spends ~20 s timing out metric exports to that node's gone agent. No multi-node test reads Ray's metrics
#: (tests/cluster/integrations/test_ray_metrics.py starts a single-node cluster of its own).
MULTI_NODE_SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                            "enable_metrics_collection": False}


@contextlib.contextmanager
def local_cluster(head_node_args, nodes, runtime_env=None):
    """A real multi-node ``ray.cluster_utils.Cluster`` on this machine, Ray attached: yields ``(cluster, nodes)``."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True,  # no dashboard: see start_ray
                      head_node_args={"include_dashboard": False, **head_node_args,
                                      "_system_config": MULTI_NODE_SYSTEM_CONFIG})
    try:
        added = [cluster.add_node(**node) for node in nodes]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env=runtime_env)
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
    """A local 2-CPU cluster, shared with the next module that asks for one when this module leaves it clean."""
    return start_ray(2)


@pytest.fixture(scope="module")
def ray_4cpus():
    """A local 4-CPU cluster, shared like ``ray_2cpus``."""
    return start_ray(4)


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
