"""raysgd.base.checks: the argument checkers every layer uses (no Ray)."""
import fractions
import functools
import math

import numpy as np
import pytest

from raysgd.base.checks import expect, is_int, is_number, is_one_of, is_whole, plain, takes_no_arguments


@pytest.mark.parametrize("value, expected", [
    (3, True), (np.int64(3), True), (np.uint8(3), True), (True, False), (np.bool_(True), False), (3.0, False),
    ("3", False), (None, False),
])
def test_is_int_takes_every_integer_type_but_bool(value, expected):
    assert is_int(value) is expected


@pytest.mark.parametrize("value, expected", [
    (2, True), (np.int64(2), True), (2.0, True), (np.float32(2.0), True), (2.5, False), (True, False),
    (math.inf, False), (math.nan, False), ("2", False), (None, False), (0.0, False),
])
def test_is_whole_takes_ints_and_floats_without_a_fraction(value, expected):
    assert is_whole(value, minimum=1) is expected


@pytest.mark.parametrize("value, finite, expected", [
    (0.5, False, True), (np.float32(0.5), True, True), (math.inf, False, True), (math.inf, True, False),
    (math.nan, True, False), (-math.inf, True, False), (None, True, False), ("1", True, False),
])
def test_is_number_refuses_infinity_and_nan_when_asked(value, finite, expected):
    assert is_number(value, above=0, finite=finite) is expected


@pytest.mark.parametrize("value, expected", [
    (np.int64(2), 2), (np.float64(0.5), 0.5), (np.float32(1.5), 1.5), (fractions.Fraction(1, 4), 0.25), (7, 7),
])
def test_plain_gives_python_numbers_for_numpy_scalars(value, expected):
    result = plain(value)
    assert result == expected and type(result) is type(expected)


@pytest.mark.parametrize("value", [True, "2", None, [2]])
def test_plain_leaves_what_is_no_number_as_it_is(value):
    assert plain(value) is value


@pytest.mark.parametrize("value, expected", [
    ("batch", True), ("weekly", False), (["batch"], False), ({"batch": 1}, False), (np.array(["batch", "x"]), False),
    (None, False),
])
def test_is_one_of_answers_for_unhashable_values_instead_of_raising(value, expected):
    assert is_one_of(value, {"batch", "epoch"}) is expected
    assert is_one_of(value, ("batch", "epoch")) is expected


def _needs_one(config):
    return config


@pytest.mark.parametrize("function, expected", [
    (lambda: None, True), (lambda *args, **kwargs: None, True), (lambda seed=0: None, True), (print, True),
    (functools.partial(_needs_one, {}), True), (_needs_one, False), (lambda config: None, False),
    (lambda *, key: None, False),
])
def test_takes_no_arguments_reads_the_signature(function, expected):
    assert takes_no_arguments(function) is expected


def test_expect_names_the_argument_the_expectation_and_the_value():
    with pytest.raises(TypeError, match=r"^TorchTrainer: num_workers expects an int >= 1; got str '2'$"):
        expect(is_int("2"), "num_workers", "an int >= 1", "2", TypeError, caller="TorchTrainer", typed=True)
