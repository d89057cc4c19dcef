"""raysgd.train on the operator API's runtime: retries, SIGTERM, warm spares, elastic growth and bad input, for real.

One shared 3-CPU local cluster; real actors, real gloo groups, real SIGKILLs and SIGTERMs. The training function
(``train_functions.counting``) counts how often each sample was trained and logs every batch, so "every sample once"
and "nothing trained twice" are checked sample by sample.
"""
import json
import logging
import os
import signal
import tempfile
import threading
import time

import pytest
import ray
import torch

from conftest import assert_released, start_ray
from helpers import signal_at_marker
from train_functions import counting, read_counts, sharded, trained_batches
import raysgd.train
from raysgd.torch.storage import filesystem
from raysgd.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from raysgd.train.torch import TorchConfig, TorchTrainer
from raysgd.train.errors import ResourcesError, TrainingFailedError, WorkerGroupError

FAST = TorchConfig(timeout_s=30)


@pytest.fixture(scope="module")
def cluster():
    ray_module = start_ray(3, num_gpus=2)  # two GPUs Ray hands out (their ids) on a machine without any
    yield ray_module
    ray_module.shutdown()


def run(tmp_path, name, config, workers=2, max_failures=0, **scaling):
    trainer = TorchTrainer(counting, train_loop_config=config, torch_config=FAST,
                           scaling_config=ScalingConfig(num_workers=workers, **scaling),
                           run_config=RunConfig(name=name, storage_path=str(tmp_path),
                                                failure_config=FailureConfig(max_failures=max_failures)))
    return trainer.fit()


def each_trained_once(log, n, epochs):
    """Every (epoch, sample) in the log exactly once: nothing lost, nothing trained twice."""
    seen = {}
    for _, _, epoch, ids in trained_batches(log):
        for sample in ids:
            seen[(epoch, sample)] = seen.get((epoch, sample), 0) + 1
    twice = sorted(key for key, count in seen.items() if count > 1)
    missing = [(epoch, sample) for epoch in range(epochs) for sample in range(n) if (epoch, sample) not in seen]
    assert not twice and not missing, f"trained twice: {twice[:10]}; never: {missing[:10]}"


# ----------------------------------------------------------------- the function's own errors
def test_a_function_error_is_retried_under_max_failures_and_is_the_results_error_once_they_run_out(cluster, tmp_path):
    marker = str(tmp_path / "raised")
    config = {"n": 32, "epochs": 2, "fault": {"kind": "raise", "rank": 1, "epoch": 0, "step": 2, "marker": marker}}
    result = run(tmp_path, "retried", config, max_failures=1)
    assert os.path.exists(marker) and result.num_failures == 1 and result.error is None
    assert read_counts(result.checkpoint).tolist() == [2.0] * 32  # resumed from step 1's checkpoint: exact
    assert result.metrics == {"epoch": 1, "done": True, "world_size": 2}  # as reported: no key of raysgd's added

    os.remove(marker)
    with pytest.raises(TrainingFailedError) as failed:
        run(tmp_path, "out-of-retries", config, max_failures=0)
    assert "the training function raised (ValueError: the training function failed once)" in str(failed.value)
    assert "the latest checkpoint is" in str(failed.value) and "checkpoint_000001" in str(failed.value)
    result = failed.value.result
    assert isinstance(failed.value, WorkerGroupError) and result.error is failed.value and result.checkpoint
    assert list(failed.value.worker_failures) == [1] and isinstance(failed.value.worker_failures[1], ValueError)
    assert_released()


def raises_at_once(config):
    raise KeyError("no such column")


def test_a_run_that_reported_nothing_says_so_when_it_fails(cluster, tmp_path):
    with pytest.raises(TrainingFailedError, match=r"KeyError: 'no such column'\); no checkpoint was reported"):
        TorchTrainer(raises_at_once, scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="nothing", storage_path=str(tmp_path))).fit()
    assert_released()


