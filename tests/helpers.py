"""Operators shared by the Ray-level tests (importable by workers: tests/ is on their path via pickling by value)."""
import os
import signal
import threading
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd.torch import TrainingOperator
from raysgd.torch.examples.train_example import LinearDataset
from raysgd.utils import BATCH_SIZE


class LinearOperator(TrainingOperator):
    """Linear regression on LinearDataset(2, 5); config: lr, momentum, batch_size or BATCH_SIZE, data_size,
    val_size, pad (a zero buffer of that many floats in the state), compile (registered as ``torch.compile(model, **config["compile"])``). Its loops are the default
    ones (tests rely on that)."""

    def setup(self, config):
        torch.manual_seed(config.get("seed", 0))
        model = nn.Linear(1, 1)
        if config.get("pad"):  # a buffer of that many floats: a state too large for Ray to inline (> 100 KB)
            model.register_buffer("pad", torch.zeros(config["pad"]))
        if config.get("compile") is not None:
            model = torch.compile(model, **config["compile"])
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2),
                                    momentum=config.get("momentum", 0.0))
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.MSELoss())
        batch = config.get(BATCH_SIZE, config.get("batch_size", 16))
        self.register_data(
            train_loader=DataLoader(LinearDataset(2, 5, size=config.get("data_size", 200)), batch_size=batch,
                                    shuffle=config.get("shuffle", False)),
            validation_loader=DataLoader(LinearDataset(2, 5, size=config.get("val_size", 100)), batch_size=batch))


class ClassifierOperator(TrainingOperator):
    """A small MLP classifier on fixed random data (val_accuracy is meaningful).

    ``config["compile"]``: registered as ``torch.compile(model, **config["compile"])`` (a dict of its options).
    """

    def setup(self, config):
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(config.get("n", 240), 4, generator=generator)
        y = (x[:, 0] + x[:, 1] > 0).long()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        if config.get("compile") is not None:
            model = torch.compile(model, **config["compile"])
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(),
            **config.get("register_args", {}))
        self.register_data(train_loader=DataLoader(TensorDataset(x, y), batch_size=config.get("batch_size", 16)),
                           validation_loader=DataLoader(TensorDataset(x, y), batch_size=7))


def parameters_of(operator):
    """Flat copy of every parameter of the operator's registered models."""
    return torch.cat([p.detach().reshape(-1).clone() for m in operator.registered_models() for p in m.parameters()])


def pid_and_threads():
    return os.getpid(), torch.get_num_threads()


class FaultyOperator(LinearOperator):
    """LinearOperator that injects one fault when rank ``fault["rank"]`` reaches batch ``fault["batch"]`` of an epoch
    (or, with ``fault["step"]``, that global step).

    ``fault["kind"]``: ``"exit"`` (``os._exit``), ``"sleep"`` (stuck but alive), ``"signal"`` (writes its pid to
    ``fault["marker"]`` and carries on, for the driver to kill it). The marker file makes it happen once, unless
    ``fault["always"]``. ``config["batch_sleep"]`` slows every batch so a fault lands mid-epoch.
    ``config["input_dropout"]``: dropout on the inputs, so every batch draws from each rank's own torch stream, as a
    model's dropout does.
    """

    def train_batch(self, batch, batch_info):
        if self.config.get("input_dropout"):
            features, target = batch
            batch = (nn.functional.dropout(features, self.config["input_dropout"]), target)
        fault = self.config.get("fault")
        at = batch_info["global_step"] == fault["step"] if fault and "step" in fault else \
            fault and batch_info["batch_idx"] == fault["batch"]
        if fault and self.world_rank == fault["rank"] and at:
            if fault.get("always") or not os.path.exists(fault["marker"]):
                with open(fault["marker"], "w") as handle:
                    handle.write(str(os.getpid()))
                if fault["kind"] == "exit":
                    os._exit(1)
                elif fault["kind"] == "sleep":
                    time.sleep(fault.get("seconds", 600))
        time.sleep(self.config.get("batch_sleep", 0))
        return super().train_batch(batch, batch_info)


def exit_once_hook(marker):
    """An initialization hook that ends its process the first time it runs (start-up failure)."""

    def hook():
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)

    return hook


def seeding_hook():
    torch.manual_seed(1234)


