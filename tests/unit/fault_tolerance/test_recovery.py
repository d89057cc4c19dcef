"""The pure recovery policy, with a fake clock and no Ray."""
import pytest

from raysgd.torch.fault_tolerance import recovery


def test_backoff_is_capped_exponential():
    assert list(recovery.backoff_delays(6, base_s=1, cap_s=8)) == [1, 2, 4, 8, 8, 8]
    assert list(recovery.backoff_delays(0)) == []


@pytest.mark.parametrize("nodes, cpus, gpus, limit, expected", [
    ([{"CPU": 4.0}], 1, 0, 8, 4),
    ([{"CPU": 4.0}], 2, 0, 8, 2),
    ([{"CPU": 3.0}, {"CPU": 1.0}], 2, 0, 8, 1),      # counts per node: 1.5 + 0.5 is not 2
    ([{"CPU": 8.0, "GPU": 1.0}], 1, 1, 8, 1),         # GPUs bound it
    ([{"CPU": 8.0}], 1, 1, 8, 0),                      # no GPU at all
    ([{"CPU": 16.0}], 1, 0, 3, 3),                     # never above the limit
    ([{}], 1, 0, 3, 0),
])
def test_workers_that_fit(nodes, cpus, gpus, limit, expected):
    assert recovery.workers_that_fit(nodes, cpus, gpus, limit) == expected


def test_scale_up_waits_for_cooldown_and_room():
    assert not recovery.should_scale_up(1, 2, extra_fit=1, now=105, last_resize=100, cooldown_s=10)
    assert recovery.should_scale_up(1, 2, extra_fit=1, now=110, last_resize=100, cooldown_s=10)
    assert not recovery.should_scale_up(1, 2, extra_fit=0, now=200, last_resize=100, cooldown_s=10)
    assert not recovery.should_scale_up(2, 2, extra_fit=3, now=200, last_resize=100, cooldown_s=10)


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def test_restart_waits_with_backoff_until_workers_fit():
    clock = FakeClock()
    fits = iter([0, 0, 0, 2])
    started = recovery.restart_with_backoff(lambda n: n, lambda: next(fits), tries=10, base_s=1, cap_s=60,
                                            sleep=clock.sleep)
    assert started == 2
    assert clock.sleeps == [1, 2, 4]


def test_restart_retries_start_failures_then_succeeds():
    clock = FakeClock()
    attempts = []

    def try_start(n):
        attempts.append(n)
        if len(attempts) == 1:
            raise ConnectionError("died while starting")
        return n

    assert recovery.restart_with_backoff(try_start, lambda: 3, tries=5, sleep=clock.sleep,
                                         retryable=(ConnectionError,)) == 3
    assert attempts == [3, 3] and clock.sleeps == [1]


def test_restart_gives_up_with_last_failure_as_cause():
    clock = FakeClock()

    def try_start(n):
        raise ConnectionError(f"attempt at {clock.now}")

    with pytest.raises(recovery.RestartGaveUp) as info:
        recovery.restart_with_backoff(try_start, lambda: 1, tries=4, base_s=1, cap_s=2, sleep=clock.sleep,
                                      retryable=(ConnectionError,))
    assert isinstance(info.value.__cause__, ConnectionError)
    assert str(info.value.__cause__) == "attempt at 5.0"  # 1 + 2 + 2 seconds waited before the 4th try
    assert clock.sleeps == [1, 2, 2]


def test_restart_gives_up_when_nothing_ever_fits():
    clock = FakeClock()
    with pytest.raises(recovery.RestartGaveUp, match="no worker fit"):
        recovery.restart_with_backoff(lambda n: n, lambda: 0, tries=3, sleep=clock.sleep)
    assert clock.now == 3  # bounded: 1 + 2 seconds


def test_non_retryable_errors_propagate_at_once():
    with pytest.raises(ValueError):
        recovery.restart_with_backoff(lambda n: (_ for _ in ()).throw(ValueError("user bug")), lambda: 1, tries=5,
                                      sleep=lambda s: None, retryable=(ConnectionError,))


