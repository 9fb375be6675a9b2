"""`kvstrata bench serve` against a scripted OpenAI-compatible server on loopback.

The fake server streams one chunk per token with a known delay before the first and between the
rest, reports usage with cached_tokens = half the prompt, and can demand an API key or answer 429 to
every k-th completion. It runs under uvicorn in a thread, so the benchmark's real HTTP client and
event loop measure real sockets. Timing bounds are generous: the host is a noisy 2-core VM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import socket
import statistics
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvstrata.cluster.bench.serve import (
    RequestRecord,
    ServeConfig,
    ServeReport,
    Slo,
    poisson_arrival_times,
    run_serve_bench,
)
from kvstrata.cluster.bench.serve_cli import format_report, plot_report
from kvstrata.cluster.bench.workloads import WORKLOADS, BenchRequest, Workload
from kvstrata.cluster.cli import main

MODEL = "fake-model"


@dataclasses.dataclass
class Script:
    """What the fake server does, and what it saw. A fresh one per test."""

    first_delay_s: float = 0.0  # before the first chunk
    token_delay_s: float = 0.0  # between chunks
    reject_every: int = 0  # answer 429 to every k-th completion request
    api_key: str | None = None
    bodies: list[dict] = dataclasses.field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


class FakeServer:
    def __init__(self) -> None:
        self.script = Script()
        self.url = ""

    def authorized(self, request: Request) -> bool:
        key = self.script.api_key
        return key is None or request.headers.get("authorization") == f"Bearer {key}"

    async def models(self, request: Request):
        if not self.authorized(request):
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "other"}]})

    async def completions(self, request: Request):
        script = self.script  # a stream outliving its test keeps its own script
        if not self.authorized(request):
            return JSONResponse({"error": {"message": "invalid API key"}}, status_code=401)
        body = await request.json()
        script.bodies.append(body)
        if script.reject_every and len(script.bodies) % script.reject_every == 0:
            return JSONResponse({"error": {"message": "server overloaded", "type": "overloaded"}}, status_code=429)
        script.in_flight += 1
        script.max_in_flight = max(script.max_in_flight, script.in_flight)
        return StreamingResponse(self.events(script, body), media_type="text/event-stream")

    @staticmethod
    async def events(script: Script, body: dict):
        n, prompt = body["max_tokens"], body["prompt"]
        await asyncio.sleep(script.first_delay_s)
        for i in range(n):
            if i:
                await asyncio.sleep(script.token_delay_s)
            done = "length" if i == n - 1 else None
            yield _sse({"object": "text_completion",
                        "choices": [{"index": 0, "text": f" t{i}", "finish_reason": done}]})
        yield _sse({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                             "total_tokens": len(prompt) + n,
                                             "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}})
        script.in_flight -= 1  # before [DONE], so the client cannot have sent its next request yet
        yield "data: [DONE]\n\n"

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/models", self.models),
                                 Route("/v1/completions", self.completions, methods=["POST"])])


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", access_log=False, lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield fake
    uv.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(server):
    server.script = Script()
    return server


def workload(num_requests: int, prompt_len: int = 10, max_tokens: int = 5) -> Workload:
    return Workload("test", [BenchRequest([100 + i] * (prompt_len + i), max_tokens) for i in range(num_requests)])


def bench(fake: FakeServer, wl: Workload, **kwargs) -> ServeReport:
    return asyncio.run(run_serve_bench(ServeConfig(fake.url, MODEL, **kwargs), wl))


# -- arrivals -----------------------------------------------------------------------------------

def test_poisson_arrivals_have_exponential_gaps_of_mean_one_over_rate():
    times = poisson_arrival_times(4000, 8.0, random.Random(0))
    assert len(times) == 4000 and times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 8, rel=0.05)
    assert statistics.stdev(gaps) / mean == pytest.approx(1.0, abs=0.07)  # exponential: sd == mean
    assert sum(g < mean for g in gaps) / len(gaps) == pytest.approx(1 - 1 / 2.71828, abs=0.03)
    assert poisson_arrival_times(50, 8.0, random.Random(0)) == times[:50]  # seeded
    assert poisson_arrival_times(50, 8.0, random.Random(1)) != times[:50]


def test_infinite_rate_sends_everything_at_once_and_bad_rates_are_refused():
    assert poisson_arrival_times(5, float("inf"), random.Random(0)) == [0.0] * 5
    for rate in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="request_rate"):
            poisson_arrival_times(3, rate, random.Random(0))
        with pytest.raises(ValueError, match="request_rate"):
            ServeConfig("http://x", MODEL, request_rate=rate)


def test_requests_are_sent_at_their_arrival_times(fake):
    report = bench(fake, workload(8, max_tokens=2), request_rate=20.0, seed=3)
    expected = poisson_arrival_times(8, 20.0, random.Random(3))
    assert len(fake.script.bodies) == 8 and len(report.completed) == 8
    for rec, t in zip(report.records, expected):
        assert t - 0.005 <= rec.send_s <= t + 0.15
    assert report.duration_s >= expected[-1]


def test_max_concurrency_caps_requests_in_flight(fake):
    fake.script.first_delay_s, fake.script.token_delay_s = 0.05, 0.01
    report = bench(fake, workload(6, max_tokens=3), max_concurrency=2)
    assert len(report.completed) == 6 and fake.script.max_in_flight == 2
    fake.script = Script(first_delay_s=0.05, token_delay_s=0.01)
    bench(fake, workload(6, max_tokens=3))
    assert fake.script.max_in_flight > 2  # without the cap they do overlap


# -- measurements -------------------------------------------------------------------------------

def test_latencies_match_the_injected_delays(fake):
    fake.script.first_delay_s, fake.script.token_delay_s = 0.2, 0.05
    wl = workload(4, max_tokens=5)
    report = bench(fake, wl)
    assert [r.index for r in report.records] == [0, 1, 2, 3]
    for rec, req in zip(report.records, wl.requests):
        assert rec.ok and rec.status == 200
        assert 0.19 <= rec.ttft_s <= 0.5
        assert len(rec.itl_s) == 4
        assert 0.04 <= rec.tpot_s <= 0.15
        assert 0.38 <= rec.e2e_s <= 0.9
        assert rec.num_output_tokens == 5
        assert rec.num_prompt_tokens == len(req.prompt_token_ids)
        assert rec.num_cached_tokens == len(req.prompt_token_ids) // 2
    gaps = [g for r in report.records for g in r.itl_s]
    assert 0.04 <= statistics.median(gaps) <= 0.15
    s = report.summary()
    assert s["num_completed"] == 4 and s["num_failed"] == 0 and s["failures"] == {}
    assert 190 <= s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] <= 500
    assert 40 <= s["itl_ms"]["mean"] <= 150 and 40 <= s["tpot_ms"]["mean"] <= 150
    prompt = sum(len(r.prompt_token_ids) for r in wl.requests)
    assert s["prefix_cache_hit_rate"] == pytest.approx(sum(len(r.prompt_token_ids) // 2 for r in wl.requests) / prompt,
                                                       abs=1e-4)
    assert s["output_tokens_per_s"] == pytest.approx(20 / report.duration_s, rel=0.01)
    assert s["total_tokens_per_s"] == pytest.approx((prompt + 20) / report.duration_s, rel=0.01)
    # the same records judged against SLOs either side of the injected delays
    assert report.num_good == 4
    for slo in (Slo(ttft_ms=100, tpot_ms=1000), Slo(ttft_ms=5000, tpot_ms=20)):
        assert dataclasses.replace(report, config=dataclasses.replace(report.config, slo=slo)).num_good == 0
    bodies = sorted(fake.script.bodies, key=lambda b: len(b["prompt"]))  # they may arrive in any order
    assert bodies == [{"model": MODEL, "prompt": r.prompt_token_ids, "max_tokens": 5, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                      for r in wl.requests]


def test_goodput_counts_only_requests_within_both_slos():
    def done(i, ttft, e2e, out):
        return RequestRecord(i, status=200, ttft_s=ttft, e2e_s=e2e, num_prompt_tokens=10, num_output_tokens=out)

    records = [done(0, 0.1, 1.1, 11),  # TPOT 100 ms: good
               done(1, 0.6, 1.6, 11),  # TTFT over
               done(2, 0.1, 2.1, 11),  # TPOT 200 ms: over
               RequestRecord(3, status=429, error="HTTP 429: server overloaded"),
               done(4, 0.1, 0.1, 1),  # one token: no TPOT, judged on TTFT
               done(5, 0.5, 0.5, 1),  # exactly at the TTFT SLO counts as met
               RequestRecord(6, error="ConnectError: refused")]
    report = ServeReport(ServeConfig("http://x", MODEL, slo=Slo(ttft_ms=500, tpot_ms=150)), "test", 2.0, records)
    assert report.num_good == 3
    s = report.summary()
    assert s["goodput"] == 1.5 and s["request_throughput"] == 2.5
    assert s["num_failed"] == 2 and s["failures"] == {"HTTP 429": 1, "no response": 1}
    # TPOTs 100, 100, 200 ms: one-token requests have none, failed ones count nowhere
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0) and s["tpot_ms"]["mean"] == pytest.approx(133.333)
    assert s["ttft_ms"]["mean"] == pytest.approx(280.0)
    assert "goodput               1.50 req/s (3 requests" in format_report(report)


# -- failures -----------------------------------------------------------------------------------

def test_overload_answers_are_counted_not_raised(fake):
    fake.script.reject_every = 3
    report = bench(fake, workload(9, max_tokens=2))
    failed = [r for r in report.records if not r.ok]
    assert len(failed) == 3 and len(report.completed) == 6
    assert all(r.status == 429 and "server overloaded" in r.error and r.ttft_s is None for r in failed)
    s = report.summary()
    assert s["failures"] == {"HTTP 429": 3} and s["num_completed"] == 6
    assert s["num_output_tokens"] == 12  # failed requests add nothing
    assert "failed                3 (HTTP 429: 3)" in format_report(report)


def test_unreachable_target_and_timeouts_fail_requests(fake):
    report = asyncio.run(run_serve_bench(ServeConfig(f"http://127.0.0.1:{_closed_port()}", MODEL), workload(2)))
    assert [r.status for r in report.records] == [None, None]
    assert all("ConnectError" in r.error for r in report.records)
    assert report.summary()["ttft_ms"] is None and report.failures() == {"no response": 2}
    fake.script.first_delay_s = 3.0
    report = bench(fake, workload(1), timeout_s=0.3)
    assert report.records[0].error == "no complete response within 0.3 s"
    assert report.records[0].status == 200 and report.failures() == {"failed stream": 1}


# -- the command --------------------------------------------------------------------------------

def test_cli_runs_end_to_end_and_writes_json_and_plot(fake, tmp_path, capsys):
    fake.script.token_delay_s = 0.001
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = main(["bench", "serve", "--target", fake.url + "/", "--num-requests", "4", "--request-rate", "50",
               "--seed", "1", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "completed             4" in printed.out and "TTFT" in printed.out
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["model"] == MODEL and s["target"] == fake.url and s["workload"] == "shared-prefix"
    assert s["request_rate"] == 50.0 and s["num_completed"] == 4 and s["num_output_tokens"] == 4 * 64
    assert s["ttft_slo_ms"] == 2000.0 and s["tpot_slo_ms"] == 200.0 and "api_key" not in s
    assert len(data["requests"]) == 4 and all(r["error"] is None and r["ttft_s"] > 0 for r in data["requests"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = WORKLOADS["shared-prefix"](num_requests=4, seed=1).requests
    timed = fake.script.bodies[1:]  # the first is the untimed warm-up
    assert sorted(b["prompt"] for b in timed) == sorted(r.prompt_token_ids for r in expected)
    assert all(b["model"] == MODEL and b["max_tokens"] == 64 for b in timed)


def test_cli_samples_each_request_with_its_own_seed(fake, capsys):
    fake.script.token_delay_s = 0.001
    rc = main(["bench", "serve", "--target", fake.url, "--num-requests", "3", "--temperature", "0.8",
               "--top-p", "0.9"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "sampled at temperature 0.8, top_p 0.9" in printed.out
    timed = sorted(fake.script.bodies[1:], key=lambda b: b["seed"])  # the warm-up stays greedy
    assert fake.script.bodies[0]["temperature"] == 0.0 and "seed" not in fake.script.bodies[0]
    assert [(b["temperature"], b["top_p"], b["seed"]) for b in timed] == [(0.8, 0.9, i) for i in range(3)]
    expected = WORKLOADS["shared-prefix"](num_requests=3, seed=0).requests
    assert [b["prompt"] for b in timed] == [r.prompt_token_ids for r in expected]  # seed i goes with request i


def test_plot_draws_failed_requests_too(tmp_path):
    records = [RequestRecord(0, status=200, ttft_s=0.1, e2e_s=0.5, num_output_tokens=5),
               RequestRecord(1, send_s=0.2, status=503, error="HTTP 503: draining")]
    png = tmp_path / "p.png"
    plot_report(ServeReport(ServeConfig("http://x", MODEL), "test", 1.0, records), png)
    assert png.stat().st_size > 0


def test_cli_api_key_from_flag_or_environment(fake, monkeypatch, capsys):
    fake.script.api_key = "s3cret"
    monkeypatch.delenv("KVSTRATA_API_KEY", raising=False)
    args = ["bench", "serve", "--target", fake.url, "--num-requests", "1"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvstrata bench serve: error:") and "rejected the API key (HTTP 401)" in err
    assert "\n" not in err
    assert main([*args, "--api-key", "s3cret"]) == 0
    monkeypatch.setenv("KVSTRATA_API_KEY", "s3cret")
    assert main(args) == 0
    assert main([*args, "--model", "no-such"]) == 0  # the fake serves any name; the key still goes along


def test_cli_unreachable_target_is_one_line(capsys):
    rc = main(["bench", "serve", "--target", f"http://127.0.0.1:{_closed_port()}"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "Traceback" not in err and "\n" not in err
    assert err.startswith("kvstrata bench serve: error: cannot reach http://127.0.0.1:")


def test_cli_stops_when_every_request_would_fail(fake, capsys):
    fake.script.reject_every = 1  # the warm-up gets 429 and passes: overload is what is measured
    assert main(["bench", "serve", "--target", fake.url, "--num-requests", "2"]) == 1
    captured = capsys.readouterr()
    assert "failed                2 (HTTP 429: 2)" in captured.out
    assert captured.err.strip() == "kvstrata bench serve: error: no request completed (HTTP 429: 2)"


@pytest.mark.parametrize("args, flag", [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--num-requests", "-3"], "--num-requests"),
    (["--ttft-slo-ms", "0"], "--ttft-slo-ms"),
    (["--tpot-slo-ms", "inf"], "--tpot-slo-ms"),
    (["--timeout", "-5"], "--timeout"),
    (["--workload", "nope"], "--workload"),
    (["--seed", "x"], "--seed"),
    (["--target", "localhost:8000"], "--target"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
])
def test_cli_rejects_bad_flags_with_status_2(args, flag, capsys):
    argv = ["bench", "serve", *args] if "--target" in args else ["bench", "serve", "--target", "http://h:1", *args]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_cli_requires_a_target(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve"])
    assert e.value.code == 2 and "--target" in capsys.readouterr().err