class CursorSampler(torch.utils.data.Sampler):
    """A sampler with the data cursor's API, for tests that must not depend on how loaders are sharded.

    The epoch's global order is a permutation of ``range(n)`` from ``(seed, epoch)``; from global position
    ``start`` on, this rank takes every ``world_size``-th index.
    """

    def __init__(self, n, rank, world_size, seed=0):
        self.n, self.rank, self.world_size, self.seed = n, rank, world_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def set_start(self, consumed):
        self.start = consumed

    def _order(self):
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))

    def __iter__(self):
        return iter(self._order()[self.start:][self.rank::self.world_size].tolist())

    def __len__(self):
        return len(range(self.start + self.rank, self.n, self.world_size))

    def position_after(self, num_batches, batch_size):
        return min(self.n, self.start + num_batches * batch_size * self.world_size)


class CountingModel(nn.Module):
    """``p[i]`` counts how often sample ``i`` was trained; a small dropout layer draws from torch's stream."""

    def __init__(self, n):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n))
        self.lin = nn.Linear(4, 4)

    def forward(self, idx, features):
        return self.p[idx], torch.nn.functional.dropout(self.lin(features), 0.5, self.training)


class CountingOperator(TrainingOperator):
    """``p[i]`` grows by exactly 1 each time sample ``i`` is trained (on any number of workers).

    config: ``n`` samples, ``batch_size`` per worker, ``own_sampler`` (a :class:`CursorSampler`), ``log`` (a file each executed batch appends a line
    to), ``fault`` (one or a list of ``{"step", "marker", "rank"}``: that rank writes its pid to ``marker`` at that global
    step, then waits to be killed, once; with ``"until_sigterm": True`` it waits for a SIGTERM instead and
    trains on (after ``"after_s"`` more seconds in that step), with ``"until_resize": True`` for the driver's
    request to grow, with ``"exit": True`` it ends its process), ``hold`` (``{"step", "rank", "marker"}``: stays
    inside that global step until killed, once), ``hold_until`` (``{"step", "path"}``: every rank waits inside that
    global step until ``path`` exists, at most 60 s), ``batch_sleep``, ``step_sleeps`` (seconds to sleep at global step
    i: ``step_sleeps[i]``), and the DataLoader's ``drop_last``, ``loader_workers`` (its ``num_workers``; its
    processes start by forkserver, with a ``loader_timeout_s`` of 120 s) and ``in_order``.
    """

    def setup(self, config):
        import torch.distributed as dist

        n = config.get("n", 96)
        model = CountingModel(n)
        optimizer = torch.optim.SGD([{"params": [model.p], "lr": 1.0, "momentum": 0.0},
                                     {"params": model.lin.parameters(), "lr": 0.01, "momentum": 0.9}])
        self.model, self.optimizer = self.register(models=model, optimizers=optimizer)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        features = torch.randn(n, 4, generator=torch.Generator().manual_seed(5))
        dataset = TensorDataset(torch.arange(n), features)
        options = {"batch_size": config.get("batch_size", 4), "drop_last": config.get("drop_last", False),
                   "num_workers": config.get("loader_workers", 0), "in_order": config.get("in_order", True)}
        if options["num_workers"]:
            # Loader processes start by forkserver, never by forking this process: in-process tests run it inside
            # pytest, whose other threads (Ray's, loggers' writers) may hold a lock at the fork. One run had a loader
            # stuck until pytest's 600 s timeout (its cause not proven; fork is the likeliest). A stuck loader now
            # fails within the timeout instead.
            options.update(multiprocessing_context="forkserver", timeout=config.get("loader_timeout_s", 120))
        if config.get("own_sampler"):  # with TorchTrainer(add_dist_sampler=False)
            sampler = CursorSampler(n, self.world_rank, self.world, seed=config.get("seed", 3))
            loader = DataLoader(dataset, sampler=sampler, **options)
        else:  # sharded by raysgd's data cursor
            loader = DataLoader(dataset, shuffle=True, **options)
        self.register_data(train_loader=loader)

    def train_batch(self, batch, batch_info):
        faults = self.config.get("fault") or []  # one fault, or a list of them
        for fault in faults if isinstance(faults, list) else [faults]:
            self._fault(fault)
        hold = self.config.get("hold")  # {"step", "rank", "marker"}: stay inside that step until killed, once
        if hold and self.world_rank == hold.get("rank", 0) and self.global_step == hold["step"] \
                and not os.path.exists(hold["marker"]):
            with open(hold["marker"], "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(600)
        until = self.config.get("hold_until")
        if until and self.global_step == until["step"]:
            deadline = time.monotonic() + 60
            while not os.path.exists(until["path"]) and time.monotonic() < deadline:
                time.sleep(0.01)
        return self._step(batch)

    def _fault(self, fault):
        if self.world_rank == fault.get("rank", 1) and self.global_step == fault["step"] \
                and not os.path.exists(fault["marker"]):
            with open(fault["marker"], "w") as handle:
                handle.write(str(os.getpid()))
            if fault.get("exit"):
                os._exit(1)
            if fault.get("until_sigterm") or fault.get("until_resize"):  # finish this step once it arrived
                from raysgd.torch.commits import preemption

                arrived = preemption.resize_requested if fault.get("until_resize") else preemption.requested
                deadline = time.monotonic() + fault.get("wait_s", 60)
                while not arrived() and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(fault.get("after_s", 0))  # stuck inside the step a while after it arrived
            else:
                time.sleep(120)  # the test kills this process once the commit it waits for is stored

    def _step(self, batch):
        if self.config.get("log"):
            with open(self.config["log"], "a") as handle:
                handle.write(f"{self.world_rank} {self.global_step}\n")
        time.sleep(self.config.get("batch_sleep", 0))
        step_sleeps = self.config.get("step_sleeps", ())
        time.sleep(step_sleeps[self.global_step] if self.global_step < len(step_sleeps) else 0)
        idx, features = (tensor.to(self.device) for tensor in batch)
        counts, out = self.model(idx, features)
        loss = -counts.sum() * self.world + 0.01 * out.pow(2).sum()  # DDP's mean over ranks becomes a sum
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"train_loss": out.detach().pow(2).mean().item(), "num_samples": len(idx)}


