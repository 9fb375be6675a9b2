"""`kvstrata status`: connect to a running cluster's Ray, find its named actors (`kvstrata-worker-<i>`,
their tensor-parallel ranks `kvstrata-worker-<i>-rank-<r>`, `kvstrata-router-<j>`) and print each
worker's KV tiers, prefix hit rate and queue, and each router's index size and health.

Exit status: 0 when every actor answered and every router's index is healthy, 1 when one did not,
2 (with one line on stderr) when there is no Ray cluster at the address or no kvstrata actor in it.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from kvstrata.cluster.argtypes import non_negative_float
from kvstrata.cluster.cluster_actors import NAMESPACE
from kvstrata.cluster.ray_metrics import TierUsage, tier_usage

_WORKER = re.compile(r"^kvstrata-worker-(\d+)$")
_ROUTER = re.compile(r"^kvstrata-router-(\d+)$")
_RANK = re.compile(r"^(kvstrata-worker-.+)-rank-(\d+)$")


@dataclass
class WorkerStatus:
    name: str
    namespace: str
    reachable: bool = False
    error: str = ""
    tiers: list[TierUsage] = field(default_factory=list)
    prefix_hit_rate: float = 0.0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    num_running: int = 0
    num_waiting: int = 0
    ranks: list[str] = field(default_factory=list)  # tensor-parallel rank actors beyond rank 0


@dataclass
class RouterStatus:
    name: str
    namespace: str
    reachable: bool = False
    error: str = ""
    index_healthy: bool = False
    index_blocks: dict[str, int] = field(default_factory=dict)
    policy: str = ""
    healthy_workers: list[str] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.reachable and self.index_healthy


@dataclass
class ClusterStatus:
    address: str
    workers: list[WorkerStatus]
    routers: list[RouterStatus]
    stray_ranks: list[str] = field(default_factory=list)  # ranks of no worker actor (a single-process server's)

    @property
    def ok(self) -> bool:
        return all(w.reachable for w in self.workers) and all(r.healthy for r in self.routers)

    def to_json(self) -> dict[str, Any]:
        workers = []
        for w in self.workers:
            d = asdict(w)
            d["tiers"] = {t.tier: {"used_blocks": t.used_blocks, "total_blocks": t.total_blocks, "usage": t.usage}
                          for t in w.tiers}
            workers.append(d)
        routers = [{**asdict(r), "healthy": r.healthy, "index_size_blocks": sum(r.index_blocks.values())}
                   for r in self.routers]
        return {"address": self.address, "ok": self.ok, "workers": workers, "routers": routers,
                "stray_ranks": self.stray_ranks}

    def render(self) -> str:
        lines = [f"kvstrata cluster at {self.address}: {len(self.workers)} worker(s), {len(self.routers)} router(s)"]
        lines.append("workers")
        for w in self.workers:
            if not w.reachable:
                lines.append(f"  {w.name}  unreachable: {w.error}")
                continue
            ranks = f"  tp ranks {1 + len(w.ranks)}" if w.ranks else ""
            lines.append(f"  {w.name}  running {w.num_running}  waiting {w.num_waiting}  prefix hits "
                         f"{w.prefix_hit_rate:.1%} ({w.prefix_cache_hits}/{w.prefix_cache_queries} tokens){ranks}")
            for t in w.tiers:
                lines.append(f"      {t.tier:<4} {t.used_blocks:>7} / {t.total_blocks:<7} blocks {t.usage:>7.1%}")
        lines.append("routers")
        for r in self.routers:
            if not r.reachable:
                lines.append(f"  {r.name}  unreachable: {r.error}")
                continue
            per_worker = ", ".join(f"{w} {n}" for w, n in sorted(r.index_blocks.items()))
            lines.append(f"  {r.name}  {'healthy' if r.healthy else 'index unhealthy'}  index "
                         f"{sum(r.index_blocks.values())} blocks ({per_worker})  policy {r.policy}  "
                         f"decisions {sum(r.decisions.values())}  healthy workers {len(r.healthy_workers)}")
        if self.stray_ranks:
            lines.append("tensor-parallel ranks of no worker actor: " + ", ".join(self.stray_ranks))
        return "\n".join(lines)


def collect_status(address: str, named: list[dict[str, str]], get_actor: Callable[[str, str], Any],
                   wait: Callable[[Any], Any]) -> ClusterStatus:
    """The status of the kvstrata actors among `named` ({"name", "namespace"} entries, as
    `ray.util.list_named_actors(all_namespaces=True)` gives them). `get_actor(name, namespace)` returns a
    handle and `wait(ref)` a call's result (raising on failure or timeout). ValueError if none is found."""
    workers: dict[tuple[str, str], WorkerStatus] = {}
    routers: list[RouterStatus] = []
    ranks: list[tuple[str, str, str]] = []
    for entry in sorted(named, key=lambda e: (e["namespace"], _natural(e["name"]))):
        name, ns = entry["name"], entry["namespace"]
        if _WORKER.match(name):
            workers[(ns, name)] = WorkerStatus(name, ns)
        elif _ROUTER.match(name):
            routers.append(RouterStatus(name, ns))
        elif (m := _RANK.match(name)) is not None:
            ranks.append((ns, m.group(1), name))
    if not workers and not routers:
        raise ValueError(f"no kvstrata workers or routers in the Ray cluster at {address}")
    stray = []
    for ns, worker, name in ranks:
        if (ns, worker) in workers:
            workers[(ns, worker)].ranks.append(name)
        else:
            stray.append(name)
    calls: dict[tuple[str, str], Any] = {}  # every call goes out before any answer is awaited
    for a in [*workers.values(), *routers]:
        try:
            handle = get_actor(a.name, a.namespace)
            worker = isinstance(a, WorkerStatus)
            calls[(a.namespace, a.name)] = (handle.cache_stats.remote(), handle.load.remote()) if worker \
                else handle.stats.remote()
        except Exception as e:  # noqa: BLE001 - gone since it was listed
            a.error = _first_line(e)
    for w in workers.values():
        try:
            stats_ref, load_ref = calls[(w.namespace, w.name)]
            stats = wait(stats_ref)
            w.num_running, w.num_waiting = wait(load_ref)
        except Exception as e:  # noqa: BLE001 - dead, restarting or stuck: reported as such
            w.error = w.error or _first_line(e)
            continue
        w.reachable = True
        w.tiers = tier_usage(stats)
        w.prefix_hit_rate = stats["prefix_hit_rate"]
        w.prefix_cache_hits, w.prefix_cache_queries = stats["prefix_cache_hits"], stats["prefix_cache_queries"]
    for r in routers:
        try:
            s = wait(calls[(r.namespace, r.name)])
        except Exception as e:  # noqa: BLE001
            r.error = r.error or _first_line(e)
            continue
        r.reachable, r.index_healthy, r.policy = True, s["index_healthy"], s["policy"]
        r.index_blocks, r.healthy_workers, r.decisions = s["index_blocks"], s["healthy_workers"], s["decisions"]
    return ClusterStatus(address, list(workers.values()), routers, stray)


