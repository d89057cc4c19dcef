"""The four sides of the comparison, each run as its own process: plain loop, torchrun DDP, Ray Train, raysgd.

``benchmark.py`` starts ``python sides.py SPEC.json`` (under ``torchrun`` for the torchrun side) and reads
back the run records this writes to ``spec["record"]``. Every side runs the same job per model and worker
count: three epochs (the short job; the trained model then reaches the driver), then the warm-up and the
timed windows of the steady-state rate (``workloads.timed_steps``). Times are ``time.time()`` on one machine, so stamps taken in
different processes compare directly.

Example (what benchmark.py runs)::

    python benchmarks/sides.py /tmp/spec.json
"""
import json
import logging
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.nn as nn

from workloads import (epochs_of, make_dataset, make_loader, make_model, make_optimizer, pin_threads, run_steps,
                       timed_steps, workload_spec)

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
WAIT_S = 300  # deadline of every wait between processes


def launch_time():
    """When benchmark.py launched this process (``BENCH_T_LAUNCH``), or now."""
    return float(os.environ.get("BENCH_T_LAUNCH", time.time()))


def write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def wait_for(path, deadline_s=WAIT_S, poll_s=0.005):
    """Block until ``path`` exists; TimeoutError after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {deadline_s} s")
        time.sleep(poll_s)


def record(side, model, workers, sizes, job_stamps, tp_stamps, t0, t_model, threads, **extra):
    """One run's raw measurements (benchmark.py derives the rates and ratios)."""
    return dict(side=side, model=model, workers=workers, threads=threads, batch_size=sizes["batch_size"],
                steps_per_epoch=sizes["steps_per_epoch"], warmup=sizes["warmup"], steps=sizes["steps"],
                windows=sizes["windows"], t0=t0, t_first_batch=job_stamps[0], t_model=t_model,
                job_steps=len(job_stamps), tp_stamps=tp_stamps[-timed_steps(sizes):], **extra)


# ----------------------------------------------------------------------------------------- plain loop
def run_plain(spec):
    """One process, no process group, no DDP: the baseline for one worker."""
    t0 = launch_time()
    pin_threads(spec["threads"])
    name, sizes = spec["model"], workload_spec(spec["model"], spec["smoke"])
    model, criterion = make_model(name), nn.CrossEntropyLoss()
    optimizer = make_optimizer(model)
    loader = make_loader(make_dataset(name, sizes["batch_size"] * sizes["steps_per_epoch"]), sizes["batch_size"])
    batches, job, tp = epochs_of(loader), [], []
    model.train()
    run_steps(model, optimizer, criterion, batches, sizes["job_epochs"] * sizes["steps_per_epoch"], job)
    t_model = time.time()  # the trained model is in this (the driver) process
    run_steps(model, optimizer, criterion, batches, timed_steps(sizes), tp)
    return [record("plain", name, 1, sizes, job, tp, t0, t_model, torch.get_num_threads())]