def small_resnet():
    """A BatchNorm ResNet small enough for CPU tests: a 3x3 stem with batch norm, two of raysgd's ResNet
    ``BasicBlock`` (the second with a projection shortcut and its own batch norm), pooling and a linear head."""
    from raysgd.torch.resnet import BasicBlock  # noqa: PLC0415

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), BasicBlock(8, 8),
                         BasicBlock(8, 16, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


class BatchNormOperator(CountingOperator):
    """:func:`small_resnet` on ``n`` random 8x8 images of 4 classes with SGD (momentum), cross entropy and the
    data cursor's shuffled loader (``batch_size`` per worker); 10 validation images. Faults, holds and the log as
    :class:`CountingOperator`'s."""

    def setup(self, config):
        n = config.get("n", 64)
        model = small_resnet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.CrossEntropyLoss())
        generator = torch.Generator().manual_seed(7)
        x, y = torch.randn(n, 3, 8, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator)
        self.register_data(train_loader=DataLoader(TensorDataset(x, y), batch_size=config.get("batch_size", 4),
                                                    shuffle=True),
                           validation_loader=DataLoader(TensorDataset(x[:10], y[:10]), batch_size=3))

    def _step(self, batch):
        if self.config.get("log"):
            with open(self.config["log"], "a") as handle:
                handle.write(f"{self.world_rank} {self.global_step}\n")
        x, y = (tensor.to(self.device) for tensor in batch)
        loss = self.criterion(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"train_loss": loss.item(), "num_samples": len(x)}


def buffers_of(model):
    """``{name: buffer}`` of ``model`` (copies on the CPU)."""
    return {name: buffer.detach().cpu().clone() for name, buffer in model.named_buffers()}


class SlowCleanupOperator(CountingOperator):
    """A CountingOperator whose ``train_epoch``, when an error ends it, takes ``config["cleanup_s"]`` seconds to
    clean up (a DataLoader's worker processes, a log flush): a rank that exits meanwhile (a preempted one) is
    seen dead by the driver before the error it raised."""

    def train_epoch(self, iterator, info=None):
        try:
            return super().train_epoch(iterator, info)
        except BaseException:
            time.sleep(self.config.get("cleanup_s", 0))
            raise


