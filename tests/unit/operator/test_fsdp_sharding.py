"""FSDP2 sharding (raysgd.torch.operator.fsdp's Sharding) and whole states loaded into sharded models, without Ray.

One spawned gloo world of 2 CPU processes (:func:`_ranks`) runs the distributed part once for the module and writes
what each check gives to a folder the tests read; what needs no process group runs in this process.
"""
import copy
import datetime
import multiprocessing
import multiprocessing.forkserver
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import join_ranks
from raysgd.torch.operator import fsdp
from raysgd.torch.operator.fsdp import Sharding
from raysgd.torch.operator.precision import Precision
from raysgd.torch.state import sharded
from s3_server import free_port

DEADLINE_S = 120
PRELOAD = ["torch.distributed.fsdp", "torch.distributed.checkpoint", "raysgd.torch.operator.fsdp",
           "raysgd.torch.state.sharded"]


def _batchnorm_net(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2))


def _adam_with_groups(model):
    return torch.optim.Adam([{"params": model[0].parameters(), "lr": 0.05},
                             {"params": list(model[1].parameters()) + list(model[3].parameters())}], lr=0.01)


def _train(model, optimizer, steps, autocast=False):
    torch.manual_seed(7)  # the same batches on every rank and in the reference
    for _ in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(torch.randn(8, 4)).float().square().mean()
        loss.backward()
        optimizer.step()


def _ddp_state(steps):
    """A whole state as strategy="ddp" saves it: ``model.state_dict()`` and torch's ``optimizer.state_dict()``."""
    model = _batchnorm_net(0)
    optimizer = _adam_with_groups(model)
    _train(model, optimizer, steps)
    state = {"models": [model.state_dict()], "optimizers": [optimizer.state_dict()]}
    return copy.deepcopy(state), model, optimizer  # as a checkpoint holds it: no tensor shared with the optimizer


class _Head(torch.nn.Module):
    """An output layer whose weight is the embedding's (tied, as a language model's)."""

    def __init__(self, embedding):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = embedding.weight

    def forward(self, x):
        return self.out(self.proj(x))


def _tied_net(seed):
    """A Sequential whose first and last blocks share a weight: the default policy picks both blocks."""
    torch.manual_seed(seed)
    embedding = torch.nn.Embedding(10, 4)
    return torch.nn.Sequential(embedding, torch.nn.Linear(4, 4), _Head(embedding))


def _train_tied(model, optimizer, steps):
    torch.manual_seed(7)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randint(0, 10, (6,))).square().mean().backward()
        optimizer.step()


def _check(results, name, action):
    try:
        results[name] = action()
    except Exception:  # noqa: BLE001 (the test names the failure)
        results[name] = {"error": traceback.format_exc()}


def _ranks(rank, port, out):
    """One rank of the world: every distributed check, its result saved to ``out`` by rank 0."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    results = {}

    def bf16_batchnorm():  # use_fp16="bf16": MixedPrecisionPolicy(param_dtype=bfloat16) and bfloat16 autocast
        model = _batchnorm_net(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sharding = Sharding("fsdp", None, Precision("bf16", torch.device("cpu")), world_size=2)
        sharding.shard([model], [optimizer])
        _train(model, optimizer, 2, autocast=True)
        gathered = sharding.gather([model])  # get_model(): a collective, the whole model on rank 0
        return {"model": gathered[0].state_dict() if rank == 0 else None,
                "dtypes": {name: p.dtype for name, p in model.named_parameters()}}

    def ddp_state_into_shards():  # a strategy="ddp" checkpoint loaded into sharded models, then one more step each
        state, reference, reference_optimizer = _ddp_state(2)
        model = _batchnorm_net(1)
        optimizer = _adam_with_groups(model)
        Sharding("fsdp", None, world_size=2).shard([model], [optimizer])
        loaded_from = copy.deepcopy(state)  # (DCP shards its tensors in place)
        sharded.load_models_and_optimizers([model], [optimizer], loaded_from, full=True)
        loaded = copy.deepcopy(sharded.models_and_optimizers_state([model], [optimizer], full=True))  # (its buffers
        # are the model's own tensors, which the next step updates)
        _train(model, optimizer, 1)
        _train(reference, reference_optimizer, 1)
        stepped = sharded.models_and_optimizers_state([model], [optimizer], full=True)
        return {"state": state, "loaded": loaded, "stepped": stepped, "reference_stepped": reference.state_dict()}

    def tied_weights():  # tied weights in two blocks stay with the root; get_model() keeps them tied
        model = _tied_net(0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        sharding = Sharding("fsdp", None, world_size=2)
        sharding.shard([model], [optimizer])
        _train_tied(model, optimizer, 2)
        gathered = sharding.gather([model])
        return {"model": gathered[0] if rank == 0 else None}

    _check(results, "tied_weights", tied_weights)
    dist.barrier()
    _check(results, "bf16_batchnorm", bf16_batchnorm)
    dist.barrier()
    _check(results, "ddp_state_into_shards", ddp_state_into_shards)
    if rank == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The results of :func:`_ranks`' world (``{check: result or {"error": traceback}}``)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    out = str(tmp_path_factory.mktemp("fsdp"))
    context = mp.start_processes(_ranks, args=(free_port(), out), nprocs=2, join=False, start_method="forkserver")
    join_ranks(context, "the 2 FSDP ranks", DEADLINE_S)
    return torch.load(os.path.join(out, "results.pt"), weights_only=False)


def _result(world, name):
    result = world[name]
    assert "error" not in result, result.get("error")
    return result


def test_bf16_trains_a_sharded_batchnorm_model_with_its_norm_layers_in_float32(world):
    """FSDP2's bfloat16 parameters met BatchNorm's float32 running statistics in batch_norm ("expected scalar type
    BFloat16 but found Float"); a BatchNorm layer keeps float32 parameters, as under autocast with DDP."""
    result = _result(world, "bf16_batchnorm")
    assert set(result["dtypes"].values()) == {torch.float32}  # the shards stay float32 (the policy casts in forwards)
    reference = _batchnorm_net(0)
    _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), 2, autocast=True)
    for name, value in reference.state_dict().items():
        assert torch.allclose(result["model"][name].float(), value.float(), atol=2e-2), name


