"""The OpenAI-compatible HTTP front end on a real server on loopback, driven by the official `openai`
package: completions, chat, streaming, cached-token usage per tenant, auth, bad input, overload,
disconnects, drain, /metrics, TLS and the `kvstrata client` command."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")

from kvstrata.protos.v1 import generation_pb2 as pb  # noqa: E402
from kvstrata.protos.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from kvstrata.worker.sampling_params import SamplingParams  # noqa: E402
from tests.servers import LiveServer, used_blocks, wait_for_line, wait_for_used_blocks  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY_ALPHA = "alpha-key-0123456789abcdef"
KEY_BETA = "beta-key-0123456789abcdef"
KEY_OPS = "ops-key-0123456789abcdef"
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name one planet of the solar system."}]


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs computed in-process before the server owns the engine."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    text = llm.generate([PROMPT], greedy)[0].outputs[0]
    chat = llm.chat([CHAT], greedy)[0].outputs[0]
    llm.reset_prefix_cache()
    return {"text": text.text, "chat": chat.text}


@pytest.fixture(scope="module")
def live(llm, reference):
    from kvstrata.cluster.tenants import TenantAuth

    auth = TenantAuth({KEY_ALPHA: "alpha", KEY_BETA: "beta", KEY_OPS: "ops"}, admin_tenants={"ops"},
                      salt_secret=b"test-secret")
    server = LiveServer(llm, auth=auth, max_waiting=16, max_tokens_limit=256)
    yield server
    server.stop()
    assert used_blocks(llm) == 0


def _client(live, key: str = KEY_ALPHA, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def test_completion_matches_the_engine(live, reference):
    r = _client(live).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == reference["text"]
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_matches_the_engine_and_streams_the_same_text(live, reference):
    c = _client(live)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference["chat"]
    chunks = list(c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == reference["chat"]
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) > 2  # really incremental
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_streamed_completion_and_n_choices(live, reference):
    c = _client(live)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == reference["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    r = c.completions.create(model=MODEL, prompt=[PROMPT, "Water boils at"], n=2, max_tokens=4, temperature=0.8,
                             seed=3)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16


def test_logprobs_in_both_endpoints(live):
    c = _client(live)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 3 for e in content)
    # greedy: the chosen token is the most likely one
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


def test_cached_tokens_are_per_tenant(live):
    system = "You are a meticulous assistant for a shipping company. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where is parcel 17?"}]

    def cached(key: str) -> int:
        r = _client(live, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(KEY_ALPHA) == 0  # first sight of this prompt
    hit = cached(KEY_ALPHA)
    assert hit >= 64  # the same tenant reuses its own prefix blocks
    assert cached(KEY_BETA) == 0  # another tenant sees none of them
    assert cached(KEY_BETA) == hit
    # gRPC shares the tenant's salt
    md = [("authorization", f"Bearer {KEY_ALPHA}")]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages])
    out = list(live.gen.Generate(pb.GenerateRequest(chat=chat, sampling=pb.SamplingOptions(max_tokens=2)),
                                 metadata=md))
    assert out[-1].usage.cached_tokens == hit
    assert wait_for_used_blocks(live.llm, 0) == 0


def test_keys_are_required_on_both_apis(live):
    for key in ("wrong-key-0123456789abcdef", ""):
        with pytest.raises(openai.AuthenticationError):
            _client(live, key or "x").models.list()
    r = httpx.post(live.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    # auth comes before body validation: an unauthenticated caller learns nothing about the API
    assert httpx.post(live.base_url + "/v1/completions", json={"bogus": 1}).status_code == 401
    with pytest.raises(grpc.RpcError) as e:
        list(live.gen.Generate(pb.GenerateRequest(text="x")))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        live.admin.FlushCache(pb.FlushCacheRequest(), metadata=[("authorization", f"Bearer {KEY_ALPHA}")])
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    stats = live.admin.GetCacheStats(pb.GetCacheStatsRequest(), metadata=[("authorization", f"Bearer {KEY_OPS}")])
    assert stats.num_total_blocks == live.llm.engine.kv.pool.num_blocks
    models = _client(live).models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 1000}, "n"),
    ({"model": MODEL, "prompt": "x", "frobnicate": True}, "frobnicate"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": [5, 10**9]}, "prompt"),
    ({"model": MODEL, "prompt": "word " * 9000}, "prompt"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": "x", "kv_eviction": "lru(8)"}, "kv_eviction"),
    ({"model": MODEL, "prompt": "x", "kv_eviction": "h2o(heavy=8)"}, "kv_eviction"),
    ({"model": MODEL, "prompt": "x", "kv_eviction": ""}, "kv_eviction"),
    ({"model": MODEL, "prompt": "x", "kv_eviction": 32}, "kv_eviction"),
])
def test_bad_completion_requests_are_400_naming_the_field(live, body, param):
    r = httpx.post(live.base_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY_ALPHA}"},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_malformed_json_unknown_model_and_bad_chat(live):
    h = {"authorization": f"Bearer {KEY_ALPHA}", "content-type": "application/json"}
    r = httpx.post(live.base_url + "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers=h)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(live.base_url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    for body, param in (({"model": MODEL, "messages": []}, "messages"),
                        ({"model": MODEL, "messages": [{"role": "user"}], "tools": []}, "tools"),
                        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages")):
        r = httpx.post(live.base_url + "/v1/chat/completions", json=body, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # the server still serves
    assert _client(live).completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1


EVICTION_PROMPT = "A sliding window keeps only the most recent tokens of a long request in the KV cache. " * 5


def _evicted_tokens(live) -> int:
    """The server's count of KV entries dropped by token eviction, as Prometheus shows it."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(live.base_url + "/metrics").text)}
    return int(families["kvstrata:kv_evicted_tokens"].samples[0].value)


