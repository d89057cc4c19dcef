"""GPU images/s: raysgd's default loop (1 worker) against a plain torch.amp loop, ResNet-50 and a CIFAR ResNet-18.

Workloads (synthetic data generated on the GPU, one batch repeated, so no input pipeline is measured):

* ``resnet50``: ResNet-50, 224x224, batch 128, fp32, fp16 and bf16 (target: raysgd >= 0.97x plain);
* ``cifar-resnet18``: :func:`raysgd.torch.resnet.ResNet18`, 32x32, batch 256, where the per-step overhead
  shows (target: >= 0.95x).

Sides, each with the same ``torch.autocast`` dtype and a ``torch.amp.GradScaler`` for fp16 only, SGD with
momentum, ``cudnn.benchmark`` on:

* ``plain``: a plain loop that never reads the loss during the timed steps;
* ``raysgd``: ``TorchTrainer(num_workers=1, use_gpu=True, use_fp16=...)`` with the default ``train_batch``;
* ``raysgd-sync``: the same trainer, but every step reads its loss with ``.item()``, as raysgd's default loop
  did before the sync fix: the "before" number.

Timing: every step's end time is stamped; at each window boundary the stamp is taken after
``torch.cuda.synchronize()`` (on both sides alike), and the rate is the median over the windows. Run it:

    python benchmarks/gpu.py                      # the full table (CUDA only; prints why it skips without it)
    python benchmarks/gpu.py --smoke-test         # toy sizes; on the CPU (bf16) when there is no CUDA
    python benchmarks/gpu.py --workloads cifar-resnet18 --precisions fp16 --json /tmp/gpu.json

benchmark.py runs it as ``python gpu.py SPEC.json`` for its ``gpu`` section.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

from raysgd import TrainingOperator
from sides import write_json
from workloads import make_model, make_optimizer, pin_threads, steady_rate, timed_steps

WORKLOADS = {  # the quick one first: a run cut short by the device's time limit still has its rows
    "cifar-resnet18": {"model": "cifar-resnet18", "batch_size": 256, "image": 32, "classes": 10, "warmup": 20,
                       "steps": 100, "windows": 3, "target": 0.95},
    "resnet50": {"model": "resnet50", "batch_size": 128, "image": 224, "classes": 1000, "warmup": 10, "steps": 30,
                 "windows": 3, "target": 0.97},
}
SMOKE = {"batch_size": 2, "image": 32, "warmup": 1, "steps": 2, "windows": 1}
#: benchmark.py's check of this code on a machine without CUDA: every side and precision path at SMOKE's sizes (as
#: every run without CUDA), on a CIFAR ResNet-8 (78 k weights): ResNet-50's 25 M weights cost ~2.6 s a step in bf16
#: on a CPU, and its builder is checked on its own (tests/repo/test_benchmarks.py). Its rates mean nothing.
CPU_CHECK = {"cpu-check-resnet8": {"model": "resnet", "classes": 10, "target": 0.95}}
PRECISIONS = ("fp32", "fp16", "bf16")
SIDES = ("plain", "raysgd", "raysgd-sync")


def build_model(name, classes):
    if name == "cifar-resnet18":
        from raysgd.torch.resnet import ResNet18  # noqa: PLC0415

        torch.manual_seed(0)
        return ResNet18({"num_classes": classes})
    return make_model(name)


def synthetic_batch(sizes, device):
    """One batch of random images and labels, generated on ``device``."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(sizes["batch_size"], 3, sizes["image"], sizes["image"], generator=generator, device=device)
    y = torch.randint(0, sizes["classes"], (sizes["batch_size"],), generator=generator, device=device)
    return x, y


def autocast_dtype(precision, device):
    """float16 only on CUDA (raysgd keeps fp32 for use_fp16=True on CPU); bfloat16 anywhere."""
    if precision == "fp16" and device.type == "cuda":
        return torch.float16
    return torch.bfloat16 if precision == "bf16" else None


