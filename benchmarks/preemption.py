"""What preemption costs per step: the all_reduce (max) of one CPU int that every step boundary of a committing
``train()`` call adds (``raysgd.torch.commits.preemption.agree``), against a training step.

Run from the repository root (two gloo processes on this machine, no Ray)::

    PYTHONPATH=$PWD python benchmarks/preemption.py [--steps 2000] [--smoke-test]

Prints, for 2 ranks: microseconds per agreement alone (median and 90th percentile of ``--steps`` calls), per
step of an MLP (784-256-10, batch 64, DDP's gradient all_reduce), and per step followed by an agreement (the
asynchronous all_reduce started at one boundary is read at the next) or a synchronous one, and the ratios.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raysgd.torch.commits import preemption  # noqa: E402


class _Worker:
    backend, world_size = "gloo", 2


def _times(fn, steps):
    out = []
    for _ in range(steps):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def _run(rank, port, steps, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    worker = _Worker()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def step():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    def step_and_agree():
        step()
        preemption.agree(worker)

    def step_and_wait():
        step()
        flag = torch.zeros(1, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    _times(step, 20)
    agree = _times(lambda: preemption.agree(worker), steps)  # alone, back to back: waits for each other
    plain, agreeing, waiting = [], [], []
    for _ in range(5):  # interleaved, so that the machine's load hits all alike
        plain += _times(step, steps // 5)
        agreeing += _times(step_and_agree, steps // 5)
        waiting += _times(step_and_wait, steps // 5)
    preemption.agree(worker, last=True)
    if rank == 0:
        queue.put((agree, plain, agreeing, waiting))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--smoke-test", action="store_true")
    args = parser.parse_args()
    steps = 100 if args.smoke_test else args.steps
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_run, args=(rank, port, steps, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    agree, plain, agreeing, waiting = queue.get(timeout=300)
    for proc in procs:
        proc.join(60)

    def p90(values):
        return sorted(values)[int(0.9 * (len(values) - 1))]

    rows = [("agreement alone, back to back", agree), ("MLP step, batch 64 (DDP)", plain),
            ("MLP step + agreement (asynchronous, read one step late: raysgd's)", agreeing),
            ("MLP step + a synchronous all_reduce of one int (for comparison)", waiting)]
    print("| 2 ranks, gloo, 1 thread each | median us | p90 us |")
    print("|---|---|---|")
    for name, values in rows:
        print(f"| {name} | {statistics.median(values) * 1e6:.0f} | {p90(values) * 1e6:.0f} |")
    for name, values in (("asynchronous", agreeing), ("synchronous", waiting)):
        print(f"step + {name} agreement / step (medians): {statistics.median(values) / statistics.median(plain):.3f}")

if __name__ == "__main__":
    main()
