"""Draw raysgd's architecture from its code: the run on a cluster, and the package's layers with their imports.

    python tools/draw_architecture.py                       # both, into docs/images/
    python tools/draw_architecture.py --runtime out.png --layers layers.png

``--runtime`` (docs/images/architecture.png): the processes of a run on two nodes, the driver's (your script, the
facade, the run controller, the worker group, the commit store, rank 0) and another (rank 1, a warm spare), the
object stores holding the restart points and commits with a copy on the other node, and durable storage. Each box
names the class that does the job and the file it lives in, both read from the code: the script imports every class
it draws, so a class renamed or moved changes the picture, or stops the script with an error naming it.

``--layers`` (docs/images/layers.png): every unit of the package (a folder of ``raysgd/torch``, or a module) in its
layer, as docs/architecture.md's layer table assigns them (``tests/repo/test_layers.py`` checks the imports against it),
sized by its lines of code, with an arrow for each unit it imports (read from the source with ``ast``): every arrow
points down.

Run from the repository root with raysgd importable (``pip install -e .`` or ``PYTHONPATH=$PWD``) and matplotlib.
"""
import argparse
import ast
import importlib
import inspect
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raysgd"
IMAGES = ROOT / "docs" / "images"


def _pyplot():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def component(path):
    """``(name, file)`` of the class or function ``path`` (``"module:Name"``) as the code has it.

    Example:
        >>> component("raysgd.torch.torch_trainer:TorchTrainer")
        ('TorchTrainer', 'torch/torch_trainer.py')
    """
    module, name = path.split(":")
    obj = getattr(importlib.import_module(module), name)
    source = pathlib.Path(inspect.getsourcefile(obj)).resolve().relative_to(PACKAGE)
    return obj.__name__.lstrip("_"), str(source)


# What the runtime picture draws: (box id, role, the code doing the job or None, what it holds or does, x, y).
PROCESS, ACTOR, STORE, USER = "#dbe9f8", "#e3f1e0", "#fff2cc", "#f3e5f5"
WIDTH, HEIGHT = 0.27, 0.10
BOXES = (
    ("script", "your driver script", None, "for epoch in ...: trainer.train()", 0.04, 0.80, USER),
    ("facade", "the facade", "raysgd.torch.torch_trainer:TorchTrainer", "checks the options, nothing else",
     0.04, 0.67, PROCESS),
    ("controller", "the run's one owner", "raysgd.torch.execution.controller:RunController",
     "restart points, failures, resizes", 0.04, 0.54, PROCESS),
    ("group", "the workers' actors", "raysgd.torch.execution.worker_group:WorkerGroup",
     "every call under a deadline", 0.04, 0.41, PROCESS),
    ("durable", "durable checkpoints", "raysgd.torch.storage.durable:DurableRun", "uploads in the background",
     0.04, 0.28, PROCESS),
    ("store", "commit store, 0 CPU", "raysgd.torch.commits.commit_store:CommitStore",
     "small records: cursor, RNG, metrics", 0.365, 0.80, ACTOR),
    ("rank0", "rank 0 (a Ray actor)", "raysgd.torch.execution.worker:TorchWorker",
     "your TrainingOperator (DDP or FSDP)", 0.365, 0.54, ACTOR),
    ("holder0", "part holder, 0 CPU", "raysgd.torch.commits.part_holders:Holders", "keeps this node's commit parts",
     0.365, 0.41, ACTOR),
    ("objects0", "in the object store", "raysgd.torch.restart_points.restart_point:RestartPoint",
     "restart point and commit parts", 0.365, 0.28, STORE),
    ("spare", "warm spare (idle actor)", "raysgd.torch.execution.spares:SparePool",
     "torch imported, your hook run", 0.715, 0.80, ACTOR),
    ("rank1", "rank 1 (a Ray actor)", "raysgd.torch.execution.worker:TorchWorker",
     "your TrainingOperator (DDP or FSDP)", 0.715, 0.54, ACTOR),
    ("holder1", "part holder, 0 CPU", "raysgd.torch.commits.part_holders:Holders", "keeps the other node's copy",
     0.715, 0.41, ACTOR),
    ("objects1", "in the object store", "raysgd.torch.restart_points.restart_point:RestartPoint",
     "the copies of node 1's parts", 0.715, 0.28, STORE),
    ("storage", "storage_path: a folder, NFS or s3://", "raysgd.torch.storage.filesystem:CheckpointStorage",
     "checkpoint_000007/: the state parts, then checkpoint.json", 0.365, 0.03, STORE),
)
# (from, to, label, style): arrows between boxes.
ARROWS = (
    ("script", "facade", "", "-"), ("facade", "controller", "", "-"), ("controller", "group", "", "-"),
    ("group", "rank0", "calls on every rank", "-"),
    ("rank0", "rank1", "allreduce (gloo / nccl)", "<->"),
    ("rank0", "store", "records", "-"), ("rank1", "store", "", "-"),
    ("rank0", "holder0", "", "-"), ("holder0", "objects0", "", "-"), ("holder1", "objects1", "", "-"),
    ("holder0", "holder1", "a copy on another node", "-"),
    ("spare", "rank1", "takes a dead rank's place", "dashed"),
    ("objects0", "storage", "0-CPU tasks write the parts", "-"), ("durable", "storage", "checkpoint.json last", "-"),
)


