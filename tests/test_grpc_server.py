"""The gRPC front end on a real server on loopback: streaming Generate with the generated stubs,
Tokenize, model info, admin, health and reflection, bad input, cancellation and drain."""

from __future__ import annotations

import subprocess
import sys

import pytest

grpc = pytest.importorskip("grpc")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from kvstrata.protos.v1 import generation_pb2 as pb  # noqa: E402
from kvstrata.protos.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402
from kvstrata.worker.sampling_params import SamplingParams  # noqa: E402
from tests.servers import LiveServer, used_blocks, wait_for_line, wait_for_used_blocks  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(llm):
    server = LiveServer(llm, http=False, max_waiting=4, max_tokens_limit=512)
    yield server
    server.stop()


def _engine_generate(live, llm, prompt: str, params: SamplingParams):
    """The in-process engine's own output, generated on the server's engine thread: the server owns
    the engine while it runs, and stepping it from the test thread as well would race with it."""
    return live.run(live.service.call(lambda _: llm.generate(prompt, params)[0].outputs[0]))


def test_generate_streams_tokens_equal_to_the_in_process_engine(live, llm):
    prompt = "The three primary colours are"
    responses = list(live.gen.Generate(pb.GenerateRequest(
        text=prompt, request_id="stream-1", sampling=pb.SamplingOptions(max_tokens=12, temperature=0.0))))
    token_msgs = [r for r in responses if r.token_ids]
    assert len(token_msgs) >= 2, "tokens should arrive over several messages, not all at the end"
    assert all(r.request_id == "stream-1" for r in responses)
    streamed = [t for r in token_msgs for t in r.token_ids]
    text = "".join(r.text for r in responses)
    assert responses[-1].usage.completion_tokens == 12
    assert responses[-1].usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert [r.finish_reason for r in responses if r.finish_reason] == ["length"]
    # the server's output is the engine's own greedy output
    ref = _engine_generate(live, llm, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert streamed == ref.token_ids
    assert text == ref.text


def test_repeated_prompt_reports_cached_tokens(live):
    prompt = "Paged attention keeps the KV cache in fixed-size blocks. " * 6
    req = pb.GenerateRequest(text=prompt, sampling=pb.SamplingOptions(max_tokens=2, temperature=0.0))
    first = list(live.gen.Generate(req))[-1].usage
    second = list(live.gen.Generate(req))[-1].usage
    assert second.cached_tokens >= 16 * ((first.prompt_tokens - 1) // 16) > 0
    assert second.cached_tokens > first.cached_tokens


def test_stop_string_is_never_streamed(live, llm):
    prompt = "Count: 1, 2, 3, 4, 5,"
    ref = _engine_generate(live, llm, prompt, SamplingParams(max_tokens=16, temperature=0.0)).text
    stop = ref.strip()[2:5]  # a piece of the greedy continuation
    assert stop
    responses = list(live.gen.Generate(pb.GenerateRequest(
        text=prompt, sampling=pb.SamplingOptions(max_tokens=16, temperature=0.0, stop=[stop]))))
    text = "".join(r.text for r in responses)
    assert stop not in text
    assert text == ref[: ref.index(stop)]
    assert any(r.finish_reason == "stop" for r in responses)


def test_n_samples_and_chat_prompt(live):
    responses = list(live.gen.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Name a colour.")]),
        sampling=pb.SamplingOptions(max_tokens=5, temperature=0.8, seed=3, n=3))))
    finals = {r.index: r.finish_reason for r in responses if r.finish_reason}
    assert finals == {0: "length", 1: "length", 2: "length"}
    assert responses[-1].usage.completion_tokens == 15


@pytest.mark.parametrize("request_kw,field", [
    ({"text": ""}, "prompt.text"),
    ({}, "prompt"),
    ({"text": "hi", "sampling": pb.SamplingOptions(max_tokens=0)}, "max_tokens"),
    ({"text": "hi", "sampling": pb.SamplingOptions(max_tokens=100000)}, "max_tokens"),
    ({"text": "hi", "sampling": pb.SamplingOptions(temperature=-1.0)}, "temperature"),
    ({"text": "hi", "sampling": pb.SamplingOptions(top_p=0.0)}, "top_p"),
    ({"text": "hi", "sampling": pb.SamplingOptions(n=1000)}, "n"),
    ({"token_ids": pb.TokenIds(ids=[10**7])}, "prompt"),
    ({"chat": pb.ChatMessages()}, "prompt.chat.messages"),
    ({"text": "hi", "sampling": pb.SamplingOptions(kv_eviction="lru(8)")}, "kv_eviction"),
    ({"text": "hi", "sampling": pb.SamplingOptions(kv_eviction="snapkv(window=16, budget=8)")}, "kv_eviction"),
    ({"text": "hi", "sampling": pb.SamplingOptions(kv_eviction="")}, "kv_eviction"),
])
def test_bad_input_is_invalid_argument_naming_the_field(live, request_kw, field):
    with pytest.raises(grpc.RpcError) as e:
        list(live.gen.Generate(pb.GenerateRequest(**request_kw)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_kv_eviction_per_request_applies_the_policy_like_the_in_process_engine(live, llm):
    prompt = "StreamingLLM keeps a few attention sinks and a window of recent tokens in its cache. " * 5
    spec = "streaming(sinks=4, window=28)"

    def evicted() -> int:
        return live.admin.GetCacheStats(pb.GetCacheStatsRequest()).num_evicted_tokens

    before = evicted()
    responses = list(live.gen.Generate(pb.GenerateRequest(text=prompt, sampling=pb.SamplingOptions(
        max_tokens=40, temperature=0.0, ignore_eos=True, kv_eviction=spec))))
    by_grpc = evicted() - before
    usage = responses[-1].usage
    assert usage.completion_tokens == 40 and 90 <= usage.prompt_tokens <= 120 and usage.cached_tokens == 0
    assert by_grpc >= usage.prompt_tokens + 39 - 32 - 16  # kept 4 sinks + 28 recent, and part of a block
    before = evicted()
    ref = _engine_generate(live, llm, prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                             kv_eviction=spec))
    assert [t for r in responses for t in r.token_ids] == ref.token_ids
    assert evicted() - before == by_grpc
    assert wait_for_used_blocks(llm, 0) == 0


def test_prompt_over_max_model_len_is_invalid_argument(live, llm):
    too_long = [100] * llm.engine.scheduler_config.max_model_len
    with pytest.raises(grpc.RpcError) as e:
        list(live.gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=too_long))))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in e.value.details()


