"""A trainer that finds Ray not started starts a fresh local cluster without the dashboard (cluster_state.start_ray).

No shared cluster here: the module before left none running (tests/conftest.py), so the trainer is the one that
starts Ray, as in a user's script that never calls ``ray.init``.
"""
import pytest
import ray
import psutil  # noqa: I001 (after ray: Ray puts its own psutil, ray/thirdparty_files, on sys.path)

from helpers import LinearOperator
from raysgd import TorchTrainer


def dashboard_processes():
    """The dashboard's module processes (``ray-dashboard-<Module>-0``) under this process: with the dashboard on,
    the head starts about nine of them (what they cost: ``start_ray``'s docstring)."""
    return [p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("ray-dashboard-")]


def test_a_trainer_starts_a_local_cluster_without_the_dashboard(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        pytest.skip("Ray was started before this test (the trainer would not start it)")
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=1, config={"data_size": 32})
    try:
        assert ray.is_initialized() and ray.cluster_resources().get("CPU", 0) >= 1
        assert dashboard_processes() == []
        assert trainer.train()["num_samples"] == 32
    finally:
        trainer.shutdown()
        ray.shutdown()