def test_a_restart_behind_a_lagging_resource_view_does_not_wait_the_full_timeout_per_size():
    """Ray's view still counts a lost node (6 workers "fit", 2 really do, and the view catches up slowly): the
    sizes are not tried one by one with 10 s each (40 s before 2 was tried); a size above the minimum gets 3 s,
    then the size that fits now is tried."""
    clock, tried, view = [0.0], [], iter([5, 3, 2])

    def start(size, timeout_s):
        tried.append((size, timeout_s))
        if size > 2:  # never placed: the node it needs is gone
            clock[0] += timeout_s
            raise TimeoutError(f"{size} workers not placed within {timeout_s} s")

    assert recovery.place_largest(start, lambda limit: min(limit, next(view)), first=6, low=1, try_s=3,
                                  full_s=10) == 2
    assert tried == [(6, 3), (5, 3), (3, 3), (2, 3)] and clock[0] == 9
    with pytest.raises(TimeoutError):  # the minimum itself gets the full timeout, then gives up
        recovery.place_largest(start, lambda limit: limit, first=4, low=3, try_s=3, full_s=10)
    assert tried[-2:] == [(4, 3), (3, 10)]


def test_grow_watch_decides_once_only_when_more_fit_and_the_attempt_has_a_commit():
    from raysgd.torch.fault_tolerance.watches import GrowWatch, Stop

    now, fit, committed = [0.0], [None], [None]
    watch = GrowWatch(target=lambda: fit[0], committed=lambda: committed[0], check_s=2.0, clock=lambda: now[0])
    decisions = []
    for step in range(1, 4):  # nothing fits: no decision
        now[0] = 2.0 * step
        decisions.append(watch.tick())
    fit[0] = 3
    now[0] = 8.0
    decisions.append(watch.tick())
    assert decisions == [None] * 4 and not watch.requested  # more fit, but no commit of this attempt yet
    committed[0] = (7, 1)
    now[0] = 9.0
    assert watch.tick() is None  # within check_s of the last check: not decided yet
    now[0] = 10.0
    assert watch.tick() == Stop(3, (7, 1), "to grow") and watch.requested and watch.size == 3
    now[0] = 20.0
    assert watch.tick() is None  # one decision per attempt


def test_a_lost_or_unanswered_request_to_stop_is_asked_again_while_the_attempt_runs(caplog):
    """A request's answer that failed (a lost request) is asked again at the next tick; one that did not come
    within SGD_RESIZE_ASK_S (5 s) too; at most MAX_ASKS (3) requests per rank; an answered rank is never
    asked again. The answers are read with ``answered`` (a Ray ObjectRef's state, here a table of them)."""
    from raysgd.torch.execution.restarts import StopRequest
    from raysgd.torch.fault_tolerance.watches import Stop

    class Group:
        def __init__(self):
            self.requests, self.calls = [], 0

        def request_resize(self, call_id, attempt, ranks=None):
            assert (call_id, attempt) == (7, 1)
            self.requests.append(sorted(ranks) if ranks is not None else "all")
            made = {}
            for rank in (ranks if ranks is not None else (0, 1, 2)):
                self.calls += 1
                made[rank] = self.calls
            return made

    # call id -> its answer: rank 0 answers, rank 1's request is lost, rank 2 never answers
    answers = {1: True, 2: False, 3: None, 4: True}
    now, group = [0.0], Group()
    request = StopRequest(group, Stop(3, (7, 1), "to grow"), clock=lambda: now[0],
                          answered=lambda call: answers.get(call)).send()
    assert group.requests == ["all"]
    now[0] = 0.5
    request.tick()
    assert group.requests == ["all", [1]]  # lost: asked again at once (call 4, answered)
    now[0] = 4.0
    request.tick()
    assert group.requests == ["all", [1]]  # rank 2 has 5 s to answer
    now[0] = 5.5
    request.tick()
    assert group.requests == ["all", [1], [2]]  # overdue: asked again (call 5, never answered)
    for later in (8.0, 11.0, 20.0, 30.0):
        now[0] = later
        with caplog.at_level("WARNING", logger="raysgd.torch.execution.restarts"):
            request.tick()
    assert group.requests == ["all", [1], [2], [2]]  # 3 requests to rank 2 in all, then it gives up (logged)
    assert caplog.text.count("did not take the request to stop") == 1


def test_a_failing_grow_check_only_delays_growing():
    from raysgd.torch.fault_tolerance.watches import GrowWatch

    def broken():
        raise ConnectionError("the GCS is restarting")

    watch = GrowWatch(target=broken, committed=lambda: (1, 0), check_s=0)
    assert watch.tick() is None and not watch.requested


