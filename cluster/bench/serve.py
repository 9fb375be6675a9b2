"""`kvstrata bench serve`: an online serving benchmark against an OpenAI-compatible HTTP endpoint.

Each workload request goes to POST /v1/completions as a token-id prompt (greedy, `ignore_eos`, so it
yields exactly its max_tokens), streamed as server-sent events, at Poisson arrivals of `request_rate`
requests/s, optionally with at most `max_concurrency` in flight. Times count from the moment a
request is sent; a content chunk is one whose `choices[0].text` is not empty:

    send        text 1        text 2        text 3  ...  text n     [DONE]
     |-- TTFT ---|--- ITL -----|--- ITL -----|  ...  ---|-----------|
     |--------------------------------- E2E ----------------------------|
    TPOT = (E2E - TTFT) / (output_tokens - 1), output_tokens from the final usage chunk

Goodput is completed requests per second that met both the TTFT and the TPOT SLO.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstrata.cluster.bench.throughput import GREEDY, Decoding, percentile
from kvstrata.cluster.bench.workloads import BenchRequest, Workload

# CPU defaults: a 135M model on a few cores prefills a few hundred tokens in well under a second and
# decodes a batch step in tens of milliseconds, so these leave room for queueing but not for overload.
DEFAULT_TTFT_SLO_MS = 2000.0
DEFAULT_TPOT_SLO_MS = 200.0
DEFAULT_TIMEOUT_S = 300.0
PERCENTILES = (50, 90, 99)
_WARMUP = BenchRequest([17 + i for i in range(24)], 4)  # untimed; unlike the workloads' random prompts

class ServeBenchError(Exception):
    """The target cannot be benchmarked at all: unreachable, rejects the key, or lists no model."""


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float = DEFAULT_TTFT_SLO_MS
    tpot_ms: float = DEFAULT_TPOT_SLO_MS

    def met_by(self, r: RequestRecord) -> bool:
        """Completed, first text within ttft_ms, and tpot_ms or less per later token.

        A one-token request has no TPOT and is judged on its TTFT alone.
        """
        if not r.ok:
            return False
        tpot = r.tpot_s
        return r.ttft_s * 1e3 <= self.ttft_ms and (tpot is None or tpot * 1e3 <= self.tpot_ms)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    target: str  # base URL, without /v1
    model: str
    request_rate: float = math.inf  # requests/s; inf sends everything at t = 0
    max_concurrency: int | None = None
    seed: int = 0  # seeds the arrival times
    api_key: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S  # the whole request, from send to [DONE]
    slo: Slo = Slo()
    decoding: Decoding = GREEDY  # sampled: request i with seed i

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Seconds throughout; `send_s` counts from the start of the run."""

    index: int
    send_s: float = 0.0
    status: int | None = None  # HTTP status; None when no response came (refused, timed out)
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


@dataclass
class ServeReport:
    config: ServeConfig
    workload: str
    duration_s: float  # first send to the last request's end
    records: list[RequestRecord]

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def num_good(self) -> int:
        return sum(self.config.slo.met_by(r) for r in self.records)

    def failures(self) -> dict[str, int]:
        """Failed requests by cause: "HTTP 429" and the like; "no response" (refused, or timed out before
        the headers); "failed stream" (a 200 whose stream broke, timed out, carried an error or no text)."""
        causes = Counter(_cause(r) for r in self.records if not r.ok)
        return dict(sorted(causes.items()))

    def per_second(self, count: float) -> float:
        return count / self.duration_s if self.duration_s > 0 else 0.0

    def latency_ms(self) -> dict[str, dict[str, float] | None]:
        """mean and percentiles of each latency, in ms; None where no completed request measured it."""
        done = self.completed
        samples = {"ttft": [r.ttft_s for r in done],
                   "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
                   "itl": [gap for r in done for gap in r.itl_s],
                   "e2e": [r.e2e_s for r in done]}
        return {name: _stats_ms(xs) for name, xs in samples.items()}

    def summary(self) -> dict[str, Any]:
        c, done = self.config, self.completed
        prompt = sum(r.num_prompt_tokens for r in done)
        output = sum(r.num_output_tokens for r in done)
        cached = sum(r.num_cached_tokens for r in done)
        return {
            "target": c.target, "model": c.model, "workload": self.workload,
            "request_rate": "inf" if math.isinf(c.request_rate) else c.request_rate,
            "max_concurrency": c.max_concurrency, "seed": c.seed,
            "temperature": c.decoding.temperature, "top_p": c.decoding.top_p,
            "ttft_slo_ms": c.slo.ttft_ms, "tpot_slo_ms": c.slo.tpot_ms,
            "num_requests": len(self.records), "num_completed": len(done),
            "num_failed": len(self.records) - len(done), "failures": self.failures(),
            "duration_s": round(self.duration_s, 3),
            "request_throughput": round(self.per_second(len(done)), 3),
            "goodput": round(self.per_second(self.num_good), 3), "num_good": self.num_good,
            "output_tokens_per_s": round(self.per_second(output), 2),
            "total_tokens_per_s": round(self.per_second(prompt + output), 2),
            "num_prompt_tokens": prompt, "num_output_tokens": output, "num_cached_tokens": cached,
            "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else None,
            **{f"{name}_ms": stats for name, stats in self.latency_ms().items()},
        }

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [r.to_json() for r in self.records]}


def _cause(r: RequestRecord) -> str:
    if r.status is None:
        return "no response"
    return "failed stream" if r.status == 200 else f"HTTP {r.status}"


