"""Ray Tune integration: resource requests, real Tune runs (Tuner and tune.run), checkpoints, trial restore.

One local 4-CPU Ray cluster for the module; tiny linear-regression trainers.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")
tune = pytest.importorskip("ray.tune", reason="needs ray[tune]")

from raysgd import TorchTrainer  # noqa: E402
from raysgd.torch import BaseTorchTrainable  # noqa: E402
from raysgd.torch.integrations import tune as raysgd_tune  # noqa: E402
from raysgd.utils import BATCH_SIZE  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: tune_operators.py
ROOT = os.path.dirname(TESTS_DIR)
sys.path.insert(0, TESTS_DIR)
from tune_operators import CrashingOperator, LinearOperator  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False)  # its workers inherit the test folders (conftest)
    yield ray
    ray.shutdown()


def live_placement_groups():
    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def assert_released(timeout_s=15):
    """No placement group or trial actor is left and every CPU is free again (removal is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free = ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", 0)
        if not live_placement_groups() and free:
            return
        time.sleep(0.2)
    assert not live_placement_groups(), f"placement groups left behind: {live_placement_groups()}"
    assert free, f"CPUs not released: {ray.available_resources()} of {ray.cluster_resources()}"


# --------------------------------------------------------------------- without a Tune run
def test_resource_request_bundles():
    if ray.is_initialized():  # a running cluster also checks the request against what it has (tests below)
        ray.shutdown()
    trainable = TorchTrainer.as_trainable(training_operator_cls=LinearOperator, num_workers=2, use_gpu=False)
    request = trainable.default_resource_request({})
    assert request.bundles == [{"CPU": 1}, {"CPU": 1}, {"CPU": 1}]
    assert request.strategy == "PACK"
    # use_local: rank 0 is the trainable itself, so no separate driver bundle
    assert trainable.default_resource_request({"use_local": True}).bundles == [{"CPU": 1}, {"CPU": 1}]
    # the Tune config overrides the captured kwargs
    request = trainable.default_resource_request({"num_workers": 3, "num_cpus_per_worker": 2})
    assert request.bundles == [{"CPU": 1}] + [{"CPU": 2}] * 3
    gpu = TorchTrainer.as_trainable(training_operator_cls=LinearOperator, use_gpu=True, num_cpus_per_worker=2)
    assert gpu.default_resource_request({}).bundles == [{"CPU": 1}, {"CPU": 2, "GPU": 1}]
    shared = TorchTrainer.as_trainable(training_operator_cls=LinearOperator, use_gpu=True, num_workers=2,
                                       num_gpus_per_worker=0.5)
    assert shared.default_resource_request({}).bundles == [{"CPU": 1}] + [{"CPU": 1, "GPU": 0.5}] * 2
    assert shared.default_resource_request({"num_gpus_per_worker": 0.25}).bundles[1] == {"CPU": 1, "GPU": 0.25}
    with pytest.raises(ValueError, match="num_gpus_per_worker expects a fraction in"):
        shared.default_resource_request({"num_gpus_per_worker": 2.5})
    # "auto" (the default) is resolved: on a machine and cluster without GPUs, no GPU is requested
    auto = TorchTrainer.as_trainable(training_operator_cls=LinearOperator)
    assert auto.default_resource_request({}).bundles == [{"CPU": 1}, {"CPU": 1}]
    with pytest.raises(ValueError, match="num_workers expects an int >= 1; got 0"):
        trainable.default_resource_request({"num_workers": 0})


def test_as_trainable_checks_its_arguments():
    with pytest.raises(ValueError, match="exactly 2 parameters"):
        TorchTrainer.as_trainable(training_operator_cls=LinearOperator, override_tune_step=lambda trainer: {})
    with pytest.raises(ValueError, match="exactly 2 parameters"):
        TorchTrainer.as_trainable(training_operator_cls=LinearOperator, override_tune_step=lambda a, b, c: {})
    with pytest.raises(TypeError, match="expects a callable"):
        TorchTrainer.as_trainable(training_operator_cls=LinearOperator, override_tune_step="step")
    with pytest.raises(ValueError, match="use_gpu expects True, False or 'auto'; got 'yes'"):
        TorchTrainer.as_trainable(training_operator_cls=LinearOperator, use_gpu="yes")
    trainable = TorchTrainer.as_trainable(training_operator_cls=LinearOperator, override_tune_step=lambda t, i: {})
    assert issubclass(trainable, BaseTorchTrainable) and issubclass(trainable, tune.Trainable)


def test_trial_kwargs_merge_tune_config_without_mutating():
    captured = {"training_operator_cls": LinearOperator, "num_workers": 1, "use_gpu": "auto",
                "config": {"lr": 0.1, "batch_size": 8}}
    kwargs = raysgd_tune.trainer_kwargs_for({"lr": 0.5, "num_workers": 2}, captured)
    assert kwargs["config"] == {"lr": 0.5, "batch_size": 8, "num_workers": 2}
    assert kwargs["num_workers"] == 2 and kwargs["use_gpu"] is False  # as the resource request resolved it
    assert captured["config"] == {"lr": 0.1, "batch_size": 8} and captured["num_workers"] == 1
    assert captured["use_gpu"] == "auto"


def test_import_raysgd_does_not_need_tune():
    code = (
        "import sys\n"
        "import raysgd, raysgd.torch\n"
        "assert 'ray.tune' not in sys.modules, 'import raysgd imported ray.tune'\n"
        "sys.modules['ray.tune'] = None  # as if ray[tune] were not installed\n"
        "from raysgd import TorchTrainer\n"
        "from tune_operators import LinearOperator\n"
        "try:\n"
        "    TorchTrainer.as_trainable(training_operator_cls=LinearOperator)\n"
        "except ImportError as err:\n"
        "    assert 'pip install \"raysgd[tune]\"' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('as_trainable worked without Tune')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_trial_that_can_never_fit_is_refused_naming_what_it_asks_and_what_exists():
    check = raysgd_tune.check_trial_fits
    check([{"CPU": 1}, {"CPU": 2}], {"CPU": 3, "GPU": 0}, [{"CPU": 2, "GPU": 0}, {"CPU": 1, "GPU": 0}])
    check([{"CPU": 1}] * 5, {"CPU": 2**63 - 1, "GPU": 0}, None)  # an autoscaler that may add nodes: no error
    check([{"CPU": 1}] * 5, None, None)  # a cluster that may grow by an unknown amount: no error
    with pytest.raises(ValueError, match=r"asks for 5 CPUs and 0 GPUs .* can have at most 4 CPUs and 0 GPUs"):
        check([{"CPU": 1}] * 5, {"CPU": 4, "GPU": 0}, None)
    with pytest.raises(ValueError, match=r"asks for 3 CPUs and 2 GPUs .* at most 8 CPUs and 1 GPUs"):
        check([{"CPU": 1}, {"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}], {"CPU": 8, "GPU": 1}, None)
    with pytest.raises(ValueError, match=r"no node can hold the bundle \{'CPU': 3\}"):  # 4 CPUs, but 2 per node
        check([{"CPU": 1}, {"CPU": 3}], {"CPU": 4, "GPU": 0}, [{"CPU": 2, "GPU": 0}, {"CPU": 2, "GPU": 0}])


def test_the_1x_tune_example_asking_more_than_the_cluster_fails_at_once():
    """1.x's tune_example(num_workers=2) on 2 CPUs: 6 trials of 3 CPUs each stayed PENDING forever."""
    code = (
        "import ray\n"
        "ray.init(address='local', num_cpus=2, include_dashboard=False)\n"
        "from raysgd.torch.examples.tune_example import get_custom_training_operator, tune_example\n"
        "try:\n"
        "    tune_example(get_custom_training_operator(), num_workers=2, storage_path=STORAGE)\n"
        "except ValueError as err:\n"
        "    print('REFUSED:', err)\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with tempfile.TemporaryDirectory() as storage:
        done = subprocess.run([sys.executable, "-c", f"STORAGE = {storage!r}\n" + code], env=env, text=True,
                              capture_output=True, timeout=180)  # before the check: PENDING until killed here
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED: as_trainable: each trial asks for 3 CPUs and 0 GPUs" in done.stdout, done.stdout[-3000:]
    assert "the cluster can have at most 2 CPUs and 0 GPUs" in done.stdout


def test_the_running_clusters_limits_are_read(cluster):
    assert raysgd_tune.cluster_limits() == ({"CPU": 4, "GPU": 0}, [{"CPU": 4, "GPU": 0}])  # local: cannot grow
    trainable = TorchTrainer.as_trainable(training_operator_cls=LinearOperator, num_workers=2, use_gpu=False)
    assert len(trainable.default_resource_request({}).bundles) == 3
    with pytest.raises(ValueError, match=r"asks for 5 CPUs and 0 GPUs .* can have at most 4 CPUs"):
        trainable.default_resource_request({"num_workers": 4})
    with pytest.raises(ValueError, match=r"asks for 2 CPUs and 1 GPUs .* at most 4 CPUs and 0 GPUs"):
        trainable.default_resource_request({"use_gpu": True, "num_workers": 1})


# --------------------------------------------------------------------- real Tune runs
def _load_script(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tuner_grid_two_trials_with_checkpoints_that_restore(cluster, tmp_path):
    """examples/tune_example.py --smoke-test --manual: a 2-trial lr grid of 1-worker trainers with tune.Tuner."""
    script = _load_script("tune_example_script", os.path.join(ROOT, "examples", "tune_example.py"))
    results = script.main(["--smoke-test", "--manual", "--storage-path", str(tmp_path)])
    assert not results.errors
    assert sorted(r.config["lr"] for r in results) == [1e-4, 1e-3]
    for result in results:
        assert result.metrics["training_iteration"] == 2 and result.metrics["epoch"] == 2
        assert {"train_loss", "val_loss", "num_samples"} <= set(result.metrics)
        assert 0 < result.metrics["lr"] <= result.config["lr"]  # ReduceLROnPlateau, stepped by the custom step
        assert os.path.isfile(os.path.join(result.checkpoint.path, raysgd_tune.CHECKPOINT_FILE))
    best = results.get_best_result()
    assert best.metrics["val_loss"] == min(r.metrics["val_loss"] for r in results)
    # the checkpoint restores: a fresh trainer loaded from it validates to the trial's last val_loss
    operator_cls = script.get_custom_training_operator(lr_reduce_on_plateau=True)
    trainer = TorchTrainer(training_operator_cls=operator_cls, config={BATCH_SIZE: 128, **best.config},
                           use_local=True, use_gpu=False, scheduler_step_freq="manual")
    try:
        trainer.load(os.path.join(best.checkpoint.path, raysgd_tune.CHECKPOINT_FILE))
        assert trainer.state_dict()["epoch"] == 2
        assert trainer.validate()["val_loss"] == pytest.approx(best.metrics["val_loss"], rel=1e-5)
    finally:
        trainer.shutdown()
    assert_released()


def _inspect_step(trainer, info):
    """A custom step reporting where the trial's workers run, besides train and validation metrics."""
    import os as _os

    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    worker_pgs = trainer.apply_all_workers(lambda: ray.get_runtime_context().get_placement_group_id())
    worker_pids = trainer.apply_all_workers(_os.getpid)
    available = ray.available_resources()
    stats = {**trainer.train(), **trainer.validate()}
    return {**stats, "iteration_seen": info["iteration"], "trial_pg": pg.id.hex() if pg else None,
            "same_pg": all(w == pg.id.hex() for w in worker_pgs), "num_workers_seen": len(worker_pids),
            "rank0_in_trainable": worker_pids[0] == _os.getpid(), "num_bundles": len(pg.bundle_specs),
            "created_pgs": sum(p["state"] == "CREATED" for p in ray.util.placement_group_table().values()),
            "own_pg": trainer.worker_group._own_pg,
            "bundle_cpus_free": sum(available.get(f"CPU_group_{i}_{pg.id.hex()}", 0)
                                    for i in range(len(pg.bundle_specs)))}


def test_tune_run_two_workers_custom_step_in_one_placement_group(cluster, tmp_path):
    """tune.run (the 1.x API): 2-worker trials, with and without use_local, in the trial's own placement group."""
    trainable = TorchTrainer.as_trainable(training_operator_cls=LinearOperator, num_workers=2, use_gpu=False,
                                          config={"batch_size": 8}, override_tune_step=_inspect_step)
    analysis = tune.run(trainable, config={"lr": 1e-3, "use_local": tune.grid_search([False, True])},
                        stop={"training_iteration": 2}, storage_path=str(tmp_path),
                        checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True), verbose=0)
    assert len(analysis.trials) == 2
    for trial in analysis.trials:
        use_local = trial.config["use_local"]
        assert trial.status == "TERMINATED"
        result = trial.last_result
        assert result["iteration_seen"] == 1  # info["iteration"]: steps completed before this one
        assert result["trial_pg"] and result["same_pg"] and result["num_workers_seen"] == 2
        assert result["rank0_in_trainable"] is use_local  # use_local: the trainable process is rank 0
        assert result["num_bundles"] == (2 if use_local else 3)  # no driver bundle with use_local
        # no nested placement group (the other trial's group waits, PENDING, for the CPUs this one holds)
        assert result["created_pgs"] == 1 and result["own_pg"] is False
        assert result["bundle_cpus_free"] == 0  # the trainable and the workers fill every bundle
        assert result["num_samples"] == 32 and result["epoch"] == 2
        assert os.path.isfile(os.path.join(trial.checkpoint.path, raysgd_tune.CHECKPOINT_FILE))
    assert_released()


def test_trial_restored_by_tune_after_failure(cluster, tmp_path):
    """The worker dies twice in iteration 2: once retried inside the trial, then beyond retries -> Tune restores."""
    crash_dir = tmp_path / "crashes"
    crash_dir.mkdir()
    trainable = TorchTrainer.as_trainable(
        training_operator_cls=CrashingOperator, num_workers=1, use_gpu=False,
        config={"batch_size": 16, "crash_dir": str(crash_dir), "crash_epoch": 1, "crashes": 2})
    assert trainable.max_retries == 1
    tuner = tune.Tuner(trainable, param_space={"lr": 1e-3}, run_config=tune.RunConfig(
        stop={"training_iteration": 3}, storage_path=str(tmp_path / "results"), verbose=0,
        checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1),
        failure_config=tune.FailureConfig(max_failures=1)))
    [result] = tuner.fit()
    assert result.error is None
    assert len(os.listdir(crash_dir)) == 2  # both crashes happened; Tune saw only the second one
    assert result.metrics["training_iteration"] == 3
    assert result.metrics["iterations_since_restore"] == 2  # restored from the checkpoint of iteration 1
    assert result.metrics["epoch"] == 3  # the restored trainer went on from the checkpoint's epoch 1
    assert_released()


def test_worker_deadline_ends_as_worker_failure(cluster):
    """A worker that misses its deadline (as when a lost node's bundle cannot be re-placed) is a WorkerFailure.

    Regression: the deadline's cause was text, and ``raise ... from <str>`` turned it into a TypeError.
    """
    from raysgd.torch.errors import WorkerFailure

    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=1, use_gpu=False)
    try:
        with pytest.raises(WorkerFailure, match="no answer within 1 s"):
            trainer.worker_group.run("apply", lambda: time.sleep(30), deadline_s=1)
    finally:
        trainer.shutdown()
    assert_released()
