"""The ranks of tests/unit/state/test_sharded_state.py: one spawned gloo world of 3 CPU processes runs every distributed check.

FSDP2 (``fully_shard``) models on CPU device meshes built from sub-groups of the world: ranks 0 and 1 train and save
(a 2-rank mesh), all 3 load (the world), rank 0 alone loads again (a 1-rank group). What each load gives is written
to ``out`` (full state dicts gathered with ``torch.save``, fetch logs as JSON) for the tests to compare.
"""
import datetime
import faulthandler
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from raysgd.torch.state import sharded
from raysgd.torch.storage import dcp_files

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def models(mesh, seed):
    """Two FSDP2 models whose sizes do not divide by 2 or 3 (Linear(7, 5) ...) and their optimizers (Adam, SGD
    with momentum), initialised from ``seed`` (their learning rates too: a load must bring the saved ones back)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 7), torch.nn.Tanh(),
                              torch.nn.Linear(7, 5))
    head = torch.nn.Linear(5, 1)
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    fully_shard(head, mesh=mesh)
    optimizers = [torch.optim.Adam(net.parameters(), lr=0.01 * (seed + 1)),
                  torch.optim.SGD(head.parameters(), lr=0.1 * (seed + 1), momentum=0.9)]
    return [net, head], optimizers


def full_state(models_, optimizers):
    """The full (unsharded) state on the group's first rank (CPU): a collective of the models' mesh."""
    return {"models": [get_model_state_dict(m, options=FULL) for m in models_],
            "optimizers": [get_optimizer_state_dict(m, o, options=FULL) for m, o in zip(models_, optimizers)]}


class Fetcher:
    """``fetch(relative_path)`` from a dict of blobs, recording every call."""

    def __init__(self, blobs):
        self.blobs, self.calls = blobs, []

    def __call__(self, name):
        self.calls.append(name)
        return self.blobs[name]


def read_folder(folder):
    """``{name: bytes}`` of every file in ``folder``."""
    blobs = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as handle:
            blobs[name] = handle.read()
    return blobs


def load_into_fresh(mesh, seed, load, metadata):
    """Fresh models on ``mesh``, loaded by ``load(state)`` (``state`` made for a checkpoint of ``metadata``: fresh
    optimizers get state to fill); returns their full state (on the mesh's rank 0)."""
    models_, optimizers = models(mesh, seed)
    state = sharded.models_and_optimizers_state(models_, optimizers, metadata=metadata)
    load(state)
    sharded.load_models_and_optimizers(models_, optimizers, state)
    return full_state(models_, optimizers)


def main(rank, port, out, s3, environ):
    faulthandler.enable()  # a native crash (a signal) prints every thread's Python stack to stderr: where it died
    torch.set_num_threads(1)
    os.environ.update(environ)  # a fork server's children have its environment, not the test's (S3 credentials)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=60))
    pair, solo = dist.new_group([0, 1]), dist.new_group([0])
    world = dist.group.WORLD
    mem, fsw, s3_ckpt = os.path.join(out, "mem"), os.path.join(out, "fsw"), f"{s3[0]}/ckpt{s3[1]}"
    timings = {}
    if rank in (0, 1):  # ---------------- train and save at 2 ranks
        mesh = DeviceMesh.from_group(pair, "cpu")
        models_, optimizers = models(mesh, seed=0)
        torch.manual_seed(100 + rank)
        for _ in range(3):
            for optimizer in optimizers:
                optimizer.zero_grad()
            models_[1](models_[0](torch.randn(4, 7))).square().mean().backward()
            for optimizer in optimizers:
                optimizer.step()
        reference = full_state(models_, optimizers)
        state = sharded.models_and_optimizers_state(models_, optimizers)
        started = time.perf_counter()
        part = sharded.save_parts(state, process_group=pair)
        timings["save_parts_s"] = time.perf_counter() - started
        dcp_files.write_part(mem, part)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(fsw), process_group=pair)
        started = time.perf_counter()
        dcp_files.save(state, s3_ckpt, process_group=pair)
        timings["s3_save_s"] = time.perf_counter() - started
        dist.barrier(group=pair)
        if rank == 0:
            dcp_files.write_metadata(mem, part.metadata)
            torch.save(reference, os.path.join(out, "reference.pt"))
            torch.save(part.layout, os.path.join(out, "layout.pt"))  # where each tensor item's raw bytes start
        # the laziness check: one layer whose rows split 6/6 at 2 ranks and 4/4/4 at 3
        lazy = torch.nn.Linear(4, 12)
        fully_shard(lazy, mesh=mesh)
        lazy_part = sharded.save_parts({"model": get_model_state_dict(lazy)}, process_group=pair)
        dcp_files.write_part(os.path.join(out, "lazy"), lazy_part)
        if rank == 0:
            dcp_files.write_metadata(os.path.join(out, "lazy"), lazy_part.metadata)
            torch.save(lazy_part.layout, os.path.join(out, "lazy_layout.pt"))
    dist.barrier()
    mesh = DeviceMesh.from_group(world, "cpu")  # ---------------- load at 3 ranks
    blobs = read_folder(mem)
    metadata = blobs.pop(".metadata")
    fetcher, needed = Fetcher(blobs), None

    def from_memory(state):
        nonlocal needed
        needed = sharded.files_needed(state, metadata)
        started = time.perf_counter()
        sharded.load_parts(state, metadata, fetcher, process_group=world)
        timings["load_parts_3_s"] = time.perf_counter() - started

    layout = torch.load(os.path.join(out, "layout.pt"), weights_only=True)
    ranged = {}

    def rows_only(state):  # with the layout: only the rows this rank's shard takes, and the replicated values
        ranged.update(sharded.load_parts(state, metadata, blobs.__getitem__, process_group=world, layout=layout))

    results = {"loaded_3": load_into_fresh(mesh, 1, from_memory, metadata),
               "loaded_3_ranged": load_into_fresh(mesh, 6, rows_only, metadata),
               "loaded_3_torch_reader": load_into_fresh(
                   mesh, 2, lambda state: dcp.load(state, storage_reader=dcp.FileSystemReader(mem), process_group=world),
                   metadata),
               "loaded_3_from_torch_writer": load_into_fresh(mesh, 3, lambda state: dcp_files.load(state, fsw, world),
                                                             metadata),
               "loaded_3_s3": load_into_fresh(mesh, 4, lambda state: dcp_files.load(state, s3_ckpt, world), metadata)}
    lazy_blobs = read_folder(os.path.join(out, "lazy"))
    lazy_metadata = lazy_blobs.pop(".metadata")
    lazy = torch.nn.Linear(4, 12)
    fully_shard(lazy, mesh=mesh)
    lazy_state, lazy_fetcher = {"model": get_model_state_dict(lazy)}, Fetcher(lazy_blobs)
    lazy_needed = sharded.files_needed(lazy_state, lazy_metadata)
    sharded.load_parts(lazy_state, lazy_metadata, lazy_fetcher, process_group=world)
    lazy_rows = {"model": get_model_state_dict(lazy)}  # the same again, reading only this rank's rows
    for value in lazy_rows["model"].values():
        value.to_local().zero_()
    lazy_ranged = sharded.load_parts(lazy_rows, lazy_metadata, lazy_blobs.__getitem__, process_group=world,
                                     layout=torch.load(os.path.join(out, "lazy_layout.pt"), weights_only=True))
    lazy_same = all(torch.equal(lazy_rows["model"][key].to_local(), lazy_state["model"][key].to_local())
                    for key in lazy_state["model"])
    if rank == 0:  # ---------------- load at 1 rank
        solo_mesh = DeviceMesh.from_group(solo, "cpu")
        results["loaded_1"] = load_into_fresh(
            solo_mesh, 5, lambda state: sharded.load_parts(state, metadata, blobs.__getitem__, process_group=solo),
            metadata)
        for name, result in results.items():
            torch.save(result, os.path.join(out, f"{name}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"fetched": fetcher.calls, "needed": needed, "lazy_fetched": lazy_fetcher.calls,
                   "lazy_needed": lazy_needed, "timings": timings, "ranged": ranged, "lazy_ranged": lazy_ranged,
                   "lazy_same": lazy_same}, handle)
    dist.barrier()
    dist.destroy_process_group()
