"""Pictures of the benchmarks' results (PNG, matplotlib), for the documentation: never drawn by hand.

Each benchmark draws its own with ``--plot PATH``; this module also redraws one from a result a benchmark saved
(``--json``/``--out``), without measuring again::

    python benchmarks/plots.py throughput benchmarks/results/latest.json docs/images/throughput.png
    python benchmarks/plots.py recovery recovery.json docs/images/recovery_timeline.png
    python benchmarks/plots.py fsdp fsdp.json docs/images/fsdp_memory.png

- ``throughput``: ``benchmark.py``'s samples/s per side (plain loop, torchrun DDP, Ray Train, raysgd), per model
  and worker count, with raysgd's ratio to torchrun.
- ``recovery``: ``recovery.py``'s batch log around the event, one lane per case and rank: each dot a batch trained,
  the event at 0 s, the pause until training resumed shaded and labelled.
- ``fsdp``: ``fsdp.py``'s training memory per rank (state and peak rise) of DDP and FSDP per worker count.

Every picture's caption line says which run made it (date, machine, load, smoke or not).
"""
import argparse
import json
import sys

SIDES = (("plain", "plain loop"), ("torchrun", "torchrun DDP"), ("raytrain", "Ray Train"), ("raysgd", "raysgd"))
COLORS = {"plain": "#9e9e9e", "torchrun": "#5b8def", "raytrain": "#f0a030", "raysgd": "#2e9e5b",
          "ddp": "#5b8def", "fsdp": "#2e9e5b"}


def _pyplot():
    import matplotlib  # noqa: PLC0415 (optional: the logging/test extras)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _save(fig, path, caption):
    fig.text(0.01, 0.005, caption, fontsize=7, color="#555555", ha="left", va="bottom")
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def throughput(result, path):
    """Bars of samples/s per side for each model and worker count of a ``benchmark.py`` result; returns ``path``."""
    plt = _pyplot()
    runs = result["runs"]
    models = sorted({r["model"] for r in runs}, key=lambda m: ("mlp", "resnet").index(m) if m in ("mlp", "resnet")
                    else 9)
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        counts = sorted({r["workers"] for r in runs if r["model"] == model})
        width = 0.8 / len(SIDES)
        for i, (side, label) in enumerate(SIDES):
            xs, ys = [], []
            for j, n in enumerate(counts):
                found = [r for r in runs if (r["model"], r["side"], r["workers"]) == (model, side, n)]
                if found:
                    xs.append(j + (i - (len(SIDES) - 1) / 2) * width)
                    ys.append(found[0]["samples_per_s"])
            ax.bar(xs, ys, width, label=label, color=COLORS[side])
        for j, n in enumerate(counts):
            mine = [r for r in runs if (r["model"], r["side"], r["workers"]) == (model, "raysgd", n)]
            other = [r for r in runs if (r["model"], r["side"], r["workers"]) == (model, "torchrun", n)]
            if mine and other:
                ratio = mine[0]["samples_per_s"] / other[0]["samples_per_s"]
                top = max(r["samples_per_s"] for r in runs if (r["model"], r["workers"]) == (model, n))
                ax.text(j, top * 1.03, f"raysgd / torchrun {ratio:.2f}x", ha="center", fontsize=8)
        ax.set_xticks(range(len(counts)), [f"{n} worker{'s' if n > 1 else ''}" for n in counts])
        ax.set_ylabel("samples/s (steady state)")
        ax.set_title({"mlp": "MLP 784-1024-1024-10", "resnet": "CIFAR ResNet-8"}.get(model, model), fontsize=10)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Training throughput: the same model, batch and threads on every side", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _save(fig, path, caption(result.get("meta", {}), "benchmarks/benchmark.py"))


