"""The Ray actors of a cluster: workers (`kvstrata-worker-<i>`: an engine, its KV events) and routers
(`kvstrata-router-<j>`: the prefix index mirror and a placement policy). Thin wrappers: the logic is in
`EngineService`, `Router`, the index classes and the policies; their Ray metrics in `ray_metrics`.

    front end --route--> router j --(worker id)--> front end --generate (stream)--> worker i
    worker i --KV events--> Redis --> every router     (or, embedded: worker i --push--> every router)

Requests and stream items cross as protobuf bytes (`kvstrata.cluster.wire`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, AsyncIterator

log = logging.getLogger(__name__)

NAMESPACE = "kvstrata"  # the Ray namespace of a deployment's named actors, where `kvstrata status` looks
WORKER_NAME = "kvstrata-worker-{}"
ROUTER_NAME = "kvstrata-router-{}"


def worker_kwargs(llm_kwargs: dict[str, Any], worker_id: str) -> dict[str, Any]:
    """One worker's engine arguments: an NVMe tier gets a directory of its own under the one given,
    so workers that share a node (or a volume) never share block files."""
    kwargs = dict(llm_kwargs)
    if kwargs.get("nvme_kv_dir") is not None:
        import os

        kwargs["nvme_kv_dir"] = os.path.join(kwargs["nvme_kv_dir"], worker_id)
    return kwargs


class WorkerActor:
    """One worker group: an LLM (rank 0 of its tensor-parallel group), an EngineService over it, and
    the publisher of its KV events."""

    def __init__(self, index: int, llm_kwargs: dict[str, Any], redis: dict[str, Any] | None, router_names: list[str],
                 max_waiting: int = 256, max_tokens_limit: int = 4096):
        import ray

        from kvstrata.cluster.engine_service import EngineService
        from kvstrata.cluster.ray_metrics import WorkerMetrics
        from kvstrata.router.events import EventRecorder
        from kvstrata.worker.llm import LLM

        self.worker_id = WORKER_NAME.format(index)
        self.llm = LLM(**worker_kwargs(llm_kwargs, self.worker_id), worker_id=str(index))
        self.service = EngineService(self.llm.engine, max_waiting=max_waiting, max_tokens_limit=max_tokens_limit,
                                     recover=self.llm.recover, worker_id=self.worker_id)
        recorder = EventRecorder()
        self.llm.engine.kv.attach_events(recorder)
        if redis is not None:
            from kvstrata.router.redis_index import KVEventPublisher, RedisSettings

            self.publisher = KVEventPublisher(RedisSettings(**redis), self.worker_id, recorder).start()
        else:
            from kvstrata.router.push_index import PushPublisher

            routers = [ray.get_actor(name) for name in router_names]

            def send(data: bytes) -> None:
                for r in routers:
                    r.apply_batch.remote(data)

            self.publisher = PushPublisher(self.worker_id, recorder, send).start()
        self.metrics = WorkerMetrics(self.worker_id)
        self._stop = threading.Event()
        self._metrics_thread = threading.Thread(target=self._refresh_metrics, name="kvstrata-worker-metrics",
                                                daemon=True)
        self._metrics_thread.start()

    async def generate(self, request: bytes) -> AsyncIterator[bytes]:
        """Stream one request (WorkerRequest bytes) as WorkerStreamItem bytes; a refusal is an item too."""
        from kvstrata.cluster.wire import decode_request, encode_error, encode_item

        try:
            call = decode_request(request)
            latency = self.metrics.request(len(call.prompt_token_ids))
            async for item in self.service.generate(call.prompt_token_ids, call.params, request_id=call.request_id,
                                                    cache_salt=call.cache_salt, prompt=call.prompt,
                                                    cache_pins=call.cache_pins or None, tenant=call.tenant):
                latency.item(sum(len(d.token_ids) for d in item.deltas))
                yield encode_item(item, self.worker_id)
        except Exception as e:  # noqa: BLE001 - refused or failed: the front end raises it again
            yield encode_error(e, self.worker_id)

    def load(self) -> tuple[int, int]:
        """(running, waiting) requests of the engine now."""
        s = self.llm.engine.scheduler
        return s.num_running, s.num_waiting + self.service._pending

    def model_info(self) -> dict[str, Any]:
        from dataclasses import asdict

        info = self.service.model_info
        return {"model_id": info.model_id, "dtype": info.dtype, "max_model_len": info.max_model_len,
                "block_size": info.block_size, "config": asdict(info.config)}

    async def cache_stats(self) -> dict[str, Any]:
        return await self.service.cache_stats()

    async def flush_cache(self) -> int:
        return await self.service.flush_cache()

    def resend_state(self) -> None:
        resend = getattr(self.publisher, "resend_state", None)
        if resend is not None:
            resend()

    def close(self) -> None:
        self._stop.set()
        self.service.shutdown()
        self.publisher.close()
        self.llm.close()

    def _refresh_metrics(self) -> None:
        """Every second, the engine's stats (read on its thread between steps) into the Ray metrics. The
        thread runs its own event loop for `EngineService.call`; the loop is never closed, as a stats
        command that outlived its wait still answers into it."""
        from kvstrata.cluster.ray_metrics import REFRESH_INTERVAL_S

        loop = asyncio.new_event_loop()
        while not self._stop.wait(REFRESH_INTERVAL_S):
            try:
                stats = loop.run_until_complete(asyncio.wait_for(self.service.cache_stats(), 10))
                running, waiting = self.load()
                self.metrics.refresh(stats, running, waiting)
            except Exception:  # noqa: BLE001 - a busy or failed engine: the next refresh tries again
                log.debug("worker metrics refresh failed", exc_info=True)


class RouterActor:
    """One router: a mirror of the prefix index and a placement policy over the workers."""

    def __init__(self, index: int, worker_ids: list[str], policy: str, redis: dict[str, Any] | None, model_id: str,
                 block_size: int, load_interval_s: float = 0.25, kv_dtype: str = "auto"):
        from kvstrata.cluster.ray_metrics import RouterMetrics
        from kvstrata.router.placement import make_policy
        from kvstrata.router.router import Router

        self.name = ROUTER_NAME.format(index)
        if redis is not None:
            from kvstrata.router.index_follower import IndexFollower
            from kvstrata.router.redis_index import RedisSettings

            self.index = IndexFollower(RedisSettings(**redis)).start()
        else:
            from kvstrata.router.push_index import PushedIndex

            self.index = PushedIndex()
        self.router = Router(worker_ids, self.index, make_policy(policy), model_id, block_size, kv_dtype=kv_dtype)
        self.metrics = RouterMetrics(self.name)
        self._handles: dict[str, Any] = {}
        self._stop = threading.Event()
        self._interval = load_interval_s
        self._thread = threading.Thread(target=self._poll_loads, name="kvstrata-router-loads", daemon=True)
        self._thread.start()

    def route(self, request_id: str, prompt_token_ids: list[int], cache_salt: str, tenant: str) -> tuple[str, str]:
        d = self.router.route(request_id, prompt_token_ids, cache_salt, tenant)
        self.metrics.decision(d.worker_id)
        return d.worker_id, d.reason

    def first_output(self, worker_id: str, request_id: str) -> None:
        self.router.first_output(worker_id, request_id)

    def done(self, worker_id: str, request_id: str) -> None:
        self.router.done(worker_id, request_id)

    def apply_batch(self, data: bytes) -> None:
        self.index.apply_batch(data)

    def stats(self) -> dict[str, Any]:
        return self.router.stats()

    def close(self) -> None:
        self._stop.set()
        close = getattr(self.index, "close", None)
        if close is not None:
            close()

    def _poll_loads(self) -> None:
        import ray

        while not self._stop.wait(self._interval):
            for w in self.router.workers:
                try:
                    handle = self._handles.get(w)
                    if handle is None:
                        handle = self._handles[w] = ray.get_actor(w)
                        if hasattr(self.index, "apply_batch"):
                            handle.resend_state.remote()  # a router that starts late learns what is cached
                    running, waiting = ray.get(handle.load.remote(), timeout=2)
                    self.router.update_load(w, running, waiting, healthy=True)
                except Exception:  # noqa: BLE001 - not up yet, or dead: not a placement target
                    self._handles.pop(w, None)
                    self.router.update_load(w, 0, 0, healthy=False)
            if self.metrics.due():
                try:
                    self.metrics.refresh(self.router.stats())
                except Exception:  # noqa: BLE001 - an index being rebuilt: the next refresh tries again
                    log.debug("router metrics refresh failed", exc_info=True)
            time.sleep(0)
