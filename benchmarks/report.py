"""Turning raw run records into rates, ratios, target checks and tabulate tables.

Pure functions over the dicts that ``sides.py``, ``raysgd_costs.py`` and ``gpu.py`` write, so the
arithmetic can be read (and checked) apart from the measuring.

Example:
    >>> run = dict(side="plain", model="mlp", workers=1, threads=1, batch_size=2, warmup=1, steps=2, t0=0.0,
    ...            t_first_batch=1.5, t_model=3.0, tp_stamps=[4.0, 5.0, 6.0])
    >>> derive_run(run)["samples_per_s"], derive_run(run)["startup_s"]
    (2.0, 1.5)
"""
from tabulate import tabulate

from workloads import steady_rate

SIDE_NAMES = {"plain": "plain loop", "torchrun": "torchrun DDP", "raytrain": "Ray Train", "raysgd": "raysgd"}
TARGETS = {"steady_vs_torchrun": 0.98, "steady_vs_plain": 0.99, "e2e_vs_raytrain": 0.7, "overhead_ms": 10.0,
           "recovery_s": 5.0}


def derive_run(run):
    """The run's steady-state samples/s, start-up and end-to-end seconds (raw stamps dropped)."""
    out = {k: v for k, v in run.items() if k not in ("tp_stamps", "t0", "t_first_batch", "t_model")}
    out["samples_per_s"] = steady_rate(run["tp_stamps"], run["warmup"], run["steps"],
                                       run["workers"] * run["batch_size"], run.get("windows", 1))
    out["startup_s"] = run["t_first_batch"] - run["t0"]
    out["e2e_s"] = run["t_model"] - run["t0"]
    if run.get("cluster_start_s") is not None:
        out["e2e_with_cluster_s"] = out["e2e_s"] + run["cluster_start_s"]
    return out


def _find(runs, side, model, workers):
    for run in runs:
        if run["side"] == side and run["model"] == model and run["workers"] == workers:
            return run
    return None


def ratios(runs):
    """raysgd over each other side, per model and worker count, for every measure both have."""
    rows = []
    pairs = [("torchrun", "samples_per_s"), ("raytrain", "samples_per_s"), ("plain", "samples_per_s"),
             ("raytrain", "e2e_s"), ("raytrain", "e2e_with_cluster_s"), ("raytrain", "startup_s"),
             ("torchrun", "startup_s"), ("torchrun", "e2e_s")]
    for ours in (r for r in runs if r["side"] == "raysgd"):
        for other_side, measure in pairs:
            other = _find(runs, other_side, ours["model"], ours["workers"])
            if other is None or other.get(measure) is None or ours.get(measure) is None:
                continue
            rows.append(dict(model=ours["model"], workers=ours["workers"], measure=measure, versus=other_side,
                             raysgd=ours[measure], other=other[measure], ratio=ours[measure] / other[measure]))
    return rows


def _ratio(rows, model, workers, measure, versus):
    for row in rows:
        if (row["model"], row["workers"], row["measure"], row["versus"]) == (model, workers, measure, versus):
            return row["ratio"]
    return None


def targets(ratio_rows, costs):
    """Each target of issue 7 with the measured value and whether it is met."""
    rows = []

    def add(name, measured, target, met):
        if measured is not None:
            rows.append(dict(target=name, measured=round(measured, 3), goal=target, met=bool(met)))

    for model in sorted({r["model"] for r in ratio_rows}):
        value = _ratio(ratio_rows, model, 2, "samples_per_s", "torchrun")
        add(f"{model}: raysgd 2 / torchrun 2, steady state", value, ">= 0.98",
            value is not None and value >= TARGETS["steady_vs_torchrun"])
        value = _ratio(ratio_rows, model, 1, "samples_per_s", "plain")
        add(f"{model}: raysgd 1 / plain loop, steady state", value, ">= 0.99",
            value is not None and value >= TARGETS["steady_vs_plain"])
        for workers in (1, 2):
            value = _ratio(ratio_rows, model, workers, "e2e_s", "raytrain")
            add(f"{model}: 3-epoch job, raysgd {workers} / Ray Train {workers}", value, "<= 0.7",
                value is not None and value <= TARGETS["e2e_vs_raytrain"])
    for row in (costs or {}).get("driver_overhead", []):
        if row["max_retries"] == 0:
            add(f"driver overhead per train(), {row['workers']} worker(s), {row['batches']} batches, no snapshot "
                "(ms)", row["overhead_ms"], "<= 10", row["overhead_ms"] <= TARGETS["overhead_ms"])
    recovery = (costs or {}).get("recovery")
    if recovery:
        add("recovery: worker death to next batch trained (s)", recovery["recovery_s"], "<= 5",
            recovery["recovery_s"] <= TARGETS["recovery_s"])
    return rows


def _fmt(value, digits=2):
    return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else value)