def test_kv_eviction_per_request_applies_the_policy_like_the_engine(live):
    c = _client(live)
    policy = {"kv_eviction": "sliding_window(32)", "ignore_eos": True}  # kvstrata's extensions
    before = _evicted_tokens(live)
    r = c.completions.create(model=MODEL, prompt=EVICTION_PROMPT, max_tokens=40, temperature=0, extra_body=policy)
    evicted = _evicted_tokens(live) - before
    assert r.usage.completion_tokens == 40 and 90 <= r.usage.prompt_tokens <= 120
    assert r.usage.total_tokens == r.usage.prompt_tokens + 40
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the request kept a window of 32 (plus part of a block) out of prompt + 39 computed tokens
    assert evicted >= r.usage.prompt_tokens + 39 - 32 - 16
    # the in-process engine under the same SamplingParams: the same tokens, the same evictions
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, kv_eviction="sliding_window(32)")
    before = _evicted_tokens(live)
    ref = live.run(live.service.call(lambda _: live.llm.generate([EVICTION_PROMPT], params)[0].outputs[0]))
    assert r.choices[0].text == ref.text
    assert _evicted_tokens(live) - before == evicted
    # chat, streamed; without the field nothing is evicted
    messages = [{"role": "user", "content": EVICTION_PROMPT}]
    before = _evicted_tokens(live)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={**policy, "kv_eviction": "streaming(sinks=4, window=28)"}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert _evicted_tokens(live) - before >= chunks[-1].usage.prompt_tokens + 39 - 32 - 16
    before = _evicted_tokens(live)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 and _evicted_tokens(live) == before
    assert wait_for_used_blocks(live.llm, 0) == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "kv_eviction": "snapkv(window=16, budget=8)"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "kv_eviction": "streaming(4,, 8)"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "kv_eviction": ["h2o(8, 8)"]}),
])
def test_bad_kv_eviction_is_400_naming_it_and_the_server_keeps_serving(live, path, body):
    r = httpx.post(live.base_url + path, json=body, headers={"authorization": f"Bearer {KEY_ALPHA}"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_eviction" and err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["message"].startswith("kv_eviction")
    with pytest.raises(openai.BadRequestError):  # as the official client sees it
        _client(live).completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"kv_eviction": "lru(8)"})
    assert _client(live).completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def test_oversized_bodies_are_413(live):
    from kvstrata.cluster.http_server import MAX_BODY_BYTES

    h = {"authorization": f"Bearer {KEY_ALPHA}", "content-type": "application/json"}
    big = b'{"model": "m", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = httpx.post(live.base_url + "/v1/completions", content=big, headers=h, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body")

    def chunked():  # no Content-Length: the limit applies as the bytes arrive
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    r = httpx.post(live.base_url + "/v1/completions", content=chunked(), headers=h, timeout=60)
    assert r.status_code == 413
    assert _client(live).completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage.completion_tokens == 1


def test_openapi_schema_lists_the_endpoints(live):
    paths = httpx.get(live.base_url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(paths)


def test_stream_disconnect_aborts_and_frees_blocks(live):
    before = wait_for_used_blocks(live.llm, 0)
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", live.base_url + "/v1/completions", json=body,
                      headers={"authorization": f"Bearer {KEY_ALPHA}"}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert used_blocks(live.llm) > before
    assert wait_for_used_blocks(live.llm, before) == before


def test_non_streaming_client_timeout_aborts_and_frees_blocks(live):
    before = wait_for_used_blocks(live.llm, 0)
    body = {"model": MODEL, "prompt": "Tell a very long story:", "max_tokens": 250, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.base_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY_ALPHA}"},
                   timeout=1.0)
    assert wait_for_used_blocks(live.llm, before) == before


