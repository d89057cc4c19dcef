"""Training functions for raysgd.train's runtime tests: a counting loop that says which sample was trained how often.

``counting(config)`` trains ``n`` samples (their ids) for ``epochs`` epochs with ``prepare_data_loader`` (raysgd's
data cursor), reports a checkpoint every ``every`` steps and at each epoch's end, and keeps ``counts[i]``: how often
sample ``i`` was trained, summed over the ranks (an ``all_reduce``: DDP replicas agree), in every checkpoint. Every
batch a rank trains is appended to ``config["log"]`` (``pid epoch ids...``), so a test can tell what was trained
twice; ``config["resumed_log"]`` gets ``rank path`` of the checkpoint each rank resumed from. ``config["fault"]`` makes one rank fail once, at a step of an epoch (``marker`` records that it happened, and
holds the rank's pid):

- ``"kill"``: SIGKILL itself right after that step's report (a lost process), once ``release`` exists if given;
- ``"raise"``: raise ``ValueError`` (the user's code failing: retried under ``max_failures``);
- ``"wait"``: write its pid and wait until signalled (the test sends SIGTERM; the rank goes on to the next report);
- ``"hold"``: hold every rank at that step until ``release`` exists, or with ``until="asked"`` until the driver
  asked the rank to stop at its next commit point (a test grows or drains meanwhile).
"""
import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import raysgd.train
from raysgd.torch.commits import preemption
from raysgd.train import Checkpoint
from raysgd.train.torch import prepare_data_loader, prepare_model


def _save(counts, epoch, metrics):
    with tempfile.TemporaryDirectory() as folder:
        torch.save({"counts": counts, "epoch": epoch}, os.path.join(folder, "state.pt"))
        raysgd.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))


def counting(config):
    """See the module docstring."""
    n, batch, epochs, every = config.get("n", 32), config.get("batch", 4), config.get("epochs", 2), config.get("every", 2)
    fault = config.get("fault") or {}
    counts, start_epoch = torch.zeros(n), 0
    checkpoint = raysgd.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        counts, start_epoch = state["counts"], state["epoch"]
        if config.get("resumed_log"):
            with open(config["resumed_log"], "a") as log:
                log.write(f"{raysgd.train.get_context().get_world_rank()} {checkpoint.path}\n")
    model = prepare_model(torch.nn.Linear(1, 1))
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, shuffle=True))
    context = raysgd.train.get_context()
    rank, size = context.get_world_rank(), context.get_world_size()
    for epoch in range(start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        for step, (ids,) in enumerate(loader):
            seen = torch.zeros(n)
            seen[ids] += 1
            if size > 1:
                dist.all_reduce(seen)
            counts += seen
            model(ids.float().unsqueeze(1)).sum().backward()
            if config.get("log"):
                with open(config["log"], "a") as log:
                    log.write(f"{os.getpid()} {size} {epoch} {' '.join(str(int(i)) for i in ids)}\n")
            if config.get("step_s"):
                time.sleep(config["step_s"])
            due = fault and epoch == fault.get("epoch", 0) and step == fault["step"] and \
                not os.path.exists(fault["marker"])
            if due and fault["kind"] == "hold":
                if rank == 0:
                    open(fault["marker"], "w").write(str(os.getpid()))
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not (
                        preemption.resize_requested() if fault.get("until") == "asked" else
                        os.path.exists(fault["release"])):
                    time.sleep(0.05)
            elif due and rank == fault.get("rank", 1) and fault["kind"] == "raise":
                open(fault["marker"], "w").write(str(os.getpid()))
                raise ValueError("the training function failed once")
            elif due and rank == fault.get("rank", 1) and fault["kind"] == "wait":
                open(fault["marker"], "w").write(str(os.getpid()))
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # the signal ends the wait (the handler only sets a flag)
                    time.sleep(0.05)
                    if preemption.requested():
                        break
            if (step + 1) % every == 0:
                extra = {"loss": float(1 + epoch)} if config.get("loss") else {}
                _save(counts, epoch, {"epoch": epoch, "step": step, "world_size": size, **extra})
            if due and rank == fault.get("rank", 1) and fault["kind"] == "kill":
                deadline = time.monotonic() + 120
                while fault.get("release") and not os.path.exists(fault["release"]) and time.monotonic() < deadline:
                    time.sleep(0.05)  # the test says when (its spares are warm)
                open(fault["marker"], "w").write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        _save(counts, epoch + 1, {"epoch": epoch, "done": True, "world_size": size})
    return {"pid": os.getpid(), "world_size": size}


def read_counts(checkpoint):
    """``counts`` of a checkpoint ``counting`` reported."""
    with checkpoint.as_directory() as folder:
        return torch.load(os.path.join(folder, "state.pt"))["counts"]


def trained_batches(log):
    """``[(pid, world size, epoch, [ids])]`` of every batch a rank trained, in the order the log holds them."""
    rows = []
    for line in open(log).read().splitlines():
        pid, size, epoch, *ids = line.split()
        rows.append((int(pid), int(size), int(epoch), [int(i) for i in ids]))
    return rows


def sharded(config):
    """An FSDP2 model (``fully_shard`` on a CPU mesh) trained a few steps, then saved with DCP: every rank writes its
    own shard (``__<rank>_0.distcp``; rank 0 also ``.metadata``) into its own local folder and reports it, so the
    run's checkpoint holds every rank's files merged. Started from a checkpoint, it loads the shards with DCP at
    whatever world size it runs at now and only checks that. Returns the whole model's weights (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    size = raysgd.train.get_context().get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    checkpoint = raysgd.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=folder)
            set_model_state_dict(model, state["model"])
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            torch.manual_seed(step)
            model(torch.randn(4, 9)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        with tempfile.TemporaryDirectory() as folder:
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=folder)
            raysgd.train.report({"files": sorted(os.listdir(folder))}, checkpoint=Checkpoint.from_directory(folder))
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return whole if raysgd.train.get_context().get_world_rank() == 0 else None


class RunFolder:
    """A run folder written as a training function's reports write it (every file, then the marker), for tests that
    need one without running a trainer: ``write(source, meta)`` adds the next ``checkpoint_NNNNNN`` and returns its
    URI; ``path`` is the folder's path inside its filesystem."""

    def __init__(self, storage_path, name):
        from raysgd.torch.storage import filesystem

        self.storage = filesystem.CheckpointStorage(filesystem.child_uri(storage_path, name), None,
                                                    marker=filesystem.REPORT_MARKER)
        self.path = self.storage.path

    def check_writable(self):
        self.storage.check_writable()

    def write(self, source, meta):
        from raysgd.torch.storage import filesystem, rank_files

        index = self.storage.next_index()
        name = filesystem.numbered(index)
        directory = f"{self.storage.path}/{name}"
        files, _ = rank_files.write_files(self.storage.root, directory, source, rank_files.local_files(source),
                                          home=None)
        rank_files.write_marker(self.storage.root, directory, files, {"kind": "report", "index": index, **meta},
                                filesystem.REPORT_MARKER, home=None)
        return self.storage.uri(directory)
