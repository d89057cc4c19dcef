"""The result loggers in one process (no Ray): what a metrics dict a user returns becomes in MLflow (a sqlite store in
a temporary folder), W&B's and the result log's metrics, and the training-curve plot."""
import pytest


class Trainer:
    """What a logger reads of the trainer: its ``config`` (logged as the run's params)."""

    def __init__(self, config):
        self.config = config


def metric_history(mlflow_logger):
    client = mlflow_logger.client
    keys = client.get_run(mlflow_logger.run_id).data.metrics
    return {key: [(m.step, m.value) for m in client.get_metric_history(mlflow_logger.run_id, key)] for key in keys}


def test_mlflow_logs_every_metric_and_param_when_mlflow_refuses_some_names(tmp_path, caplog):
    pytest.importorskip("mlflow")
    from raysgd.loggers import MLflowLogger

    mlflow_logger = MLflowLogger(tracking_uri=str(tmp_path / "mlruns"), experiment_name="names")
    trainer = Trainer({"lr(max)": 0.1, "batch_size": 32})
    long_a, long_b = "a" * 300, "a" * 299 + "b"
    mlflow_logger.on_train_result(trainer, {"epoch": 1, "train_loss": 0.5, "acc@1": 0.75, long_a: 1.0, long_b: 2.0})
    mlflow_logger.on_train_result(trainer, {"epoch": 2, "train_loss": 0.25, "acc@1": 0.875})
    mlflow_logger.on_validate_result(trainer, {"val_loss": 0.5, "top-1 (%)": 80.0, "profile": {"": 3.0}})
    mlflow_logger.on_shutdown(trainer)  # raised the failed writes' error before

    history = metric_history(mlflow_logger)
    assert history["train/train_loss"] == [(1, 0.5), (2, 0.25)]
    assert history["train/acc_1"] == [(1, 0.75), (2, 0.875)]
    assert history["validate/val_loss"] == [(2, 0.5)] and history["validate/top-1 ___"] == [(2, 80.0)]
    assert history["validate/profile/_"] == [(2, 3.0)]
    long_names = sorted(key for key in history if key.startswith("train/aaa"))
    assert len(long_names) == 2 and all(len(key) == 250 for key in long_names)  # cut, yet two names
    assert sorted(value for key in long_names for _, value in history[key]) == [1.0, 2.0]
    params = mlflow_logger.client.get_run(mlflow_logger.run_id).data.params
    assert params == {"lr_max_": "0.1", "batch_size": "32"}
    renamed = [record.getMessage() for record in caplog.records
               if "MLflow refuses the metric name 'train/acc@1'" in record.getMessage()]
    assert len(renamed) == 1 and "logged as 'train/acc_1'" in renamed[0]  # once, not at every step


def test_mlflow_tags_whose_names_mlflow_refuses_are_an_error_naming_them():
    pytest.importorskip("mlflow")
    from raysgd.loggers import MLflowLogger

    with pytest.raises(ValueError, match=r"MLflowLogger: tags expects keys MLflow takes .*\(refused: \['team@x'\]\)"):
        MLflowLogger(experiment_name="names", tags={"team@x": "a", "owner": "b"})


def test_nested_metrics_reach_wandb_and_the_result_log_under_the_same_names(tmp_path):
    """A ``profile=True`` result holds a dict: W&B's metrics (``numbers``, what ``WandbLogger.log_result`` logs)
    lost it, where MLflow and the result log flattened it."""
    from raysgd.torch.integrations.results import ResultLogger, read_results
    from raysgd.torch.integrations.tracker import numbers

    result = {"epoch": 1, "train_loss": 0.5, "note": "x", "done": True,
              "profile": {"mean_fwd_s": 0.01, "io": {"wait_s": 0.25}}, 7: 1.5}
    assert numbers(result) == {"epoch": 1, "train_loss": 0.5, "profile/mean_fwd_s": 0.01, "profile/io/wait_s": 0.25,
                               "7": 1.5}
    log = ResultLogger(tmp_path, tensorboard=False)
    log.log("train", result)
    row = read_results(tmp_path)[0]
    assert {key: row[key] for key in numbers(result)} == numbers(result)


