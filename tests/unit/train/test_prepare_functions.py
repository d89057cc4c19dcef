"""raysgd.train.torch's prepare_model and prepare_data_loader in one process, on a session built here (no Ray)."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from raysgd.train import prepare
from raysgd.train.session import Session, TrainContext, running


def session(world_size=1, device="cpu"):
    """A running session of rank 0 in a world of ``world_size`` (its context only: no process group)."""
    context = TrainContext(world_size=world_size, world_rank=0, local_rank=0, local_world_size=world_size,
                           node_rank=0, experiment_name="exp", storage_path="/tmp")
    return running(Session(context, torch.device(device)))


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of this process alone (DistributedDataParallel needs one to be built)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_prepare_model_moves_the_model_to_the_device_it_is_given():
    """prepare_model(move_to_device=torch.device(...)) (Ray Train's form) moved the model to the worker's device
    instead, silently; False leaves the model where it is."""
    with session():
        moved = prepare.prepare_model(torch.nn.Linear(2, 2), move_to_device=torch.device("meta"))
        assert next(moved.parameters()).device.type == "meta"
        kept = prepare.prepare_model(torch.nn.Linear(2, 2).to("meta"), move_to_device=False)
        assert next(kept.parameters()).device.type == "meta"
        assert next(prepare.prepare_model(torch.nn.Linear(2, 2)).parameters()).device.type == "cpu"


def test_prepare_model_passes_ddps_own_arguments_and_refuses_kwargs_that_are_no_dict():
    """parallel_strategy_kwargs={"device_ids": ...} (or output_device) crashed with "got multiple values for keyword
    argument 'device_ids'"; a list crashed inside DDP's call with a message naming no argument."""
    with session(world_size=2), one_rank_group():
        model = prepare.prepare_model(torch.nn.Linear(2, 2), parallel_strategy_kwargs={
            "device_ids": None, "output_device": None, "find_unused_parameters": True})
        assert isinstance(model, DistributedDataParallel) and model.find_unused_parameters
        with pytest.raises(TypeError, match=r"prepare_model\(parallel_strategy_kwargs=...\) expects None or a dict"):
            prepare.prepare_model(torch.nn.Linear(2, 2), parallel_strategy_kwargs=[("device_ids", None)])
