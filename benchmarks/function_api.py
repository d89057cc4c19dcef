"""The function API (``raysgd.train``) against the operator API (``raysgd.TorchTrainer``) on one runtime.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/function_api.py [--smoke-test] [--epochs E] [--repeats R] [--json out.json]

The MLP of ``workloads.py`` on 2 workers of 1 thread each (a local cluster of 3 CPUs: the third holds a warm spare
in the recovery part), the same data, batch and optimizer on both sides:

- **throughput**: ``E`` epochs of ``--steps`` steps (default 200: seconds each), each ended by a durable checkpoint of the model and optimizer: the operator API's
  ``train()`` with ``storage_path`` (its automatic checkpoint after every call), the function's ``report()`` with a
  checkpoint of ``torch.save``'d state. Steady-state samples/s over the epochs after the first (rank 0's step
  stamps), and their ratio (goal: the function within 2 % of the operator API).
- **report cost**: the seconds rank 0 spends in ``report()`` with a checkpoint (a commit: every rank writes its files,
  rank 0 the marker, every rank returns once it is durable) and without one (the collective alone), median.
- **recovery**: rank 1 is SIGKILLed mid-epoch with ``num_spares=1`` once the spare is warm; the seconds from the kill
  to the next step trained and to the next report, against the operator API's kill to its next batch (same spare).

Every number comes from one run on one machine; the ratios are what to compare (see benchmarks/README.md).
"""
import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from tabulate import tabulate  # noqa: E402

import raysgd.train  # noqa: E402
from raysgd import TorchTrainer as OperatorTrainer  # noqa: E402
from raysgd_costs import BenchOperator  # noqa: E402
from raysgd.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from raysgd.train.torch import TorchConfig, TorchTrainer, prepare_data_loader, prepare_model  # noqa: E402
from workloads import make_dataset, make_loader, make_model, make_optimizer, pin_threads, workload_spec  # noqa: E402

DEADLINE_S = 300


def function_loop(config):
    """The training function: ``epochs`` epochs of the workload, a report per epoch (a checkpoint with it, or every
    ``report_every`` steps without one); rank 0 appends ``time.time()`` after every step to ``config["stamps"]``, and
    ``report_s`` (seconds in report, with and without a checkpoint) to the same file's sibling. For recovery, rank 1
    writes its pid to ``kill_marker`` at ``kill_step`` of epoch 1 and waits to be killed."""
    pin_threads(1)
    context = raysgd.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    sizes = config["sizes"]
    model, criterion = make_model("mlp"), nn.CrossEntropyLoss()
    optimizer = make_optimizer(model)
    start_epoch = 0
    checkpoint = raysgd.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
    ddp = prepare_model(model)
    dataset = make_dataset("mlp", 2 * sizes["batch_size"] * sizes["steps_per_epoch"])
    loader = prepare_data_loader(make_loader(dataset, sizes["batch_size"]), move_to_device=False)
    stamps, timings = [], {"with": [], "without": []}
    ddp.train()
    for epoch in range(start_epoch, config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            optimizer.zero_grad(set_to_none=True)
            criterion(ddp(x), y).backward()
            optimizer.step()
            stamps.append(time.time())
            if config.get("stamp_file") and rank == 0:
                with open(config["stamp_file"], "a") as handle:
                    handle.write(f"{stamps[-1]!r} {world}\n")
            if config.get("report_every") and (step + 1) % config["report_every"] == 0:
                started = time.perf_counter()
                raysgd.train.report({"epoch": epoch, "step": step})
                timings["without"].append(time.perf_counter() - started)
            if config.get("kill_marker") and rank == 1 and epoch == 1 and step == config["kill_step"] and \
                    not os.path.exists(config["kill_marker"]):
                with open(config["kill_marker"] + ".tmp", "w") as handle:
                    handle.write(str(os.getpid()))
                os.replace(config["kill_marker"] + ".tmp", config["kill_marker"])
                time.sleep(60)  # until the driver's kill lands
        with tempfile.TemporaryDirectory() as folder:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1},
                       os.path.join(folder, "state.pt"))
            started = time.perf_counter()
            raysgd.train.report({"epoch": epoch}, checkpoint=Checkpoint.from_directory(folder))
            timings["with"].append(time.perf_counter() - started)
    return {"stamps": stamps, "report_s": timings} if rank == 0 else None


def steady(stamps, steps_per_epoch, global_batch):
    """Samples/s over the epochs after the first (the first epoch warms up: DDP's first wrap, the allocator)."""
    tail = stamps[steps_per_epoch:]
    if len(tail) < 2:
        return None
    return (len(tail) - 1) * global_batch / (tail[-1] - tail[0])


def run_function(sizes, epochs, storage, **extra):
    config = dict(sizes=sizes, epochs=epochs, **extra)
    trainer = TorchTrainer(function_loop, train_loop_config=config, torch_config=TorchConfig(timeout_s=60),
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name=f"fn-{time.time_ns()}", storage_path=storage,
                                                failure_config=FailureConfig(max_failures=1)))
    return trainer, trainer.fit()


def throughput(sizes, epochs, storage):
    """Both APIs, an epoch and a durable checkpoint at a time; returns a table row dict."""
    global_batch = 2 * sizes["batch_size"]
    operator = OperatorTrainer(training_operator_cls=BenchOperator, num_workers=2, num_cpus_per_worker=1,
                               config=dict(model="mlp", batch_size=sizes["batch_size"],
                                           num_samples=global_batch * sizes["steps_per_epoch"]),
                               storage_path=os.path.join(storage, "operator"), num_to_keep=2)
    for _ in range(epochs):
        operator.train()
    operator_stamps = operator.apply_all_operators(lambda op: op.stamps)[0]
    operator.shutdown()
    _, result = run_function(sizes, epochs, storage)
    ours = result.return_value
    operator_rate = steady(operator_stamps, sizes["steps_per_epoch"], global_batch)
    function_rate = steady(ours["stamps"], sizes["steps_per_epoch"], global_batch)
    return {"operator_samples_per_s": operator_rate, "function_samples_per_s": function_rate,
            "ratio": function_rate / operator_rate if operator_rate and function_rate else None,
            "report_with_checkpoint_s": statistics.median(ours["report_s"]["with"])}