class Stamper:
    """Step end times; at window boundaries after a device synchronisation, so the windows time the GPU."""

    def __init__(self, sizes, device):
        first = sizes["warmup"] - 1
        self._boundaries = {first + k * sizes["steps"] for k in range(sizes["windows"] + 1)}
        self._cuda = device.type == "cuda"
        self.stamps = []

    def __call__(self):
        if self._cuda and len(self.stamps) in self._boundaries:
            torch.cuda.synchronize()
        self.stamps.append(time.time())


def plain_loop(sizes, precision, device):
    """The reference loop: autocast, a GradScaler (fp16), no read of the loss; returns step end times."""
    torch.backends.cudnn.benchmark = True
    model, criterion = build_model(sizes["model"], sizes["classes"]).to(device), nn.CrossEntropyLoss()
    optimizer = make_optimizer(model)
    dtype = autocast_dtype(precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    x, y = synthetic_batch(sizes, device)
    stamper = Stamper(sizes, device)
    model.train()
    for _ in range(timed_steps(sizes)):
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = criterion(model(x), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        stamper()
    return stamper.stamps


class BenchOperator(TrainingOperator):
    """raysgd's default ``train_batch`` on the workload; ``sync_per_step`` adds the ``.item()`` of the old loop."""

    def setup(self, config):
        torch.backends.cudnn.benchmark = True
        model = build_model(config["model"], config["classes"])
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=make_optimizer(model), criterion=nn.CrossEntropyLoss())
        self.register_data(train_loader=[synthetic_batch(config, self.device)] * timed_steps(config))
        self.sync_per_step = False
        self.stamper = None

    def train_batch(self, batch, batch_info):
        if batch_info["batch_idx"] == 0:
            self.stamper = Stamper(self.config, self.device)
        metrics = super().train_batch(batch, batch_info)
        if self.sync_per_step:
            metrics["train_loss"] = metrics["train_loss"].item()
        self.stamper()
        return metrics


def raysgd_loops(sizes, precision, device, threads):
    """One trainer: an epoch of the default loop, then one with a sync per step; returns both stamp lists."""
    from gpu import BenchOperator as by_name  # noqa: PLC0415 (not __main__'s copy: the worker imports it by name)
    from raysgd import TorchTrainer  # noqa: PLC0415

    cuda = device.type == "cuda"
    use_fp16 = {"fp32": False, "fp16": True, "bf16": "bf16"}[precision]
    trainer = TorchTrainer(training_operator_cls=by_name, num_workers=1, use_gpu=cuda, num_cpus_per_worker=threads,
                           use_fp16=use_fp16, config=dict(sizes))
    try:
        stamps = {}
        for side in ("raysgd", "raysgd-sync"):
            trainer.apply_all_operators(lambda op, on=side == "raysgd-sync": setattr(op, "sync_per_step", on))
            trainer.train()
            stamps[side] = trainer.apply_all_operators(lambda op: op.stamper.stamps)[0]
        return stamps
    finally:
        trainer.shutdown()


def measure(workloads, precisions, smoke, threads, bench_dir, on_rows=None):
    """Every (workload, precision, side) row: images/s, and each raysgd side's ratio to the plain loop.

    ``on_rows(rows)``, if given, is called with the rows so far after each (workload, precision).
    """
    import ray  # noqa: PLC0415

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    ray.init(address="local", num_cpus=max(threads, 1), num_gpus=1 if cuda else 0, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 p for p in (bench_dir, os.environ.get("PYTHONPATH")) if p)}}, log_to_driver=False)
    try:
        for workload in workloads:
            sizes = dict({**WORKLOADS, **CPU_CHECK}[workload], **(SMOKE if smoke or not cuda else {}))
            for precision in precisions:
                stamps = {"plain": plain_loop(sizes, precision, device)}
                if cuda:
                    torch.cuda.empty_cache()
                stamps.update(raysgd_loops(sizes, precision, device, threads))
                rate = {side: steady_rate(stamps[side], sizes["warmup"], sizes["steps"], sizes["batch_size"],
                                          sizes["windows"]) for side in SIDES}
                for side in SIDES:
                    rows.append(dict(workload=workload, precision=precision, side=side, batch_size=sizes["batch_size"],
                                     image=sizes["image"], images_per_s=rate[side],
                                     ratio=rate[side] / rate["plain"], target=sizes["target"]))
                if on_rows is not None:
                    on_rows(rows)
    finally:
        ray.shutdown()
    return rows


