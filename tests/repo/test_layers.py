"""The package's imports point down the layers of docs/architecture.md's tables, folder by folder, and every module
says its job.

A folder of ``raysgd/torch`` is one layer; a module at the root of ``raysgd/`` or ``raysgd/torch/`` is a unit of
its own. A module may import the modules of its own unit and those of lower layers: never sideways (another unit
of the same layer), never up. Package glue (the packages' public names and RaySGD 1.x's paths) may import anything.
"""
import ast
import importlib.util
import pathlib
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "raysgd"


def _layer_table():
    """``tools/layer_table.py``: the reader of docs/architecture.md's layer tables (shared with the drawing)."""
    spec = importlib.util.spec_from_file_location("layer_table", ROOT.parent / "tools" / "layer_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_TABLE = _layer_table()
GLUE = _TABLE.GLUE
_TABLES = _TABLE.read()
# unit (a folder or a root module) -> layer
LAYERS = _TABLES.units
# What each layer may import from outside the package (beyond the standard library); None: anything.
THIRD_PARTY = _TABLES.allowed
# Modules that must stay lighter than their layer allows: the pure policies are tested without Ray or torch.
PURE = _TABLES.lighter


def module_name(path):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules():
    return [p for p in sorted(ROOT.rglob("*.py")) if "examples" not in p.parts]


MODULES = {module_name(p) for p in library_modules()}


def unit_of(name):
    """``(unit, layer)`` of a raysgd module: the longest entry it is or lies under (the packages only as themselves)."""
    for unit in sorted(LAYERS, key=len, reverse=True):
        if name == unit or (unit not in ("raysgd", "raysgd.torch") and name.startswith(unit + ".")):
            return unit, LAYERS[unit]
    return None, None


def test_the_layer_table_names_every_unit_and_only_units_that_exist():
    """docs/architecture.md's tables name real units and modules, and every layer a unit is in has its row."""
    stale = [name for name in [*LAYERS, *PURE] if name not in MODULES]
    assert not stale, f"docs/architecture.md names units that do not exist: {stale}"
    assert set(LAYERS.values()) <= set(THIRD_PARTY), "a unit's layer has no row in the layers' table"
    assert all(unit_of(name)[0] is not None for name in PURE)


def imports(path):
    """Every module ``path`` imports (also inside functions), a raysgd name resolved to its module."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # "from raysgd.torch import state" imports raysgd.torch.state.training_state
                full = f"{node.module}.{alias.name}"
                yield full if full in MODULES else node.module


@pytest.mark.parametrize("path", library_modules(), ids=module_name)
def test_imports_point_down_the_layers(path):
    name = module_name(path)
    unit, layer = unit_of(name)
    assert unit is not None, f"{name} has no layer: add its folder or module to LAYERS"
    for imported in imports(path):
        if imported.startswith("raysgd"):
            target, target_layer = unit_of(imported)
            assert target is not None, f"{name} imports {imported}, which has no layer"
            if target == unit or layer == GLUE:
                continue
            assert target_layer < layer, (f"{name} ({unit}, layer {layer}) imports {target} (layer {target_layer}): "
                                          "imports point down, never sideways or up")
        else:
            top = imported.split(".")[0]
            allowed = PURE.get(name, PURE.get(unit, THIRD_PARTY[layer]))
            if allowed is not None and top not in sys.stdlib_module_names:
                assert top in allowed, f"{name} (layer {layer}) imports {top}"


def test_no_import_circle():
    """No module imports itself through others (imports inside functions count too)."""
    graph = {name: set() for name in MODULES}
    for path in library_modules():
        for imported in imports(path):
            while imported not in MODULES and "." in imported:
                imported = imported.rpartition(".")[0]
            if imported in MODULES and imported != module_name(path):
                graph[module_name(path)].add(imported)
    done, stack = set(), []

    def visit(node):
        if node in stack:
            cycle = stack[stack.index(node):] + [node]
            raise AssertionError("import circle: " + " -> ".join(cycle))
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt in ("raysgd", "raysgd.torch"):  # a package's public names, imported by its own modules' users
                continue
            visit(nxt)
        stack.pop()
        done.add(node)

    for name in sorted(graph):
        visit(name)


@pytest.mark.parametrize("path", library_modules(), ids=module_name)
def test_modules_say_their_job_and_stay_readable(path):
    """A docstring opening with the module's job, logging instead of print, and a size one can read: a warning
    near 400 lines (a module is one concept: split it only at a seam of meaning), a hard limit at 600."""
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= 600, f"{path.name} has {lines} lines"
    if lines > 400:
        warnings.warn(f"{module_name(path)} has {lines} lines: is it still one concept?", UserWarning)
    docstring = ast.get_docstring(ast.parse(source))
    assert docstring and len(docstring.splitlines()[0]) > 10, f"{path.name} needs a docstring opening with its job"
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"]
    assert not calls, f"{path.name}: library code logs, it does not print"


def test_only_the_worker_group_touches_actor_handles():
    for path in library_modules():
        if module_name(path) in ("raysgd.torch.execution.worker_group", "raysgd.torch.execution.worker_handle", "raysgd.torch.integrations.mailbox",
                                 "raysgd.torch.commits.commit_store", "raysgd.torch.commits.part_holders",
                                 "raysgd.torch.restart_points.restart_point",
                                 "raysgd.torch.storage.parts", "raysgd.torch.storage.rank_files"):
            continue
        assert ".remote(" not in path.read_text(), f"{path.name} calls actors directly"


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def test_no_module_reaches_into_another_modules_private_attributes():
    """``x._name`` outside ``self``/``cls``/``super()`` only for a private name that no other raysgd module defines:
    a module uses another's objects through their public methods (the facade never reads ``trainer._``-style
    state of the controller, the worker never reads the operator's registered loaders directly)."""
    trees = {path: ast.parse(path.read_text()) for path in library_modules()}
    defined = {}  # private name -> the modules that define it (a def, a class or a self./cls. assignment)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                defined.setdefault(node.name, set()).add(path)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                defined.setdefault(node.attr, set()).add(path)
    reaching = []
    for path, tree in trees.items():
        foreign = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom)) and not (getattr(node, "module", "") or "")
                   .startswith("raysgd") for alias in node.names if not alias.name.startswith("raysgd")}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in defined):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ({"self", "cls"} | foreign):
                continue  # its own state, or a third-party module's name (os._exit)
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
                continue
            if defined[node.attr] != {path}:
                reaching.append(f"{module_name(path)}:{node.lineno}: {ast.unparse(owner)}.{node.attr} "
                                f"(defined in {sorted(module_name(p) for p in defined[node.attr])})")
    assert not reaching, "modules reach into others' private attributes:\n" + "\n".join(reaching)


