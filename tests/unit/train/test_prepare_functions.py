"""raysgd.train.torch's prepare_model and prepare_data_loader in one process, on a session built here (no Ray)."""
import contextlib
import os

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


class _Stream(torch.utils.data.IterableDataset):
    """An iterable-style dataset without a length."""

    def __iter__(self):
        return iter(range(5))


def test_a_loader_without_a_length_runs_under_the_progress_bar():
    """With RunConfig(progress_bar=True), rank 0's pass over a prepared loader of an IterableDataset without
    __len__ raised TypeError("object of type ... has no len()") before its first batch; its total is unknown."""
    from raysgd.torch.integrations.progress import ProgressReporter

    sent = []
    feed = ProgressReporter(lambda state, final: sent.append((state["n"], state["total"], final)), call_id=1,
                            interval_s=0)
    context = TrainContext(world_size=1, world_rank=0, local_rank=0, local_world_size=1, node_rank=0,
                           experiment_name="exp", storage_path="/tmp")
    with running(Session(context, torch.device("cpu"), progress=feed)):
        loader = prepare.prepare_data_loader(torch.utils.data.DataLoader(_Stream(), batch_size=2))
        assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4]]
    assert sent[-1] == (3, None, True)


def test_enable_reproducibility_makes_cudnn_and_cublas_deterministic_as_ray_train(monkeypatch):
    """enable_reproducibility left cuDNN's benchmarking on (when it was) and CUBLAS_WORKSPACE_CONFIG unset, without
    which cuBLAS is not deterministic: a GPU run asked to be reproducible was not, with a warning at most."""
    from raysgd.train.torch import enable_reproducibility

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    try:
        enable_reproducibility(3)
        assert torch.backends.cudnn.benchmark is False
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own value is kept
        enable_reproducibility(3)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_prepared_loader_prepared_again_is_returned_as_it_is():
    """prepare_data_loader(prepare_data_loader(loader)) (a loop preparing its loader every epoch, which Ray Train
    allows) raised TypeError "expects a torch.utils.data.DataLoader; got PreparedLoader"."""
    with session(world_size=2):
        loader = prepare.prepare_data_loader(torch.utils.data.DataLoader(range(6), batch_size=2))
        again = prepare.prepare_data_loader(loader)
        assert again is loader
        assert [batch.tolist() for batch in again] == [[0, 2], [4]]  # rank 0's shard, not sharded twice


def test_ray_trains_sampler_set_epoch_names_the_epoch_of_a_custom_batch_sampler():
    """With a custom batch_sampler, loader.sampler was the SequentialSampler DataLoader makes beside it: Ray Train's
    loop, loader.sampler.set_epoch(epoch), raised AttributeError on every run of several workers."""
    def prepared():
        batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(range(8)), 2, drop_last=False)
        return prepare.prepare_data_loader(torch.utils.data.DataLoader(range(8), batch_sampler=batches))

    with session(world_size=2):
        by_sampler, by_loader = prepared(), prepared()
        by_sampler.sampler.set_epoch(3)
        by_loader.set_epoch(3)
        assert [b.tolist() for b in by_sampler] == [b.tolist() for b in by_loader]
        assert by_sampler.cursor_state()["epoch"] == 3
        plain = prepare.prepare_data_loader(torch.utils.data.DataLoader(range(4), batch_size=2))
        assert plain.sampler is plain.loader.sampler  # a loader without a batch_sampler: its own sampler


def test_a_custom_batch_samplers_cursor_resumes_exactly_when_the_batch_size_follows_the_workers(caplog):
    """Ray Train's pattern: the batch is the global one over the number of workers, so a resize of an elastic run
    changes a custom batch_sampler's batches, which its cursor counts: from 2 workers (batches of 4) to 1 (of 8) the
    epoch started 4 batches of 8 in and skipped 16 of 48 samples. It now starts at the same share of the epoch."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    samples = list(range(48))

    def loader(batch_size):
        return DataLoader(samples, batch_sampler=BatchSampler(RandomSampler(samples), batch_size, False))

    cpu = torch.device("cpu")
    before = [prepare.PreparedLoader(loader(4), rank, 2, cpu) for rank in range(2)]
    taken = []
    for prepared in before:
        prepared.sampler.set_epoch(1)
        batches = iter(prepared)
        taken += [int(i) for _ in range(2) for i in next(batches)]
    cursor = before[0].cursor_state()
    assert cursor["positions"] == 12 and cursor["consumed"] == 4  # batches of 4
    with caplog.at_level("WARNING", logger="raysgd"):
        rest = [int(i) for batch in prepare.PreparedLoader(loader(8), 0, 1, cpu, restored=cursor) for i in batch]
    assert sorted(taken + rest) == samples  # every sample once in the epoch
    assert "another length" in caplog.text