def _by_name(model, optimizer_state):
    """torch's optimizer state keyed by ``model``'s parameter names."""
    names = [name for name, _ in model.named_parameters()]
    return {names[number]: value for number, value in optimizer_state["state"].items()}


def test_a_ddp_checkpoint_loads_into_sharded_models_and_training_goes_on_as_before(world):
    result = _result(world, "ddp_state_into_shards")
    state, loaded = result["state"], result["loaded"]
    reference = _batchnorm_net(0)
    for name, value in state["models"][0].items():
        assert torch.equal(loaded["models"][0][name], value), name
    expected = _by_name(reference, state["optimizers"][0])
    assert sorted(loaded["optimizers"][0]["state"]) == sorted(expected)
    for name, values in expected.items():
        for key, value in values.items():
            assert torch.equal(loaded["optimizers"][0]["state"][name][key], value), (name, key)
    assert [group["lr"] for group in loaded["optimizers"][0]["param_groups"]] == [0.05, 0.01]
    stepped = result["stepped"]["models"][0]
    for name, value in result["reference_stepped"].items():
        assert torch.allclose(stepped[name], value, atol=1e-6), name


def test_a_ddp_checkpoint_loads_into_a_one_worker_fsdp_run():
    """With one worker strategy="fsdp" trains unsharded but keeps the sharded state's form: a whole state of a
    strategy="ddp" run (torch's optimizer form, parameters numbered) loads into it (it raised KeyError
    'state.0.step')."""
    state, reference, reference_optimizer = _ddp_state(2)
    model = _batchnorm_net(1)
    optimizer = _adam_with_groups(model)
    sharded.load_models_and_optimizers([model], [optimizer], state, full=True)
    assert [{**group, "betas": tuple(group["betas"])} for group in optimizer.state_dict()["param_groups"]] == \
        reference_optimizer.state_dict()["param_groups"]  # (DCP's load gives tuples back as lists)
    _train(model, optimizer, 1)
    _train(reference, reference_optimizer, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    with pytest.raises(ValueError, match=r"holds parameter groups of \[2, 4\] parameters; the optimizer has groups "
                                         r"of \[6\]"):
        sharded.load_models_and_optimizers([model], [torch.optim.Adam(model.parameters())], state, full=True)


def test_tied_weights_in_two_blocks_are_sharded_with_the_root_and_get_model_keeps_them_tied(world):
    """The default policy gave both blocks of a tied weight their own fully_shard, which FSDP2 refuses ("Parameter
    '2.out.weight' is shared with a parameter already managed by another FSDP group"), and get_model()'s copy
    held two tensors where the model has one."""
    model = _result(world, "tied_weights")["model"]
    assert model[0].weight is model[2].out.weight
    reference = _tied_net(0)
    _train_tied(reference, torch.optim.Adam(reference.parameters(), lr=0.01), 2)
    for name, value in reference.state_dict().items():
        assert torch.allclose(model.state_dict()[name], value, atol=1e-6), name


def test_the_default_policy_leaves_tied_blocks_to_the_root_and_an_unsharded_copy_keeps_them_tied():
    model = _tied_net(0)
    assert [name for name, _ in fsdp.blocks(model, None)] == ["1"]
    assert [name for name, _ in fsdp.blocks(model, torch.nn.Linear)] == ["2.proj", "1"]
    copied = Sharding("fsdp", None, world_size=1).gather([model])[0]  # one worker: nothing sharded
    assert copied[0].weight is copied[2].out.weight
    assert all(torch.equal(a, b) for a, b in zip(copied.state_dict().values(), model.state_dict().values()))