def report_without_checkpoint(sizes, storage):
    _, result = run_function(sizes, 2, storage, report_every=max(1, sizes["steps_per_epoch"] // 4))
    return statistics.median(result.return_value["report_s"]["without"])


def _kill_when(marker, ready, stamps_file):
    """Kill the pid in ``marker`` once it is there and ``ready()``; returns ``[t_kill]`` (filled by the thread)."""
    killed = []

    def watch():
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if os.path.exists(marker) and ready():
                pid = int(open(marker).read())
                killed.append(time.time())
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return killed, thread


def recovery_function(sizes, storage):
    """Seconds from the kill of rank 1 to rank 0's next step, and to the next report, with a warm spare."""
    marker, stamps_file = tempfile.mktemp(prefix="kill-"), tempfile.mktemp(prefix="stamps-")
    box = {}

    def ready():
        trainer = box.get("trainer")
        group = trainer.worker_group if trainer is not None else None
        return group is not None and group.spares.available() >= 1

    killed, thread = _kill_when(marker, ready, stamps_file)
    config = dict(sizes=sizes, epochs=3, kill_marker=marker, kill_step=sizes["steps_per_epoch"] // 2,
                  stamp_file=stamps_file)
    trainer = TorchTrainer(function_loop, train_loop_config=config, torch_config=TorchConfig(timeout_s=60),
                           scaling_config=ScalingConfig(num_workers=2, num_spares=1),
                           run_config=RunConfig(name=f"recovery-{time.time_ns()}", storage_path=storage,
                                                failure_config=FailureConfig(max_failures=1)))
    box["trainer"] = trainer
    trainer.fit()
    thread.join(5)
    stamps = [float(line.split()[0]) for line in open(stamps_file).read().splitlines()]
    after = [stamp for stamp in stamps if killed and stamp > killed[0]]
    return (after[0] - killed[0]) if after else None


def recovery_operator(sizes):
    """The operator API's kill of rank 1 mid-epoch with a warm spare: seconds to rank 0's next batch."""
    marker = tempfile.mktemp(prefix="kill-op-")
    steps = sizes["steps_per_epoch"]
    trainer = OperatorTrainer(training_operator_cls=BenchOperator, num_workers=2, num_cpus_per_worker=1,
                              num_spares=1, config=dict(model="mlp", batch_size=sizes["batch_size"],
                                                        num_samples=2 * sizes["batch_size"] * steps,
                                                        signal_batch=steps // 2, signal_path=marker))
    killed, thread = _kill_when(marker, lambda: trainer.worker_group.spares.available() >= 1, None)
    trainer.train()  # rank 1 waits at the middle batch until the spare is warm and the kill lands
    trainer.train()
    thread.join(5)
    stamps = trainer.apply_all_operators(lambda op: op.stamps)[0]
    trainer.shutdown()
    after = [stamp for stamp in stamps if killed and stamp > killed[0]]
    return (after[0] - killed[0]) if after else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke-test", action="store_true", help="toy sizes: checks the code runs")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of the throughput part (default 6)")
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (default 200: an epoch of seconds, "
                        "so that a checkpoint per epoch is a realistic share)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the recovery part (median)")
    parser.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    sizes = workload_spec("mlp", args.smoke_test)
    sizes["steps_per_epoch"] = args.steps or (4 if args.smoke_test else 200)
    epochs = args.epochs or (3 if args.smoke_test else 6)
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}})
    storage = tempfile.mkdtemp(prefix="function-api-")
    row = throughput(sizes, epochs, storage)
    row["report_without_checkpoint_s"] = report_without_checkpoint(sizes, storage)
    recoveries = [recovery_function(sizes, storage) for _ in range(args.repeats)]
    operator_recoveries = [recovery_operator(sizes) for _ in range(args.repeats)]
    row["recovery_function_s"] = statistics.median([r for r in recoveries if r is not None] or [float("nan")])
    row["recovery_operator_s"] = statistics.median([r for r in operator_recoveries if r is not None]
                                                   or [float("nan")])
    ray.shutdown()
    table = [["steady samples/s, a durable checkpoint per epoch", f"{row['operator_samples_per_s']:.0f}",
              f"{row['function_samples_per_s']:.0f}", f"{row['ratio']:.3f}"],
             ["report() with a checkpoint, s (median)", "-", f"{row['report_with_checkpoint_s']:.4f}", ""],
             ["report() without a checkpoint, s (median)", "-", f"{row['report_without_checkpoint_s']:.4f}", ""],
             ["rank 1 SIGKILLed with a warm spare: kill -> next step, s", f"{row['recovery_operator_s']:.2f}",
              f"{row['recovery_function_s']:.2f}", f"{row['recovery_function_s'] / row['recovery_operator_s']:.2f}"]]
    print(f"function API vs operator API (MLP, 2 workers x 1 thread, {epochs} epochs of "
          f"{sizes['steps_per_epoch']} steps; load average {os.getloadavg()[0]:.1f} at the end)"
          f"{' SMOKE TEST: toy sizes' if args.smoke_test else ''}")
    print(tabulate(table, ["measure", "operator API", "function API", "function / operator"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(dict(row, epochs=epochs, smoke=args.smoke_test, sizes=sizes), handle, indent=1)
    return row


if __name__ == "__main__":
    main()