def _natural(name: str) -> tuple:
    """kvstrata-worker-2 before kvstrata-worker-10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _first_line(e: BaseException) -> str:
    from kvstrata.cluster.engine_service import first_line

    return f"{type(e).__name__}: {first_line(e)}"


def _probe(address: str, timeout_s: float = 3.0) -> None:
    """ValueError at once when nothing listens at host:port (ray.init would retry for minutes)."""
    host, sep, port = address.split("://")[-1].rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--address: expected host:port (or auto), got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ValueError(f"no Ray cluster at {address}: {e.strerror or e}") from None


def add_status_parser(sub) -> None:
    p = sub.add_parser("status", help="print a running cluster's workers, KV tiers, hit rates and routers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="auto", help="the Ray cluster, host:port of its GCS (default: auto, "
                   "$RAY_ADDRESS or the Ray running on this machine)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=non_negative_float, default=10.0,
                   help="seconds to wait for each actor's answer (default 10)")
    p.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    """Joins the Ray cluster for the call; a caller already connected to Ray (a test) keeps its connection."""
    import ray

    connected = False
    if not ray.is_initialized():
        if args.address != "auto":
            _probe(args.address)
        try:
            ray.init(address=args.address, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            raise ValueError(f"no Ray cluster at {args.address}: {_first_line(e)}") from None
        connected = True
    try:
        address = ray.get_runtime_context().gcs_address
        status = collect_status(address, ray.util.list_named_actors(all_namespaces=True),
                                lambda name, ns: ray.get_actor(name, namespace=ns),
                                lambda ref: ray.get(ref, timeout=args.timeout))
    finally:
        if connected:
            ray.shutdown()
    print(json.dumps(status.to_json(), indent=2) if args.json else status.render(), flush=True)
    return 0 if status.ok else 1