def recovery(rows, path, cases=None, window=(-2.0, 7.0)):
    """A timeline of each case's batches around the event (``recovery.py`` rows with a ``timeline``)."""
    plt = _pyplot()
    rows = [r for r in rows if r.get("timeline") and (cases is None or r["case"] in cases)]
    if not rows:
        raise ValueError("no row has a timeline: run benchmarks/recovery.py with --plot (or --json) first")
    lanes = [(row, rank) for row in rows for rank in sorted({rank for _, rank in row["timeline"]})]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(lanes) + 1.6))
    for y, (row, rank) in enumerate(reversed(lanes)):
        times = [t for t, r in row["timeline"] if r == rank and window[0] <= t <= window[1]]
        ax.plot(times, [y] * len(times), "|", markersize=9, color=COLORS["raysgd"] if rank == 0 else "#5b8def")
    for row in rows:  # the pause from the event to training resumed, across the row's lanes
        ys = [y for y, (r, _) in enumerate(reversed(lanes)) if r is row]
        resumed = row["event_to_resumed_s"]
        ax.fill_betweenx([min(ys) - 0.4, max(ys) + 0.4], 0, resumed, color="#e57373", alpha=0.25, lw=0)
        ax.text(resumed + 0.1, (min(ys) + max(ys)) / 2, f"resumed after {resumed:.2f} s", va="center", fontsize=8)
    ax.axvline(0, color="#c62828", lw=1.2)
    ax.text(0.05, len(lanes) - 0.45, "event", color="#c62828", fontsize=8)
    ax.set_yticks(range(len(lanes)), [f"{row['event']}: rank {rank}" for row, rank in reversed(lanes)], fontsize=8)
    ax.set_xlim(*window)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("seconds from the event (each mark: one batch trained)")
    ax.set_title("Recovery: batches trained around a failure, 2 workers", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    meta = rows[0].get("meta", {})
    return _save(fig, path, caption(meta, "benchmarks/recovery.py", extra=f"median of {rows[0]['repeats']} runs "
                                    "per case; the marks are the median run's"))


def fsdp_memory(result, path):
    """Bars of the training memory per rank, DDP against FSDP, per worker count (an ``fsdp.py`` result)."""
    plt = _pyplot()
    rows = result["rows"]
    counts = sorted({r["workers"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in ((axes[0], "state_mb", "parameters, gradients and Adam state per rank"),
                           (axes[1], "peak_rise_mb", "peak memory added by training, per rank")):
        for i, strategy in enumerate(("ddp", "fsdp")):
            values = [next(r[key] for r in rows if (r["strategy"], r["workers"]) == (strategy, n)) for n in counts]
            xs = [j + (i - 0.5) * 0.38 for j in range(len(counts))]
            ax.bar(xs, values, 0.38, label=strategy.upper(), color=COLORS[strategy])
            for x, v in zip(xs, values):
                ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(counts)), [f"{n} worker{'s' if n > 1 else ''}" for n in counts])
        ax.set_ylabel("MB")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    meta = result.get("meta", {})
    fig.suptitle(f"FSDP against DDP: an MLP of {meta.get('parameters', 0) / 1e6:.1f} M parameters", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return _save(fig, path, caption(meta, "benchmarks/fsdp.py"))


def caption(meta, script, extra=None):
    """The line under a picture saying which run made it.

    Example:
        >>> caption({"date": "2026-11-22T17:45:18+00:00", "machine": "vm (x86_64, 2 CPUs)",
        ...          "load_average": [2.0, 1.5, 1.0]}, "benchmarks/benchmark.py")
        'benchmarks/benchmark.py, 2026-11-22, vm (x86_64, 2 CPUs), load average 2.0 at the start'
    """
    parts = [script, str(meta.get("date", "?"))[:10]]
    if meta.get("machine"):
        parts.append(meta["machine"])
    elif meta.get("cpus"):
        parts.append(f"{meta['cpus']} CPUs")
    load = meta.get("load_average") or meta.get("load_average_start") or meta.get("loadavg")
    if load:
        parts.append(f"load average {load[0]:.1f} at the start")
    if meta.get("smoke"):
        parts.append("SMOKE TEST (toy sizes: the numbers mean nothing)")
    if extra:
        parts.append(extra)
    return ", ".join(parts)


DRAW = {"throughput": throughput, "recovery": recovery, "fsdp": fsdp_memory}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(DRAW))
    parser.add_argument("result", help="the JSON a benchmark wrote")
    parser.add_argument("out", help="the PNG to write")
    args = parser.parse_args(argv)
    with open(args.result, encoding="utf-8") as handle:
        result = json.load(handle)
    print(DRAW[args.kind](result, args.out))


if __name__ == "__main__":
    sys.exit(main())
