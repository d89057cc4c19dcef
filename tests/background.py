"""Slow subprocess runs (examples, docs scripts, console scripts, benchmarks' smoke runs) started a few at a time in
the background.

One such run alone leaves about a third of this 2-core machine idle (its Ray cluster's start, its processes'
start-ups: measured 24 busy core-seconds in 19 s of wall time), so runs whose checks do not depend on timing go two
at a time. Runs whose checks do (a fault example whose lines depend on where a kill lands) stay one at a time.
"""
import concurrent.futures
import contextlib

AT_ONCE = 2


@contextlib.contextmanager
def started(jobs, at_once=AT_ONCE):
    """Start ``jobs`` (``{key: zero-argument callable}``, in their order) ``at_once`` at a time in threads; yields
    ``{key: future}``. Leaving cancels the jobs not started yet and waits for those running, so each job must bound
    its own wait (a subprocess's ``timeout``)."""
    pool = concurrent.futures.ThreadPoolExecutor(at_once, thread_name_prefix="background-run")
    try:
        yield {key: pool.submit(job) for key, job in jobs.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