def test_cancel_and_deadline_abort_the_request_and_free_its_blocks(live, llm):
    before = used_blocks(llm)
    call = live.gen.Generate(pb.GenerateRequest(
        text="Tell me a long story about a cache.",
        sampling=pb.SamplingOptions(max_tokens=400, temperature=0.0, ignore_eos=True)))
    next(call)  # the request is running
    call.cancel()
    assert wait_for_used_blocks(llm, before) == before
    with pytest.raises(grpc.RpcError) as e:
        list(live.gen.Generate(pb.GenerateRequest(
            text="Another long story.", sampling=pb.SamplingOptions(max_tokens=400, ignore_eos=True)), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for_used_blocks(llm, before) == before
    llm.check_integrity()


def test_tokenize_model_info_and_cache_admin(live, llm):
    tok = live.gen.Tokenize(pb.TokenizeRequest(text="hello world"))
    assert list(tok.token_ids) == llm.tokenizer.encode("hello world", add_special_tokens=False)
    assert len(tok.tokens) == len(tok.token_ids)
    info = live.gen.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.num_heads, info.num_kv_heads, info.vocab_size) == (9, 3, llm.config.vocab_size)
    assert info.max_tokens_limit == 512
    stats = live.admin.GetCacheStats(pb.GetCacheStatsRequest())
    assert stats.num_total_blocks == llm.engine.kv.pool.num_blocks
    assert stats.num_cached_blocks > 0  # earlier tests left cached prefixes
    flushed = live.admin.FlushCache(pb.FlushCacheRequest())
    assert flushed.blocks_flushed > 0
    assert live.admin.GetCacheStats(pb.GetCacheStatsRequest()).num_cached_blocks == 0


def test_health_and_reflection(live):
    health = health_pb2_grpc.HealthStub(live.channel)
    for name in ("", "kvstrata.v1.Generation"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(live.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {"kvstrata.v1.Generation", "kvstrata.v1.Admin", "grpc.health.v1.Health"} <= names


def test_overload_answers_resource_exhausted_and_admitted_requests_finish():
    from kvstrata import LLM

    # one running sequence at a time, so that requests really wait, and a waiting limit of 2
    small = LLM("smollm2-135m", num_gpu_blocks=64, max_num_seqs=1)
    server = LiveServer(small, http=False, max_waiting=2)
    try:
        req = pb.GenerateRequest(text="Overload test.", sampling=pb.SamplingOptions(max_tokens=40, ignore_eos=True))
        calls = [server.gen.Generate(req) for _ in range(12)]
        codes, finished = [], 0
        for c in calls:
            try:
                finished += sum(1 for r in c if r.finish_reason == "length")
            except grpc.RpcError as e:
                codes.append(e.code())
        assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert finished == 12 - len(codes) and finished >= 2
    finally:
        server.stop()
    assert small.engine.kv.pool.num_used_blocks == 0
    small.check_integrity()


def test_drain_turns_health_not_serving_and_refuses_new_requests(llm):
    server = LiveServer(llm, http=False)
    try:
        running = server.gen.Generate(pb.GenerateRequest(
            text="Drain test.", sampling=pb.SamplingOptions(max_tokens=30, ignore_eos=True)))
        first = next(running)
        assert first.token_ids
        assert server.admin.Drain(pb.DrainRequest()).in_flight == 1
        health = health_pb2_grpc.HealthStub(server.channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(server.gen.Generate(pb.GenerateRequest(text="late", sampling=pb.SamplingOptions(max_tokens=2))))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(running)  # the in-flight request still finishes
        assert rest[-1].usage.completion_tokens == 30
    finally:
        server.stop()
    assert used_blocks(llm) == 0


def test_generated_code_is_fresh():
    pytest.importorskip("grpc_tools")
    result = subprocess.run([sys.executable, "-m", "kvstrata.protos.generate", "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_serve_command_serves_and_drains_on_sigterm():
    import os
    import signal

    # the environment sets what no flag does
    env = {**os.environ, "KVSTRATA_GRPC_PORT": "0", "KVSTRATA_DISABLE_HTTP": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cluster.cli", "serve", "--num-gpu-blocks", "64",
                             "--grace-period", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        line = wait_for_line(proc, "gRPC on")
        port = int(line.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            info = pb_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.model_id and info.num_kv_heads == 3
            out = list(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                text="Hello", sampling=pb.SamplingOptions(max_tokens=3, temperature=0.0)), timeout=30))
            assert out[-1].usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