def test_drain_watch_decides_once_when_a_worker_node_drains_and_the_group_can_move(caplog):
    from raysgd.torch.fault_tolerance.watches import DrainWatch, Stop

    now, found, size = [0.0], [{}], [None]
    watch = DrainWatch(find=lambda: found[0], size_for=lambda ranks: size[0], attempt=lambda: (4, 2),
                       check_s=1.0, clock=lambda: now[0])
    now[0] = 1.0
    assert watch.tick() is None and not watch.requested  # no worker's node is draining
    found[0] = {1: "node-b"}
    now[0] = 2.0
    with caplog.at_level("WARNING", logger="raysgd.torch.fault_tolerance.watches"):
        assert watch.tick() is None
        now[0] = 3.0
        assert watch.tick() is None
    assert not watch.requested  # too few would fit elsewhere: stay
    assert sum("staying until they go" in r.getMessage() for r in caplog.records) == 1  # logged once, not per tick
    size[0] = 2
    now[0] = 3.5
    assert watch.tick() is None  # within check_s of the last check
    now[0] = 4.0
    assert watch.tick() == Stop(2, (4, 2), "to leave the draining node(s)") and watch.requested and watch.size == 2
    now[0] = 9.0
    assert watch.tick() is None  # one decision per attempt


def test_a_failing_drain_check_only_delays_the_move():
    from raysgd.torch.fault_tolerance.watches import DrainWatch

    def broken():
        raise ConnectionError("the GCS is restarting")

    watch = DrainWatch(find=broken, size_for=len, attempt=lambda: (1, 0), check_s=0)
    assert watch.tick() is None and not watch.requested


def test_a_group_moves_off_draining_nodes_only_when_enough_workers_fit_elsewhere():
    assert recovery.move_size(2, leaving=1, fit=lambda limit: min(limit, 1), low=1, high=2) == 2
    assert recovery.move_size(3, leaving=1, fit=lambda limit: 0, low=1, high=3) == 2  # the others go on alone
    assert recovery.move_size(2, leaving=2, fit=lambda limit: min(limit, 1), low=2, high=2) is None  # stay


def test_which_ranks_may_join_a_re_formed_group():
    from raysgd.torch.fault_tolerance import reform
    from raysgd.torch.fault_tolerance import stops
    from raysgd.torch.errors import CollectiveError

    assert reform.can_stay(None)  # its call finished
    assert reform.can_stay(CollectiveError(0, "RuntimeError: Connection closed by peer"))  # its peer vanished
    assert reform.can_stay(CollectiveError(0, f"a peer was {stops.MARK}; committed at step 3 of the call"))
    assert not reform.can_stay(CollectiveError(1, f"{stops.MARK}; committed at step 3 of the call"))  # leaving
    assert not reform.can_stay(RuntimeError("worker process died"))


def test_a_re_formed_group_is_never_smaller_than_a_restart_or_the_minimum():
    from raysgd.torch.fault_tolerance.reform import plan

    kept = {0: "r0", 2: "r2"}
    # bundle 1's node is alive: a replacement there, ranks in bundle order
    assert plan({0: "a", 1: "b", 2: "c"}, {"a", "b", "c"}, kept, min_size=2, fit_elsewhere=0) == [
        (0, "r0"), (1, None), (2, "r2")]
    # bundle 1's node is gone: the two survivors go on, unless a fresh group could hold 3 or 2 is below the minimum
    assert plan({0: "a", 2: "c"}, {"a", "c"}, kept, min_size=2, fit_elsewhere=0, size=3) == [(0, "r0"), (2, "r2")]
    assert plan({0: "a", 2: "c"}, {"a", "c"}, kept, min_size=2, fit_elsewhere=1, size=3) is None
    assert plan({0: "a", 2: "c"}, {"a", "c"}, kept, min_size=3, fit_elsewhere=0, size=3) is None
    assert plan({0: "a"}, {"a"}, {}, min_size=1, fit_elsewhere=0) is None  # nobody survived


