"""A plain install (no extra) imports raysgd and trains; a feature that needs an extra says which one to install.

The subprocess test hides every optional module (:data:`raysgd.optional.EXTRAS` and a few that come with
them) from a ``sitecustomize`` module on ``PYTHONPATH`` (``sys.modules[name] = None``: ``import name`` raises
``ModuleNotFoundError`` and ``importlib.util.find_spec(name)`` returns None, as when it is not installed), so the
driver *and* the Ray workers it starts see a machine where ``pip install -e .`` alone was run.
"""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from raysgd import optional

REPO = pathlib.Path(__file__).resolve().parents[2]

#: Hidden in the subprocess: every optional module raysgd knows, and what comes with their extras.
HIDDEN = sorted({name for name in optional.EXTRAS if "-" not in name}
                | {"pandas", "lightning", "ray.train", "tensorboard"})

SITECUSTOMIZE = textwrap.dedent('''
    """Test bootstrap: optional modules are not importable (as after a plain install)."""
    import os
    import sys

    for _name in os.environ.get("RAYSGD_TEST_HIDDEN_MODULES", "").split(","):
        if _name:
            sys.modules[_name] = None  # import raises ModuleNotFoundError; find_spec gives None
''')

# Runs in the subprocess: everything a newcomer does after `pip install -e .`, then each feature needing an extra.
SCRIPT = textwrap.dedent('''
    import importlib, os, pkgutil, runpy, sys, tempfile
    import raysgd, raysgd.compat, raysgd.legacy
    from raysgd.torch import TorchTrainer, TrainingOperator

    hidden = os.environ["RAYSGD_TEST_HIDDEN_MODULES"].split(",")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("the test's blocker is not in force")

    # every module of the package, under its own name and under its 1.x name
    names = sorted(info.name for info in pkgutil.walk_packages(raysgd.__path__, "raysgd."))
    for name in names:
        importlib.import_module(name)
    raysgd.compat.install()
    for name in names:
        importlib.import_module("ray.util.sgd" + name[len("raysgd"):])
    raysgd.compat.uninstall()
    loaded = sorted(n for n, m in sys.modules.items() if m is not None and any(n == h or n.startswith(h + ".")
                                                                            for h in hidden))
    assert not loaded, loaded

    def expect(error, extra, call):
        try:
            call()
        except error as err:
            assert f'pip install "raysgd[{extra}]"' in str(err), f"{call}: {err}"
            print("clear error:", err)
        else:
            raise AssertionError(f"{call} worked without the {extra} extra")

    # the examples: the plain ones import, the others say what to install
    examples = os.path.join(sys.argv[1], "examples")
    for name in ("train_linear.py", "cifar_resnet.py", "fault_tolerance.py"):
        runpy.run_path(os.path.join(examples, name), run_name="imported")
    for name in ("digits_classifier.py", "lightning_digits.py", "tune_example.py"):
        expect(ImportError, "examples", lambda: runpy.run_path(os.path.join(examples, name), run_name="imported"))

    import ray
    import torch.nn as nn
    from raysgd.torch.examples.train_example import data_creator, model_creator, optimizer_creator

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    Operator = TrainingOperator.from_creators(model_creator, optimizer_creator, data_creator, loss_creator=nn.MSELoss)
    config = {"batch_size": 16, "data_size": 64, "val_size": 32}
    expect(ImportError, "storage", lambda: TorchTrainer(training_operator_cls=Operator, config=config,
                                                        storage_path=tempfile.mkdtemp()))
    expect(ValueError, "tqdm", lambda: TorchTrainer(training_operator_cls=Operator, config=config, use_tqdm=True))
    expect(ImportError, "tune", lambda: TorchTrainer.as_trainable(training_operator_cls=Operator, config=config))

    trainer = TorchTrainer(training_operator_cls=Operator, config=config, num_workers=1)
    def worker_sees_pyarrow():
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            return False
        return True
    assert trainer.apply_all_workers(worker_sees_pyarrow) == [False]  # the workers are plain too
    stats = trainer.train()
    assert stats["num_samples"] == 64, stats
    path = os.path.join(tempfile.mkdtemp(), "model.pt")
    trainer.save(path)
    trainer.load(path)  # a checkpoint file needs no pyarrow
    expect(ImportError, "storage", lambda: trainer.load("s3://bucket/run/checkpoint_000001"))
    expect(ImportError, "data", lambda: trainer.train(dataset=[1, 2, 3]))
    trainer.shutdown()

    from raysgd.data import Dataset
    from raysgd.plot import plot_training_curve
    from raysgd.torch.examples import dcgan
    from raysgd.torch.integrations.results import ResultLogger
    expect(ImportError, "data", lambda: Dataset([(1.0, 2.0)], batch_size=1).ray_dataset())
    expect(ImportError, "logging", lambda: plot_training_curve([{"train_loss": 1.0}], "curve.png"))
    expect(ValueError, "logging", lambda: ResultLogger(tempfile.mkdtemp(), tensorboard=True))
    expect(ImportError, "lightning", lambda: TrainingOperator.from_ptl(nn.Linear))
    expect(ImportError, "examples", lambda: dcgan.digits_images(limit=1))
    from raysgd.loggers import WandbLogger
    expect(ImportError, "wandb", lambda: WandbLogger(mode="offline"))
    print("PLAIN INSTALL OK")
''')