class SlowToSave:
    """Operator state that takes ``seconds`` to serialise in a process that got SIGTERM (a multi-GB state's send)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        from raysgd.torch.commits import preemption

        if preemption.requested():
            time.sleep(self.seconds)
        return SlowToSave, (self.seconds,)


class SlowCommitOperator(CountingOperator):
    """A CountingOperator whose preemption commit takes ``config["save_s"]`` seconds to send (see SlowToSave)."""

    def state_dict(self):
        return {"slow": SlowToSave(self.config.get("save_s", 0))}

    def load_state_dict(self, state_dict):
        pass


def env_hook(**env):
    """An initialization hook setting ``env`` in the worker process (e.g. SGD_PREEMPT_GRACE_S), then seeding."""

    def hook():
        os.environ.update({key: str(value) for key, value in env.items()})
        torch.manual_seed(1234)

    return hook


class DtypeRecorder(ClassifierOperator):
    """Records the dtype of the first layer's output (the hidden activations) inside the forward pass."""

    def setup(self, config):
        super().setup(config)
        self.seen_dtypes = set()
        module = self.model.module if hasattr(self.model, "module") else self.model
        module[0].register_forward_hook(lambda mod, inputs, output: self.seen_dtypes.add(str(output.dtype)))


def signal_at_marker(marker, sig, ready=lambda: True, timeout_s=60):
    """A daemon thread: once a worker wrote its pid to ``marker`` (it then waits at its fault) and ``ready()``
    holds, send it ``sig``. Waits on the condition, not on a lucky schedule; gives up after ``timeout_s``."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if os.path.exists(marker) and open(marker).read() and ready():
                os.kill(int(open(marker).read()), sig)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def remove_node_after_commit(trainer, cluster, node, marker, min_steps, timeout_s=120, before=None):
    """A daemon thread: once a worker waits at its fault (``marker`` exists) and a commit of >= ``min_steps`` is
    stored, remove ``node`` (a ``ray.cluster_utils.Cluster`` node) at once, as a lost machine (``before()``, when
    given, runs just before). Gives up after ``timeout_s``."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            commit = trainer.latest_commit() if os.path.exists(marker) else None
            if commit is not None and commit["cursor"]["steps"] >= min_steps:
                if before is not None:
                    before()
                cluster.remove_node(node, allow_graceful=False)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def stored_commit(trainer, steps, timeout_s=30):
    """The trainer's latest commit once it is the one at ``steps`` (or the latest seen at the deadline). A commit
    taken at a call's last step is sent by a background thread of each rank and may complete just after ``train()``
    returned (commits are asynchronous: README "Commits inside an epoch"), so a test waits for it instead of reading
    ``latest_commit()`` once."""
    deadline = time.monotonic() + timeout_s
    while True:
        commit = trainer.latest_commit()
        if (commit is not None and commit["cursor"]["steps"] == steps) or time.monotonic() > deadline:
            return commit
        time.sleep(0.02)


def kill_after_commit(trainer, marker, min_steps, timeout_s=60):
    """Once a worker waits at the fault (its pid in ``marker``) and a commit of >= ``min_steps`` is stored, SIGKILL it."""

    def committed():
        commit = trainer.latest_commit() if min_steps is not None else None
        return min_steps is None or (commit is not None and commit["cursor"]["steps"] >= min_steps)

    return signal_at_marker(marker, signal.SIGKILL, committed, timeout_s)


def counts(trainer):
    """The CountingModel's ``p`` (how often each sample was trained), on the CPU."""
    return trainer.state_dict()["models"][0]["p"].cpu()


def executed(log):
    """How many batches a CountingOperator with ``config["log"]`` ran."""
    return len(open(log).read().splitlines()) if os.path.exists(log) else 0


def device_step(trainer, info):
    """An ``override_tune_step`` reporting, besides the metrics, each worker's device and the trainer's backend."""
    stats = {**trainer.train(), **trainer.validate()}
    return {**stats, "devices": ",".join(trainer.apply_all_operators(lambda op: str(op.device))),
            "backend": trainer.backend}


