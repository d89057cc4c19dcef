"""The package's imports point down the layers of DESIGN.md, and every module stays small and documented."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "raysgd"

# module -> layer (DESIGN.md); a module may import raysgd modules of a lower or equal layer only.
LAYERS = {
    "raysgd.utils": 0, "raysgd.optional": 0,  # importing an optional dependency, or naming the extra to install
    "raysgd.torch.constants": 0, "raysgd.torch.errors": 0, "raysgd.torch.reduction": 0,
    "raysgd.torch.precision": 1, "raysgd.torch.data": 1, "raysgd.torch.checkpoint": 1,
    "raysgd.torch.registration": 1,  # checking what setup() passes to register()
    "raysgd.torch.training_operator": 2, "raysgd.torch.creator_operator": 2, "raysgd.torch.state": 2,
    "raysgd.torch.committer": 3, "raysgd.torch.preemption": 3, "raysgd.torch.commit_store": 4, "raysgd.torch.commits": 5, "raysgd.torch.elastic": 5, "raysgd.torch.attempts": 5,
    "raysgd.torch.draining": 5,  # leaving nodes Ray is draining (a preemption notice) at a commit point
    "raysgd.torch.reform": 4,  # re-forming a group from the survivors of a failure
    "raysgd.torch.worker": 3, "raysgd.torch.recovery": 3,
    "raysgd.torch.worker_group": 4, "raysgd.torch.mailbox": 4,
    "raysgd.torch.failures": 4,  # reading failed worker calls (and 1.x's check_for_failure)
    "raysgd.torch.local_runner": 3, "raysgd.torch.worker_handle": 4, "raysgd.torch.placement": 4,  # the group's helpers
    "raysgd.torch.trial_placement": 4,
    "raysgd.torch.cluster_state": 4, "raysgd.torch.diagnostics": 4,
    "raysgd.torch.arguments": 5, "raysgd.torch.torch_trainer": 5,
    "raysgd.torch.progress": 5, "raysgd.torch.results": 5, "raysgd.torch.ray_data": 5,  # the trainer's helpers
    "raysgd.torch.tune": 6, "raysgd.data.dataset": 6, "raysgd.data": 7,  # 1.x's sharded Dataset on Ray Data
    "raysgd.torch.lightning": 6, "raysgd.torch.lightning_operator": 6,  # Lightning: an integration at the edge
    "raysgd.meters": 0,  # the metric meters, public through raysgd.utils
    "raysgd.torch.resnet": 1, "raysgd.plot": 0,
    "raysgd.torch.epoch_iterators": 1,  # the iterators of a worker's epochs, kept across calls
    "raysgd.torch.cursor": 1,  # the data cursor: which stream positions each rank reads
    "raysgd.torch.epoch_order": 1,  # the epoch's order: a sampler drawn from (seed, epoch), and whether it repeats
    "raysgd.torch.evaluation": 1,  # validation without collectives per batch
    "raysgd.torch.compiled": 0,  # torch.compile'd models: compiled outside DDP, saved plain
    "raysgd.torch.shipping": 0,  # user classes shipped by value: torch's config modules go by name
    "raysgd.torch.model_copy": 1, "raysgd.torch.operator_precision": 2,
    "raysgd.torch.accumulation": 1,  # fixed_worker_batch: micro-batches per optimizer step, no_sync
    "raysgd.torch.async_writer": 0, "raysgd.torch.storage": 1, "raysgd.torch.durable": 5,  # durable runs
    "raysgd.compat": 7, "raysgd.legacy": 7,  # package glue: the 1.x import mapping and its runner
    "raysgd": 7, "raysgd.torch": 7,  # the packages' public names
}
# What each layer may import from outside the package (beyond the standard library).
THIRD_PARTY = {0: {"numpy", "torch", "matplotlib"}, 1: {"torch", "numpy", "apex"}, 2: {"torch", "numpy", "filelock"},
               3: {"torch", "numpy", "ray"}, 4: {"ray", "torch", "numpy"},
               5: {"ray", "torch", "numpy", "tqdm", "tensorboardX"},  # the last two optional, imported when used
               6: {"ray", "torch", "numpy", "pytorch_lightning", "lightning"}, 7: set()}
# Lazy imports kept for 1.x's API: TorchTrainer.as_trainable builds the Tune class on first use.
UPWARD_EXCEPTIONS = {("raysgd.torch.torch_trainer", "raysgd.torch.tune"),
                     ("raysgd.torch.training_operator", "raysgd.torch.lightning_operator"),  # from_ptl, lazily
                     ("raysgd.utils", "raysgd.torch.failures")}  # 1.x's raysgd.utils.check_for_failure, lazily
PURE = {"raysgd.torch.recovery": set(), "raysgd.torch.errors": {"torch"}, "raysgd.torch.constants": set(),
        "raysgd.torch.async_writer": set(), "raysgd.torch.storage": {"torch", "pyarrow"}, "raysgd.torch.durable": set()}


def module_name(path):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # "from raysgd.torch import data" imports raysgd.torch.data
                full = f"{node.module}.{alias.name}"
                yield full if full in LAYERS else node.module


def library_modules():
    return [p for p in sorted(ROOT.rglob("*.py")) if "examples" not in p.parts]


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: module_name(p))
def test_imports_point_down_the_layers(path):
    name = module_name(path)
    if name not in LAYERS:
        pytest.skip(f"{name} is not layered (package glue or compat)")
    layer = LAYERS[name]
    for imported in imports(path):
        target = next((m for m in sorted(LAYERS, key=len, reverse=True)
                       if imported == m or imported.startswith(m + ".")), None)
        if target is not None:
            if (name, target) in UPWARD_EXCEPTIONS:
                continue
            assert LAYERS[target] <= layer, f"{name} (layer {layer}) imports {target} (layer {LAYERS[target]})"
        elif not imported.startswith("raysgd"):
            top = imported.split(".")[0]
            allowed = PURE.get(name, THIRD_PARTY[layer])
            import sys

            if top not in sys.stdlib_module_names:
                assert top in allowed, f"{name} (layer {layer}) imports {top}"


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: module_name(p))
def test_modules_are_small_and_say_their_job(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 400, f"{path.name} has {len(source.splitlines())} lines"
    docstring = ast.get_docstring(ast.parse(source))
    assert docstring and len(docstring.splitlines()[0]) > 10, f"{path.name} needs a docstring opening with its job"
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"]
    assert not calls, f"{path.name}: library code logs, it does not print"


def test_only_the_worker_group_touches_actor_handles():
    for path in library_modules():
        if module_name(path) in ("raysgd.torch.worker_group", "raysgd.torch.worker_handle", "raysgd.torch.mailbox",
                                 "raysgd.torch.commit_store"):
            continue
        assert ".remote(" not in path.read_text(), f"{path.name} calls actors directly"