def table(record):
    """The rows as a markdown table, with the header line naming the device, the date and the versions."""
    from tabulate import tabulate  # noqa: PLC0415

    lines = [f"{record['date']}, {record['device']}, torch {record['torch']}, ray {record['ray']} ({record['status']})"]
    rows = [[r["workload"], f"{r['image']}px x {r['batch_size']}", r["precision"], r["side"],
             f"{r['images_per_s']:.1f}", f"{r['ratio']:.3f}",
             "" if r["side"] == "plain" else f">= {r['target']}: {'yes' if r['ratio'] >= r['target'] else 'NO'}"]
            for r in record["rows"]]
    lines.append(tabulate(rows, ["workload", "input", "precision", "side", "images/s", "/ plain", "target"],
                          tablefmt="github"))
    return "\n".join(lines)


def _summarised(record, rows):
    ratios = [r["ratio"] for r in rows if r["side"] == "raysgd"]
    return dict(record, rows=list(rows), median_ratio=statistics.median(ratios) if ratios else None)


def run(workloads, precisions, smoke, threads, bench_dir, partial=None):
    """The record of one run. ``partial(record)``, if given, gets the record so far after each (workload,
    precision), so a run stopped by a time limit still leaves its finished rows."""
    import ray  # noqa: PLC0415

    cuda = torch.cuda.is_available()
    record = dict(status="measured" if cuda and not smoke else ("smoke" if cuda else "cpu-check"),
                  device=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__,
                  ray=ray.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    on_rows = None if partial is None else (lambda rows: partial(_summarised(dict(record, status="partial"), rows)))
    return _summarised(record, measure(workloads, precisions, smoke, threads, bench_dir, on_rows))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", nargs="?", help="benchmark.py's spec file (JSON); else the options below")
    parser.add_argument("--smoke-test", action="store_true", help="toy sizes (on the CPU without CUDA)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {list(WORKLOADS)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated subset of {PRECISIONS}")
    parser.add_argument("--threads", type=int, default=4, help="CPU threads of each side's process")
    parser.add_argument("--json", default=None, help="also write the record to this file")
    args = parser.parse_args(argv[1:])
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    if args.spec:  # from benchmark.py: its smoke flag and threads; without CUDA, the CPU check (CPU_CHECK)
        with open(args.spec, encoding="utf-8") as handle:
            spec = json.load(handle)
        pin_threads(spec["threads"])
        smoke = spec["smoke"] or not torch.cuda.is_available()
        if not torch.cuda.is_available():
            workloads = list(CPU_CHECK)
        else:
            workloads = ["resnet50"] if smoke else list(WORKLOADS)
        precisions = ["fp32", "bf16"] if smoke else list(PRECISIONS)
        record = run(workloads, precisions, smoke, spec["threads"], spec["bench_dir"])
        write_json(spec["record"], record)
        return 0
    workloads, precisions = args.workloads.split(","), args.precisions.split(",")
    for name, values, allowed in (("--workloads", workloads, WORKLOADS), ("--precisions", precisions, PRECISIONS)):
        if any(v not in allowed for v in values):
            parser.error(f"{name} expects a comma-separated subset of {list(allowed)}; got {values}")
    if not torch.cuda.is_available() and not args.smoke_test:
        print("gpu.py: skipped: CUDA is not available on this machine (--smoke-test runs the code on the CPU)")
        return 0
    pin_threads(args.threads)

    def partial(record):  # each finished (workload, precision): its rows printed, the JSON so far written
        print(table(dict(record, rows=record["rows"][-len(SIDES):])), flush=True)
        if args.json:
            write_json(args.json, record)

    record = run(workloads, precisions, args.smoke_test, args.threads, bench_dir, partial)
    print(table(record), flush=True)
    if args.json:
        write_json(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
