"""``python -m raysgd.legacy`` in this process: how its arguments are read and a 1.x ``-m`` module path is resolved;
no Ray cluster, no subprocess."""
import os
import sys

import pytest

from raysgd import compat, legacy


@pytest.fixture
def restored():
    """run_program installs the mapping and rewrites sys.argv and sys.path: undone after the test."""
    argv, path, env = list(sys.argv), list(sys.path), dict(os.environ)
    yield
    compat.uninstall()
    sys.argv[:], sys.path[:] = argv, path
    os.environ.clear()
    os.environ.update(env)


def test_dash_m_attached_to_the_module_name_as_python_takes_it():
    program = legacy.parse_program(["-mjson.tool", "--sort-keys", "in.json"])  # was "-m must come first"
    assert (program.module, program.script, program.args) == ("json.tool", None, ["--sort-keys", "in.json"])
    program = legacy.parse_program(["-m", "json.tool", "x"])
    assert (program.module, program.args) == ("json.tool", ["x"])


@pytest.mark.parametrize("name, says", [
    ("ray.util.sgd.v2.examples.train", "is gone in raysgd: RaySGD v2 became Ray Train"),
    ("ray.util.sgd.torch.examples.no_such_example", "no raysgd counterpart .*modules there: .*train_example"),
])
def test_a_1x_module_path_that_does_not_map_says_why(restored, name, says):
    """It was runpy's "No module named raysgd.v2.examples.train": the raysgd name, without the reason."""
    with pytest.raises(ModuleNotFoundError, match=says):
        legacy.run_program(legacy.parse_program(["-m", name]))
