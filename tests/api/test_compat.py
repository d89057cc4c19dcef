"""raysgd.compat and python -m raysgd.legacy: 1.x module paths map to raysgd, in the driver and in Ray workers."""
import importlib
import importlib.util
import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import ray
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

import raysgd
from conftest import TESTS_DIR, assert_released
from raysgd import compat, legacy
from raysgd.torch.constants import LEGACY_IMPORTS_ENV

LEGACY_SCRIPTS = pathlib.Path(TESTS_DIR) / "legacy_scripts"
MAPPED = ["", ".utils", ".torch", ".torch.torch_trainer", ".torch.training_operator", ".torch.constants",
          ".torch.resnet", ".torch.examples", ".torch.examples.train_example", ".torch.examples.dcgan",
          ".torch.examples.cifar_pytorch_example", ".torch.tune", ".torch.examples.tune_example"]


def _subprocess_env():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", LEGACY_IMPORTS_ENV)}
    return env


@pytest.fixture
def installed():
    compat.install()
    yield
    compat.uninstall()


def test_ray_2_ships_a_ray_util_sgd_that_only_raises():
    """The precondition for the finder: without it, the 1.x imports fail."""
    assert not compat.is_installed()
    with pytest.raises(DeprecationWarning, match="Ray SGD has been deprecated"):
        importlib.import_module("ray.util.sgd")


@pytest.mark.parametrize("suffix", MAPPED)
def test_every_legacy_path_is_the_raysgd_module(installed, suffix):
    target = "raysgd" + suffix
    if importlib.util.find_spec(target) is None:
        pytest.skip(f"{target} is not written yet (another part of the project)")
    legacy_module = importlib.import_module("ray.util.sgd" + suffix)
    assert legacy_module is importlib.import_module(target)
    assert legacy_module.__name__ == target  # classes keep raysgd names, so Ray pickles them by those names


def test_public_names_and_pickling(installed):
    from ray.util.sgd import PyTorchTrainer, TorchTrainer
    from ray.util.sgd.torch import CreatorOperator, TrainingOperator
    from ray.util.sgd.torch.constants import NUM_STEPS, SCHEDULER_STEP, USE_FP16
    from ray.util.sgd.torch.examples.train_example import LinearDataset
    from ray.util.sgd.torch.resnet import ResNet18
    from ray.util.sgd.torch.training_operator import get_test_metrics_operator, get_test_operator
    from ray.util.sgd.utils import BATCH_SIZE, NUM_SAMPLES, AverageMeterCollection, override

    assert (NUM_STEPS, SCHEDULER_STEP, USE_FP16, NUM_SAMPLES) == ("__num_steps__", "scheduler_step", "__use_fp16__",
                                                                  "num_samples")
    assert all(callable(f) for f in (get_test_operator, get_test_metrics_operator, AverageMeterCollection, override))
    assert TorchTrainer is raysgd.TorchTrainer and TrainingOperator is raysgd.TrainingOperator
    assert issubclass(CreatorOperator, TrainingOperator)
    assert BATCH_SIZE == "*batch_size" and len(LinearDataset(2, 5, size=10)) == 10
    assert ResNet18({"num_classes": 4})(torch.zeros(1, 3, 32, 32)).shape == (1, 4)
    with pytest.raises(DeprecationWarning, match="TorchTrainer"):
        PyTorchTrainer()
    payload = pickle.dumps(TrainingOperator)
    assert b"raysgd.torch.training_operator" in payload and b"ray.util.sgd" not in payload


def test_1x_names_behind_mapped_module_paths(installed):
    from ray.util.sgd.torch.torch_trainer import BaseTorchTrainable, TorchTrainer
    from ray.util.sgd.torch.training_operator import CreatorOperator, TrainingOperator
    from ray.util.sgd.torch.worker_group import RESIZE_COOLDOWN_S
    from ray.util.sgd.utils import check_for_failure

    from raysgd.torch import constants
    from raysgd.torch.integrations import tune

    assert BaseTorchTrainable is tune.BaseTorchTrainable and TorchTrainer is raysgd.TorchTrainer
    assert issubclass(CreatorOperator, TrainingOperator) and CreatorOperator is raysgd.torch.CreatorOperator
    assert RESIZE_COOLDOWN_S == constants.RESIZE_COOLDOWN_S == 10  # 1.x's value (SGD_RESIZE_COOLDOWN_S not set)
    assert callable(check_for_failure) and check_for_failure.__doc__
    for module, name in (("ray.util.sgd.utils", "no_such_name"), ("ray.util.sgd.torch.torch_trainer", "nope"),
                         ("ray.util.sgd.torch.training_operator", "nope")):
        with pytest.raises(AttributeError, match=name):
            getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("name", sorted(compat.GONE) + ["ray.util.sgd.torch.torch_dataset.TorchMLDataset"])
def test_removed_paths_say_what_replaces_them(installed, name):
    with pytest.raises(ModuleNotFoundError, match="is gone in raysgd") as info:
        importlib.import_module(name)
    assert name.startswith(info.value.name)  # a submodule of a removed package fails at the package
    assert any(word in str(info.value) for word in ("use", "Use", "instead", "now"))


