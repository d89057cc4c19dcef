"""FSDP against DDP on the same model: training memory per rank and steps/s at 1, 2 and 4 workers.

Run from the repository root (it starts its own local Ray cluster with 4 logical CPUs)::

    PYTHONPATH=$PWD python benchmarks/fsdp.py                 # a 12.6 M-parameter MLP (50 MB of float32)
    PYTHONPATH=$PWD python benchmarks/fsdp.py --smoke-test    # toy size (the tests run it)

For each strategy (``"ddp"``, ``"fsdp"``) and worker count N, ``TorchTrainer(strategy=..., num_workers=N)`` trains an
MLP (1024-2048-2048-2048-1024, ReLU; the default shard policy gives each Linear its own FSDP group) with Adam on a
global batch of 64 (``BATCH_SIZE``, divided among the workers), twice: once for memory, once for speed. Measured on
every rank, the largest rank reported:

- ``state_mb``: the rank's parameters, gradients and Adam state after ``--warmup`` steps, counted from the tensors (a
  DTensor by its local shard): what FSDP divides by N and DDP keeps whole (DDP's gradient buckets, about one more
  gradient, are not counted here);
- ``peak_rise_mb``: the rank's peak private memory (``RssAnon`` of ``/proc/self/status``, sampled every 2 ms in a
  thread during the ``--warmup`` steps, which allocate everything a step needs) minus its ``RssAnon`` before them:
  everything training added at its peak (gradients, optimizer state, FSDP's gathered parameters, DDP's buckets,
  activations, Adam's temporaries). The workers run with ``MALLOC_MMAP_THRESHOLD_`` = 1 MB for this, so that freed
  blocks go back to the system and RSS follows the tensors; libraries' pages (file-backed) are not counted;
- ``steps_per_s``: ``--steps`` steps over the wall time of a ``train()`` call, the best of ``--repeats`` calls after
  ``--warmup`` steps (``steps_per_s_median``: the median call), with the default allocator.

Then the ratios FSDP / DDP at each N. With one worker FSDP does not shard (nothing to shard over): its row is DDP's.

Prints the tables and the JSON (``--json PATH`` also writes it); ``--plot PATH`` draws the memory per rank as a PNG
(``benchmarks/plots.py``).
"""
import argparse
import json
import os
import sys
import time

import ray
import torch
import torch.nn as nn
from tabulate import tabulate
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

GLOBAL_BATCH = 64
MMAP_THRESHOLD = 1 << 20


