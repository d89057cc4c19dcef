"""Waiting, under deadlines, for Ray's view of the cluster to catch up: released resources and dead nodes.

Layer 5 helper of :mod:`raysgd.torch.execution.worker_group`: imports ray only. Ray reports a change a moment
after it happened: a killed actor's CPUs come back in ``ray.available_resources()`` a little later,
and a node whose raylet is gone stays listed as alive until its health checks fail (seconds). The
worker group waits here so that what it reads next is true:

- :func:`wait_until_released`: after ``shutdown()``, until Ray shows the actors dead, the placement
  group gone and its CPUs/GPUs available again;
- :func:`wait_out_dying_nodes`: before a restart, until every node that Ray lists as alive but whose
  raylet no longer accepts connections is reported dead, so no worker is placed on it.

:func:`draining_nodes` names the nodes Ray is draining (to be taken back soon): they are alive, their free
resources still show, but Ray places nothing new there, so no count of room includes them.
:func:`ceiling` says the most CPUs and GPUs the cluster can ever have (what it has, or what its autoscaler
may add) and :func:`fixed_nodes` what each node holds when none can be added, so a request that can never
fit fails at once instead of waiting. :func:`start_ray` is how both trainers start Ray when the script has not.

Every wait is bounded and logs (never raises) when it runs out.

Example:
    >>> held_by([{"CPU": 2, "node:1.2.3.4": 0.001}, {"CPU": 2, "GPU": 1}])
    {'CPU': 4, 'GPU': 1}
"""
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import ray

logger = logging.getLogger(__name__)

_POLL_S = 0.05


def start_ray(address):
    """Start Ray for a trainer whose script did not: ``ray.init(address)`` without the dashboard.

    ``address``: ``"local"`` (a fresh local cluster), a cluster's address, or None for Ray's own rules of a bare
    ``ray.init()`` (``$RAY_ADDRESS``, else a cluster ``ray start`` left on this machine, else a fresh one). A fresh
    cluster ends with the script, and its dashboard costs most of a local start: 10.9-11.7 s against 4.7-4.8 s
    without it (``ray[default]`` installed, 2-core machine). A script that wants the dashboard calls ``ray.init()``
    first; when ``address`` names an existing cluster the flag changes nothing.

    Example:
        >>> start_ray(os.environ.get("RAY_ADDRESS") or "local")  # doctest: +SKIP
    """
    logger.debug("Ray is not initialized: starting it (address=%r)", address)
    ray.init(address=address, include_dashboard=False)


def held_by(bundles):
    """The CPUs and GPUs that a placement group with ``bundles`` reserves."""
    held: dict[str, float] = {}
    for bundle in bundles:
        for key in ("CPU", "GPU"):
            if bundle.get(key):
                held[key] = held.get(key, 0) + bundle[key]
    return held


def _actors_dead(actor_ids):
    from ray._private.state import state  # noqa: PLC0415 (per-actor state; no public equivalent without a dashboard)

    for actor_id in actor_ids:
        try:
            entry = state.actor_table(actor_id)
        except Exception:  # noqa: BLE001 (unknown to the GCS: nothing held)
            continue
        if entry and entry.get("State") != "DEAD":
            return False
    return True