def tables(result, fmt="simple"):
    """Every table of a result as text (``fmt`` is a tabulate format, e.g. ``github`` for README.md)."""
    meta, parts = result["meta"], []
    runs = result.get("runs", [])
    if runs:
        rows = [[r["model"], SIDE_NAMES[r["side"]], r["workers"], r["threads"], r["batch_size"],
                 _fmt(r["samples_per_s"], 0), _fmt(r["startup_s"]), _fmt(r["e2e_s"]), _fmt(r.get("cluster_start_s"))]
                for r in runs]
        parts.append(("Throughput, start-up and the short job (threads = intra-op threads per process; "
                      "batch = per worker; Ray sides timed from the trainer's creation in a running cluster, "
                      "plain/torchrun from the command's launch)",
                      tabulate(rows, ["model", "side", "N", "threads", "batch", "samples/s", "start-up s",
                                      "3-epoch job s", "ray.init s"], tablefmt=fmt)))
    if result.get("ratios"):
        rows = [[r["model"], r["workers"], r["measure"], f"raysgd / {SIDE_NAMES[r['versus']]}", _fmt(r["raysgd"]),
                 _fmt(r["other"]), _fmt(r["ratio"], 3)] for r in result["ratios"]]
        parts.append(("Ratios (raysgd over the other side)",
                      tabulate(rows, ["model", "N", "measure", "ratio of", "raysgd", "other", "ratio"], tablefmt=fmt)))
    costs = result.get("costs") or {}
    if costs.get("driver_overhead"):
        rows = [[r["workers"], r["batches"], r["max_retries"], "yes" if r["max_retries"] else "no",
                 _fmt(r["train_ms"], 1), _fmt(r["overhead_ms"], 1)] for r in costs["driver_overhead"]]
        parts.append(("Driver overhead per train() (wall time minus the slowest worker's epoch; median)",
                      tabulate(rows, ["N", "batches/epoch", "max_retries", "snapshot", "train() ms", "overhead ms"],
                               tablefmt=fmt)))
    if costs.get("snapshot"):
        rows = [[r["model"], _fmt(r["state_mb"], 1), _fmt(r["snapshot_ms"], 1), _fmt(r["in_train_ms"], 1)]
                for r in costs["snapshot"]]
        parts.append(("State snapshot per train() (rank 0's state bytes to the driver; median)",
                      tabulate(rows, ["model", "state MB", "state_stream ms", "cost inside train() ms"],
                               tablefmt=fmt)))
    if costs.get("recovery"):
        rows = [[r.get("mode", ""), _fmt(r["recovery_s"]), _fmt(r["detect_s"]), _fmt(r["restart_s"]),
                 _fmt(r["first_batch_s"]), r["repeats"]]
                for r in (costs["recovery"], costs.get("recovery_restart_all")) if r]
        parts.append(("Recovery (SIGKILL of rank 1 mid-epoch, 2 workers, MLP; median)",
                      tabulate(rows, ["processes", "kill -> next batch s", "detected s", "restart + load s",
                                      "first batch s", "repeats"], tablefmt=fmt)))
    gpu = result.get("gpu") or {}
    if gpu.get("rows"):
        rows = [[r["workload"], f"{r['image']}px x {r['batch_size']}", r["precision"], r["side"],
                 _fmt(r["images_per_s"], 1), _fmt(r["ratio"], 3)] for r in gpu["rows"]]
        parts.append((f"GPU: 1 worker against a plain torch.amp loop, {gpu['device']}, torch {gpu['torch']}, "
                      f"{gpu['date']} ({gpu['status']}; raysgd-sync: a loss read per step, as before the sync fix)",
                      tabulate(rows, ["workload", "input", "precision", "side", "images/s", "/ plain"], tablefmt=fmt)))
    elif gpu:
        parts.append(("GPU", f"skipped: {gpu.get('reason')}"))
    if result.get("targets"):
        rows = [[t["target"], t["measured"], t["goal"], "yes" if t["met"] else "NO"] for t in result["targets"]]
        parts.append(("Targets", tabulate(rows, ["target", "measured", "goal", "met"], tablefmt=fmt)))
    smoke = " (SMOKE TEST: toy sizes, sides run at the same time: the numbers mean nothing)" if meta["smoke"] else ""
    header = (f"{meta['date']} on {meta['machine']}, load average {meta['load_average'][0]:.1f} at the start; "
              f"torch {meta['torch']}, ray {meta['ray']}; {meta['threads']} thread(s) per process on every side; "
              f"Ray workers at nice {meta.get('ray_worker_niceness', 15)}, the other sides at 0; Ray Train polls "
              f"every {meta.get('ray_train_poll_s', 2.0):g} s{smoke}")
    heading = "#### " if fmt == "github" else ""
    return header + "\n\n" + "\n\n".join(f"{heading}{title}\n\n{body}" if heading else f"{title}\n{body}"
                                           for title, body in parts)
