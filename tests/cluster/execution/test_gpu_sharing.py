"""Fractional GPUs (``num_gpus_per_worker``): Ray's GPU accounting on a real cluster, with no CUDA needed.

The cluster declares one GPU. Ray schedules by its resource counts and hands every actor its GPU ids whether
or not a CUDA device exists, so placement, the id each worker gets and the worker count that fits are all real
here; the workers' torch sees no CUDA, so they train on the CPU (and say so). On a GPU the same group runs in
``tests/cluster/execution/test_cuda.py``.
"""
import logging

import pytest
import ray
import torch

from conftest import start_ray
from helpers import LinearOperator, tune_two_workers_on_one_gpu


@pytest.fixture(scope="module")
def one_gpu_cluster():
    cluster = start_ray(4, num_gpus=1)  # 4 logical CPUs: a Tune trial's bundle and two workers
    yield cluster
    cluster.shutdown()


def placed_bundles():
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    return [bundle for group in groups for bundle in group["bundles"].values()]


def test_two_workers_share_one_gpu_over_gloo(one_gpu_cluster, trainer_factory):
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, use_gpu=True,
                              num_gpus_per_worker=0.5)
    assert trainer.backend == "gloo"  # nccl refuses two ranks on one device
    assert trainer.worker_group.num_workers == 2
    assert sorted(placed_bundles(), key=str) == [{"CPU": 1.0, "GPU": 0.5}] * 2
    assert trainer.apply_all_workers(lambda: [int(i) for i in ray.get_gpu_ids()]) == [[0], [0]]
    assert ray.available_resources().get("GPU", 0) == 0  # the two halves hold the whole GPU
    stats = trainer.train()
    assert stats["num_samples"] == 200
    assert trainer.apply_all_workers(lambda: __import__("torch").distributed.get_backend()) == ["gloo", "gloo"]
    # both on the one device (here, without CUDA in the workers, the CPU: see the next test)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert trainer.apply_all_operators(lambda op: str(op.device)) == [device, device]


def test_the_elastic_range_counts_fractions_of_the_gpu(one_gpu_cluster, trainer_factory):
    # 8 workers of half a CPU fit the 4 CPUs; the one GPU holds only 2 workers of 0.5 GPU
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=(1, 4), use_gpu=True,
                              num_gpus_per_worker=0.5, num_cpus_per_worker=0.5)
    assert trainer.worker_group.num_workers == 2
    assert trainer.train()["num_samples"] == 200


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the warning of a worker whose torch sees no CUDA")
def test_a_worker_without_cuda_warns_that_it_trains_on_the_cpu(one_gpu_cluster, trainer_factory, caplog):
    caplog.set_level(logging.WARNING)
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=1, use_gpu=True,
                              num_gpus_per_worker=0.25, use_local=True)  # rank 0 here: its log is caplog's
    assert trainer.backend == "gloo"
    assert any("sees no CUDA device" in r.getMessage() and "trains on the CPU" in r.getMessage()
               for r in caplog.records)
    assert trainer.train()["num_samples"] == 200


def test_a_tune_trial_puts_two_workers_on_one_gpu(one_gpu_cluster, tmp_path):
    pytest.importorskip("ray.tune", reason="needs ray[tune]")
    result = tune_two_workers_on_one_gpu(tmp_path)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert result.metrics["devices"] == f"{device},{device}" and result.metrics["backend"] == "gloo"
