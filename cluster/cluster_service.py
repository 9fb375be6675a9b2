"""The front ends' service over a cluster: the interface of `EngineService` (generate, cache stats,
drain), with each request routed by a router actor and streamed from the worker it chose.

    generate(): router.route (round-robin over routers) -> worker.generate, a Ray streaming call
                of protobuf bytes -> StreamItems with `worker` set -> router.done

`start_cluster` starts (or joins) Ray, the routers, then the workers, and waits until every worker
has its model loaded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from kvstrata.cluster.cluster_actors import NAMESPACE, ROUTER_NAME, WORKER_NAME, RouterActor, WorkerActor
from kvstrata.cluster.engine_service import (
    Drainable,
    Draining,
    EngineFailed,
    ModelInfo,
    Overloaded,
    RequestTimer,
    StreamItem,
    first_line,
)
from kvstrata.cluster.wire import decode_item, encode_request
from kvstrata.worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterSpec:
    num_workers: int
    llm_kwargs: dict[str, Any]
    num_routers: int = 1
    routing_policy: str = "prefix_aware"
    redis: dict[str, Any] | None = None  # RedisSettings fields; None: the embedded (pushed) index
    address: str | None = None  # a Ray cluster to join; None: start a local one
    max_waiting: int = 256
    max_tokens_limit: int = 4096
    worker_cpus: float = 1.0
    worker_gpus: float = 0.0


class ClusterService(Drainable):
    def __init__(self, routers: list, workers: dict[str, Any], model_info: ModelInfo, max_tokens_limit: int,
                 metrics=None, placement_groups: list | None = None):
        self.routers = routers
        self.placement_groups = placement_groups or []  # the worker groups' (tp > 1), removed at shutdown
        self.workers = workers
        self.model_info = model_info
        self.max_tokens_limit = max_tokens_limit
        self.metrics = metrics
        self._in_flight = 0
        self._ids = itertools.count()
        self._next_router = itertools.cycle(range(len(routers)))
        self.requests_by_worker: dict[str, int] = {w: 0 for w in workers}

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str = "", prompt: str | None = None,
                       cache_pins: list[tuple[int, float]] | None = None, tenant: str = "") -> AsyncIterator[StreamItem]:
        import ray

        timer = RequestTimer(self.metrics, len(prompt_token_ids))
        if self.draining:
            timer.reject("draining")
            raise Draining("the server is draining and admits no new requests")
        if params.max_tokens > self.max_tokens_limit:
            timer.reject("invalid")
            raise ValueError(f"max_tokens must be at most {self.max_tokens_limit}, got {params.max_tokens}")
        rid = request_id or f"req-{next(self._ids)}"
        router, (worker_id, reason) = await self._route(rid, prompt_token_ids, cache_salt, tenant)
        log.debug("%s -> %s (%s)", rid, worker_id, reason)
        self.requests_by_worker[worker_id] += 1
        request = encode_request(rid, prompt_token_ids, params, prompt, cache_salt, cache_pins, tenant)
        stream = self.workers[worker_id].generate.options(num_returns="streaming").remote(request)
        self._in_flight += 1
        first = True
        state = "admitted"  # or "refused", or "done"
        try:
            async for ref in stream:
                try:
                    item = decode_item(await ref)  # a refusal on the worker raises here, as it would locally
                except ray.exceptions.RayActorError as e:  # the worker died (Ray restarts it)
                    raise EngineFailed(f"{worker_id} failed: {first_line(e)}") from None
                except (ValueError, Overloaded, Draining) as e:
                    state = "refused"
                    timer.reject({ValueError: "invalid", Overloaded: "overloaded"}.get(type(e), "draining"))
                    raise
                if first:
                    router.first_output.remote(worker_id, rid)
                    first = False
                timer.step(item)
                if item.usage is not None:
                    state = "done"
                    timer.finish(next((d.finish_reason for d in item.deltas if d.finish_reason), "stop"))
                yield item
        finally:
            self._in_flight -= 1
            router.done.remote(worker_id, rid)
            if state == "admitted":
                timer.finish("abort")
                ray.cancel(stream)  # the worker's generator is cancelled, which aborts the request there

    async def _route(self, rid: str, prompt_token_ids: list[int], cache_salt: str, tenant: str):
        """(router, (worker id, reason)) from the next router that answers; EngineFailed if none does."""
        import ray

        error: BaseException | None = None
        for _ in range(len(self.routers)):
            router = self.routers[next(self._next_router)]
            try:
                return router, await router.route.remote(rid, prompt_token_ids, cache_salt, tenant)
            except ray.exceptions.RayActorError as e:  # restarting: try another
                error = e
            except RuntimeError as e:  # no healthy worker right now
                raise EngineFailed(f"no worker can take the request: {first_line(e)}") from None
        raise EngineFailed(f"no router answered: {first_line(error)}")

    async def cache_stats(self) -> dict[str, Any]:
        """Totals over the workers, and each worker's own stats under `workers`."""
        names = sorted(self.workers)
        per = await asyncio.gather(*(self.workers[w].cache_stats.remote() for w in names))
        total: dict[str, Any] = {}
        for s in per:
            for k, v in s.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        queried = total.get("prefix_cache_queries", 0)
        total["prefix_hit_rate"] = total.get("prefix_cache_hits", 0) / queried if queried else 0.0
        used, blocks = total.get("num_used_blocks", 0), total.get("num_total_blocks", 0)
        total["kv_usage"] = used / blocks if blocks else 0.0
        total["kv_utilization"] = sum(s.get("kv_utilization", 1.0) for s in per) / max(1, len(per))
        total["block_size"] = self.model_info.block_size
        total["workers"] = dict(zip(names, per))
        total["requests_by_worker"] = dict(self.requests_by_worker)
        return total

    async def flush_cache(self) -> int:
        return sum(await asyncio.gather(*(w.flush_cache.remote() for w in self.workers.values())))

    def shutdown(self) -> None:
        """Close every worker and router at once (each finishes its engine and publisher), then kill them."""
        import ray

        handles = [*self.workers.values(), *self.routers]
        closing = [h.close.remote() for h in handles]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=30)
        except Exception:  # noqa: BLE001 - tearing down anyway
            pass
        for handle in handles:
            ray.kill(handle)
        for group in self.placement_groups:
            ray.util.remove_placement_group(group)

    async def router_stats(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(r.stats.remote() for r in self.routers)))


