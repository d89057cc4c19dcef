"""The repository's promises: README's commands are what CI runs, and the docs' examples run."""
import ast
import doctest
import importlib
import pathlib
import re
import subprocess
import sys

import pytest

from raysgd import optional

REPO = pathlib.Path(__file__).resolve().parent.parent


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
    assert "-e . &&" in example, f"README's first command must be the plain install (no extra): {example!r}"
    done = subprocess.run([sys.executable, str(REPO / ".ci" / "readme_command.py"), "example"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == example + "\n", done.stdout + done.stderr  # what .ci/run runs
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    extract = next(i for i, line in enumerate(lines) if "python3 .ci/readme_command.py example" in line)
    run = next(i for i, line in enumerate(lines) if 'bash -c "$first_command"' in line)
    tests = next(i for i, line in enumerate(lines) if "python -m pytest" in line)
    assert extract < run < tests, "the first command runs before the test suite (it fails fast and is short)"
    assert ".venv/" in (REPO / ".gitignore").read_text().split(), ".venv is ignored: no copy or clone carries it"


def setup_extras():
    """``extras_require`` of setup.py, read without running it."""
    call = next(node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    return ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))


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


DOCTESTED = ["raysgd.utils", "raysgd.logs", "raysgd.cli.paths", "raysgd.cli.train_folders",
             "raysgd.optional", "raysgd.meters", "raysgd.timers", "raysgd.torch.constants",
             "raysgd.torch.errors", "raysgd.torch.options", "raysgd.torch.lightning_operator",
             "raysgd.torch.worker_group", "raysgd.torch.examples.train_example", "raysgd.torch.sharding",
             "raysgd.torch.sharding.cursor", "raysgd.torch.sharding.epoch_order", "raysgd.torch.sharding.loaders",
             "raysgd.torch.sharding.batch_split", "raysgd.torch.operator", "raysgd.torch.operator.precision",
             "raysgd.torch.operator.accumulation", "raysgd.torch.operator.compiled", "raysgd.torch.operator.fsdp",
             "raysgd.torch.operator.evaluation", "raysgd.torch.operator.registration",
             "raysgd.torch.operator.creators", "raysgd.torch.fault_tolerance",
             "raysgd.torch.fault_tolerance.recovery", "raysgd.torch.fault_tolerance.watches",
             "raysgd.torch.fault_tolerance.reform", "raysgd.torch.state", "raysgd.torch.state.training_state",
             "raysgd.torch.state.checkpoint", "raysgd.torch.state.model_copy", "raysgd.torch.state.committer",
             "raysgd.torch.state.commit_policy", "raysgd.torch.state.sharded", "raysgd.torch.state.dcp_blobs",
             "raysgd.torch.storage", "raysgd.torch.storage.dcp_files", "raysgd.torch.execution",
             "raysgd.torch.execution.controller", "raysgd.torch.execution.restarts", "raysgd.torch.execution.calls",
             "raysgd.torch.execution.worker", "raysgd.torch.execution.epoch_iterators",
             "raysgd.torch.execution.shipping", "raysgd.torch.execution.spares", "raysgd.torch.integrations", "raysgd.torch.integrations.progress",
             "raysgd.torch.integrations.results", "raysgd.torch.integrations.ray_data",
             "raysgd.torch.integrations.tune", "raysgd.data.dataset", "raysgd.data.examples.mlp_identity",
             "raysgd.train", "raysgd.train.config", "raysgd.train.checkpoint", "raysgd.train.run_storage",
             "raysgd.train.session", "raysgd.train.prepare", "raysgd.train.function_worker", "raysgd.train.trainer",
             "raysgd.train.torch", "raysgd.train.lightning", "raysgd.train.utils"]


@pytest.mark.parametrize("name", DOCTESTED)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no docstring example"


def test_readmes_torchtrainer_table_is_the_options_table():
    """The README's TorchTrainer table comes from the one options dataclass (every option, its default, its doc)."""
    import dataclasses

    from raysgd.torch.options import TrainerOptions
    table = TrainerOptions.readme_table()
    assert table.rstrip("\n") in (REPO / "README.md").read_text(), \
        "README's TorchTrainer table differs from TrainerOptions.readme_table(): paste the generated one"
    shown = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert {field.name for field in dataclasses.fields(TrainerOptions)} <= shown
