"""One engine behind an asyncio API: the step loop runs on its own thread, tokens stream back as
they are produced, and many concurrent requests batch together.

The engine is not thread-safe, so the engine thread is the only one that touches it. Callers on the
event loop send it commands (add, abort, or any function to run between steps) through a queue, and
the thread hands each step's new tokens back with `loop.call_soon_threadsafe`. Front ends (gRPC,
HTTP) are thin layers over `EngineService.generate`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from kvstrata.cluster.metrics import ServingMetrics
from kvstrata.worker.engine import LLMEngine
from kvstrata.worker.outputs import RequestOutput
from kvstrata.worker.sampling_params import SamplingParams
from kvstrata.worker.tokenizer import Detokenizer

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The waiting queue is full; the caller should answer RESOURCE_EXHAUSTED / HTTP 429."""


class Draining(Exception):
    """The service no longer admits requests (drain or shutdown)."""


def first_line(e: BaseException | None) -> str:
    """An exception's first line of text (Ray's carry a traceback), or its type's name."""
    lines = str(e).strip().splitlines() if e is not None else []
    return lines[0] if lines else type(e).__name__


class EngineFailed(RuntimeError):
    """An engine step failed (e.g. a tensor-parallel rank died) and took the requests in it down;
    the caller should answer UNAVAILABLE / HTTP 503: a retry may succeed once the engine recovers."""


@dataclass(frozen=True)
class ModelInfo:
    """What the front ends need to know of the model behind a service (one engine or a cluster)."""

    model_id: str
    tokenizer: Any
    config: Any  # ModelConfig
    dtype: str  # e.g. "float32"
    max_model_len: int
    block_size: int

    @classmethod
    def of(cls, engine: LLMEngine) -> ModelInfo:
        return cls(engine.model_id, engine.tokenizer, engine.config, str(engine.runner.model.dtype).removeprefix("torch."),
                   engine.scheduler_config.max_model_len, engine.kv.block_size)


