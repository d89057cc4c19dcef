"""``python -m raysgd.legacy`` in this process: how its arguments are read and a 1.x ``-m`` module path is resolved;
no Ray cluster, no subprocess."""
import multiprocessing.spawn
import os
import subprocess
import sys

import pytest

from raysgd import compat, legacy


@pytest.fixture
def restored():
    """run_program installs the mapping (for multiprocessing's children too) and rewrites sys.argv and sys.path:
    undone after the test."""
    argv, path, env = list(sys.argv), list(sys.path), dict(os.environ)
    preparation_data = multiprocessing.spawn.get_preparation_data
    yield
    multiprocessing.spawn.get_preparation_data = preparation_data
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


CHILD_SCRIPT = '''
import multiprocessing
import sys

from ray.util.sgd.utils import BATCH_SIZE  # run again by each spawned child: needs the mapping there too


def child(path):
    with open(path, "w") as out:
        out.write(BATCH_SIZE)


if __name__ == "__main__":
    process = multiprocessing.get_context(sys.argv[1]).Process(target=child, args=(sys.argv[2],))
    process.start()
    process.join(60)
    sys.exit(process.exitcode)
'''


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_multiprocessing_children_of_a_legacy_script_get_the_mapping(tmp_path, method):
    """A child re-imports the script: it died on Ray's ``DeprecationWarning`` (a ``Pool`` then restarted it for
    ever)."""
    script, out = tmp_path / "script.py", tmp_path / "out.txt"
    script.write_text(CHILD_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYSGD_LEGACY_IMPORTS")}
    result = subprocess.run([sys.executable, "-m", "raysgd.legacy", str(script), method, str(out)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_text() == "*batch_size"


def test_ray_trains_internals_under_train_say_that_ray_tune_cannot_run_there():
    """Ray Tune's own import of ray.train._internal said only "use its public names", as if the script had not."""
    with pytest.raises(ModuleNotFoundError, match="Ray Tune imports them.*run it without --train"):
        compat.TrainFinder().find_spec("ray.train._internal.session")
