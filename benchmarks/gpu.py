"""GPU: ResNet-50 on synthetic ImageNet-shaped data, one worker, fp32 and fp16 images/s, raysgd against torch.amp.

benchmark.py runs ``python gpu.py SPEC.json`` when CUDA is available. ``--smoke-test`` runs it at toy size
(32x32 images, batch 2), on the CPU when there is no CUDA (bfloat16 instead of float16) so that the code
cannot rot; such a run measures nothing and is recorded as ``status: smoke`` or ``cpu-check``.

Example::

    python benchmarks/gpu.py /tmp/gpu-spec.json
"""
import datetime
import json
import sys
import time

import torch
import torch.nn as nn

from raysgd import TrainingOperator
from sides import write_json
from workloads import make_model, make_optimizer, pin_threads, steady_rate, timed_steps

FULL = {"batch_size": 128, "image": 224, "warmup": 10, "steps": 50, "windows": 3}
CPU_CHECK = {"batch_size": 2, "image": 32, "warmup": 1, "steps": 2, "windows": 1}


def synthetic_batch(batch_size, image, device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, image, image, generator=generator)
    y = torch.randint(0, 1000, (batch_size,), generator=generator)
    return x.to(device), y.to(device)


def low_precision(device):
    """float16 with a GradScaler on CUDA; bfloat16 (no scaler) for the CPU check."""
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def plain_loop(sizes, fp16, device):
    """The reference: a plain loop with ``torch.autocast`` and ``torch.amp.GradScaler``; returns step end times."""
    torch.backends.cudnn.benchmark = True
    model, criterion = make_model("resnet50").to(device), nn.CrossEntropyLoss()
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler(device.type, enabled=fp16 and device.type == "cuda")
    x, y = synthetic_batch(sizes["batch_size"], sizes["image"], device)
    stamps = []
    model.train()
    for _ in range(timed_steps(sizes)):
        with torch.autocast(device.type, dtype=low_precision(device), enabled=fp16):
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss.item()  # synchronises, as raysgd's default train_batch does
        stamps.append(time.time())
    return stamps


class ResNet50Operator(TrainingOperator):
    """raysgd's default loop on ResNet-50; the loader is one device-resident batch repeated."""

    def setup(self, config):
        torch.backends.cudnn.benchmark = True
        model = make_model("resnet50")
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=make_optimizer(model), criterion=nn.CrossEntropyLoss())
        batch = synthetic_batch(config["batch_size"], config["image"], self.device)
        self.register_data(train_loader=[batch] * timed_steps(config))
        self.stamps = []

    def train_batch(self, batch, batch_info):
        metrics = super().train_batch(batch, batch_info)
        self.stamps.append(time.time())
        return metrics


def raysgd_loop(sizes, fp16, device, threads):
    """raysgd ``TorchTrainer(num_workers=1)`` for one epoch; returns rank 0's step end times."""
    from gpu import ResNet50Operator as by_name  # noqa: PLC0415 (not __main__'s copy: workers import it by name)
    from raysgd import TorchTrainer

    cuda = device.type == "cuda"
    low = (True if cuda else "bf16") if fp16 else False
    trainer = TorchTrainer(training_operator_cls=by_name, num_workers=1, use_gpu=cuda, num_cpus_per_worker=threads,
                           use_fp16=low, config=dict(sizes))
    try:
        trainer.train()
        return trainer.apply_all_operators(lambda op: op.stamps)[0]
    finally:
        trainer.shutdown()


def main(argv):
    import ray

    with open(argv[1], encoding="utf-8") as handle:
        spec = json.load(handle)
    pin_threads(spec["threads"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sizes = CPU_CHECK if spec["smoke"] or not cuda else FULL
    rows = []
    for fp16 in (False, True):
        stamps = plain_loop(sizes, fp16, device)
        rows.append(dict(side="plain torch.amp", fp16=fp16, stamps=stamps))
    if cuda:
        torch.cuda.empty_cache()
    ray.init(address="local", num_cpus=spec["threads"], num_gpus=1 if cuda else 0, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": spec["bench_dir"]}}, log_to_driver=False)
    try:
        for fp16 in (False, True):
            rows.append(dict(side="raysgd", fp16=fp16, stamps=raysgd_loop(sizes, fp16, device, spec["threads"])))
    finally:
        ray.shutdown()
    for row in rows:
        row["images_per_s"] = steady_rate(row.pop("stamps"), sizes["warmup"], sizes["steps"], sizes["batch_size"],
                                          sizes["windows"])
    status = "measured" if cuda and not spec["smoke"] else ("smoke" if cuda else "cpu-check")
    write_json(spec["record"], dict(
        status=status, device=torch.cuda.get_device_name(0) if cuda else "cpu",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        precision_low="float16" if cuda else "bfloat16", **sizes, rows=rows))


if __name__ == "__main__":
    main(sys.argv)