@dataclass
class Delta:
    """New output of one sample since the last delta. `finish_reason` is set on its last delta."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cache_write_tokens: int = 0


@dataclass
class StreamItem:
    """What `generate` yields: the deltas of one step, and usage once the request is done."""

    deltas: list[Delta]
    usage: Usage | None = None
    worker: str = ""  # in a cluster, the worker that serves the request


class _Tracked:
    """Engine-thread state of one request: how much of each sample has been streamed."""

    def __init__(self, engine: LLMEngine, request_id: str, params: SamplingParams, out: asyncio.Queue,
                 loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.params = params
        self.out = out
        self.loop = loop
        self.sent_tokens = [0] * params.n
        self.sent_text = [0] * params.n
        self.detok = [Detokenizer(engine.tokenizer) for _ in range(params.n)]
        # text that might still turn out to be the start of a stop string is held back
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1
        self.done = [False] * params.n

    def collect(self, engine: LLMEngine, finished: RequestOutput | None) -> StreamItem | None:
        deltas = []
        if finished is not None:
            for o in finished.outputs:
                i = o.index
                if self.done[i]:
                    continue
                new_ids = o.token_ids[self.sent_tokens[i]:]
                lps = list(o.logprobs[self.sent_tokens[i]:]) if o.logprobs is not None else []
                text = o.text[self.sent_text[i]:]
                deltas.append(Delta(i, new_ids, text, o.finish_reason, lps))
                self.done[i] = True
            usage = Usage(len(finished.prompt_token_ids), sum(len(o.token_ids) for o in finished.outputs),
                          finished.num_cached_tokens, finished.num_cache_write_tokens)
            return StreamItem(deltas, usage)
        group = engine.groups.get(self.request_id)
        if group is None:
            return None
        for s in group.samples:
            i = s.sample_index
            ids = s.output_token_ids
            # a sample that finished before its group is flushed with the group's final output,
            # whose text is already cut at a stop string
            if s.is_finished or len(ids) == self.sent_tokens[i]:
                continue
            self.detok[i].step(ids)
            full = self.detok[i].text
            text = full[self.sent_text[i]:max(len(full) - self.hold, self.sent_text[i])]
            lps = list(s.logprobs[self.sent_tokens[i]:]) if s.logprobs is not None else []
            deltas.append(Delta(i, ids[self.sent_tokens[i]:], text, None, lps))
            self.sent_tokens[i] = len(ids)
            self.sent_text[i] += len(text)
        return StreamItem(deltas) if deltas else None

    def push(self, item: StreamItem | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class RequestTimer:
    """Latency of one request as its consumer sees it, fed to the metrics histograms."""

    def __init__(self, metrics: ServingMetrics | None, num_prompt_tokens: int):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.start = time.perf_counter()
        self.last: float | None = None
        self.num_tokens = 0

    def step(self, item: StreamItem) -> None:
        new = sum(len(d.token_ids) for d in item.deltas)
        if self.metrics is None or not new:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_tokens += new

    def finish(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.e2e.observe(time.perf_counter() - self.start)
            self.metrics.observe_finished(reason, self.num_prompt_tokens, self.num_tokens)

    def reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_rejected(reason)


class Drainable:
    """Draining, for a service that counts its requests in flight (`num_in_flight`)."""

    draining = False

    def drain(self) -> int:
        """Stop admitting requests; those in flight run to completion. Returns how many there are."""
        self.draining = True
        return self.num_in_flight

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight, up to timeout seconds; True if it got there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.num_in_flight:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True


class EngineService(Drainable):
    """Owns an `LLMEngine` and its step thread. `max_waiting` bounds requests not yet admitted."""

    def __init__(self, engine: LLMEngine, max_waiting: int = 256, max_tokens_limit: int = 4096,
                 metrics: ServingMetrics | None = None, recover: Callable[[Exception], None] | None = None,
                 worker_id: str = ""):
        """`recover(e)`, if given, runs on the engine thread after a step failed with e (and its
        requests were failed): e.g. restarting a tensor-parallel group whose rank died. `worker_id`
        names this engine in every StreamItem (the front ends' x-kvstrata-worker)."""
        self.engine = engine
        self.model_info = ModelInfo.of(engine)
        self.metrics = metrics
        self.recover = recover
        self.worker_id = worker_id
        self.max_waiting = max_waiting
        self.max_tokens_limit = max_tokens_limit
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._tracked: dict[str, _Tracked] = {}
        self._pending = 0  # submitted from the event loop but not yet added on the engine thread
        self._num_waiting = 0  # added but not yet scheduled, as of the last step (set by the engine thread)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopping = False
        self.draining = False
        self._thread = threading.Thread(target=self._run, name="kvstrata-engine", daemon=True)
        self._thread.start()

    # -- event-loop side ---------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._tracked) + self._pending

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str = "", prompt: str | None = None,
                       cache_pins: list[tuple[int, float]] | None = None, tenant: str = "") -> AsyncIterator[StreamItem]:
        """Stream one request. Raises ValueError for bad input, Overloaded or Draining before any
        output; cancelling the consumer (client gone, deadline) aborts the request and frees its blocks."""
        timer = RequestTimer(self.metrics, len(prompt_token_ids))
        if self.draining or self._stopping:
            timer.reject("draining")
            raise Draining("the server is draining and admits no new requests")
        if params.max_tokens > self.max_tokens_limit:
            timer.reject("invalid")
            raise ValueError(f"max_tokens must be at most {self.max_tokens_limit}, got {params.max_tokens}")
        with self._lock:
            waiting = self._pending + self._num_waiting
            if waiting >= self.max_waiting:
                timer.reject("overloaded")
                raise Overloaded(f"{waiting} requests are waiting (limit {self.max_waiting}); retry later")
            self._pending += 1
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        tracked = _Tracked(self.engine, rid, params, out, loop)

        def add() -> None:
            try:
                if rid in self._tracked or rid in self.engine.groups:
                    raise ValueError(f"request_id {rid!r} is already in use")
                self.engine.add_request(rid, prompt_token_ids, params, prompt=prompt, cache_salt=cache_salt,
                                        cache_pins=cache_pins, tenant=tenant)
            except Exception as e:  # the request's own error; the engine thread carries on
                with self._lock:
                    self._pending -= 1
                tracked.push(e)
                return
            with self._lock:  # from pending to waiting in one move, so the overload check never misses it
                self._pending -= 1
                self._num_waiting += 1
                self._tracked[rid] = tracked

        self._commands.put(add)
        state = "admitted"  # or "refused" (bad input, seen on the engine thread) or "done"
        try:
            while True:
                item = await out.get()
                if isinstance(item, ValueError):
                    state = "refused"
                    timer.reject("invalid")
                if isinstance(item, BaseException):
                    raise item
                if item is None:  # aborted by shutdown
                    return
                timer.step(item)
                item.worker = self.worker_id
                if item.usage is not None:
                    state = "done"
                    timer.finish(next((d.finish_reason for d in item.deltas if d.finish_reason), "stop"))
                yield item
                if state == "done":
                    return
        finally:
            if state == "admitted":
                self._commands.put(lambda: self._abort(rid))
                timer.finish("abort")

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread, between steps, and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:  # handed to the caller
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return await fut

    async def cache_stats(self) -> dict[str, Any]:
        return await self.call(lambda e: e.cache_stats())

    async def flush_cache(self) -> int:
        return await self.call(lambda e: e.kv.reset_prefix_cache())

    def shutdown(self) -> None:
        """Abort everything in flight and stop the engine thread."""
        self._stopping = True
        self._commands.put(self._abort_all)
        self._thread.join(timeout=30)

    # -- engine thread -----------------------------------------------------------------------
    def _abort(self, rid: str) -> None:
        tracked = self._tracked.pop(rid, None)
        if tracked is not None:
            self.engine.abort(rid)

    def _abort_all(self) -> None:
        for rid in list(self._tracked):
            tracked = self._tracked.pop(rid)
            self.engine.abort(rid)
            tracked.push(None)

    def _run(self) -> None:
        while True:
            # block for a command only when there is nothing to step; then run every queued one
            if not self.engine.has_unfinished_requests():
                self._commands.get()()
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                cmd()
            if self._stopping and not self._tracked:
                return
            with self._lock:
                self._num_waiting = self.engine.scheduler.num_waiting
            if not self.engine.has_unfinished_requests():
                continue
            try:
                finished = {o.request_id: o for o in self.engine.step()}
            except Exception as e:  # a failed step fails the requests in it, not the server
                log.exception("engine step failed")
                for rid in list(self._tracked):
                    self._tracked.pop(rid).push(EngineFailed(f"engine step failed: {e}"))
                    self.engine.abort(rid)
                if self.recover is not None:
                    try:
                        self.recover(e)
                    except Exception:  # noqa: BLE001 - the next step fails again and retries
                        log.exception("recovering from the failed step failed")
                continue
            for rid, tracked in list(self._tracked.items()):
                item = tracked.collect(self.engine, finished.get(rid))
                if item is not None:
                    tracked.push(item)
                if rid in finished or rid not in self.engine.groups:
                    self._tracked.pop(rid, None)


def chat_cache_pins(tokenizer, messages: list[dict[str, str]], ttls: list[float | None],
                    ids: list[int]) -> list[tuple[int, float]]:
    """Cache pins for chat breakpoints: for each message with a TTL, (tokens of the templated
    conversation up to and including it, TTL seconds). `ids` is the whole templated prompt."""
    pins = []
    for i, ttl in enumerate(ttls):
        if ttl is None:
            continue
        prefix = tokenizer.encode(tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False),
                                  add_special_tokens=False)
        n = 0
        while n < min(len(prefix), len(ids)) and prefix[n] == ids[n]:
            n += 1
        if n:
            pins.append((n, float(ttl)))
    return pins


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