class MLPOperator(TrainingOperator):
    """An MLP ``config["widths"]`` with Adam on synthetic regression data (the default loops)."""

    def setup(self, config):
        widths = config["widths"]
        torch.manual_seed(0)
        layers = []
        for fan_in, fan_out in zip(widths, widths[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(config["samples"], widths[0], generator=generator)
        y = torch.randn(config["samples"], widths[-1], generator=generator)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.Adam(model.parameters(), lr=1e-4), criterion=nn.MSELoss())
        self.register_data(train_loader=DataLoader(TensorDataset(x, y), batch_size=config[BATCH_SIZE]))


def local_bytes(tensor):
    """A tensor's bytes on this rank (a DTensor: its local shard)."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def state_mb(operator):
    """Parameters, gradients and optimizer state on this rank, in MB."""
    params = list(operator.registered_models()[0].parameters())
    total = sum(local_bytes(p) for p in params) + sum(local_bytes(p.grad) for p in params if p.grad is not None)
    for state in operator.optimizer.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total / 1e6


def rss_mb(field):
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def start_sampling():
    """Sample this process's ``RssAnon`` every 2 ms in a thread until :func:`stop_sampling`; returns it now (MB).

    Runs in a worker through ``apply_all_workers`` (shipped by value): the sampler lives in a module of its own."""
    import threading  # noqa: PLC0415
    import types  # noqa: PLC0415

    home = sys.modules.setdefault("fsdp_benchmark_sampler", types.ModuleType("fsdp_benchmark_sampler"))
    home.stop, home.peak = threading.Event(), rss_mb("RssAnon")

    def sample():
        while not home.stop.wait(0.002):
            home.peak = max(home.peak, rss_mb("RssAnon"))

    home.thread = threading.Thread(target=sample, daemon=True)
    home.thread.start()
    return home.peak


def stop_sampling():
    """Stop :func:`start_sampling`'s thread; returns the peak ``RssAnon`` it saw (MB)."""
    home = sys.modules["fsdp_benchmark_sampler"]
    home.stop.set()
    home.thread.join()
    return max(home.peak, rss_mb("RssAnon"))


def start_trainer(strategy, workers, widths, samples):
    return TorchTrainer(training_operator_cls=MLPOperator, num_workers=workers, strategy=strategy,
                        config={BATCH_SIZE: GLOBAL_BATCH, "widths": widths, "samples": samples}, timeout_s=300,
                        commit_every_n_steps=0)


def measure_memory(strategy, workers, widths, warmup, then=None):
    """``state_mb`` and ``peak_rise_mb`` of the largest rank (run with :data:`MMAP_THRESHOLD` set); ``then(trainer)``
    adds its measurements from the same trainer (the smoke test's speed: one trainer start instead of two)."""
    trainer = start_trainer(strategy, workers, widths, GLOBAL_BATCH * (warmup + (then.samples if then else 0)))
    try:
        before = trainer.apply_all_workers(start_sampling)
        trainer.train(num_steps=warmup)
        peaks = trainer.apply_all_workers(stop_sampling)
        states = trainer.apply_all_operators(state_mb)
        sharded = trainer.apply_all_operators(lambda op: op.strategy)[0] == "fsdp"
        more = then(trainer) if then else {}
    finally:
        trainer.shutdown()
    return {"sharded": sharded, "state_mb": max(states), "peak_rise_mb": max(p - b for p, b in zip(peaks, before)),
            **more}


class Timed:
    """``steps_per_s`` of a trainer: the best of ``repeats`` timed calls of ``steps`` steps (the machine is shared: the
    best call is the one least slowed by others)."""

    def __init__(self, steps, repeats):
        self.steps, self.repeats, self.samples = steps, repeats, GLOBAL_BATCH * steps * repeats

    def __call__(self, trainer):
        seconds = []
        for _ in range(self.repeats):
            started = time.perf_counter()
            trainer.train(num_steps=self.steps)
            seconds.append(time.perf_counter() - started)
        return {"steps_per_s": self.steps / min(seconds),
                "steps_per_s_median": self.steps / sorted(seconds)[len(seconds) // 2]}


def measure_speed(strategy, workers, widths, warmup, steps, repeats):
    """``steps_per_s`` (:class:`Timed`) after ``warmup`` steps, in a trainer of its own."""
    timed = Timed(steps, repeats)
    trainer = start_trainer(strategy, workers, widths, GLOBAL_BATCH * warmup + timed.samples)
    try:
        trainer.train(num_steps=warmup)
        return timed(trainer)
    finally:
        trainer.shutdown()


def cluster(num_cpus, env_vars=None):
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env_vars or {}})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="toy model, 2 timed steps")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (the best is reported)")
    parser.add_argument("--json", help="also write the results there")
    parser.add_argument("--plot", metavar="PATH", help="also draw the memory per rank as a PNG there")
    args = parser.parse_args(argv)
    widths = [16, 32, 32, 16] if args.smoke_test else [1024, 2048, 2048, 2048, 1024]
    warmup, steps, repeats = (1, 2, 1) if args.smoke_test else (args.warmup, args.steps, args.repeats)
    counts = [int(n) for n in args.workers.split(",")]
    load_at_start = os.getloadavg()
    runs = [(strategy, n) for n in counts for strategy in ("ddp", "fsdp")]
    rows = {run: {"strategy": run[0], "workers": run[1]} for run in runs}
    try:
        # Memory: large blocks straight from mmap and back to the system when freed (glibc's threshold otherwise
        # rises to 32 MB and its heap keeps freed blocks), so a worker's RSS follows what its tensors hold.
        cluster(max(counts), {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
        for run in runs:  # the smoke test times its steps in the same trainer (its speeds are no results)
            rows[run].update(measure_memory(*run, widths, warmup, Timed(steps, repeats) if args.smoke_test else None))
        if not args.smoke_test:
            # Speed with the default allocator: that setting would make FSDP map and fault its gathered blocks each
            # step.
            cluster(max(counts))
            for run in runs:
                rows[run].update(measure_speed(*run, widths, warmup, steps, repeats))
    finally:
        ray.shutdown()
    rows = list(rows.values())
    by = {(r["strategy"], r["workers"]): r for r in rows}
    ratios = [{"workers": n, **{f"fsdp/ddp {key}": by["fsdp", n][key] / by["ddp", n][key]
                                for key in ("state_mb", "peak_rise_mb", "steps_per_s")}} for n in counts]
    parameters = sum(a * b + b for a, b in zip(widths, widths[1:]))
    meta = {"parameters": parameters, "widths": widths, "global_batch": GLOBAL_BATCH, "warmup": warmup,
            "steps": steps, "repeats": repeats, "torch": torch.__version__, "cpus": os.cpu_count(),
            "smoke": args.smoke_test, "date": time.strftime("%Y-%m-%d"), "load_average_start": load_at_start,
            "load_average_end": os.getloadavg()}
    title = f"MLP {'-'.join(map(str, widths))}: {parameters / 1e6:.2f} M parameters, Adam, global batch {GLOBAL_BATCH}"
    result = emit(title, {"meta": meta, "rows": rows, "ratios": ratios}, args.json)
    if args.plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import plots  # noqa: PLC0415 (beside this script)

        sys.stdout.write(f"drawn: {plots.fsdp_memory(result, args.plot)}\n")
    return result


def emit(title, result, json_path=None):
    """Print ``title`` with the machine and its load (``result["meta"]``), then a table of each list in ``result``;
    write ``result`` as JSON to ``json_path`` too (if given). Returns ``result``."""
    meta = result["meta"]
    sys.stdout.write(f"{title}; torch {torch.__version__}, {os.cpu_count()} CPUs, load average (1 min) "
                     f"{meta['load_average_start'][0]:.1f} at the start, {meta['load_average_end'][0]:.1f} at the "
                     f"end\n")
    for rows in (value for value in result.values() if isinstance(value, list)):
        sys.stdout.write("\n" + tabulate(rows, headers="keys", floatfmt=".2f", tablefmt="github") + "\n")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