def test_a_results_own_step_and_time_keep_the_result_log_columns(tmp_path):
    """A result with a ``step`` of its own (a global step) replaced the log's ``step``, so a validation row no longer
    lined up with its epoch (and rewind counted the wrong rows), and the user's value had no column."""
    from raysgd.torch.integrations.results import ResultLogger, read_results

    log = ResultLogger(tmp_path, tensorboard=False)
    log.log("train", {"step": 400, "time": 12.5, "train_loss": 1.0})
    log.log("validate", {"val_loss": 0.5, "step": 400})
    log.log("train", {"step": 800, "time": 25.0, "train_loss": 0.5})
    train, validate = read_results(tmp_path), read_results(tmp_path, "validate")
    assert [(row["step"], row["result/step"], row["result/time"]) for row in train] == [(1, 400, 12.5), (2, 800, 25.0)]
    assert all(row["time"] > 1e9 for row in train)  # the log's wall clock
    assert [(row["step"], row["result/step"]) for row in validate] == [(1, 400)]
    by_step = {row["step"]: row for row in train}
    assert by_step[validate[0]["step"]]["train_loss"] == 1.0  # the docs' join of the two files on step


def test_the_result_log_gives_back_what_was_written(tmp_path):
    """A bool came back as the text 'False', which is truthy; numbers, NaN, inf and text with commas, quotes,
    newlines and unicode come back as written."""
    import math

    from raysgd.torch.integrations.results import ResultLogger, read_results

    written = {"epoch": 3, "train_loss": 0.5, "whole": 2.0, "early_stop": False, "best": True, "nan": float("nan"),
               "inf": float("-inf"), "note": 'a,b\n"c" é', "none": None, "k" * 300: 1}
    log = ResultLogger(tmp_path, tensorboard=False)
    log.log("train", written)
    row = read_results(tmp_path)[0]
    assert row["early_stop"] is False and row["best"] is True
    assert math.isnan(row["nan"]) and row["inf"] == float("-inf")
    assert {key: row[key] for key in ("epoch", "train_loss", "whole", "note", "none", "k" * 300)} == {
        key: written[key] for key in ("epoch", "train_loss", "whole", "note", "none", "k" * 300)}
    assert type(row["epoch"]) is int and type(row["whole"]) is float


def test_a_row_cut_short_does_not_stop_the_result_log_from_opening(tmp_path):
    """A row a killed driver left short made read_results (and so ResultLogger, which counts the rows) raise
    TypeError: the folder could not be logged to again."""
    from raysgd.torch.integrations.results import ResultLogger, read_results

    ResultLogger(tmp_path, tensorboard=False).log("train", {"train_loss": 1.0, "val": 2.0})
    with open(tmp_path / "train.csv", "a", encoding="utf-8") as handle:
        handle.write("2,1796000000.5\n")  # the row a killed driver was writing
    assert read_results(tmp_path)[1] == {"step": 2, "time": 1796000000.5, "train_loss": None, "val": None}
    log = ResultLogger(tmp_path, tensorboard=False)
    log.log("train", {"train_loss": 0.5})
    assert [(row["step"], row["train_loss"]) for row in read_results(tmp_path)] == [(1, 1.0), (2, None), (3, 0.5)]


def test_result_log_arguments_are_checked(tmp_path):
    """``read_results(logdir, "validation")`` answered ``[]`` (a typo read as a log with no rows), and
    ``ResultLogger(tensorboard=0)`` opened TensorBoard."""
    from raysgd.torch.integrations.results import ResultLogger, read_results

    with pytest.raises(ValueError, match=r"read_results\(phase=...\) expects one of \('train', 'validate'\); "
                                         r"got 'validation'"):
        read_results(tmp_path, "validation")
    with pytest.raises(TypeError, match=r"read_results\(logdir=...\) expects a directory path; got None"):
        read_results(None)
    for flag in (0, 1):
        with pytest.raises(ValueError, match=rf"ResultLogger\(tensorboard=...\) expects 'auto', True or False; "
                                             rf"got {flag}"):
            ResultLogger(tmp_path, tensorboard=flag)
    assert ResultLogger(tmp_path, tensorboard=False).tensorboard is False


def test_tensorboard_takes_an_int_past_int64(tmp_path):
    """An int metric past int64 (a run's FLOP count) made tensorboardX raise TypeError: the row's later scalars and
    the flush were lost."""
    pytest.importorskip("tensorboardX")
    import glob
    import struct

    from tensorboardX.proto import event_pb2

    from raysgd.torch.integrations.results import ResultLogger, read_results

    log = ResultLogger(tmp_path, tensorboard=True)
    log.log("train", {"flops": 3 * 10**19, "train_loss": 0.5})
    log.close()
    assert read_results(tmp_path)[0]["flops"] == 3 * 10**19
    scalars = {}
    for path in glob.glob(str(tmp_path / "events.out.tfevents.*")):
        with open(path, "rb") as handle:
            data = handle.read()
        offset = 0
        while offset < len(data):  # TFRecord framing: length, its crc, the event, its crc
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            scalars.update({value.tag: (event.step, value.simple_value) for value in event.summary.value})
    assert scalars == {"train/flops": (1, pytest.approx(3e19)), "train/train_loss": (1, 0.5)}