def test_metrics_use_vllm_names_and_count_requests(live):
    from prometheus_client.parser import text_string_to_metric_families

    _client(live).completions.create(model=MODEL, prompt="Metrics", max_tokens=3, temperature=0)
    text = httpx.get(live.base_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert families[name].type == "histogram"
        count = next(s.value for s in families[name].samples if s.name.endswith("_count"))
        assert count >= 1
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert families[name].type == "gauge"
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                 "vllm:request_success"):
        assert families[name].type == "counter"
    queries = families["vllm:prefix_cache_queries"].samples[0].value
    hits = families["vllm:prefix_cache_hits"].samples[0].value
    assert queries > 0 and 0 < hits <= queries  # earlier tests repeated prompts
    success = sum(s.value for s in families["vllm:request_success"].samples if s.labels["finished_reason"] == "length")
    assert success >= 5


def test_client_generate_command_streams(live, reference, capsys):
    from kvstrata.cluster.cli import main

    rc = main(["client", "generate", "--target", f"127.0.0.1:{live.port}", "--api-key", KEY_ALPHA,
               "--max-tokens", "12", "--temperature", "0", "--usage", PROMPT])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.strip() == reference["text"].strip()
    assert "completion 12 tokens" in out.err
    rc = main(["client", "generate", "--target", f"127.0.0.1:{live.port}", "--api-key", "nope-" * 4, "Hi"])
    assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
    # a policy rides in the request: a bad one is the server's INVALID_ARGUMENT, naming the field
    rc = main(["client", "generate", "--target", f"127.0.0.1:{live.port}", "--api-key", KEY_ALPHA,
               "--kv-eviction", "forget_everything()", "Hi"])
    err = capsys.readouterr().err
    assert rc == 1 and "INVALID_ARGUMENT" in err and "kv_eviction" in err
    rc = main(["client", "generate", "--target", f"127.0.0.1:{live.port}", "--api-key", KEY_ALPHA,
               "--max-tokens", "12", "--temperature", "0", "--kv-eviction", "sliding_window(64)", PROMPT])
    assert rc == 0 and capsys.readouterr().out.strip() == reference["text"].strip()  # nothing left the window


def test_overload_is_429_and_admitted_requests_finish():
    from kvstrata import LLM

    small = LLM("smollm2-135m", num_gpu_blocks=64, max_num_seqs=1)
    server = LiveServer(small, max_waiting=2)
    body = {"model": MODEL, "prompt": "Overload test.", "max_tokens": 30, "ignore_eos": True}
    results: list[int] = []

    def send():
        results.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).status_code)

    try:
        threads = [threading.Thread(target=send) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(results) == {200, 429}
        assert results.count(200) >= 2
    finally:
        server.stop()
    assert small.engine.kv.pool.num_used_blocks == 0
    small.check_integrity()


def test_drain_makes_health_503_and_in_flight_streams_finish(llm):
    server = LiveServer(llm)
    try:
        body = {"model": MODEL, "prompt": "Drain over HTTP.", "max_tokens": 25, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", server.base_url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert server.service.drain() == 1
            assert c.get(server.base_url + "/health").status_code == 503
            late = c.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "late"})
            assert late.status_code == 503
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        texts = [json.loads(line[5:])["choices"][0] for line in [first, *rest[:-1]]]
        assert texts[-1]["finish_reason"] == "length"
    finally:
        server.stop()
    assert used_blocks(llm) == 0


def test_cache_control_pins_a_prefix_on_both_apis(llm):
    from kvstrata import LLM
    from kvstrata.worker.model_runner import ModelRunner

    block_bytes = ModelRunner.kv_bytes_per_block(llm.engine.runner.model, 16)
    tiered = LLM("smollm2-135m", num_gpu_blocks=64, cpu_kv_bytes=64 * block_bytes)
    server = LiveServer(tiered)
    try:
        c = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        system = "You answer questions about the tides, briefly and exactly. " * 5
        marked = [{"role": "system", "content": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                  {"role": "user", "content": "When is high tide?"}]
        first = c.chat.completions.create(model=MODEL, messages=marked, max_tokens=2).usage.prompt_tokens_details
        assert first.cached_tokens == 0 and first.cache_write_tokens >= 48
        assert tiered.engine.kv.tiers.pinned_blocks() * 16 == first.cache_write_tokens
        second = c.chat.completions.create(model=MODEL, messages=marked, max_tokens=2).usage.prompt_tokens_details
        assert second.cached_tokens >= first.cache_write_tokens and second.cache_write_tokens == 0
        bad = dict(marked[0], cache_control={"type": "ephemeral", "ttl": "2h"})
        r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": [bad]})
        assert r.status_code == 400 and "cache_control" in r.json()["error"]["message"]
        # gRPC: the same breakpoint, as a field of the chat message
        msg = pb.ChatMessage(role="system", content="Another long system prompt about weather. " * 6,
                             cache_control=pb.CacheControl(ttl_seconds=300))
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[msg, pb.ChatMessage(role="user", content="Hi")]),
                                 sampling=pb.SamplingOptions(max_tokens=2))
        assert list(server.gen.Generate(req))[-1].usage.cache_write_tokens >= 48
        req.chat.messages[0].cache_control.ttl_seconds = 0
        with pytest.raises(grpc.RpcError) as e:
            list(server.gen.Generate(req))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds" in e.value.details()
    finally:
        server.stop()
    tiered.check_integrity()