def wait_until_released(actor_ids, pg_id=None, expected=None, timeout_s=10.0):
    """Wait until the actors are dead and, for a removed placement group, its resources are free again.

    Args:
        actor_ids: hex ids of the killed actors.
        pg_id: hex id of the removed placement group, a list of them (a group that gained one per partial move or
            grow), or None (a Tune trial's group is not ours).
        expected: ``{"CPU": n, ...}``: the least ``ray.available_resources()`` must show again
            (what was available before the removal plus what the group held, capped at the cluster's total).

    Returns True when everything was seen released within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pg_ids = [pg_id] if isinstance(pg_id, str) else list(pg_id or ())
    while True:
        released = _actors_dead(actor_ids)
        if released and (pg_ids or expected):
            available, total = ray.available_resources(), ray.cluster_resources()
            released = not any(pg in key for pg in pg_ids for key in available)
            for key, amount in (expected or {}).items():
                released = released and available.get(key, 0) + 1e-6 >= min(amount, total.get(key, 0))
        if released:
            return True
        if time.monotonic() > deadline:
            logger.warning("Ray did not report the workers' resources released within %.0f s (actors %s, "
                           "placement group %s); available: %s", timeout_s, actor_ids, pg_id,
                           ray.available_resources())
            return False
        time.sleep(_POLL_S)


def _raylet_answers(node, timeout_s):
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
            return True
    except OSError:
        return False


def _dying(nodes, connect_timeout_s):
    alive = [node for node in nodes if node.get("Alive") and node.get("NodeManagerPort")]
    if not alive:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(alive))) as pool:
        answers = list(pool.map(lambda node: _raylet_answers(node, connect_timeout_s), alive))
    return [node for node, answered in zip(alive, answers) if not answered]


def draining_nodes():
    """``{node id: deadline}`` of the nodes Ray is draining, the deadline in ``time.time()`` seconds (None: none
    given); ``{}`` when Ray cannot tell. A node is drained by ``ray drain-node``, by the autoscaler, or by Ray
    itself when ``ray start --block`` gets SIGTERM (a Kubernetes pod being deleted, a spot node preempted)."""
    try:
        from ray._private.state import state  # noqa: PLC0415 (the GCS's drain table; no public equivalent)

        found = state.get_draining_nodes()
    except Exception as err:  # noqa: BLE001 (not connected, or an older GCS: nothing known to be draining)
        logger.debug("could not read the draining nodes: %s", err)
        return {}
    return {node: (deadline_ms / 1000.0 if deadline_ms else None) for node, deadline_ms in found.items()}


def dying_nodes(connect_timeout_s=1.0):
    """Ids of the nodes Ray lists as alive whose raylet does not accept connections (being removed or lost)."""
    return [node["NodeID"] for node in _dying(ray.nodes(), connect_timeout_s)]


def wait_out_dying_nodes(timeout_s=30.0):
    """Wait until Ray reports every dying node (see :func:`dying_nodes`) dead; returns the ids still listed.

    Ray's health check (``health_check_period_ms`` times ``health_check_failure_threshold``) decides
    how long this takes; a restart placed meanwhile could land on the dying node. A node whose raylet
    answers again stops being waited for.
    """
    dying = _dying(ray.nodes(), 1.0)
    if not dying:
        return []
    ids = [node["NodeID"] for node in dying]
    logger.info("Waiting up to %.0f s for Ray to report node(s) %s dead (their raylets are gone)", timeout_s, ids)
    deadline = time.monotonic() + timeout_s
    while ids and time.monotonic() < deadline:
        time.sleep(0.2)
        ids = [node["NodeID"] for node in _dying([n for n in ray.nodes() if n["NodeID"] in ids], 1.0)]
    if ids:
        logger.warning("Node(s) %s still listed as alive after %.0f s although their raylets are gone",
                       ids, timeout_s)
    return ids


#: The file Ray's cluster launcher leaves on an autoscaling cluster's head node (Ray Tune reads it the same way).
AUTOSCALER_BOOTSTRAP_FILE = "~/ray_bootstrap_config.yaml"


def _autoscaler_limits():
    """``(limits, launched)``: the autoscaler's most resources (None without its config), and whether Ray's
    cluster launcher set up this head node (its bootstrap file exists)."""
    try:
        from ray._private.state import state  # noqa: PLC0415 (the autoscaler's config; no public equivalent)

        limits = state.get_max_resources_from_cluster_config()
    except Exception as err:  # noqa: BLE001 (an older GCS or no connection: judge by the bootstrap file)
        logger.debug("could not read the autoscaler's cluster config: %s", err)
        limits = None
    return limits or None, os.path.exists(os.path.expanduser(AUTOSCALER_BOOTSTRAP_FILE))


def ceiling():
    """The most CPUs and GPUs the cluster can ever have, ``{"CPU": n, "GPU": m}``; None when that is unknown.

    A cluster without an autoscaler (a local one, or nodes started by hand) has what it has now. With Ray's
    autoscaler, the ceiling is what its node groups can grow to (the cluster config Ray's autoscaler puts in
    the GCS, as Ray Data reads it; unlimited groups give ``sys.maxsize``). A head node that Ray's cluster
    launcher set up (its bootstrap file exists) without such a config gives None: it may grow, by how much
    is not known.
    """
    now = ray.cluster_resources()
    limits, launched = _autoscaler_limits()
    if limits:
        return {key: max(now.get(key, 0), limits.get(key, 0)) for key in ("CPU", "GPU")}
    if launched:
        return None
    return {key: now.get(key, 0) for key in ("CPU", "GPU")}


def fixed_nodes():
    """Each alive node's ``{"CPU": n, "GPU": m}`` when the cluster cannot grow (no autoscaler), else None."""
    limits, launched = _autoscaler_limits()
    if limits or launched:
        return None
    return [{key: node.get("Resources", {}).get(key, 0) for key in ("CPU", "GPU")}
            for node in ray.nodes() if node.get("Alive")]