# ----------------------------------------------------------------- SIGTERM
def test_sigterm_to_one_rank_commits_at_the_next_report_and_nothing_is_trained_twice(cluster, tmp_path):
    """Rank 1 is signalled during step 2 of epoch 0; the ranks commit at the report after step 3, the signalled
    process exits, and the run resumes there: every sample of both epochs trained exactly once."""
    marker, log = str(tmp_path / "pid"), str(tmp_path / "batches.log")
    config = {"n": 64, "epochs": 2, "log": log,
              "fault": {"kind": "wait", "rank": 1, "epoch": 0, "step": 2, "marker": marker}}
    watcher = signal_at_marker(marker, signal.SIGTERM)
    result = run(tmp_path, "sigterm", config, max_failures=1)
    watcher.join(5)
    signalled = int(open(marker).read())
    deadline = time.monotonic() + 30
    while _alive(signalled) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(signalled)  # it exited after the commit
    assert result.num_failures == 1
    each_trained_once(log, 64, 2)
    assert read_counts(result.checkpoint).tolist() == [2.0] * 64
    assert_released()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ----------------------------------------------------------------- warm spares
def release_when(condition, release, timeout_s=120):
    """A daemon thread: create the file ``release`` once ``condition()`` holds (the rank at its fault waits for it)."""
    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if condition():
                    break
            except Exception:  # noqa: BLE001 (the group is being formed: ask again)
                pass
            time.sleep(0.05)
        open(release, "w").close()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread



def test_a_warm_spare_takes_a_killed_ranks_place_and_the_survivor_keeps_its_process(cluster, tmp_path, caplog):
    marker, release, log = str(tmp_path / "killed"), str(tmp_path / "warm"), str(tmp_path / "batches.log")
    config = {"n": 64, "epochs": 2, "log": log, "step_s": 0.05,
              "fault": {"kind": "kill", "rank": 1, "epoch": 0, "step": 3, "marker": marker, "release": release}}
    trainer = TorchTrainer(counting, train_loop_config=config, torch_config=FAST,
                           scaling_config=ScalingConfig(num_workers=2, num_spares=1),
                           run_config=RunConfig(name="spare", storage_path=str(tmp_path),
                                                failure_config=FailureConfig(max_failures=1)))
    release_when(lambda: trainer.worker_group is not None and trainer.worker_group.spares.available() == 1, release)
    with caplog.at_level(logging.INFO, logger="raysgd"):
        result = trainer.fit()
    assert result.num_failures == 1
    assert "1 kept their process, 1 warm spare(s) took a rank, 0 new" in caplog.text  # rank 0 stayed; the spare took rank 1
    killed = int(open(marker).read())
    before = {pid for pid, _, epoch, _ in trained_batches(log)[:8]}
    after = {pid for pid, _, _, _ in trained_batches(log)[8:]}
    assert killed in before and killed not in after and len(before & after) == 1  # the survivor, same pid
    each_trained_once(log, 64, 2)
    assert read_counts(result.checkpoint).tolist() == [2.0] * 64
    assert_released()


# ----------------------------------------------------------------- elastic growth
@ray.remote(num_cpus=2)
class Holder:
    """Holds 2 of the 3 CPUs until killed: only one worker fits at first."""

    def ready(self):
        return True


def test_a_range_grows_at_a_report_when_workers_fit_again(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0.5")
    monkeypatch.setenv("SGD_GROW_CHECK_S", "0.3")
    holder = Holder.remote()
    ray.get(holder.ready.remote())
    marker, log = str(tmp_path / "held"), str(tmp_path / "batches.log")
    config = {"n": 48, "epochs": 2, "log": log, "every": 2, "step_s": 0.1,
              "fault": {"kind": "hold", "epoch": 0, "step": 4, "marker": marker, "until": "asked"}}

    def free_cpus():
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.kill(holder)  # two more CPUs: the watch sees room and asks the ranks to stop at their next commit

    thread = threading.Thread(target=free_cpus, daemon=True)
    thread.start()
    result = run(tmp_path, "grow", config, workers=(1, 2))
    thread.join(5)
    sizes = [size for _, size, _, _ in trained_batches(log)]
    assert sizes[0] == 1 and sizes[-1] == 2 and result.metrics["world_size"] == 2
    assert result.num_failures == 0  # a resize is no failure
    each_trained_once(log, 48, 2)
    assert read_counts(result.checkpoint).tolist() == [2.0] * 48
    assert_released()


# ----------------------------------------------------------------- bad input and damaged checkpoints
def test_a_cluster_that_can_never_hold_the_workers_fails_at_once_naming_the_resources(cluster, tmp_path):
    started = time.monotonic()
    with pytest.raises(ResourcesError, match=r"num_workers=5\) needs 5 worker\(s\) of 1 CPU\(s\).*can hold 3"):
        run(tmp_path, "too-big", {}, workers=5)
    assert time.monotonic() - started < 10  # not the 100 s placement timeout
    with pytest.raises(TrainingFailedError, match="expects a checkpoint of a local directory.*not a directory"):
        TorchTrainer(reports_a_missing_folder, scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="missing", storage_path=str(tmp_path))).fit()
    assert_released()