@pytest.mark.slow
def test_a_plain_install_imports_trains_and_names_the_extra_a_feature_needs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env["RAYSGD_TEST_HIDDEN_MODULES"] = ",".join(HIDDEN)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "PLAIN INSTALL OK" in done.stdout, \
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"


def test_require_imports_or_names_the_extra():
    assert optional.require("json", "reading JSON").dumps([1]) == "[1]"
    with pytest.raises(optional.MissingExtra, match=r'storage_path needs pyarrow, .*: pip install "raysgd\[storage\]"'):
        optional.require("pyarrow.no_such_submodule_here", "storage_path")
    with pytest.raises(ImportError, match=r"the thing needs no_such_module_here, .*: pip install no_such_module_here"):
        optional.require("no_such_module_here", "the thing")


def test_a_broken_install_keeps_its_cause(tmp_path, monkeypatch):
    (tmp_path / "tqdm.py").write_text("import no_such_dependency_of_tqdm\n")  # installed, but cannot import
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    with pytest.raises(optional.MissingExtra) as caught:
        optional.require("tqdm", "the bar")
    assert "no_such_dependency_of_tqdm" in str(caught.value)  # why, not only what
    assert isinstance(caught.value.__cause__, ModuleNotFoundError) and caught.value.extra == "tqdm"


def test_a_lazy_module_imports_on_first_use_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    lazy = optional.lazy("pyarrow", "durable checkpoints")
    assert "not imported yet" in repr(lazy)
    with pytest.raises(optional.MissingExtra, match=r'durable checkpoints needs pyarrow.*raysgd\[storage\]'):
        lazy.fs  # noqa: B018 (the attribute access is the import)
    json = optional.lazy("json", "reading JSON")
    assert json.loads("[2]") == [2] and "imported" in repr(json)


def test_the_driver_and_a_ddp_worker_never_import_torchs_distributed_checkpoint():
    """DCP (with DTensor and sympy: about 0.65 s of every process start) is imported by sharded strategies only:
    ``import raysgd``, the trainer and the worker's module leave it out (a DDP worker's first DDP wrap imports
    ``torch._dynamo``, which brings most of it anyway; the driver and 1-worker runs never do)."""
    code = ("import sys, raysgd, raysgd.legacy, raysgd.train; from raysgd.torch import TorchTrainer; "
            "import raysgd.torch.execution.worker; "
            "print(sorted(n for n in sys.modules if n.startswith(('torch.distributed.checkpoint', "
            "'torch.distributed.tensor', 'sympy'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_a_checkpoint_files_write_and_read_tasks_import_no_torch(tmp_path):
    """The tasks that write and read a checkpoint's state file on a node (``raysgd.torch.storage.parts``' ``_write``
    and ``_read``, sent by name) start a process that imports their module: with ``import raysgd`` and the storage
    modules, that process imports no torch (about a CPU second and ~150 MB a process), until a name that needs it
    is asked for; ``dir()`` lists the names before their import."""
    code = textwrap.dedent(f"""
        import sys
        import raysgd
        from raysgd.torch.storage import filesystem, parts
        fs, root = filesystem.resolve({str(tmp_path)!r})
        size, crc32 = filesystem.write_state_file(fs, root + "/trainer.checkpoint", b"state")  # as _write does
        assert filesystem.read_state_file(fs, root, {{"size": size, "crc32": crc32}}) == b"state"  # as _read does
        print(sorted(n for n in sys.modules if n.split(".")[0] == "torch")[:3])  # the first few, if any
        import raysgd.torch
        print("TorchTrainer" in dir(raysgd), "CreatorOperator" in dir(raysgd.torch))  # listed before their import
        from raysgd import TorchTrainer  # the trainer, asked for, brings torch
        print("torch" in sys.modules, TorchTrainer.__module__)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["[]", "True True", "True raysgd.torch.torch_trainer"], done.stdout


def test_the_lightning_guide_without_lightning_names_the_extra_to_install(tmp_path):
    """README promises an ImportError naming the extra for every example that needs one: the Lightning guide's script
    (Lightning under either import name hidden) stops with it, not with a bare ModuleNotFoundError."""
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), str(REPO), os.environ.get("PYTHONPATH")) if p)
    env["RAYSGD_TEST_HIDDEN_MODULES"] = "lightning,pytorch_lightning"
    done = subprocess.run([sys.executable, "-m", "raysgd.legacy", "--train",
                           str(REPO / "examples" / "ray_train_lightning_guide.py"), "--smoke-test"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1, done.stderr[-3000:]
    assert last.startswith("raysgd.optional.MissingExtra: ") and 'pip install "raysgd[examples]"' in last, last
