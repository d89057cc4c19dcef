"""The repository's promises: README's commands are what CI runs, and the docs' examples run."""
import doctest
import importlib
import pathlib
import re

import pytest

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


def test_changelog_keeps_a_changelog_form():
    text = (REPO / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog") and "## [Unreleased]" in text and "### Added" in text


DOCTESTED = ["raysgd.utils", "raysgd.torch.recovery", "raysgd.torch.reduction", "raysgd.torch.arguments",
             "raysgd.torch.checkpoint", "raysgd.torch.data", "raysgd.torch.errors", "raysgd.torch.precision",
             "raysgd.torch.worker", "raysgd.torch.constants", "raysgd.torch.examples.train_example",
             "raysgd.torch.progress", "raysgd.torch.results", "raysgd.torch.ray_data",
             "raysgd.torch.cursor", "raysgd.torch.evaluation",
             "raysgd.torch.model_copy", "raysgd.data.dataset", "raysgd.data.examples.mlp_identity",
             "raysgd.torch.state", "raysgd.torch.committer", "raysgd.torch.commits", "raysgd.torch.elastic", "raysgd.torch.attempts",
             "raysgd.torch.reform", "raysgd.torch.compiled",
             "raysgd.torch.operator_precision", "raysgd.torch.registration", "raysgd.torch.failures",
             "raysgd.torch.draining", "raysgd.torch.shipping"]


@pytest.mark.parametrize("name", DOCTESTED)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no docstring example"