def tune_two_workers_on_one_gpu(storage_path):
    """One Tune trial of 2 workers holding half a GPU each, 2 iterations with checkpoints; returns its result."""
    from ray import tune  # noqa: PLC0415

    from raysgd import TorchTrainer  # noqa: PLC0415

    trainable = TorchTrainer.as_trainable(training_operator_cls=ClassifierOperator, num_workers=2, use_gpu=True,
                                          num_gpus_per_worker=0.5, override_tune_step=device_step, timeout_s=120)
    assert trainable.default_resource_request({}).bundles == [{"CPU": 1}] + [{"CPU": 1, "GPU": 0.5}] * 2
    tuner = tune.Tuner(trainable, run_config=tune.RunConfig(
        storage_path=str(storage_path), stop={"training_iteration": 2}, verbose=0,
        checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1, num_to_keep=1)))
    results = tuner.fit()
    assert not results.errors, results.errors
    (result,) = results
    assert result.metrics["training_iteration"] == 2 and result.checkpoint is not None
    return result


class WideOperator(TrainingOperator):
    """One ``width x width`` linear layer (``4 * width**2`` bytes of parameters) on ``data_size`` random rows: a
    model whose size is set by the config, for tests of where the state travels."""

    def setup(self, config):
        width = config["width"]
        torch.manual_seed(0)
        model = nn.Linear(width, width, bias=False)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(config.get("data_size", 8), width, generator=generator)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=1e-3), criterion=nn.MSELoss())
        self.register_data(train_loader=DataLoader(TensorDataset(x, x), batch_size=config.get("batch_size", 4)),
                           validation_loader=DataLoader(TensorDataset(x, x), batch_size=config.get("batch_size", 4)))


def holders_started():
    """How many commit part holders (``_HolderActor``, one per node) are alive or starting, from Ray's actor table
    (a starting actor names no node there yet)."""
    import ray  # noqa: PLC0415

    return sum(1 for actor in ray._private.state.actors().values()
               if actor["ActorClassName"] == "_HolderActor" and actor["State"] != "DEAD")


class SnapshotProbe:
    """Operator state whose serialisation, in a call-start snapshot serialised beside the call
    (:mod:`raysgd.torch.restart_points.call_start`), waits until this process's call has started its first batch (a
    ``"batch_start"`` event after the latest ``"captured"`` one), at most 30 s: a call that waited for its snapshot
    before training would never get there."""

    def __deepcopy__(self, memo):
        return SnapshotProbe()

    def __reduce__(self):
        from raysgd.torch.restart_points import call_start

        def overlapping():
            events = list(call_start.EVENTS)
            started = [i for i, (name, _) in enumerate(events) if name == "serialising"]
            return bool(started) and ("serialised", events[started[-1]][1]) not in events[started[-1]:]

        def batch_started():
            events = list(call_start.EVENTS)
            captured = [i for i, (name, _) in enumerate(events) if name == "captured"]
            return bool(captured) and any(name == "batch_start" for name, _ in events[captured[-1]:])

        if overlapping():
            deadline = time.monotonic() + 30
            while not batch_started():
                if time.monotonic() > deadline:
                    raise RuntimeError("the call did not start while its snapshot was serialised")
                time.sleep(0.005)
        return SnapshotProbe, ()


class SnapshotProbeOperator(CountingOperator):
    """A CountingOperator that records ``("batch_start", step)`` and ``("batch_end", step)`` in
    ``call_start.EVENTS`` around each batch (after its ``fault``, if any), with a :class:`SnapshotProbe` in its
    state."""

    def state_dict(self):
        return {"probe": SnapshotProbe()}

    def load_state_dict(self, state_dict):
        pass

    def train_batch(self, batch, batch_info):
        from raysgd.torch.restart_points import call_start

        faults = self.config.get("fault") or []  # before the batch starts: a rank 0 that dies here never releases
        for fault in faults if isinstance(faults, list) else [faults]:  # the probe (its snapshot is never stored)
            self._fault(fault)
        call_start.EVENTS.append(("batch_start", self.global_step))
        result = self._step(batch)
        call_start.EVENTS.append(("batch_end", self.global_step))
        return result


def join_ranks(context, what, deadline_s):
    """Wait for the ranks ``torch.multiprocessing.start_processes(..., join=False)`` started (``context``): its join
    raises for a rank that failed, ``TimeoutError`` naming ``what`` past ``deadline_s``; a rank still alive at the
    end is killed."""
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not finish within {deadline_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(10)
