"""Benchmark workloads: the models, the synthetic data and the one training step that every side runs.

Every side (plain loop, torchrun, Ray Train, raysgd) builds its model, optimizer and data through these
functions, so the work per step is the same everywhere; only the machinery around it differs.

Example:
    >>> spec = workload_spec("mlp", smoke=True)
    >>> model = make_model("mlp")
    >>> x, y = next(iter(make_loader(make_dataset("mlp", 8), batch_size=4)))
    >>> tuple(model(x).shape), spec["batch_size"] > 0
    ((4, 10), True)
"""
import os
import statistics
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

#: Per-model sizes for a full run: per-worker batch, batches per worker per epoch (of the short 3-epoch job
#: and of the steady-state run that follows it), warm-up steps, then ``windows`` timed windows of ``steps``.
FULL = {
    "mlp": {"batch_size": 64, "steps_per_epoch": 20, "warmup": 20, "steps": 200, "windows": 3},
    "resnet": {"batch_size": 32, "steps_per_epoch": 8, "warmup": 5, "steps": 50, "windows": 3},
}
#: The same structure, tiny, for ``--smoke-test``.
SMOKE = {
    "mlp": {"batch_size": 16, "steps_per_epoch": 4, "warmup": 2, "steps": 5, "windows": 1},
    "resnet": {"batch_size": 4, "steps_per_epoch": 2, "warmup": 1, "steps": 2, "windows": 1},
}
JOB_EPOCHS = 3
_INPUT_SHAPE = {"mlp": (784,), "resnet": (3, 32, 32), "resnet50": (3, 224, 224), "tiny": (16,)}
_NUM_CLASSES = {"mlp": 10, "resnet": 10, "resnet50": 1000, "tiny": 4}
WIDE_DEFAULT = 5000


def workload_spec(model, smoke=False):
    """The sizes of ``model``'s run (see :data:`FULL`), with ``job_epochs`` added.

    Example:
        >>> workload_spec("resnet")["batch_size"]
        32
    """
    table = SMOKE if smoke else FULL
    if model not in table:
        raise ValueError(f"model expects one of {sorted(table)}; got {model!r}")
    return dict(table[model], job_epochs=JOB_EPOCHS)