def reports_a_missing_folder():
    raysgd.train.report({"loss": 1.0}, checkpoint=Checkpoint(os.path.join(os.getcwd(), "no-such-folder")))


def test_a_truncated_newest_checkpoint_is_skipped_and_the_one_before_it_resumed(cluster, tmp_path, caplog):
    first = run(tmp_path, "damaged", {"n": 16, "epochs": 1}, workers=1)
    folder = first.checkpoint.path
    state = os.path.join(folder, "state.pt")
    with open(state, "r+b") as handle:
        handle.truncate(os.path.getsize(state) // 2)
    with caplog.at_level(logging.WARNING, logger="raysgd"):
        again = run(tmp_path, "damaged", {"n": 16, "epochs": 2}, workers=1)
    assert "Skipping checkpoint" in caplog.text and "state.pt has" in caplog.text
    assert read_counts(again.checkpoint).tolist() == [2.0] * 16  # epoch 0 from the older checkpoint, then epoch 1
    assert_released()


def reports_the_checkpoint_it_started_from(config):
    """Reports the checkpoint it was started from (``get_checkpoint()``) again, unchanged, as its own."""
    checkpoint = raysgd.train.get_checkpoint()
    with checkpoint.as_directory() as folder:
        loss = float(open(os.path.join(folder, "loss.txt")).read())
    raysgd.train.report({"loss": loss / 2}, checkpoint=checkpoint)


def test_a_checkpoint_reported_again_is_whole_and_raysgds_own_files_are_not_its_content(cluster, tmp_path, caplog):
    """A run started from another run's checkpoint (``resume_from_checkpoint``) reports that checkpoint again, in
    place (its folder holds raysgd's marker and the callbacks' note beside the user's file): the new checkpoint's
    marker lists only the user's file, so the run folder resumes from it, not skipping it as damaged (the old
    marker listed as a file of the new checkpoint had another size once the new marker was written). ``to_directory``
    copies the user's files only. Metadata set on a reported checkpoint (``update_metadata``) leaves it whole."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "loss.txt").write_text("1.0")
    (source / filesystem.REPORT_MARKER).write_text('{"kind": "report", "note": "an old marker"}')
    (source / filesystem.CALLBACKS_NOTE).write_text('{"state": {"0:Old": {}}}')
    Checkpoint.from_directory(source).set_metadata({"step": 1})

    def fit():
        return TorchTrainer(reports_the_checkpoint_it_started_from, torch_config=FAST,
                            scaling_config=ScalingConfig(num_workers=1),
                            resume_from_checkpoint=Checkpoint.from_directory(source),
                            run_config=RunConfig(name="again", storage_path=str(tmp_path / "runs"))).fit()

    first = fit()
    marker = json.loads(open(os.path.join(first.checkpoint.path, filesystem.REPORT_MARKER)).read())
    assert sorted(marker["files"]) == [".metadata.json", "loss.txt"] and first.metrics["loss"] == 0.5
    assert not os.path.exists(os.path.join(first.checkpoint.path, filesystem.CALLBACKS_NOTE))  # no callback state
    copied = first.checkpoint.to_directory(tmp_path / "copy")
    assert sorted(os.listdir(copied)) == [".metadata.json", "loss.txt"]
    first.checkpoint.update_metadata({"note": "the best so far"})  # rewritten after the report: still whole
    with caplog.at_level(logging.INFO, logger="raysgd"):
        second = fit()  # the run folder's checkpoint is the start now, whole
    assert f"Resuming the run from {first.checkpoint.path}" in caplog.text and "Skipping checkpoint" not in caplog.text
    assert os.path.basename(second.checkpoint.path) == "checkpoint_000002" and second.metrics["loss"] == 0.5
    assert second.checkpoint.get_metadata() == {"step": 1, "note": "the best so far"}
    assert_released()


# ----------------------------------------------------------------- sharded (DCP) checkpoints
def test_every_rank_reports_its_dcp_shard_and_the_merged_checkpoint_loads_at_another_size(cluster, tmp_path):
    """Each rank saves its own FSDP2 shard with DCP into its own folder and reports it: the checkpoint holds every
    rank's shard and DCP's metadata; a run at 3 workers loads it (resharded by DCP) to the same whole weights."""
    def trainer(workers):
        return TorchTrainer(sharded, torch_config=FAST, scaling_config=ScalingConfig(num_workers=workers),
                            run_config=RunConfig(name="dcp", storage_path=str(tmp_path)))

    saved = trainer(2).fit()
    assert sorted(os.listdir(saved.checkpoint.path)) == [".metadata", ".raysgd_report.json", "__0_0.distcp",
                                                         "__1_0.distcp"]
    assert saved.metrics["files"] == [".metadata", "__0_0.distcp"]  # rank 0's own folder: its shard alone
    loaded = trainer(3).fit()
    whole_saved, whole_loaded = saved.return_value, loaded.return_value
    assert sorted(whole_saved) == sorted(whole_loaded)
    assert all(torch.equal(whole_saved[key], whole_loaded[key]) for key in whole_saved)
    assert_released()


# ----------------------------------------------------------------- callbacks, retention, restore
class Seen(raysgd.train.UserCallback):
    """Records what a user callback is told (on the driver)."""

    def __init__(self):
        self.reports, self.exceptions = [], []

    def after_report(self, run_context, metrics, checkpoint):
        self.reports.append((metrics, checkpoint.path if checkpoint else None))

    def after_exception(self, run_context, worker_exceptions):
        self.exceptions.append({rank: type(error).__name__ for rank, error in worker_exceptions.items()})


def scored(config):
    """Four reports with checkpoints, scored by ``acc`` (0.5, 0.9, 0.7, 0.1), each rank its own metrics; rank 1 raises
    once after the second (a retried error)."""
    rank = raysgd.train.get_context().get_world_rank()
    start = 0
    checkpoint = raysgd.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            start = int(open(os.path.join(folder, "step")).read()) + 1
    done = None
    for step, acc in list(enumerate([0.5, 0.9, 0.7, 0.1]))[start:]:
        if step == 2 and rank == 1 and not os.path.exists(config["raised"]):
            open(config["raised"], "w").close()
            raise ValueError("once")
        with tempfile.TemporaryDirectory() as folder:
            open(os.path.join(folder, "step"), "w").write(str(step))
            raysgd.train.report({"acc": acc, "rank": rank}, checkpoint=Checkpoint.from_directory(folder))
        done = step
    return done


def test_user_callbacks_hear_every_ranks_reports_and_the_scored_best_are_kept(cluster, tmp_path):
    """Every report reaches after_report with each rank's metrics; the raised error reaches after_exception with its
    rank; num_to_keep=2 by "acc" keeps the two best and the latest (never pruned); restore() goes on from the run."""
    seen = Seen()
    config = raysgd.train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc")
    trainer = TorchTrainer(scored, train_loop_config={"raised": str(tmp_path / "raised")}, torch_config=FAST,
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="scored", storage_path=str(tmp_path), callbacks=[seen],
                                                checkpoint_config=config,
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    assert [[m["acc"] for m in metrics] for metrics, _ in seen.reports] == [[0.5, 0.5], [0.9, 0.9], [0.7, 0.7],
                                                                            [0.1, 0.1]]
    assert [[m["rank"] for m in metrics] for metrics, _ in seen.reports][0] == [0, 1]  # each rank's own
    assert seen.exceptions == [{1: "ValueError"}] and result.num_failures == 1
    kept = sorted(os.listdir(tmp_path / "scored"))
    assert [name for name in kept if name.startswith("checkpoint_")] == ["checkpoint_000002", "checkpoint_000003",
                                                                         "checkpoint_000004"]  # the best 2 + latest
    assert [m["acc"] for _, m in result.best_checkpoints] == [0.7, 0.9]  # worst first, best last
    assert result.metrics == {"acc": 0.1, "rank": 0} and result.return_value == 3
    assert TorchTrainer.can_restore(str(tmp_path / "scored")) and not TorchTrainer.can_restore(str(tmp_path))
    again = TorchTrainer.restore(str(tmp_path / "scored"), scored, train_loop_config={"raised": "-"},
                                 torch_config=FAST, scaling_config=ScalingConfig(num_workers=1)).fit()
    assert again.return_value is None and again.metrics == {"acc": 0.1, "rank": 0}  # nothing left to train
    with pytest.raises(ValueError, match=r"restore\(path=...\) expects the folder of a raysgd.train run"):
        TorchTrainer.restore(str(tmp_path), scored)
    assert_released()


# ----------------------------------------------------------------- GPUs: what a worker sees
def environment(config):
    """Each rank writes what it sees: its context, the rendezvous and the visible GPUs (the ids Ray assigned)."""
    import json

    context = raysgd.train.get_context()
    seen = {"rank": context.get_world_rank(), "local_rank": context.get_local_rank(),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "master": (os.environ.get("MASTER_ADDR"),
                                                                       os.environ.get("MASTER_PORT")),
            "ranks": [os.environ.get("RANK"), os.environ.get("LOCAL_RANK"), os.environ.get("WORLD_SIZE")],
            "own": [str(gpu) for gpu in ray.get_gpu_ids()]}
    with open(os.path.join(config["out"], f"rank{context.get_world_rank()}.json"), "w") as handle:
        json.dump(seen, handle)


def test_gpu_workers_of_a_node_see_all_its_gpus_with_their_own_at_the_local_rank(cluster, tmp_path):
    """As in Ray Train: every worker of a node sees the node's workers' GPUs, in local-rank order, so
    ``cuda:{local_rank}`` is its own; MASTER_ADDR/MASTER_PORT name the process group's rendezvous. (The GPUs are
    Ray's resource ids on a machine without CUDA: the workers train on the CPU over gloo.)"""
    import json

    TorchTrainer(environment, train_loop_config={"out": str(tmp_path)}, torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
                 run_config=RunConfig(name="gpus", storage_path=str(tmp_path))).fit()
    seen = [json.load(open(tmp_path / f"rank{rank}.json")) for rank in range(2)]
    assert [s["local_rank"] for s in seen] == [0, 1]
    assert seen[0]["gpus"] == seen[1]["gpus"] and sorted(seen[0]["gpus"].split(",")) == ["0", "1"]
    assert seen[0]["master"] == seen[1]["master"] and seen[0]["master"][0] and int(seen[0]["master"][1]) > 0
    assert all(s["gpus"].split(",")[s["local_rank"]] == s["own"][0] for s in seen)  # cuda:{local_rank} is its own
    assert [s["ranks"] for s in seen] == [["0", "0", "2"], ["1", "1", "2"]]
    assert_released()


# ----------------------------------------------------------------- the progress view
def test_a_progress_bar_shows_rank_0s_epoch_and_the_loss_it_reported(cluster, tmp_path, capfd):
    result = TorchTrainer(counting, train_loop_config={"n": 32, "epochs": 2, "loss": True}, torch_config=FAST,
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="bar", storage_path=str(tmp_path), progress_bar=True)).fit()
    shown = capfd.readouterr().err
    assert "2e" in shown and "4/4" in shown, shown[-2000:]  # epoch 2's 4 batches of rank 0, each shown
    assert "loss=" in shown  # the loss of the last report
    assert result.metrics["done"]
    assert_released()


class Levels(raysgd.train.UserCallback):
    """Records raysgd's log level on the driver at each report."""

    def __init__(self):
        self.levels = []

    def after_report(self, run_context, metrics, checkpoint):
        import logging

        self.levels.append(logging.getLogger("raysgd").level)


def test_a_logging_config_sets_raysgds_level_for_the_run_and_puts_it_back(cluster, tmp_path):
    import logging

    before = logging.getLogger("raysgd").level
    levels = Levels()
    TorchTrainer(counting, train_loop_config={"n": 8, "epochs": 1}, torch_config=FAST,
                 scaling_config=ScalingConfig(num_workers=1),
                 run_config=RunConfig(name="levels", storage_path=str(tmp_path), callbacks=[levels],
                                      logging_config=raysgd.train.LoggingConfig("ERROR"))).fit()
    assert levels.levels and set(levels.levels) == {logging.ERROR}
    assert logging.getLogger("raysgd").level == before
    assert_released()