def test_cache_control_without_tiers_is_400(live):
    marked = [{"role": "user", "content": "Hi", "cache_control": {"type": "ephemeral"}}]
    r = httpx.post(live.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": marked},
                   headers={"authorization": f"Bearer {KEY_ALPHA}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_control"


# -- TLS ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=kvstrata test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(ext + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_mutual_tls_on_both_apis(llm, certs):
    from kvstrata.cluster.client_cmd import open_channel
    from kvstrata.cluster.grpc_server import server_credentials

    creds = server_credentials(certs["server.pem"], certs["server.key"], certs["ca.pem"])
    server = LiveServer(llm, grpc_credentials=creds, tls_files=(certs["server.pem"], certs["server.key"], certs["ca.pem"]))
    target = f"127.0.0.1:{server.port}"
    req = pb.GenerateRequest(text="Secure hello", sampling=pb.SamplingOptions(max_tokens=2))
    try:
        with open_channel(target, certs["ca.pem"], certs["client.pem"], certs["client.key"]) as ch:
            out = list(pb_grpc.GenerationStub(ch).Generate(req, timeout=30))
            assert out[-1].usage.completion_tokens == 2
        with open_channel(target, certs["ca.pem"]) as ch:  # no client certificate
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.GenerationStub(ch).Generate(req, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with open_channel(target) as ch:  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError):
                list(pb_grpc.GenerationStub(ch).Generate(req, timeout=10))
        import ssl

        ctx = ssl.create_default_context(cafile=certs["ca.pem"])
        ctx.load_cert_chain(certs["client.pem"], certs["client.key"])
        r = httpx.get(server.base_url + "/health", verify=ctx)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):  # no client certificate
            httpx.get(server.base_url + "/health", verify=ssl.create_default_context(cafile=certs["ca.pem"]))
    finally:
        server.stop()


# -- the serve command ----------------------------------------------------------------------------
def test_serve_command_with_config_keys_and_sigterm(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"alpha:{KEY_ALPHA}\n")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"http-port: 0\ndisable_grpc: true\nnum_gpu_blocks: 64\napi_keys_file: {keys}\n"
                   "grace_period: 5\nlog_level: warning\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cluster.cli", "serve", "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = wait_for_line(proc, "HTTP on")
        url = line.split("HTTP on ", 1)[1].strip()
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY_ALPHA, max_retries=0, timeout=60)
        raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert raw.parse().usage.completion_tokens == 2
        assert raw.headers["x-kvstrata-worker"] == "kvstrata-worker-0"  # one worker, named like a cluster's
        assert httpx.get(url + "/v1/models").status_code == 401
        # SIGTERM with a stream in flight: /health and new requests turn 503 at once, the stream finishes
        stream = c.completions.create(model=MODEL, prompt="Drain me", max_tokens=40, stream=True,
                                      extra_body={"ignore_eos": True})
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "health never turned 503"
            time.sleep(0.05)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL, prompt="late", max_tokens=2)
        assert e.value.status_code == 503
        chunks = [first, *stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(1 for ch in chunks if ch.choices[0].text) >= 30
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_failed_engine_step_is_503_on_both_apis_and_the_service_recovers(llm):
    import grpc

    calls: list[Exception] = []
    server = LiveServer(llm, recover=calls.append)
    real = llm.engine.step
    fails = [2]

    def step():
        if fails[0]:
            fails[0] -= 1
            raise RuntimeError("device lost")
        return real()

    llm.engine.step = step
    try:
        r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "unavailable_error" and "device lost" in r.json()["error"]["message"]
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                    text=PROMPT, sampling=pb.SamplingOptions(max_tokens=3)), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 10  # recover runs on the engine thread just after the failure is sent
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [str(c) for c in calls] == ["device lost", "device lost"]  # recover ran after each failure
        ok = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3},
                        timeout=60)
        assert ok.status_code == 200
        wait_for_used_blocks(llm, 0)
    finally:
        llm.engine.step = real
        server.stop()