def start_cluster(spec: ClusterSpec, metrics=None) -> ClusterService:
    """Routers first (workers push their KV events to them), then workers; returns once all are up."""
    import ray

    from kvstrata.worker.loader import load_config

    if not ray.is_initialized():
        ray.init(address=spec.address, include_dashboard=False, namespace=NAMESPACE) if spec.address \
            else ray.init(include_dashboard=False, namespace=NAMESPACE)
    model = spec.llm_kwargs.get("model", "smollm2-135m")
    block_size = spec.llm_kwargs.get("block_size", 16)
    config = load_config(model)
    worker_ids = [WORKER_NAME.format(i) for i in range(spec.num_workers)]
    router_cls = ray.remote(RouterActor)
    # Ray restarts a router or a worker that dies: a new worker incarnation replaces the old one's index
    # entries, and a new router rebuilds its index (from Redis, or by asking every worker)
    routers = [router_cls.options(name=ROUTER_NAME.format(j), num_cpus=0, max_concurrency=64, max_restarts=-1)
               .remote(j, worker_ids, spec.routing_policy, spec.redis, config.model_id, block_size,
                       kv_dtype=spec.llm_kwargs.get("kv_dtype", "auto"))
               for j in range(spec.num_routers)]
    worker_cls = ray.remote(WorkerActor)
    workers, groups = {}, []
    for i, w in enumerate(worker_ids):
        placement, group = worker_placement(spec)
        groups += [group] if group is not None else []
        workers[w] = (worker_cls.options(name=w, **placement, max_concurrency=1000, max_restarts=-1)
                      .remote(i, spec.llm_kwargs, spec.redis, [ROUTER_NAME.format(j) for j in range(spec.num_routers)],
                              spec.max_waiting, spec.max_tokens_limit))
    infos = ray.get([workers[w].model_info.remote() for w in worker_ids])
    _wait_until_routed(routers, len(worker_ids))
    info = infos[0]
    tokenizer = _tokenizer(model)
    model_info = ModelInfo(info["model_id"], tokenizer, config, info["dtype"], info["max_model_len"], info["block_size"])
    return ClusterService(routers, workers, model_info, spec.max_tokens_limit, metrics, placement_groups=groups)


def _wait_until_routed(routers: list, num_workers: int, timeout_s: float = 30.0) -> None:
    """Until every router has seen every worker answer (its load poll marks a worker that was still
    starting as unhealthy), so that the first requests are not refused."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get([r.stats.remote() for r in routers])
        if all(len(s["healthy_workers"]) == num_workers for s in stats):
            return
        if time.monotonic() > deadline:
            log.warning("routers still see only %s of %d workers after %.0f s",
                        [len(s["healthy_workers"]) for s in stats], num_workers, timeout_s)
            return
        time.sleep(0.05)


def worker_placement(spec: ClusterSpec, timeout_s: float = 120.0) -> tuple[dict[str, Any], Any]:
    """Ray options that place one worker actor, and the placement group made for it (or None). With
    tp > 1 the actor is rank 0 of its group: it runs in bundle 0 of a STRICT_PACK placement group of
    tp bundles, and its ranks take the others, so a group uses exactly tp GPUs (or CPUs) on one node
    and a restarted worker finds its place again."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from kvstrata.cluster.tp_group import rank_bundles

    tp = spec.llm_kwargs.get("tensor_parallel_size", 1)
    if tp == 1:
        return {"num_cpus": spec.worker_cpus, "num_gpus": spec.worker_gpus}, None
    gpu = spec.worker_gpus > 0
    pg = placement_group(rank_bundles(tp, gpu), strategy="STRICT_PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"tp {tp}: Ray could not place a worker group ({tp} {'GPUs' if gpu else 'CPUs'} on one "
                           f"node) within {timeout_s:.0f} s") from None
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
    return {"num_cpus": 1, "num_gpus": 1 if gpu else 0, "scheduling_strategy": strategy}, pg


def _tokenizer(model: str):
    from kvstrata.worker.gguf_loader import converted_dir
    from kvstrata.worker.model_source import resolve_model
    from kvstrata.worker.tokenizer import Tokenizer

    src = resolve_model(model)
    return Tokenizer.from_dir(converted_dir(src.path) if src.kind == "gguf" else src.path)
