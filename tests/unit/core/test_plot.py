"""raysgd.plot: a training curve PNG from result dicts or a CSV file; clear errors for bad input."""
import struct

import pytest

from raysgd.plot import plot_training_curve, read_history

pytest.importorskip("matplotlib", reason="the plot helper needs matplotlib (the 'logging' extra)")

HISTORY = [{"epoch": e, "train_loss": 1.0 / e, "val_loss": 1.2 / e, "val_accuracy": 1 - 0.5 / e,
            "last_train_loss": 0.0, "num_samples": 100} for e in range(1, 6)]


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def test_two_panels_from_result_dicts(tmp_path):
    out = tmp_path / "sub" / "curve.png"
    assert plot_training_curve(HISTORY, str(out), title="t") == str(out)
    width, height = _png_size(out)
    assert (width, height) == (1100, 400)  # a loss panel and an accuracy panel


def test_one_panel_for_losses_only(tmp_path):
    out = tmp_path / "loss.png"
    plot_training_curve([{"train_loss": 2.0}, {"train_loss": 1.0}], str(out))
    assert _png_size(out) == (550, 400)


def test_from_a_csv_file(tmp_path):
    csv_path = tmp_path / "results.csv"
    csv_path.write_text("epoch,train_loss,val_accuracy,note\n1,0.9,0.5,a\n2,0.4,,b\n3,0.2,0.8,c\n")
    rows = read_history(str(csv_path))
    assert rows[1] == {"epoch": 2.0, "train_loss": 0.4}
    plot_training_curve(str(csv_path), str(tmp_path / "csv.png"))
    assert _png_size(tmp_path / "csv.png")[0] == 1100


def test_bad_input_is_named(tmp_path):
    out = str(tmp_path / "x.png")
    with pytest.raises(ValueError, match="at least one result"):
        plot_training_curve([], out)
    with pytest.raises(TypeError, match="list of result dicts or a CSV path; got int"):
        plot_training_curve(3, out)
    with pytest.raises(ValueError, match=r"names \['val_f1'\].*available: \['epoch'"):
        plot_training_curve(HISTORY, out, metrics=["val_f1"])
    with pytest.raises(ValueError, match="no loss or accuracy keys"):
        plot_training_curve([{"epoch": 1, "throughput": 3.0}], out)


def test_numpy_numbers_are_drawn(tmp_path):
    """A one-worker result keeps a metric's numpy type (np.float32 from a float32 array's mean): drawn as any number."""
    np = pytest.importorskip("numpy")
    history = [{"epoch": np.int64(e), "val_loss": np.float32(1.0 / e), "val_accuracy": np.float32(0.5 + e / 10)}
               for e in (1, 2, 3)]
    out = tmp_path / "numpy.png"
    plot_training_curve(history, str(out))
    assert _png_size(out) == (1100, 400)  # both panels: the numpy losses and accuracies were found


def test_metrics_as_one_name_is_an_error_naming_the_argument(tmp_path):
    with pytest.raises(TypeError, match=r"plot_training_curve\(metrics=...\) expects None or a list of metric names; "
                                        r"got 'train_loss'"):
        plot_training_curve(HISTORY, str(tmp_path / "x.png"), metrics="train_loss")
    plot_training_curve(HISTORY, str(tmp_path / "y.png"), metrics=("train_loss",))  # any iterable of names
