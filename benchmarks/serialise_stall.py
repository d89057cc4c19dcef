"""How long a thread that serialises the state stalls the training thread beside it (the interpreter lock).

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/serialise_stall.py                  # 10 MB and 256 MB states
    PYTHONPATH=$PWD python benchmarks/serialise_stall.py --sizes 10,256,1000
    PYTHONPATH=$PWD python benchmarks/serialise_stall.py --smoke-test     # 1 MB (the tests run it)

For each size: a state of that many MB of float32 is serialised in a second thread, once by ``torch.save`` into an
``io.BytesIO`` (before) and once by :func:`raysgd.torch.state.checkpoint.serialise` (raysgd's commits and call-start
snapshots), while the main thread runs a Python loop (the training thread's Python work: the data loader, hooks,
the optimizer's Python code). Columns: ``serialise_ms`` the serialisation's wall time; ``worst_stall_ms`` the longest
gap between two iterations of the main thread's loop while it ran (the longest the training thread waited for the
lock); ``loop_share`` the main loop's iterations during the serialisation per second, against the same loop alone
(1.0: no stall). Median of ``--repeats``. Prints a table and the JSON (``--json PATH`` also writes it).
"""
import argparse
import io
import json
import statistics
import threading
import time

import torch
from tabulate import tabulate

from raysgd.torch.state.checkpoint import serialise


def _loop(stop, out, running=None):
    """Counts iterations until ``stop``; sets ``running`` (if given) once the loop runs, so that the work it is
    measured beside starts only then (a small serialisation could otherwise end before the loop's first step)."""
    count, worst, last = 0, 0.0, time.perf_counter()
    while not stop.is_set():
        now = time.perf_counter()
        worst, last, count = max(worst, now - last), now, count + 1
        if count == 1 and running is not None:
            running.set()
    out.update(count=count, worst=worst)


def _alone_rate(seconds=0.3):
    stop, out = threading.Event(), {}
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    _loop(stop, out)
    return out["count"] / seconds


def _bytesio(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer()


def measure(size_mb, how, repeats):
    """One row: ``how`` (``"io.BytesIO"`` or ``"serialise"``) on a state of ``size_mb`` MB."""
    state = {"weight": torch.randn(int(size_mb * 2**20 / 4)), "step": 3}
    write = _bytesio if how == "io.BytesIO" else serialise
    alone = _alone_rate()
    walls, stalls, shares = [], [], []
    for _ in range(repeats):
        stop, running, out, done = threading.Event(), threading.Event(), {}, {}

        def work(done=done, stop=stop, running=running):
            if not running.wait(timeout=60):
                stop.set()
                return  # the main thread raises: no wall time recorded
            started = time.perf_counter()
            done["view"] = write(state)
            done["wall"] = time.perf_counter() - started
            stop.set()

        worker = threading.Thread(target=work)
        worker.start()
        _loop(stop, out, running)
        worker.join()
        if "wall" not in done:
            raise TimeoutError("the measured loop did not start within 60 s")
        assert torch.equal(torch.load(io.BytesIO(done.pop("view")))["weight"], state["weight"])
        walls.append(done["wall"])
        stalls.append(out["worst"])
        shares.append(out["count"] / done["wall"] / alone)
    return {"size_mb": size_mb, "how": how, "serialise_ms": 1000 * statistics.median(walls),
            "worst_stall_ms": 1000 * statistics.median(stalls), "loop_share": statistics.median(shares)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,256", help="state sizes in MB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (median)")
    parser.add_argument("--smoke-test", action="store_true", help="one 1 MB state, one run")
    parser.add_argument("--json", help="also write the rows there")
    args = parser.parse_args()
    sizes = [1] if args.smoke_test else [float(size) for size in args.sizes.split(",")]
    repeats = 1 if args.smoke_test else args.repeats
    rows = [measure(size, how, repeats) for size in sizes for how in ("io.BytesIO", "serialise")]
    print(tabulate(rows, headers="keys", floatfmt=".2f"))
    result = {"rows": rows, "torch": torch.__version__}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