def test_an_nccl_misuse_is_a_user_error_and_a_lost_nccl_peer_a_collective_failure():
    """A user error is never retried: an NCCL "invalid usage" (a bug that a restart repeats) keeps its type, even as
    torch's DistBackendError; an NCCL error from a lost peer or a timeout is a collective failure (retried)."""
    import torch.distributed as dist

    from raysgd.torch.errors import is_collective_failure

    misuse = "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details)"
    assert not is_collective_failure(RuntimeError(misuse))
    assert not is_collective_failure(dist.DistBackendError(misuse))
    assert not is_collective_failure(RuntimeError("my own check failed: NCCL buffers must be contiguous"))
    assert is_collective_failure(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert is_collective_failure(RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)"))
    assert is_collective_failure(dist.DistBackendError("NCCL communicator was aborted on rank 1"))
    assert is_collective_failure(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"))


def test_fit_counts_what_the_placement_strategy_allows():
    from raysgd.torch.fault_tolerance.recovery import fit_for_strategy

    free = {"a": {"CPU": 3.0}, "b": {"CPU": 1.0}, "c": {"CPU": 0.0}}
    assert fit_for_strategy(free, set(), "STRICT_SPREAD", 1, 0, 8) == 2  # one per node that has room
    assert fit_for_strategy(free, {"a"}, "STRICT_SPREAD", 1, 0, 8) == 1  # node a holds a worker already
    assert fit_for_strategy(free, {"a", "b"}, "STRICT_SPREAD", 1, 0, 8) == 0
    assert fit_for_strategy(free, {"b"}, "STRICT_PACK", 1, 0, 8) == 1  # only on the group's own node
    assert fit_for_strategy(free, set(), "STRICT_PACK", 1, 0, 8) == 3  # a new group: the roomiest node
    assert fit_for_strategy(free, {"a"}, "PACK", 1, 0, 8) == fit_for_strategy(free, {"a"}, "SPREAD", 1, 0, 8) == 4


def test_warm_spares_take_vacant_ranks_a_lost_bundles_first_in_the_old_rank_order():
    from raysgd.torch.fault_tolerance.reform import SPARE, plan

    placed, alive = {0: "a", 1: "b", 2: "c", 3: "a"}, {"a", "b", "c"}
    # bundle 3 is a spare's (not in ``order``); the ranks were in bundles 2, 0, 1 (a spare took rank 0 before)
    assert plan(placed, alive, {2: "r0", 1: "r2"}, min_size=1, fit_elsewhere=0, order=[2, 0, 1], spares=1) == [
        (2, "r0"), (0, SPARE), (1, "r2")]  # the dead rank 1's bundle: the spare takes rank 1
    assert plan(placed, alive, {2: "r0", 1: "r2"}, min_size=1, fit_elsewhere=0, order=[2, 0, 1]) == [
        (2, "r0"), (0, None), (1, "r2")]  # no spare: a new process there, as before
    # node b is lost with rank 1 and rank 2 died on node a: the one spare takes the lost node's rank, so the group
    # keeps its size, and the live bundle takes a new process
    assert plan({0: "a", 2: "a"}, {"a"}, {0: "r0"}, min_size=1, fit_elsewhere=1, size=3, spares=1) == [
        (0, "r0"), (1, SPARE), (2, None)]
    assert plan({0: "a"}, {"a"}, {}, min_size=1, fit_elsewhere=0, spares=1) == [(0, SPARE)]  # no survivor needed
    assert plan({0: "a"}, {"a"}, {}, min_size=1, fit_elsewhere=0, spares=0) is None


def test_a_planned_resize_keeps_the_ranks_on_usable_nodes_and_fills_the_rest():
    from raysgd.torch.fault_tolerance.reform import SPARE, resize_plan

    ranks = [(0, "r0"), (1, "r1"), (2, "r2")]
    # rank 1's node drains: a spare takes its place (the vacated bundle 1 goes to the pool), the others stay
    assert resize_plan(ranks, usable={0, 2, 5}, target=3, spares=1, free=[5]) == (
        [(0, "r0"), (1, SPARE), (2, "r2")], ["r1"], 0)
    # no spare: a free bundle of the group's, then a new placement group's (None)
    assert resize_plan(ranks, usable={0, 2, 5}, target=3, spares=0, free=[5]) == (
        [(0, "r0"), (5, None), (2, "r2")], ["r1"], 0)
    assert resize_plan(ranks, usable={0, 2}, target=3, spares=0, free=[]) == (
        [(0, "r0"), (None, None), (2, "r2")], ["r1"], 1)
    # a grow from 3 to 5: every rank stays, the added ranks follow; spares are only for moved ranks
    assert resize_plan(ranks, usable={0, 1, 2, 7}, target=5, spares=2, free=[7]) == (
        [(0, "r0"), (1, "r1"), (2, "r2"), (7, None), (None, None)], [], 1)
    # fewer fit elsewhere: the moved rank's place is dropped; rank 0 in the driver (bundle None) always stays
    assert resize_plan([(None, "local"), (1, "r1")], usable=set(), target=1, spares=0, free=[]) == (
        [(None, "local")], ["r1"], 0)
    assert resize_plan(ranks, usable={0, 1, 2}, target=2, spares=0, free=[]) is None  # a shrink: restart all
    assert resize_plan(ranks, usable=set(), target=3, spares=3, free=[]) is None  # nothing stays: restart all
