"""Pictures of the benchmarks' results (PNG, matplotlib), for the documentation: never drawn by hand.

Each benchmark draws its own with ``--plot PATH``; this module also redraws one from a result a benchmark saved
(``--json``/``--out``), without measuring again::

    python benchmarks/plots.py throughput benchmarks/results/latest.json docs/images/throughput.png
    python benchmarks/plots.py throughput benchmarks/README.md docs/images/throughput.png   # its tables, as markdown
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
    """Bars of samples/s per side for each model and worker count of a ``benchmark.py`` result, and of the 3-epoch
    job's seconds end to end when the result has them; returns ``path``."""
    plt = _pyplot()
    runs = result["runs"]
    models = sorted({r["model"] for r in runs}, key=lambda m: ("mlp", "resnet").index(m) if m in ("mlp", "resnet")
                    else 9)
    titles = {"mlp": "MLP 784-1024-1024-10", "resnet": "CIFAR ResNet-8"}
    jobs = all("e2e_s" in r for r in runs)
    fig, axes = plt.subplots(1, len(models) + jobs, figsize=(4.6 * (len(models) + jobs), 4.0), squeeze=False)
    width = 0.8 / len(SIDES)

    def find(model, side, n):
        return next((r for r in runs if (r["model"], r["side"], r["workers"]) == (model, side, n)), None)

    for ax, model in zip(axes[0], models):
        counts = sorted({r["workers"] for r in runs if r["model"] == model})
        for i, (side, label) in enumerate(SIDES):
            bars = [(j + (i - (len(SIDES) - 1) / 2) * width, find(model, side, n)) for j, n in enumerate(counts)]
            ax.bar([x for x, r in bars if r], [r["samples_per_s"] for _, r in bars if r], width, label=label,
                   color=COLORS[side])
        for j, n in enumerate(counts):
            mine, other = find(model, "raysgd", n), find(model, "torchrun", n)
            if mine and other:
                top = max(r["samples_per_s"] for r in runs if (r["model"], r["workers"]) == (model, n))
                ax.text(j, top * 1.03, f"raysgd / torchrun {mine['samples_per_s'] / other['samples_per_s']:.2f}x",
                        ha="center", fontsize=8)
        ax.set_xticks(range(len(counts)), [f"{n} worker{'s' if n > 1 else ''}" for n in counts])
        ax.set_ylabel("samples/s, steady state")
        ax.set_title(titles.get(model, model), fontsize=10)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
        ax.grid(axis="y", alpha=0.3)
    if jobs:  # the short job: start-up included, where Ray Train's controller and raysgd differ most
        ax, groups = axes[0][-1], [(m, n) for m in models for n in sorted({r["workers"] for r in runs
                                                                         if r["model"] == m})]
        for i, (side, label) in enumerate(SIDES):
            bars = [(j + (i - (len(SIDES) - 1) / 2) * width, find(m, side, n)) for j, (m, n) in enumerate(groups)]
            ax.bar([x for x, r in bars if r], [r["e2e_s"] for _, r in bars if r], width, color=COLORS[side])
        ax.set_xticks(range(len(groups)), [f"{'ResNet-8' if m == 'resnet' else m.upper()}, {n}" for m, n in groups],
                      fontsize=8)
        ax.set_ylabel("seconds, lower is better")
        ax.set_title("a 3-epoch job, end to end (model, workers)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(SIDES), fontsize=8, bbox_to_anchor=(0.5, 0.93),
               frameon=False)
    fig.suptitle("raysgd against a plain loop, torchrun DDP and Ray Train: the same model, batch and threads",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 0.89))
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
        ax.set_ylim(0, max(r[key] for r in rows) * 1.3)  # room for the legend above the bars
        ax.set_ylabel("MB")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2, loc="upper right")
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


def result_from_markdown(text):
    """A ``benchmark.py`` result (``runs`` and ``meta``) read back from the tables it printed as markdown
    (``--markdown``, as benchmarks/README.md keeps the latest run's): the first table with ``side`` and
    ``samples/s`` columns, and the run's description line (``<date> on <machine>, load average <x> ...``).

    Example:
        >>> result = result_from_markdown("2026-11-22T17:45:18+00:00 on vm (x86_64, 2 CPUs), load average 2.0 at "
        ...     "the start; torch\\n\\n| model | side | N | samples/s |\\n|---|---|---|---|\\n| mlp | raysgd | 2 | 7320 |\\n")
        >>> result["runs"], result["meta"]["load_average"]
        ([{'model': 'mlp', 'side': 'raysgd', 'workers': 2, 'samples_per_s': 7320.0}], [2.0])
    """
    import re  # noqa: PLC0415

    names = {"plain loop": "plain", "torchrun DDP": "torchrun", "Ray Train": "raytrain", "raysgd": "raysgd"}
    meta = {}
    described = re.search(r"^(\S+) on (.+?), load average ([\d.]+) at the start", text, flags=re.M)
    if described:
        meta = {"date": described.group(1), "machine": described.group(2),
                "load_average": [float(described.group(3))]}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and "side" in cells and "samples/s" in cells:
            runs = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                values = dict(zip(cells, (c.strip() for c in row.strip().strip("|").split("|"))))
                runs.append({"model": values["model"], "side": names.get(values["side"], values["side"]),
                             "workers": int(values["N"]), "samples_per_s": float(values["samples/s"])})
                if values.get("3-epoch job s"):
                    runs[-1]["e2e_s"] = float(values["3-epoch job s"])
            return {"runs": runs, "meta": meta}
    raise ValueError("no table with 'side' and 'samples/s' columns")


DRAW = {"throughput": throughput, "recovery": recovery, "fsdp": fsdp_memory}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(DRAW))
    parser.add_argument("result", help="the JSON a benchmark wrote (throughput: or the markdown of its tables)")
    parser.add_argument("out", help="the PNG to write")
    args = parser.parse_args(argv)
    with open(args.result, encoding="utf-8") as handle:  # JSON, or benchmark.py's tables as markdown
        result = result_from_markdown(handle.read()) if args.result.endswith(".md") else json.load(handle)
    print(DRAW[args.kind](result, args.out))


if __name__ == "__main__":
    sys.exit(main())