# ----------------------------------------------------------------------------------------- torchrun
def run_torchrun(spec):
    """One rank of ``torchrun --nproc_per_node=N``: gloo, DDP when N > 1, a DistributedSampler.

    After the job, rank 0 writes the model for benchmark.py (the driver) and waits for it to be loaded.
    """
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    pin_threads(spec["threads"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=WAIT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    name, sizes = spec["model"], workload_spec(spec["model"], spec["smoke"])
    model, criterion = make_model(name), nn.CrossEntropyLoss()
    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model) if world > 1 else model
    dataset = make_dataset(name, world * sizes["batch_size"] * sizes["steps_per_epoch"])
    loader = make_loader(dataset, sizes["batch_size"], rank=rank if world > 1 else None, world_size=world)
    batches, job, tp = epochs_of(loader), [], []
    ddp.train()
    run_steps(ddp, optimizer, criterion, batches, sizes["job_epochs"] * sizes["steps_per_epoch"], job)
    if rank == 0:
        tmp = spec["model_out"] + ".tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, spec["model_out"])
        wait_for(spec["ack"])
    if world > 1:
        dist.barrier()
    run_steps(ddp, optimizer, criterion, batches, timed_steps(sizes), tp)
    result = []
    if rank == 0:  # t0 and t_model are the driver's: benchmark.py fills them in
        result = [record("torchrun", name, world, sizes, job, tp, None, None, torch.get_num_threads())]
    dist.destroy_process_group()
    return result if rank == 0 else None


# ----------------------------------------------------------------------------------------- Ray Train
def ray_train_loop(config):
    """Ray Train's ``train_loop_per_worker``: prepare_model / prepare_data_loader, a report per epoch."""
    import ray.train
    from ray.train.torch import prepare_data_loader, prepare_model

    pin_threads(config["threads"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    name, sizes = config["model"], config["sizes"]
    model, criterion = make_model(name), nn.CrossEntropyLoss()
    optimizer = make_optimizer(model)
    ddp = prepare_model(model)
    dataset = make_dataset(name, world * sizes["batch_size"] * sizes["steps_per_epoch"])
    loader = prepare_data_loader(make_loader(dataset, sizes["batch_size"]))
    batches, stamps = epochs_of(loader), []
    ddp.train()
    if config["phase"] == "job":
        for epoch in range(sizes["job_epochs"]):
            run_steps(ddp, optimizer, criterion, batches, sizes["steps_per_epoch"], stamps)
            checkpoint = None
            if rank == 0 and epoch == sizes["job_epochs"] - 1:
                directory = tempfile.mkdtemp(prefix="raytrain-ckpt-")
                torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
                checkpoint = ray.train.Checkpoint.from_directory(directory)
            ray.train.report({"epoch": epoch}, checkpoint=checkpoint)  # uploads the checkpoint before returning
            if checkpoint is not None:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
    else:
        run_steps(ddp, optimizer, criterion, batches, timed_steps(sizes), stamps)
    if rank == 0:
        write_json(config["record"], {"stamps": stamps, "threads": torch.get_num_threads()})


def start_ray(spec):
    """A fresh local cluster with ``threads`` CPUs per worker; returns the seconds it took.

    No job ``runtime_env``: the cluster's processes inherit this process's environment (``PYTHONPATH`` with the
    benchmark's folder, ``OMP_NUM_THREADS``: set by benchmark.py), as a user's script without one gets. With a job
    ``runtime_env`` the workers Ray prestarts at ``ray.init`` fit no actor (ray-project/ray#33621) and every worker
    actor waits for a new process (0.82 s against 0.16 s for a bare actor here)."""
    import ray

    for name, wanted in (("PYTHONPATH", BENCH_DIR), ("OMP_NUM_THREADS", str(spec["threads"]))):
        if wanted not in os.environ.get(name, "").split(os.pathsep):
            raise RuntimeError(f"sides.py: {name}={os.environ.get(name)!r} lacks {wanted!r} (run it through "
                               f"benchmark.py, which sets it)")
    start = time.time()
    ray.init(address="local", num_cpus=spec["threads"] * max(spec["workers"]), include_dashboard=False,
             log_to_driver=False)
    return time.time() - start


def run_raytrain(spec):
    """``ray.train.torch.TorchTrainer`` with N workers of ``threads`` CPUs each, for every model and N."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer as RayTorchTrainer

    cluster_s, results = start_ray(spec), []
    storage = tempfile.mkdtemp(prefix="raytrain-", dir=spec["work_dir"])
    for name in spec["models"]:
        sizes = workload_spec(name, spec["smoke"])
        for workers in spec["workers"]:
            runs = {}
            # A smoke test runs the throughput phase at the largest N only, so both phases still run: a Ray Train
            # fit costs ~18 s here even at toy size, and a smoke test's rates mean nothing (the smaller N's come
            # from its job's steps).
            smaller = spec["smoke"] and workers < max(spec["workers"])
            for phase in ("job",) if smaller else ("job", "throughput"):
                path = os.path.join(spec["work_dir"], f"raytrain-{name}-{workers}-{phase}.json")
                config = dict(model=name, sizes=sizes, threads=spec["threads"], phase=phase, record=path)
                t0 = time.time()
                trainer = RayTorchTrainer(
                    ray_train_loop, train_loop_config=config,
                    scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": spec["threads"]}),
                    run_config=RunConfig(name=f"{name}-{workers}-{phase}", storage_path=storage))
                result = trainer.fit()
                if phase == "job":
                    with result.checkpoint.as_directory() as directory:
                        state = torch.load(os.path.join(directory, "model.pt"))
                    make_model(name).load_state_dict(state)
                    t_model = time.time()
                with open(path, encoding="utf-8") as handle:
                    runs[phase] = (t0, json.load(handle))
            (t0, job), (_, tp) = runs["job"], runs.get("throughput", runs["job"])
            results.append(record("raytrain", name, workers, sizes, job["stamps"], tp["stamps"], t0, t_model,
                                  tp["threads"], cluster_start_s=cluster_s))
    ray.shutdown()
    return results


# ----------------------------------------------------------------------------------------- raysgd
def run_raysgd(spec):
    """raysgd ``TorchTrainer`` with N actors of ``threads`` CPUs each; then the raysgd-only costs."""
    import ray

    from raysgd import TorchTrainer
    from raysgd_costs import BenchOperator, measure_costs

    cluster_s, results = start_ray(spec), []
    for name in spec["models"]:
        sizes = workload_spec(name, spec["smoke"])
        for workers in spec["workers"]:
            config = dict(model=name, batch_size=sizes["batch_size"],
                          num_samples=workers * sizes["batch_size"] * sizes["steps_per_epoch"])
            t0 = time.time()
            trainer = TorchTrainer(training_operator_cls=BenchOperator, num_workers=workers,
                                   num_cpus_per_worker=spec["threads"], use_gpu=False, config=config)
            for _ in range(sizes["job_epochs"]):
                trainer.train()
            trainer.get_model()
            t_model = time.time()
            trainer.train(num_steps=timed_steps(sizes))
            stamps, threads = trainer.apply_all_operators(lambda op: (op.stamps, torch.get_num_threads()))[0]
            trainer.shutdown()
            job = stamps[:sizes["job_epochs"] * sizes["steps_per_epoch"]]
            results.append(record("raysgd", name, workers, sizes, job, stamps, t0, t_model, threads,
                                  cluster_start_s=cluster_s))
    costs = measure_costs(spec) if spec.get("costs") else None
    ray.shutdown()
    return {"runs": results, "costs": costs}


SIDES = {"plain": run_plain, "torchrun": run_torchrun, "raytrain": run_raytrain, "raysgd": run_raysgd}


def main(argv):
    if len(argv) != 2:
        raise SystemExit("usage: sides.py SPEC.json")
    with open(argv[1], encoding="utf-8") as handle:
        spec = json.load(handle)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if spec.get("side") not in SIDES:
        raise SystemExit(f"spec['side'] expects one of {sorted(SIDES)}; got {spec.get('side')!r}")
    result = SIDES[spec["side"]](spec)
    if result is not None:
        write_json(spec["record"], result)


if __name__ == "__main__":
    main(sys.argv)