def test_sharded_dataset_paths_map_to_raysgd_data(installed):
    from ray.util.sgd.data import Dataset
    from ray.util.sgd.data.dataset import Dataset as FromModule
    from ray.util.sgd.data.examples.mlp_identity import dataset_creator, model_creator, optimizer_creator, to_mat

    import raysgd.data

    assert Dataset is raysgd.data.Dataset is FromModule
    assert isinstance(dataset_creator(num_points=64), Dataset) and to_mat(0.5).shape == (1, 1)
    assert callable(model_creator) and callable(optimizer_creator)


def test_unknown_paths_list_what_exists(installed):
    with pytest.raises(ModuleNotFoundError, match="no raysgd counterpart") as info:
        importlib.import_module("ray.util.sgd.torch.examples.segmentation")
    assert "train_example" in str(info.value) and "dcgan" in str(info.value)


def test_uninstall_restores_ray(installed):
    importlib.import_module("ray.util.sgd.torch")
    assert os.environ[LEGACY_IMPORTS_ENV] == "1"
    compat.uninstall()
    assert "ray.util.sgd" not in sys.modules and LEGACY_IMPORTS_ENV not in os.environ
    with pytest.raises(DeprecationWarning):
        importlib.import_module("ray.util.sgd")
    compat.install()  # for the fixture's uninstall


def test_runner_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as info:
        legacy.main([])
    assert info.value.code == 2 and "expected a script path or -m module" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        legacy.main(["no_such_script.py"])
    assert info.value.code == 2 and "'no_such_script.py', which is not a file" in capsys.readouterr().err


def test_runner_runs_a_1x_module_path():
    result = subprocess.run(
        [sys.executable, "-m", "raysgd.legacy", "-m", "ray.util.sgd.torch.examples.train_example", "--help"],
        capture_output=True, text=True, timeout=120, env=_subprocess_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RaySGD linear regression" in result.stdout


def test_legacy_script_with_two_workers(tmp_path):
    """An unchanged 1.x script (and a helper module it imports) trains on 2 workers under python -m raysgd.legacy."""
    out = tmp_path / "result.json"
    script = LEGACY_SCRIPTS / "legacy_linear.py"
    result = subprocess.run(
        [sys.executable, "-m", "raysgd.legacy", str(script), "--num-workers", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=_subprocess_env())
    assert result.returncode == 0, result.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["name"] == "__main__"
    assert report["argv"] == [str(script), "--num-workers", "2", "--out", str(out)]
    assert report["losses"][-1] < report["losses"][0]
    assert report["val_num_samples"] == 100
    workers = report["workers"]
    assert len(workers) == 2 and len({w["pid"] for w in workers} | {report["driver_pid"]}) == 3
    assert all(w["operator_module"] == "raysgd.torch.training_operator" for w in workers)


def test_mapping_reaches_workers_of_a_running_cluster(ray_2cpus):
    """install() after ray.init(): the worker group forwards the flag, so a worker's own ray.util.sgd imports work."""
    # Precondition: this cluster's processes did not inherit the flag (else the test proves nothing).
    assert ray.get(ray.remote(lambda: os.environ.get(LEGACY_IMPORTS_ENV)).remote(), timeout=60) is None
    compat.install()

    class ImportsOnWorker(raysgd.TrainingOperator):
        def setup(self, config):
            import ray.util.sgd.utils as legacy_utils  # executed in the worker process

            from raysgd.torch.examples.train_example import LinearDataset

            model = nn.Linear(1, 1)
            self.model, self.optimizer, self.criterion = self.register(
                models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01), criterion=nn.MSELoss())
            self.register_data(train_loader=DataLoader(LinearDataset(2, 5, size=64), batch_size=16))
            self.batch_key = legacy_utils.BATCH_SIZE

    trainer = raysgd.TorchTrainer(training_operator_cls=ImportsOnWorker, num_workers=2, timeout_s=60)
    try:
        assert trainer.apply_all_operators(lambda op: op.batch_key) == ["*batch_size"] * 2
        assert trainer.apply_all_workers(lambda: os.environ.get(LEGACY_IMPORTS_ENV)) == ["1", "1"]
        assert trainer.train()["num_samples"] == 64
    finally:
        trainer.shutdown()
        compat.uninstall()
    assert_released()


def test_check_for_failure_waits_and_reports_dead_actors_as_1x(ray_2cpus):
    """1.x's ``check_for_failure(remote_values)``: True when every call succeeded, False when an actor died;
    an exception raised by the called code propagates."""
    from raysgd.utils import check_for_failure

    @ray.remote(num_cpus=0)
    class Worker:
        def ok(self, seconds=0.0):
            import time

            time.sleep(seconds)
            return 1

        def die(self):
            os._exit(1)

        def fail(self):
            raise KeyError("user code")

    worker = Worker.remote()
    assert check_for_failure([worker.ok.remote(0.5), worker.ok.remote(), ray.put(3)]) is True
    assert check_for_failure([]) is True
    with pytest.raises(KeyError, match="user code"):
        check_for_failure([worker.fail.remote()])
    assert check_for_failure([worker.ok.remote(), worker.die.remote()]) is False