def _stats_ms(values_s: list[float]) -> dict[str, float] | None:
    if not values_s:
        return None
    ms = [v * 1e3 for v in values_s]
    return {"mean": round(statistics.fmean(ms), 3), **{f"p{q}": round(percentile(ms, q), 3) for q in PERCENTILES}}


# -- sending --------------------------------------------------------------------------------------

def poisson_arrival_times(num_requests: int, request_rate: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps of mean 1 / rate.

    An infinite rate sends every request at 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    times, t = [], 0.0
    for i in range(num_requests):
        if i and math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        times.append(t)
    return times


def _client(target: str, api_key: str | None, timeout_s: float, max_connections: int | None = None):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(base_url=target, headers=headers, timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=None))


def _describe(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _error_body(body: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else its first 200 bytes."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):  # OpenAI's {"error": {"message"}}, or FastAPI's {"detail"}
        err = err.get("message") or err.get("detail")
    if isinstance(err, str) and err:
        return err
    return body[:200].decode("utf-8", "replace").strip()


async def send_request(client: Any, req: BenchRequest, index: int, model: str, start: float,
                       timeout_s: float, clock: Callable[[], float] = time.perf_counter,
                       sampling: dict[str, Any] | None = None) -> RequestRecord:
    """Stream one completion and time it; every failure ends up in the record, none is raised.
    sampling: the request's sampling fields (Decoding.request_fields; default greedy)."""
    import httpx

    payload = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
               **(sampling or {"temperature": 0.0}), "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    rec = RequestRecord(index, num_prompt_tokens=len(req.prompt_token_ids))
    sent = clock()
    rec.send_s = sent - start
    try:
        await asyncio.wait_for(_stream(client, payload, rec, sent, clock), timeout_s)
    except asyncio.TimeoutError:
        rec.error = f"no complete response within {timeout_s:g} s"
    except httpx.HTTPError as e:
        rec.error = _describe(e)
    except ValueError as e:  # a data line that is not JSON
        rec.error = f"bad event stream: {e}"
    return rec


async def _stream(client: Any, payload: dict, rec: RequestRecord, sent: float, clock: Callable[[], float]) -> None:
    usage = None
    last = None  # when the latest content chunk arrived
    async with client.stream("POST", "/v1/completions", json=payload) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {_error_body(await resp.aread())}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk or chunk.get("object") == "error":
                rec.error = f"error in stream: {_error_body(data.encode())}"
                return
            choices = chunk.get("choices")
            if choices and choices[0].get("text"):
                now = clock()
                if last is None:
                    rec.ttft_s = now - sent
                else:
                    rec.itl_s.append(now - last)
                last = now
            if chunk.get("usage"):
                usage = chunk["usage"]
        rec.e2e_s = clock() - sent
    if last is None:
        rec.error = "the stream carried no text"
        return
    if usage is None:  # a server without include_usage: one token per content chunk, no cache figure
        rec.num_output_tokens = len(rec.itl_s) + 1
        return
    rec.num_prompt_tokens = usage.get("prompt_tokens", rec.num_prompt_tokens)
    rec.num_output_tokens = usage.get("completion_tokens", 0)
    rec.num_cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def run_serve_bench(config: ServeConfig, workload: Workload,
                          clock: Callable[[], float] = time.perf_counter) -> ServeReport:
    """Send every request of `workload` at its Poisson arrival time and collect what each measured."""
    arrivals = poisson_arrival_times(workload.num_requests, config.request_rate, random.Random(config.seed))
    gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None

    async with _client(config.target, config.api_key, config.timeout_s, config.max_concurrency) as client:
        start = clock()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + arrivals[i] - clock()))
            send = send_request(client, workload.requests[i], i, config.model, start, config.timeout_s, clock,
                                config.decoding.request_fields(i))
            if gate is None:
                return await send
            async with gate:  # the request is sent, and timed, once it holds a slot
                return await send

        records = await asyncio.gather(*(one(i) for i in range(workload.num_requests)))
        duration = clock() - start
    return ServeReport(config, workload.name, duration, list(records))


async def list_models(target: str, api_key: str | None, timeout_s: float = 10.0) -> list[str]:
    """The model ids GET /v1/models lists; ServeBenchError when the target cannot answer it."""
    import httpx

    try:
        async with _client(target, api_key, timeout_s) as client:
            resp = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ServeBenchError(f"cannot reach {target}: {_describe(e)}") from None
    if resp.status_code in (401, 403):
        raise ServeBenchError(f"{target} rejected the API key (HTTP {resp.status_code}); "
                              f"pass --api-key or set KVSTRATA_API_KEY")
    if resp.status_code != 200:
        raise ServeBenchError(f"GET {target}/v1/models answered HTTP {resp.status_code}: {_error_body(resp.content)}")
    try:
        return [str(m["id"]) for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServeBenchError(f"GET {target}/v1/models did not answer an OpenAI model list") from None


async def warm_up(config: ServeConfig) -> None:
    """One small untimed request. Overload (429, 503) is what the benchmark measures, so it passes;
    any other failure would fail every request alike, so it stops the run here."""
    async with _client(config.target, config.api_key, config.timeout_s) as client:
        rec = await send_request(client, _WARMUP, 0, config.model, 0.0, config.timeout_s)
    if not rec.ok and rec.status not in (429, 503):
        raise ServeBenchError(f"the warm-up request to {config.target} failed: {rec.error}")