def test_the_tests_use_the_trainers_public_surface():
    """The tests drive a trainer as a user does: no ``trainer._`` attribute."""
    tests = ROOT.parent / "tests"
    uses = [f"{path.name}:{number}" for path in sorted(tests.rglob("*.py")) if path.name != "test_layers.py"
            for number, line in enumerate(path.read_text().splitlines(), 1) if "trainer._" in line]
    assert not uses, f"tests read a trainer's private state: {uses}"


def test_tests_and_benchmarks_use_raysgds_modules_through_their_public_names():
    """No ``module._name`` of a raysgd module in the tests and benchmarks: what they read or change (a process's
    commit timings, its preemption state) is an object with a public API (``commit_stats.process_stats()``,
    ``preemption.PreemptionState``), never a module's private global."""
    repo = ROOT.parent
    reaching = []
    for path in sorted([*(repo / "tests").rglob("*.py"), *(repo / "benchmarks").glob("*.py")]):
        tree = ast.parse(path.read_text())
        modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom))
                   and (getattr(node, "module", None) or "raysgd").startswith("raysgd") for alias in node.names
                   if isinstance(node, ast.ImportFrom) or alias.name.startswith("raysgd")}
        reaching += [f"{path.relative_to(repo)}:{node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                     and node.value.id in modules]
    assert not reaching, "tests and benchmarks reach into raysgd modules' private names:\n" + "\n".join(reaching)


def test_argument_errors_come_from_the_one_checker():
    """Every "<argument> expects <what>; got <value>" error is made by ``raysgd.base.checks`` (``expect``,
    ``argument_error``): no module defines a checker of its own (a function taking ``expected`` that raises) or
    writes such a message by hand, so every message names the argument, what it expects and what it got alike."""
    home = ROOT / "base" / "checks.py"
    own, by_hand = [], []
    for path in library_modules():
        if path == home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                arguments = {a.arg for a in node.args.args + node.args.kwonlyargs}
                if "expected" in arguments and any(isinstance(n, ast.Raise) for n in ast.walk(node)):
                    own.append(f"{module_name(path)}:{node.lineno} {node.name}")
            elif isinstance(node, ast.Raise) and node.exc is not None:
                text = "".join(c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant)
                               and isinstance(c.value, str))
                if " expects " in text or text.startswith("expects "):
                    by_hand.append(f"{module_name(path)}:{node.lineno}")
    assert not own, f"checkers of their own (use raysgd.base.checks.expect): {own}"
    assert not by_hand, f"'... expects ...' errors written by hand (use raysgd.base.checks): {by_hand}"