def _anchor(box, toward):
    """The point on ``box``'s edge facing the centre of ``toward`` (boxes as (x, y, w, h))."""
    x, y, w, h = box
    tx, ty = toward[0] + toward[2] / 2, toward[1] + toward[3] / 2
    cx, cy = x + w / 2, y + h / 2
    dx, dy = tx - cx, ty - cy
    if abs(dx) * h > abs(dy) * w:  # leaves through a side
        return (x + w if dx > 0 else x), cy + dy * (w / 2) / abs(dx)
    return cx + dx * (h / 2) / max(abs(dy), 1e-9), (y + h if dy > 0 else y)


def runtime(path):
    """Draw the run on a cluster (see the module docstring) into ``path``; returns ``path``."""
    plt = _pyplot()
    from matplotlib.patches import FancyBboxPatch  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(12, 8))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    for x, w, title in ((0.02, 0.635, "the driver's node"), (0.70, 0.288, "another node")):
        ax.add_patch(FancyBboxPatch((x, 0.16), w, 0.80, boxstyle="round,pad=0.005", fc="#fafafa", ec="#9e9e9e",
                                    ls="--"))
        ax.text(x + 0.01, 0.955, title, fontsize=10, color="#616161", va="top")
    ax.add_patch(FancyBboxPatch((0.03, 0.265), 0.295, 0.67, boxstyle="round,pad=0.003", fc="none", ec="#90a4ae"))
    ax.text(0.035, 0.932, "the driver process", fontsize=8, color="#616161", va="top")
    geometry = {}
    for key, role, code, detail, x, y, colour in BOXES:
        w = 0.62 if key == "storage" else WIDTH
        geometry[key] = (x, y, w, HEIGHT)
        ax.add_patch(FancyBboxPatch((x, y), w, HEIGHT, boxstyle="round,pad=0.004", fc=colour, ec="#546e7a", lw=0.8))
        if code is None:
            lines = [(role, 9, "bold", None), (detail, 7.5, "normal", "monospace")]
        else:
            name, source = component(code)
            lines = [(f"{name}: {role}", 8.5, "bold", None), (f"raysgd/{source}", 6.5, "normal", "monospace"),
                     (detail, 7.5, "normal", None)]
        for i, (text, size, weight, family) in enumerate(lines):
            ax.text(x + w / 2, y + HEIGHT * (0.78 - 0.28 * i), text, ha="center", va="center", fontsize=size,
                    fontweight=weight, family=family, color="#263238" if i else "black")
    for start, end, label, style in ARROWS:
        a, b = geometry[start], geometry[end]
        p, q = _anchor(a, b), _anchor(b, a)
        arrow = dict(arrowstyle="<->" if style == "<->" else "->", color="#37474f", lw=1,
                     ls="--" if style == "dashed" else "-", shrinkA=2, shrinkB=2)
        ax.annotate("", xy=q, xytext=p, arrowprops=arrow)
        if label:
            ax.text((p[0] + q[0]) / 2, (p[1] + q[1]) / 2 + 0.012, label, fontsize=7, ha="center", color="#263238",
                    bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5))
    ax.set_title("A raysgd run on two nodes: the state stays with the workers, with a copy on another node",
                 fontsize=11)
    fig.text(0.01, 0.01, "drawn by tools/draw_architecture.py from raysgd's code: each box names the class doing the "
             "job and its file under raysgd/", fontsize=7, color="#555555")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def layer_table():
    """``({unit: layer}, the glue's layer)``: docs/architecture.md's layer table (read by ``tools/layer_table.py``,
    as ``tests/repo/test_layers.py`` reads it)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import layer_table as table  # noqa: PLC0415 (a script beside this one)
    finally:
        sys.path.pop(0)
    return table.read().units, table.GLUE


def _module(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_graph():
    """``({unit: (layer, lines)}, {(unit, imported unit): count})`` of the library (examples left out)."""
    layers, _ = layer_table()

    def unit_of(name):
        for unit in sorted(layers, key=len, reverse=True):
            if name == unit or (unit not in ("raysgd", "raysgd.torch") and name.startswith(unit + ".")):
                return unit
        return None

    modules = {_module(path) for path in PACKAGE.rglob("*.py")}
    units, edges = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "examples" in path.parts:
            continue
        unit = unit_of(_module(path))
        if unit is None:
            continue
        layer = layers[unit]
        units[unit] = (layer, units.get(unit, (layer, 0))[1] + len(path.read_text().splitlines()))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # "from raysgd.torch import state" imports the module raysgd.torch.state, as tests/repo/test_layers.py reads it
                names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names]
            for name in names:
                target = unit_of(name) if name.startswith("raysgd") else None
                if target and target != unit:
                    edges[unit, target] = edges.get((unit, target), 0) + 1
    return units, edges


def layers_picture(path):
    """Draw the units per layer and their imports into ``path``; returns ``path``."""
    plt = _pyplot()
    from matplotlib.patches import FancyBboxPatch  # noqa: PLC0415

    _, glue = layer_table()
    units, edges = unit_graph()
    units = {u: v for u, v in units.items() if v[0] != glue}  # package glue imports anything: left out
    edges = {k: v for k, v in edges.items() if k[0] in units and k[1] in units}
    rows = sorted({layer for layer, _ in units.values()})
    fig, ax = plt.subplots(figsize=(12, 1.05 * len(rows) + 1))
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, len(rows) - 0.3)
    ax.axis("off")
    where = {}
    for row, layer in enumerate(rows):
        members = sorted((u for u, v in units.items() if v[0] == layer), key=lambda u: -units[u][1])
        for i, unit in enumerate(members):
            width = 0.9 / max(len(members), 3)
            x = 0.08 + i * width + width * 0.05
            label = unit.replace("raysgd.torch.", "torch/").replace("raysgd.", "")
            where[unit] = (x + width * 0.45, row)
            ax.add_patch(FancyBboxPatch((x, row - 0.2), width * 0.9, 0.4, boxstyle="round,pad=0.004",
                                        fc=plt.cm.Blues(0.2 + 0.6 * min(units[unit][1] / 5000, 1)), ec="#455a64"))
            ax.text(x + width * 0.45, row + 0.04, label, ha="center", va="center", fontsize=8, fontweight="bold")
            ax.text(x + width * 0.45, row - 0.11, f"{units[unit][1]:,} lines", ha="center", va="center", fontsize=6.5)
        ax.text(0.01, row, f"layer {layer}", va="center", fontsize=9, color="#455a64")
    heaviest = max(edges.values(), default=1)
    for (src, dst), count in edges.items():
        (x0, y0), (x1, y1) = where[src], where[dst]
        ax.annotate("", xy=(x1, y1 + 0.2), xytext=(x0, y0 - 0.2),
                    arrowprops=dict(arrowstyle="->", color="#b71c1c" if y1 >= y0 else "#546e7a",
                                    alpha=0.25 + 0.6 * count / heaviest, lw=0.6 + 1.6 * count / heaviest,
                                    connectionstyle="arc3,rad=0.05"))
    upward = sum(1 for (src, dst) in edges if where[dst][1] >= where[src][1])
    ax.set_title(f"raysgd's package: {len(units)} units in {len(rows)} layers, {len(edges)} import edges, "
                 f"{upward} pointing sideways or up", fontsize=11)
    fig.text(0.01, 0.01, "drawn by tools/draw_architecture.py from the imports in raysgd/ (layers: docs/architecture.md;"
             " package glue, which may import anything, left out)", fontsize=7, color="#555555")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", default=str(IMAGES / "architecture.png"), help="the run on a cluster (PNG)")
    parser.add_argument("--layers", default=str(IMAGES / "layers.png"), help="the package's layers (PNG)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    for path in (args.runtime, args.layers):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    print(runtime(args.runtime))
    print(layers_picture(args.layers))


if __name__ == "__main__":
    main()