def pin_threads(threads):
    """Use exactly ``threads`` intra-op threads in this process (and its OpenMP/MKL children)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = str(threads)
    torch.set_num_threads(threads)


class MLP(nn.Sequential):
    """784-1024-1024-10 with ReLU (1.86 M parameters)."""

    def __init__(self, sizes=(784, 1024, 1024, 10)):
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, fan_in, fan_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(fan_in, fan_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(fan_out)
        self.conv2 = nn.Conv2d(fan_out, fan_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(fan_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or fan_in != fan_out:
            self.shortcut = nn.Sequential(nn.Conv2d(fan_in, fan_out, 1, stride, bias=False), nn.BatchNorm2d(fan_out))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4), with batch norm and a projection shortcut where shapes change."""

    expansion = 4

    def __init__(self, fan_in, width, stride=1):
        super().__init__()
        fan_out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(fan_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, fan_out, 1, bias=False), nn.BatchNorm2d(fan_out))
        self.shortcut = nn.Sequential()
        if stride != 1 or fan_in != fan_out:
            self.shortcut = nn.Sequential(nn.Conv2d(fan_in, fan_out, 1, stride, bias=False), nn.BatchNorm2d(fan_out))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """A ResNet: a stem, stages of ``block`` (widths doubling, stride 2 from the second stage), pool, linear.

    ``cifar=True`` uses a 3x3 stem without pooling (32x32 inputs); otherwise the ImageNet 7x7 stem.
    """

    def __init__(self, block, blocks_per_stage, widths, num_classes, cifar):
        super().__init__()
        stem_width = widths[0]
        if cifar:
            self.stem = nn.Sequential(nn.Conv2d(3, stem_width, 3, 1, 1, bias=False), nn.BatchNorm2d(stem_width),
                                      nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, stem_width, 7, 2, 3, bias=False), nn.BatchNorm2d(stem_width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        stages, fan_in = [], stem_width
        for index, (count, width) in enumerate(zip(blocks_per_stage, widths)):
            for i in range(count):
                stages.append(block(fan_in, width, stride=2 if index > 0 and i == 0 else 1))
                fan_in = width * getattr(block, "expansion", 1)
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(fan_in, num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def small_resnet(num_classes=10):
    """A CIFAR ResNet-8: one basic block per stage, widths 16-32-64 (78 k parameters)."""
    return ResNet(BasicBlock, (1, 1, 1), (16, 32, 64), num_classes, cifar=True)


def resnet50(num_classes=1000):
    """ResNet-50 (bottleneck blocks 3-4-6-3, 25.6 M parameters) for 224x224 images."""
    return ResNet(Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512), num_classes, cifar=False)


def make_model(name, seed=0, width=None):
    """The model ``name``, initialised from ``seed``.

    ``mlp``, ``resnet`` (CIFAR ResNet-8), ``resnet50``; for the overhead measurements ``tiny`` (16-4, 68
    parameters) and ``wide`` (one ``width`` x ``width`` linear layer: 100 MB of weights at 5,000).
    """
    builders = {"mlp": MLP, "resnet": small_resnet, "resnet50": resnet50, "tiny": lambda: MLP((16, 4)),
                "wide": lambda: nn.Linear(width or WIDE_DEFAULT, width or WIDE_DEFAULT)}
    if name not in builders:
        raise ValueError(f"model expects one of {sorted(builders)}; got {name!r}")
    torch.manual_seed(seed)
    return builders[name]()


def make_dataset(name, num_samples, seed=1, width=None):
    """``num_samples`` random inputs shaped for ``name`` with random class labels (the same for every side)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (width or WIDE_DEFAULT,) if name == "wide" else _INPUT_SHAPE[name]
    classes = (width or WIDE_DEFAULT) if name == "wide" else _NUM_CLASSES[name]
    x = torch.randn(num_samples, *shape, generator=generator)
    y = torch.randint(0, classes, (num_samples,), generator=generator)
    return TensorDataset(x, y)


def make_loader(dataset, batch_size, rank=None, world_size=None):
    """A shuffling loader dropping the last partial batch; sharded with ``DistributedSampler`` when given a rank."""
    if rank is None:
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)


def make_optimizer(model, momentum=0.9):
    """SGD with momentum, as in every side."""
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)


def train_step(model, optimizer, criterion, x, y):
    """One step, written as raysgd's default ``train_batch`` does it; returns the loss as a float."""
    loss = criterion(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def epochs_of(loader):
    """The loader's batches epoch after epoch (calling ``set_epoch`` when sharded), without end."""
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def run_steps(model, optimizer, criterion, batches, num_steps, stamps):
    """Train ``num_steps`` batches from the iterator ``batches``, appending each step's end time to ``stamps``."""
    for _ in range(num_steps):
        x, y = next(batches)
        train_step(model, optimizer, criterion, x, y)
        stamps.append(time.time())


def timed_steps(sizes):
    """How many steps the steady-state phase runs: the warm-up and every timed window."""
    return sizes["warmup"] + sizes.get("windows", 1) * sizes["steps"]


def steady_rate(stamps, warmup, steps, global_batch, windows=1):
    """Samples per second: the median over ``windows`` consecutive windows of ``steps`` steps after ``warmup``.

    ``stamps`` are rank 0's step end times; a window runs from the end of the step before it to the end
    of its last step.

    Example:
        >>> steady_rate([0.0, 1.0, 1.5, 2.0], warmup=2, steps=2, global_batch=10)
        20.0
        >>> steady_rate([0.0, 1.0, 2.0, 4.0, 5.0], warmup=1, steps=1, global_batch=10, windows=4)
        10.0
    """
    needed = warmup + windows * steps
    if len(stamps) < needed or warmup < 1 or steps < 1 or windows < 1:
        raise ValueError(f"stamps expects at least warmup + windows * steps = {needed} step times (warmup, "
                         f"steps, windows >= 1); got {len(stamps)}")
    rates = []
    for window in range(windows):
        start = warmup - 1 + window * steps
        elapsed = stamps[start + steps] - stamps[start]
        rates.append(steps * global_batch / elapsed if elapsed > 0 else float("inf"))
    return statistics.median(rates)
