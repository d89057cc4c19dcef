"""Plots a training curve (losses and accuracies per epoch) to a PNG file with matplotlib.

Outside the training layers: imports the standard library and :mod:`raysgd.optional`; matplotlib (the
optional ``logging`` extra: ``pip install "raysgd[logging]"``) is imported when a plot is drawn. Uses matplotlib's
object API with the Agg canvas, so it never touches pyplot's global state or needs a display.

Example:
    >>> history = [{"epoch": 1, "train_loss": 1.2, "val_loss": 1.0, "val_accuracy": 0.6},
    ...            {"epoch": 2, "train_loss": 0.7, "val_loss": 0.6, "val_accuracy": 0.8}]
    >>> plot_training_curve(history, "curve.png")  # doctest: +SKIP
    'curve.png'
"""
import csv
import math
import os

from raysgd import optional
from raysgd.base.checks import expect, is_number

__all__ = ["plot_training_curve", "read_history"]


def read_history(path):
    """Rows of a CSV results file (one ``train()``/``validate()`` result a row) as dicts of floats.

    Cells that are not numbers (or are empty) are left out of their row.

    Example:
        >>> read_history("results.csv")[0]["train_loss"]  # doctest: +SKIP
        1.23
    """
    rows = []
    with open(path, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            parsed = {}
            for key, value in row.items():
                try:
                    parsed[key] = float(value)
                except (TypeError, ValueError):
                    continue
            rows.append(parsed)
    return rows


def _is_number(value):
    """A finite real number (a numpy one too, as a one-worker result holds it): a point to draw."""
    return is_number(value) and math.isfinite(value)


def _default_metrics(history):
    keys = []
    for row in history:
        for key, value in row.items():
            if key not in keys and _is_number(value) and not key.startswith("last_") and (
                    "loss" in key or "accuracy" in key):
                keys.append(key)
    return keys


def plot_training_curve(history, path, metrics=None, x="epoch", title=None):
    """Draw ``metrics`` of each result in ``history`` against ``x`` and save the figure as ``path``.

    Losses go on the left panel, accuracies (keys containing ``"acc"``) on the right one.

    Args:
        history: a list of result dicts (e.g. ``{**trainer.train(), **trainer.validate()}`` per
            epoch), or the path of a CSV file with one result per row.
        path: where to write the PNG; missing parent directories are created.
        metrics: a list of the keys to draw (any finite real number is a point, numpy's too); default every
            key containing ``loss`` or ``accuracy`` (``last_*`` keys left out).
        x: the key for the x axis; results without it are numbered 1, 2, ...
        title: the figure's title.

    Returns:
        ``path``.

    Example:
        >>> plot_training_curve([{"train_loss": 1.0}, {"train_loss": 0.5}], "loss.png")  # doctest: +SKIP
        'loss.png'
    """
    if isinstance(history, (str, os.PathLike)):
        history = read_history(history)
    how = {"caller": "plot_training_curve", "call": True}
    expect(isinstance(history, (list, tuple)) and all(isinstance(row, dict) for row in history), "history",
           "a list of result dicts or a CSV path", history, TypeError, got=type(history).__name__, **how)
    expect(history, "history", "at least one result", history, got="an empty list", **how)
    names = list(metrics) if metrics is not None and not isinstance(metrics, (str, bytes)) and hasattr(
        metrics, "__iter__") else metrics
    expect(names is None or (isinstance(names, list) and all(isinstance(m, str) for m in names)), "metrics",
           "None or a list of metric names", metrics, TypeError, **how)
    metrics = names if names is not None else _default_metrics(history)
    if not metrics:
        raise ValueError(f"plot_training_curve found no loss or accuracy keys to draw; the results have "
                         f"{sorted(history[0])}. Pass metrics=[...].")
    missing = [m for m in metrics if not any(_is_number(row.get(m)) for row in history)]
    if missing:
        raise ValueError(f"plot_training_curve(metrics=...) names {missing}, which no result holds as a number; "
                         f"available: {sorted({k for row in history for k, v in row.items() if _is_number(v)})}")
    backend = optional.require("matplotlib.backends.backend_agg", "plot_training_curve")
    Figure = optional.require("matplotlib.figure", "plot_training_curve").Figure  # noqa: N806 (a class)

    accuracies = [m for m in metrics if "acc" in m]
    losses = [m for m in metrics if m not in accuracies]
    panels = [group for group in (losses, accuracies) if group]
    figure = Figure(figsize=(5.5 * len(panels), 4), dpi=100)
    backend.FigureCanvasAgg(figure)
    for index, group in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), index + 1)
        for metric in group:
            points = [(row.get(x, i + 1), row[metric]) for i, row in enumerate(history) if _is_number(row.get(metric))]
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=metric)
        axes.set_xlabel(x)
        axes.set_ylabel("accuracy" if group is accuracies else "loss")
        axes.grid(True, alpha=0.3)
        axes.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(path, format="png")
    return path
