"""The repository's promises: README's commands are what CI runs, and the docs' examples run."""
import ast
import doctest
import functools
import importlib
import os
import pathlib
import re
import runpy
import subprocess
import sys
import textwrap

import pytest

import background
from raysgd import optional

REPO = pathlib.Path(__file__).resolve().parents[2]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_gives_two_setup_commands_and_ci_runs_the_test_one():
    commands = readme_commands()
    setup = [c for c in commands if c.startswith("python3 -m venv")]
    assert len(setup) == 2, setup
    example, tests = setup
    assert "examples/train_linear.py" in example and "pytest" in tests
    assert "constraints.txt" in example and "constraints.txt" in tests
    test_part = tests.split(" && ", 2)[2]  # after creating and activating the venv
    ci = (REPO / ".ci" / "run").read_text()
    assert test_part in ci, f"{test_part!r} is not what .ci/run runs"
    assert "torch==2.13.0" in (REPO / "constraints.txt").read_text()


def test_ci_runs_readmes_first_command_as_written_in_a_fresh_copy():
    example = next(c for c in readme_commands() if c.startswith("python3 -m venv"))
    assert example.endswith("python examples/train_linear.py --num-workers 2"), example
    assert " pip install -c constraints.txt . && " in example, \
        f"README's first command must be the plain install of the checkout (no extra, not editable): {example!r}"
    done = subprocess.run([sys.executable, str(REPO / ".ci" / "readme_command.py"), "example"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == example + "\n", done.stdout + done.stderr
    wheel = "/tmp/dist/raysgd-1.0-py3-none-any.whl"
    done = subprocess.run([sys.executable, str(REPO / ".ci" / "readme_command.py"), "example", "--wheel", wheel],
                          capture_output=True, text=True, timeout=60)  # what .ci/run runs: the built wheel installed
    assert done.returncode == 0 and done.stdout == example.replace(" . && ", f" {wheel} && ") + "\n", done.stdout
    lines = (REPO / ".ci" / "run").read_text().splitlines()

    def line_of(text):
        return next(i for i, line in enumerate(lines) if text in line and not line.lstrip().startswith("#"))

    build, check = line_of("-m build --outdir"), line_of("twine check --strict")
    extract = line_of('python3 .ci/readme_command.py example --wheel "$wheel"')
    run, tests, docs = line_of('bash -c "$first_command"'), line_of("python -m pytest"), line_of("mkdocs build --strict")
    types, waited = line_of("mypy --cache-dir"), line_of("for job in mypy docs")
    assert build < check < extract < run < tests, \
        "CI builds and checks the package, runs README's first command with its wheel, then the tests"
    assert docs < tests and types < tests < waited, "the docs and mypy run beside the tests; CI waits for both"
    assert docs - 3 <= line_of("extra_requirements.py docs") < docs, "the docs build with the docs extra's packages"
    assert ".venv/" in (REPO / ".gitignore").read_text().split(), ".venv is ignored: no copy or clone carries it"


def test_ci_reads_the_docs_extras_packages_from_setup_py():
    """.ci/run installs the docs extra's packages apart from the tests' environment: .ci/extra_requirements.py reads
    them from setup.py."""
    script = str(REPO / ".ci" / "extra_requirements.py")
    done = subprocess.run([sys.executable, script, "docs"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == setup_extras()["docs"] and "mkdocs" in done.stdout, done.stdout
    done = subprocess.run([sys.executable, script, "nope"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no extra 'nope'" in done.stderr and "docs" in done.stderr


def test_readme_is_a_front_page_whose_links_work_here_and_on_pypi():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 300, "README is the front page: the reference belongs in docs/"
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):  # every relative link and image names a file here
        if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", target):
            assert (REPO / target.split("#")[0]).exists(), f"README links to {target}, which does not exist"
    setup_py = runpy.run_path(str(REPO / "setup.py"), run_name="setup_py")  # setup() runs only as __main__
    description = setup_py["absolute_links"]((REPO / "README.md").read_text())
    links = re.findall(r"\]\(([^)\s]+)\)", description)
    assert links and all(re.match(r"^(https://|#)", link) for link in links), \
        [link for link in links if not link.startswith(("https://", "#"))]
    assert "https://raw.githubusercontent.com/" in description, "images point at the raw files"


def test_the_version_has_one_home_and_the_changelog_agrees():
    import raysgd
    setup_py = runpy.run_path(str(REPO / "setup.py"), run_name="setup_py")
    assert setup_py["version"]() == raysgd.__version__
    assert "version=version()" in (REPO / "setup.py").read_text()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d\d-\d\d)$", (REPO / "CHANGELOG.md").read_text(),
                          flags=re.M)
    assert releases, "CHANGELOG has no '## [x.y.z] - YYYY-MM-DD' release"
    versions = [tuple(int(n) for n in v.split(".")) for v, _ in releases]
    assert versions == sorted(versions, reverse=True), "releases newest first"
    assert [d for _, d in releases] == sorted((d for _, d in releases), reverse=True), "dates newest first"
    released = re.match(r"^(\d+)\.(\d+)\.(\d+)(.*)$", raysgd.__version__)
    current, suffix = tuple(int(n) for n in released.groups()[:3]), released.group(4)
    if suffix:  # a development or pre-release: past the newest release
        assert current > versions[0], f"{raysgd.__version__} should come after {releases[0][0]}"
    else:
        assert current == versions[0], f"{raysgd.__version__} is released: CHANGELOG's newest release should be it"


def test_getting_started_gives_readmes_commands():
    page = (REPO / "docs" / "getting-started.md").read_text()
    setup = [c for c in re.findall(r"```bash\n(.+?)\n```", page, flags=re.S) if c.startswith("python3 -m venv")]
    assert setup == [c for c in readme_commands() if c.startswith("python3 -m venv")]


def setup_extras():
    """``extras_require`` of setup.py, read without running it (by .ci/extra_requirements.py, as CI reads it)."""
    return runpy.run_path(str(REPO / ".ci" / "extra_requirements.py"))["extras"]()


def test_every_extra_named_anywhere_exists_and_brings_its_package():
    extras = setup_extras()
    for name, (extra, package) in optional.EXTRAS.items():  # raysgd.optional: the one home of the extra names
        names = [re.split(r"[<>=!~;]", requirement)[0].strip().lower() for requirement in extras.get(extra, [])]
        assert package.lower() in names, f"{name}: setup.py's {extra!r} extra does not install {package}: {names}"
    texts = [path.read_text() for pattern in ("raysgd/**/*.py", "examples/*.py", "docs/**/*.md", "*.md", ".ci/*")
             for path in REPO.glob(pattern)]
    named = {m for text in texts for m in re.findall(r'raysgd\[([a-z,]+)\]|extra="([a-z]+)"', text)}
    for extra in {e for pair in named for group in pair if group for e in group.split(",")}:
        assert extra in extras, f"the {extra!r} extra is named in the repository but setup.py has no such extra"


def test_changelog_keeps_a_changelog_form():
    text = (REPO / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "## [Unreleased]" in text and "### Added" in text
    sections = set(re.findall(r"^### (.+)$", text, flags=re.M))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections
    assert text.index("## [Unreleased]") < text.index("\n## [0."), "Unreleased comes first"


DOCTESTED = ["raysgd.base", "raysgd.base.checks", "raysgd.base.environment", "raysgd.base.stateful",
             "raysgd.base.durable_files", "raysgd.base.paths", "raysgd.utils",
             "raysgd.logs", "raysgd.cli.paths", "raysgd.cli.train_folders",
             "raysgd.optional", "raysgd.meters", "raysgd.timers", "raysgd.torch.constants",
             "raysgd.torch.errors", "raysgd.torch.options", "raysgd.torch.lightning_operator",
             "raysgd.torch.worker_group", "raysgd.torch.examples.train_example", "raysgd.torch.sharding",
             "raysgd.torch.sharding.cursor", "raysgd.torch.sharding.epoch_order", "raysgd.torch.sharding.loaders",
             "raysgd.torch.sharding.batch_split", "raysgd.torch.operator", "raysgd.torch.operator.precision",
             "raysgd.torch.operator.accumulation", "raysgd.torch.operator.compiled", "raysgd.torch.operator.fsdp",
             "raysgd.torch.operator.evaluation", "raysgd.torch.operator.registration",
             "raysgd.torch.operator.creators", "raysgd.torch.fault_tolerance",
             "raysgd.torch.fault_tolerance.recovery", "raysgd.torch.fault_tolerance.watches",
             "raysgd.torch.fault_tolerance.reform", "raysgd.torch.fault_tolerance.stops", "raysgd.torch.state", "raysgd.torch.state.training_state",
             "raysgd.torch.state.checkpoint", "raysgd.torch.state.model_copy", "raysgd.torch.commits.committer",
             "raysgd.torch.commits.commit_stats", "raysgd.torch.commits", "raysgd.torch.restart_points",
             "raysgd.torch.restart_points.transport",
             "raysgd.torch.commits.commit_policy", "raysgd.torch.state.sharded", "raysgd.torch.state.dcp_blobs",
             "raysgd.torch.storage", "raysgd.torch.storage.dcp_files", "raysgd.torch.execution",
             "raysgd.torch.execution.controller", "raysgd.torch.execution.restarts", "raysgd.torch.execution.calls",
             "raysgd.torch.execution.worker", "raysgd.torch.execution.epoch_iterators",
             "raysgd.torch.execution.shipping", "raysgd.torch.execution.spares",
             "raysgd.torch.execution.restart_points", "raysgd.torch.integrations", "raysgd.torch.integrations.progress",
             "raysgd.torch.integrations.results", "raysgd.torch.integrations.ray_data",
             "raysgd.torch.integrations.tune", "raysgd.data.dataset", "raysgd.data.examples.mlp_identity",
             "raysgd.train", "raysgd.train.config", "raysgd.train.checkpoint", "raysgd.train.reporting",
             "raysgd.train.commits", "raysgd.torch.storage.rank_files", "raysgd.torch.fault_tolerance.failure_policy",
             "raysgd.train.session", "raysgd.train.prepare", "raysgd.train.function_worker", "raysgd.train.trainer",
             "raysgd.train.torch", "raysgd.train.lightning", "raysgd.train.utils", "raysgd.train.errors",
             "raysgd.train.retention", "raysgd.train.callback", "raysgd.train.result", "raysgd.train.collective",
             "raysgd.train.reported"]


@pytest.mark.parametrize("name", DOCTESTED)
def test_docstring_examples_run(name):
    import ray

    running = ray.is_initialized()
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no docstring example"
    # An example shows what a call does without a cluster: one that starts Ray by the way (a query that initialises
    # it, as ray.get_runtime_context() does) costs every reader, and this suite, a cluster's start (~10 s here).
    assert running or not ray.is_initialized(), f"{name}'s docstring examples started Ray"


def test_docs_torchtrainer_table_is_the_options_table():
    """The docs' TorchTrainer table comes from the one options dataclass (every option, its default, its doc)."""
    import dataclasses

    from raysgd.torch.options import TrainerOptions
    table = TrainerOptions.readme_table()
    assert table.rstrip("\n") in (REPO / "docs" / "trainer.md").read_text(), \
        "docs/trainer.md's TorchTrainer table differs from TrainerOptions.readme_table(): paste the generated one"
    shown = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert {field.name for field in dataclasses.fields(TrainerOptions)} <= shown


def documented_commands():
    """``(page, command)`` for every ``python ...`` command in README and the docs: their ```bash blocks, and inline
    code in their text and tables (the examples table)."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text()
        lines = [line for block in re.findall(r"```bash\n(.+?)\n```", text, flags=re.S) for line in block.splitlines()]
        lines += re.findall(r"`(python (?:-m )?[^`]+)`", text)
        for line in lines:
            for part in line.split("#")[0].split(" && "):
                if re.match(r"^(PYTHONPATH=\S+ )?python3? ", part.strip()):
                    found.append((page.relative_to(REPO), part.strip()))
    return found


def test_documented_commands_name_real_scripts_and_options():
    """Every ``python script.py --option`` and ``python -m module --option`` of README and the docs names a script or
    module that exists and options it defines (the examples' --smoke-test forms run in tests/api/test_examples.py)."""
    import importlib.util
    commands = documented_commands()
    assert len(commands) > 20, commands
    placeholders = {"my_raysgd1_script.py", "my_ray_train_script.py", "my_1x_script.py", "script.py",
                    *(name for _, name, _ in docs_scripts())}  # the docs' own scripts: test_docs_scripts_run
    for page, command in commands:
        words = command.split()
        words = words[1:] if words[0].startswith("PYTHONPATH=") else words
        args = words[1:]
        if args[:2] == ["-m", "raysgd.legacy"]:  # the legacy runner: its own options, then the script's
            args = args[2:]
            args = args[1:] if args[:1] == ["--train"] else args
        if args[:1] == ["-m"]:
            if len(args) < 2 or args[1] in ("pytest", "venv", "pip", "build"):  # tools; "python -m" alone: prose
                continue
            from raysgd.compat import translate  # the legacy runner runs 1.x module names as raysgd's
            spec = importlib.util.find_spec(translate(args[1]) or args[1])
            assert spec is not None, f"{page}: {command!r} runs a module that does not exist"
            source, options = pathlib.Path(spec.origin).read_text(), args[2:]
        else:
            if not args or not args[0].endswith(".py") or args[0].split("/")[-1] in placeholders:
                continue
            assert (REPO / args[0]).is_file(), f"{page}: {command!r} runs {args[0]}, which does not exist"
            source, options = (REPO / args[0]).read_text(), args[1:]
        # a script may define its options in the raysgd module it runs (examples/dcgan.py), or in a module beside it
        # (benchmarks/commits.py's bench_args)
        imported = re.findall(r"^from (raysgd[\w.]*) import", source, flags=re.M)
        specs = [importlib.util.find_spec(name) for name in imported]
        source += "".join(pathlib.Path(spec.origin).read_text() for spec in specs if spec and spec.origin)
        if "benchmarks/" in command:
            source += "".join(path.read_text() for path in (REPO / "benchmarks").glob("*.py"))
        for option in (o.split("=")[0] for o in options if o.startswith("--")):
            assert f'"{option}"' in source, f"{page}: {command!r} passes {option}, which the script lacks"


def test_every_example_takes_the_options_readme_promises():
    """README: every script in examples/ takes --smoke-test, starts a local cluster or joins yours with --address,
    and takes --num-workers and --use-gpu (each script's options, or those of the raysgd module it runs)."""
    import importlib.util
    for script in sorted((REPO / "examples").glob("*.py")):
        source = script.read_text()
        imported = re.findall(r"^from (raysgd[\w.]*) import main$", source, flags=re.M)
        source += "".join(pathlib.Path(importlib.util.find_spec(name).origin).read_text() for name in imported)
        missing = [o for o in ("--smoke-test", "--address", "--num-workers", "--use-gpu") if f'"{o}"' not in source]
        assert not missing, f"examples/{script.name} lacks {missing}, which README says every example takes"


def test_readmes_api_example_runs(tmp_path):
    """README's Python example trains as shown (a local Ray cluster of its own, in a fresh process)."""
    (block,) = re.findall(r"```python\n(.+?)\n```", (REPO / "README.md").read_text(), flags=re.S)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=400, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("'train_loss'") == 5 and done.stdout.count("'val_loss'") == 5, done.stdout[-2000:]


def docs_scripts():
    """``(page, name, code)`` of every complete script in the docs: a ```python block whose first line is
    ``# <name>.py``, in page order (a page's later script may read what an earlier one wrote)."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for block in re.findall(r"```python\n(.+?)\n\s*```", page.read_text(), flags=re.S):
            block = textwrap.dedent(block)
            first = block.splitlines()[0].strip()
            if re.match(r"^# \w+\.py\b", first):
                found.append((page.relative_to(REPO), first.split()[1], block))
    return found


@pytest.mark.slow
def test_docs_scripts_run(tmp_path):
    """Each script the docs give whole runs as the page says (from the repository's root, in a fresh process).

    A page's scripts run in order in a folder of the page's (a later one may read what an earlier one wrote); the
    pages run two at a time (tests/background.py): in CI 88 s one after another, 63 s so."""
    scripts = docs_scripts()
    assert {"progress_and_logs.py", "plot_logs.py", "ray_data_input.py", "mlflow_example.py",
            "wandb_example.py"} <= {name for _, name, _ in scripts}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), WANDB_MODE="offline")
    pages = {}
    for page, name, code in scripts:
        pages.setdefault(page, []).append((name, code))

    def run_page(page):
        folder = tmp_path / str(page).replace(os.sep, "_")
        folder.mkdir()
        for name, code in pages[page]:
            (folder / name).write_text(code)
            done = subprocess.run([sys.executable, name], capture_output=True, text=True, timeout=400, cwd=folder,
                                  env=env)
            assert done.returncode == 0, f"{page}: {name}\n" + done.stdout[-3000:] + done.stderr[-3000:]

    with background.started({page: functools.partial(run_page, page) for page in pages}) as runs:
        for run in runs.values():
            run.result()  # re-raises the page's failed assertion; each script has its own timeout


# ----------------------------------------------------------------- the environment variables: one table
OWN_VARIABLE = re.compile(r"\b(?:SGD|RAYSGD)_[A-Z0-9_]*[A-Z0-9]\b|\bNCCL_TIMEOUT_S\b")


def environment_reads(tree):
    """``(line, name or None)`` of every read of the environment in ``tree``: ``os.environ.get(x)``,
    ``os.getenv(x)``, ``os.environ[x]`` (read), ``x in os.environ``, ``os.environ.copy()``; ``name``: the constant
    read (None when the name is computed)."""
    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ" and getattr(node.value, "id", "") == "os"

    def constant(node):
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, attr = node.func.value, node.func.attr
            if (is_environ(owner) and attr in ("get", "copy", "items", "keys", "values")) or \
                    (getattr(owner, "id", "") == "os" and attr == "getenv"):
                yield node.lineno, constant(node.args[0]) if node.args else None
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            yield node.lineno, constant(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.lineno, constant(node.left)


def test_raysgds_environment_variables_are_read_through_the_table_only():
    """Every ``SGD_*``/``RAYSGD_*`` variable is read through ``raysgd.base.environment.get`` (its default, its check
    and its doc in one table): no module reads one from ``os.environ`` itself, computes the name it reads, or names
    a variable the table lacks (code, README and the docs alike)."""
    from raysgd.base import environment

    home = REPO / "raysgd" / "base" / "environment.py"
    reads = []
    for path in sorted((REPO / "raysgd").rglob("*.py")):
        if path == home:
            continue
        for line, name in environment_reads(ast.parse(path.read_text())):
            if name is None or OWN_VARIABLE.fullmatch(name):
                reads.append(f"{path.relative_to(REPO)}:{line} reads {name or 'a computed name'}")
    assert not reads, "read raysgd's environment variables through raysgd.base.environment.get:\n" + "\n".join(reads)
    assert "env_float" not in "".join(p.read_text() for p in (REPO / "raysgd").rglob("*.py"))
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "raysgd").rglob("*.py")),
             *sorted((REPO / "examples").glob("*.py"))]
    unknown = {f"{page.relative_to(REPO)}: {name}" for page in pages for name in OWN_VARIABLE.findall(page.read_text())
               if name not in environment.VARIABLES}
    assert not unknown, f"variables named but not in raysgd.base.environment.VARIABLES: {sorted(unknown)}"


def test_docs_environment_table_is_the_table():
    """docs/environment.md lists every variable, its default, its check and its doc line, as the table gives them."""
    from raysgd.base import environment

    table = environment.docs_table()
    assert table in (REPO / "docs" / "environment.md").read_text(), \
        "docs/environment.md's table differs from raysgd.base.environment.docs_table(): paste the generated one"
    assert all(f"| `{name}` |" in table for name in environment.VARIABLES)


def test_a_bad_environment_value_is_a_clear_error(monkeypatch):
    from raysgd.base import environment
    from raysgd.torch import constants

    for name, bad, expected in [("SGD_GROW_CHECK_S", "-1", "a number of seconds >= 0"),
                                ("SGD_MAX_RESTART_TRIES", "2.5", "an int >= 1"),
                                ("SGD_KEEP_SURVIVORS", "maybe", "1 or 0"),
                                ("RAYSGD_LOG_LEVEL", "LOUD", "a level name")]:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=rf"^the environment variable {name} expects {expected}.*; got '{bad}'$"):
            environment.get(name)
    monkeypatch.setenv("SGD_PLACEMENT_GROUP_TIMEOUT_S", " 7 ")
    monkeypatch.setenv("SGD_KEEP_SURVIVORS", "0")
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "")  # empty: the default
    assert constants.SGD_PLACEMENT_GROUP_TIMEOUT_S == 7.0 and environment.get("SGD_KEEP_SURVIVORS") is False
    assert constants.RESIZE_COOLDOWN_S == environment.variable("SGD_RESIZE_COOLDOWN_S").default == 10.0
    with pytest.raises(KeyError, match="SGD_NO_SUCH is not one of raysgd's environment variables"):
        environment.get("SGD_NO_SUCH")
