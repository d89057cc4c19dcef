"""TrainerOptions: every TorchTrainer argument checked before anything starts (no Ray)."""
import datetime
import pathlib
import re
import types

import numpy as np
import pytest
import ray
from torch.utils.data import DataLoader

from helpers import LinearOperator
from raysgd.torch.options import TrainerOptions, check_checkpoint_path, check_info, check_num_steps
from raysgd.torch.sharding.batch_split import splitter
from raysgd.torch.storage.filesystem import CheckpointStorage
from raysgd.utils import BATCH_SIZE


def checked(**kwargs):
    return TrainerOptions(training_operator_cls=LinearOperator, **kwargs).checked()


@pytest.mark.parametrize("name, value, expected", [
    ("num_workers", np.int64(2), 2),
    ("num_workers", (np.int64(1), np.int32(3)), (1, 3)),
    ("num_cpus_per_worker", np.float64(1.5), 1.5),
    ("num_cpus_per_worker", np.int64(2), 2),
    ("timeout_s", np.int64(30), 30),
    ("num_spares", np.int64(1), 1),
    ("commit_every_n_steps", np.int64(5), 5),
])
def test_numpy_numbers_are_taken_and_kept_as_python_numbers(name, value, expected):
    kept = getattr(checked(**{name: value}), name)
    assert kept == expected and type(kept) is type(expected)
    if isinstance(kept, tuple):
        assert [type(n) for n in kept] == [int, int]
    assert not ray.is_initialized()


@pytest.mark.parametrize("name, value, expected", [
    ("num_workers", 2.0, 2),  # as Ray Tune's quantized search spaces give a count
    ("num_workers", (1.0, np.float64(3.0)), (1, 3)),
    ("num_spares", 1.0, 1),
    ("commit_every_n_steps", 5.0, 5),
])
def test_counts_take_floats_without_a_fraction_and_keep_ints(name, value, expected):
    kept = getattr(checked(**{name: value}), name)
    assert kept == expected and type(kept) is type(expected)
    if isinstance(kept, tuple):
        assert [type(n) for n in kept] == [int, int]


@pytest.mark.parametrize("name, value", [("num_workers", 2.5), ("num_workers", (1, 2.5)), ("num_spares", 0.5),
                                         ("commit_every_n_steps", 2.5)])
def test_counts_refuse_floats_with_a_fraction(name, value):
    with pytest.raises((TypeError, ValueError), match=rf"TorchTrainer: {name} expects .*; got {re.escape(str(value))}"):
        checked(**{name: value})


def test_num_steps_takes_a_whole_float_as_an_int():
    assert check_num_steps(3.0) == 3 and type(check_num_steps(3.0)) is int
    assert check_num_steps(np.int64(3)) == 3 and type(check_num_steps(np.int64(3))) is int
    with pytest.raises(TypeError, match="num_steps expects None or an int >= 0"):
        check_num_steps(2.5)


@pytest.mark.parametrize("given", [[2, 4], [2.0, np.int64(4)]])
def test_a_list_of_two_is_a_worker_range_as_a_tuple_is(given):
    options = checked(num_workers=given)  # as a JSON or YAML config, or ScalingConfig, gives a range
    assert options.num_workers == (2, 4) and type(options.num_workers) is tuple and options.worker_range() == (2, 4)
    with pytest.raises(ValueError, match=r"num_workers expects .*; got \[4, 2\]"):
        checked(num_workers=[4, 2])


def test_a_numpy_timeout_reaches_the_process_group_as_a_timedelta():
    assert datetime.timedelta(seconds=checked(timeout_s=np.int64(1800)).timeout_s).total_seconds() == 1800


@pytest.mark.parametrize("total", [np.int64(64), 64.0])
@pytest.mark.parametrize("fixed", [False, True])
def test_a_numpy_or_float_global_batch_size_is_taken_and_each_worker_gets_an_int(fixed, total):
    options = checked(num_workers=2, fixed_worker_batch=fixed, config={BATCH_SIZE: total})
    assert options.config[BATCH_SIZE] == 64
    worker_config, total = splitter(fixed, 2)(options.config, 2, warn=False)
    assert worker_config[BATCH_SIZE] == 32 and type(worker_config[BATCH_SIZE]) is int and total == 64
    DataLoader(range(64), batch_size=worker_config[BATCH_SIZE])  # a numpy batch size is refused here


def test_fixed_worker_batch_is_refused_for_a_lightning_operator_whose_loop_steps_every_batch():
    """``from_ptl``'s loop ignores the accumulation: after a downsize every micro-batch stepped the optimizer, and
    the global batch shrank silently."""
    pytest.importorskip("pytorch_lightning", reason="the test extra's Lightning is not installed")
    from lightning_modules import Classifier
    from raysgd import TrainingOperator

    operator = TrainingOperator.from_ptl(Classifier)
    with pytest.raises(ValueError, match=r"fixed_worker_batch=True expects a TrainingOperator whose loop "
                                         r"accumulates.*; got ClassifierOperator \(from_ptl\)"):
        TrainerOptions(training_operator_cls=operator, num_workers=(1, 2), fixed_worker_batch=True).checked()
    assert TrainerOptions(training_operator_cls=operator, num_workers=(1, 2)).checked().fixed_worker_batch is False


@pytest.mark.parametrize("num_to_keep", [np.int64(3), 3.0])
def test_num_to_keep_takes_a_numpy_int_or_a_whole_float(tmp_path, num_to_keep):
    storage = CheckpointStorage(str(tmp_path), num_to_keep=num_to_keep)
    assert storage.num_to_keep == 3 and type(storage.num_to_keep) is int


@pytest.mark.parametrize("caller", ["train", "validate", "profile"])
@pytest.mark.parametrize("info, got", [("epoch 2", "str 'epoch 2'"), (5, "int 5"), (["epoch"], "list ['epoch']")])
def test_info_that_is_no_dict_is_refused_naming_info(caller, info, got):
    # dict(info) raised "dictionary update sequence element #0 has length 1; 2 is required" (or "'int' object is not
    # iterable"), naming neither info nor what it expects
    with pytest.raises(TypeError, match=rf"^{caller}\(info=\.\.\.\) expects a dict or None; got {re.escape(got)}$"):
        check_info(info, caller)


def test_info_is_copied_from_any_mapping():
    given = {"epoch_idx": 1}
    assert check_info(None) == {} and check_info(given) == given and check_info(given) is not given
    assert check_info(types.MappingProxyType(given)) == given


@pytest.mark.parametrize("caller", ["save", "load"])
@pytest.mark.parametrize("path, error, got", [(None, TypeError, "NoneType None"), (3, TypeError, "int 3"),
                                              ("", ValueError, "''")])
def test_a_checkpoint_path_that_is_none_is_refused_naming_it(caller, path, error, got):
    # save(None) gathered the workers' state first, then os.fspath raised "expected str, bytes or os.PathLike
    # object, not NoneType"; save("") failed renaming its temporary file to ''
    with pytest.raises(error, match=rf"^{caller}\(checkpoint_path=\.\.\.\) expects .*; got {re.escape(got)}$"):
        check_checkpoint_path(path, caller)


@pytest.mark.parametrize("path", ["ckpt.pt", pathlib.Path("ckpt.pt"), "s3://bucket/run/checkpoint_000001"])
def test_a_checkpoint_path_may_be_a_str_a_path_or_a_uri(path):
    assert check_checkpoint_path(path, "save") is path
