"""Which CUDA device a training function's worker picks, with torch.cuda stood in for (no GPU, no Ray)."""
import os

import pytest
import torch

import raysgd.train.torch
from raysgd.train.function_worker import FunctionWorker


@pytest.fixture
def four_gpus(monkeypatch):
    """torch.cuda as a process that has not started CUDA sees it on a node of four GPUs; ``set_device`` recorded."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)  # restored after the test: run_loop sets them
    return chosen


def device_of(local_rank, node_gpus, own_gpus):
    """What get_device() gives inside a training function run with the arguments the driver gives a rank."""
    worker = FunctionWorker(lambda: raysgd.train.torch.get_device(), {}, is_local=True, use_gpu=True)
    worker.setup_operator(local_rank)
    answer = worker.run_loop({"name": "exp", "storage_path": "/tmp"}, local_world_size=4, node_gpus=node_gpus,
                             own_gpus=own_gpus)
    return answer["return_value"]


def test_a_worker_of_two_gpus_picks_its_own_first_gpu_not_its_local_rank(four_gpus):
    """ScalingConfig(resources_per_worker={"GPU": 2}): the worker of local rank 1 (GPUs 2 and 3) took cuda:1, the
    other worker's second GPU, as Ray Train never does (its get_device() is the worker's first own GPU)."""
    assert device_of(1, ["0", "1", "2", "3"], ["2", "3"]) == torch.device("cuda", 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert device_of(0, ["0", "1", "2", "3"], ["0", "1"]) == torch.device("cuda", 0)


def test_workers_sharing_a_gpu_see_it_once_and_pick_it(four_gpus):
    """Fractional GPUs ({"GPU": 0.5}): four workers on GPUs 0 and 1 made CUDA_VISIBLE_DEVICES "0,0,1,1" (CUDA stops
    at a repeated id) and took cuda:{local_rank}: the workers of GPU 1 were not on GPU 1."""
    assert device_of(2, ["0", "0", "1", "1"], ["1"]) == torch.device("cuda", 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert device_of(1, ["0", "0", "1", "1"], ["0"]) == torch.device("cuda", 0)


def test_one_gpu_per_worker_is_cuda_local_rank_as_before(four_gpus):
    assert device_of(3, ["4", "5", "6", "7"], ["7"]) == torch.device("cuda", 3)
    assert device_of(1, ["4", "5"], None) == torch.device("cuda", 1)  # no ids of its own given: its local rank
