"""Property-based fuzzing of request fields over both serving APIs, on a real server on loopback.
Hypothesis starts from a valid request and replaces one field, or a few, with edge values, wrong
types, nulls or nested junk, adds unknown fields, or sends malformed bodies and wire bytes. Whatever
comes in, the server must answer a client error (HTTP 400 / 404 in OpenAI's error shape, gRPC
INVALID_ARGUMENT with details) or a well-formed success, never a server error or a hang; it must accept
only values within each field's documented range, and free every KV block once the request is over.
The holes it found when it was written have regression tests at the end of each section.
"""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvstrata.protos.v1 import generation_pb2 as pb
from kvstrata.worker.sampling_params import MAX_LOGPROBS, MAX_N
from kvstrata.worker.tokenizer import ROLES

from tests.servers import LiveServer, wait_for_used_blocks

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
VOCAB = 49152
MAX_TOKENS_LIMIT = 8  # the server's cap, so that every accepted request stays cheap on a CPU
TIMEOUT_S = 30  # a request that takes longer than this has hung
U32 = 2**32


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def live(llm):
    assert wait_for_used_blocks(llm, 0) == 0
    server = LiveServer(llm, max_waiting=64, max_tokens_limit=MAX_TOKENS_LIMIT)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    with httpx.Client(base_url=live.base_url, timeout=TIMEOUT_S) as c:
        yield c


# -- strategies: JSON request bodies --------------------------------------------------------------
text = st.text(max_size=12)  # valid Unicode only: lone surrogates have their own test below
huge = st.sampled_from([10**30, -(10**30), 2**63, 2**64, -(2**63) - 1])
_scalars = st.none() | st.booleans() | st.integers() | st.floats() | text
junk = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=6)
token_id = st.integers(0, VOCAB - 1) | st.sampled_from([VOCAB, U32 - 1])  # what gRPC's uint32 can carry
json_token_id = token_id | st.sampled_from([U32, -1, 10**30])  # JSON carries any integer


# token eviction specs: some that parse, some that must be refused, and any text (either is fine)
GOOD_EVICTIONS = ["sliding_window(4)", "streaming(sinks=1, window=2)", "h2o(2, 2)", "snapkv(window=2, budget=4)"]
BAD_EVICTIONS = ["", "lru(8)", "h2o", "h2o(heavy=2)", "sliding_window(0)", "snapkv(window=4, budget=2)",
                 "streaming(4,, 8)", "sliding_window(x)", "h2o(heavy=1, 2)"]
eviction = st.sampled_from(GOOD_EVICTIONS + BAD_EVICTIONS) | text


def wide(*values: st.SearchStrategy) -> st.SearchStrategy:
    """Any value for a field: the valid and edge values given, null, or junk of any JSON type."""
    return st.one_of(*values, st.none(), junk)


_COMMON_FIELDS = {
    "model": wide(st.sampled_from([MODEL, "gpt-4o", "", MODEL.upper(), f" {MODEL}"])),
    "temperature": wide(st.floats(), st.sampled_from([0, 1e-300, 1e-5, 2.0, 1e308, -1.0]), huge),
    "top_p": wide(st.floats(0, 1), st.floats(), st.sampled_from([0, 1, 1.5])),
    "top_k": wide(st.integers(-2, VOCAB + 1), huge),
    "min_p": wide(st.floats(0, 1), st.floats()),
    "n": wide(st.integers(-1, 3), st.sampled_from([MAX_N, MAX_N + 1, 10**6]), huge),
    "seed": wide(st.integers(), huge),
    "stop": wide(text, st.lists(text, max_size=3)),
    "stop_token_ids": wide(st.lists(token_id | st.integers(), max_size=3)),
    "stream": wide(st.booleans()),
    "stream_options": wide(st.fixed_dictionaries({}, optional={"include_usage": wide(st.booleans())})),
    "presence_penalty": wide(st.just(0.0), st.floats()),
    "frequency_penalty": wide(st.just(0.0), st.floats()),
    "logit_bias": wide(st.dictionaries(text, st.floats(), max_size=2)),
    "user": wide(text),
    "ignore_eos": wide(st.booleans()),
    "kv_eviction": wide(eviction),
}
COMPLETION_FIELDS = {
    **_COMMON_FIELDS,
    "prompt": wide(text, st.lists(text, max_size=3), st.lists(json_token_id, max_size=6),
                   st.lists(st.lists(json_token_id, max_size=4), max_size=3)),
    "max_tokens": wide(st.integers(-1, MAX_TOKENS_LIMIT + 1), huge),
    "logprobs": wide(st.integers(-1, MAX_LOGPROBS + 1), huge),
    "echo": wide(st.booleans()),
    "best_of": wide(st.integers(0, 3)),
    "suffix": wide(text),
}
_part = wide(st.fixed_dictionaries({"type": wide(st.just("text")), "text": wide(text)}))
_message = wide(st.fixed_dictionaries({"role": wide(st.sampled_from([*ROLES, "", "robot"])),
                                       "content": wide(text, st.lists(_part, max_size=2))},
                                      optional={"name": wide(text)}))
CHAT_FIELDS = {
    **_COMMON_FIELDS,
    "messages": wide(st.lists(_message, max_size=3)),
    "max_tokens": wide(st.integers(-1, MAX_TOKENS_LIMIT + 1), huge),
    "max_completion_tokens": wide(st.integers(-1, MAX_TOKENS_LIMIT + 1), huge),
    "logprobs": wide(st.booleans()),
    "top_logprobs": wide(st.integers(-1, MAX_LOGPROBS + 1), huge),
    "response_format": wide(st.fixed_dictionaries({"type": wide(st.sampled_from(["text", "json_object"]))})),
}
unknown_fields = st.dictionaries(text.filter(lambda k: k not in COMPLETION_FIELDS and k not in CHAT_FIELDS),
                                 junk, min_size=1, max_size=2)

# the valid requests fuzzing starts from: a few tokens each, often greedy
_sampling = {"temperature": st.sampled_from([0.0, 0.7]), "seed": st.integers(0, U32), "n": st.integers(1, 2),
             "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "top_k": st.integers(-1, 50),
             "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}
valid_completion = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
     "prompt": st.text(min_size=1, max_size=12) | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)},
    optional={**_sampling, "logprobs": st.integers(0, 3), "echo": st.booleans()})
valid_chat = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": st.text(min_size=1, max_size=12)}),
                          min_size=1, max_size=2)},
    optional={**_sampling, "logprobs": st.booleans()})
ENDPOINTS = {"completions": ("/v1/completions", valid_completion, COMPLETION_FIELDS),
             "chat": ("/v1/chat/completions", valid_chat, CHAT_FIELDS)}


@st.composite
def fuzzed(draw, valid: st.SearchStrategy, fields: dict[str, st.SearchStrategy]) -> dict[str, Any]:
    """A valid body with up to three fields replaced by anything, maybe a required one dropped or
    unknown fields added."""
    body = draw(valid)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 0:
        body.pop(draw(st.sampled_from(["model", "prompt" if "prompt" in fields else "messages"])))
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(unknown_fields))
    return body


# -- the oracle: what the server may accept -------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return _is_int(v) or (isinstance(v, float) and math.isfinite(v))


def _is_stop(v: Any) -> bool:
    return (isinstance(v, str) and v != "") or (isinstance(v, list) and all(isinstance(s, str) and s for s in v))


_IN_RANGE = {
    "temperature": lambda v: _is_num(v) and v >= 0,
    "top_p": lambda v: _is_num(v) and 0 < v <= 1,
    "top_k": lambda v: _is_int(v) and v >= -1,
    "min_p": lambda v: _is_num(v) and 0 <= v <= 1,
    "n": lambda v: _is_int(v) and 1 <= v <= MAX_N,
    "seed": lambda v: _is_int(v) and v >= 0,
    "presence_penalty": lambda v: v in (0, 0.0),
    "frequency_penalty": lambda v: v in (0, 0.0),
    "logit_bias": lambda v: v == {},
    "max_tokens": lambda v: _is_int(v) and 1 <= v <= MAX_TOKENS_LIMIT,
    "max_completion_tokens": lambda v: _is_int(v) and 1 <= v <= MAX_TOKENS_LIMIT,
    "top_logprobs": lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
    "stop": _is_stop,
    "stop_token_ids": lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
    "suffix": lambda v: v == "",
    "kv_eviction": lambda v: isinstance(v, str) and v not in BAD_EVICTIONS,
}


def out_of_range(body: dict[str, Any], fields: dict[str, Any]) -> str | None:
    """Why the server must refuse this body, or None when it may accept it. Only the clear-cut rules,
    so a 200 for a body with a reason here is a validation hole."""
    unknown = set(body) - set(fields)
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    if body.get("model") != MODEL:
        return "model"
    for name, ok in _IN_RANGE.items():
        if body.get(name) is not None and not ok(body[name]):
            return name
    if "prompt" in fields:
        return _completion_out_of_range(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages"
    if any(not isinstance(m, dict) or m.get("role") not in ROLES for m in messages):
        return "messages role"
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        return "max_tokens and max_completion_tokens"
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        return "top_logprobs without logprobs"
    return None


def _completion_out_of_range(body: dict[str, Any]) -> str | None:
    if "max_tokens" not in body:  # the default, 16, is over the cap
        return "max_tokens (default)"
    logprobs = body.get("logprobs")
    if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= MAX_LOGPROBS):
        return "logprobs"
    if body.get("best_of") is not None and body["best_of"] != (body.get("n") or 1):
        return "best_of"
    prompt = body.get("prompt")
    if not prompt:
        return "prompt"
    id_lists = [prompt] if isinstance(prompt, list) and all(_is_int(t) for t in prompt) else \
        [p for p in (prompt if isinstance(prompt, list) else []) if isinstance(p, list)]
    if any(not ids or not all(_is_int(t) and 0 <= t < VOCAB for t in ids) for ids in id_lists):
        return "prompt token ids"
    return None


def num_choices(body: dict[str, Any]) -> int:
    n = body.get("n") or 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and not all(_is_int(t) for t in prompt):
        return n * len(prompt)
    return n


# -- checks ---------------------------------------------------------------------------------------
def assert_openai_error(resp: httpx.Response) -> dict[str, Any]:
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"].strip(), resp.text
    assert err["param"] is None or isinstance(err["param"], str), resp.text
    return err


def assert_idle(llm) -> None:
    """No request in flight and no block held: every request, refused or finished, let go."""
    assert wait_for_used_blocks(llm, 0) == 0, "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()


def assert_still_serving(live: LiveServer, client: httpx.Client, llm) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    out = list(live.gen.Generate(pb.GenerateRequest(text="Hello", sampling=pb.SamplingOptions(max_tokens=2)),
                                 timeout=TIMEOUT_S))
    assert out[-1].usage.completion_tokens == 2
    assert_idle(llm)
    llm.check_integrity()


def post_json(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    # json.dumps rather than httpx's encoder: NaN and Infinity go out as Python writes them
    return client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def settle(resp: httpx.Response) -> None:
    """After a 500, wait until the server has logged it. uvicorn logs the traceback after sending
    the response, and Python 3.11 formats tracebacks with ast.parse, which is not safe to run while
    pytest runs it in this thread to report the failure (SystemError: AST constructor recursion depth
    mismatch). A later request is served only once the server's loop has moved on."""
    if resp.status_code >= 500:
        httpx.get(str(resp.request.url.copy_with(path="/health")), timeout=TIMEOUT_S)


def check_http_answer(body: dict[str, Any], resp: httpx.Response, fields: dict[str, Any]) -> dict[str, Any] | None:
    """The answer is a client error or a well-formed success the body deserved; returns the error."""
    settle(resp)
    assert resp.status_code in (200, 400, 404), f"{resp.status_code} for {body!r}: {resp.text[:500]}"
    if resp.status_code == 404:
        assert body.get("model") != MODEL
        err = assert_openai_error(resp)
        assert err["param"] == "model"
        return err
    if resp.status_code == 400:
        return assert_openai_error(resp)
    reason = out_of_range(body, fields)
    assert reason is None, f"accepted a body with a bad {reason}: {body!r}"
    if body.get("stream") is True:
        events = [e for e in resp.text.split("\n\n") if e.strip()]
        assert events and events[-1] == "data: [DONE]", resp.text[-300:]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert not any("error" in c for c in chunks), resp.text[-500:]
        assert {c["choices"][0]["index"] for c in chunks if c["choices"]} <= set(range(num_choices(body)))
        return None
    choices = resp.json()["choices"]
    assert len(choices) == num_choices(body)
    assert all(c["finish_reason"] in ("stop", "length") for c in choices), choices
    assert resp.json()["usage"]["completion_tokens"] <= MAX_TOKENS_LIMIT * len(choices)
    return None


# -- HTTP -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint,name", [(e, name) for e, (_, _, fields) in ENDPOINTS.items() for name in fields])
def test_http_one_field_at_a_time(client, llm, endpoint, name):
    """A valid body with one field set to anything: a 400 names that field."""
    path, valid, fields = ENDPOINTS[endpoint]

    @fuzz(6)
    @given(base=valid, value=fields[name])
    def check(base, value):
        body = {**base, name: value}
        err = check_http_answer(body, post_json(client, path, body), fields)
        if err is not None:
            assert err["param"] == name, f"{err} for {name}={value!r}"
        assert_idle(llm)

    check()


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_http_fuzzed_bodies_get_a_client_error_or_a_well_formed_answer(live, client, llm, endpoint):
    path, valid, fields = ENDPOINTS[endpoint]

    @fuzz(60)
    @given(body=fuzzed(valid, fields))
    def check(body):
        check_http_answer(body, post_json(client, path, body), fields)
        assert_idle(llm)

    check()
    assert_still_serving(live, client, llm)


_body_text = st.one_of(
    st.text(max_size=40),
    st.builds(lambda s, cut: s[:cut], valid_completion.map(json.dumps), st.integers(0, 60)),  # truncated JSON
    junk.filter(lambda v: not isinstance(v, dict)).map(json.dumps),  # JSON, but not an object
)
_content_types = st.sampled_from([None, "application/json", "application/json; charset=utf-8",
                                  "application/vnd.api+json", "text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", "application/octet-stream"])
_paths = st.sampled_from([path for path, _, _ in ENDPOINTS.values()])


def test_http_malformed_text_bodies_are_400_in_openai_shape(live, client, llm):
    @fuzz(60)
    @given(path=_paths, raw=_body_text, content_type=_content_types)
    def check(path, raw, content_type):
        headers = {"content-type": content_type} if content_type else {}
        resp = client.post(path, content=raw.encode(), headers=headers)
        settle(resp)
        assert resp.status_code == 400, f"{resp.status_code} for {raw!r} ({content_type}): {resp.text[:300]}"
        assert_openai_error(resp)
        assert_idle(llm)

    check()
    assert_still_serving(live, client, llm)


def test_http_random_bytes_are_400(live, client, llm):
    """Never a 500 or a hang; the error's shape for bodies that do not decode is checked below."""
    @fuzz(60)
    @given(path=_paths, raw=st.binary(max_size=64), content_type=_content_types)
    def check(path, raw, content_type):
        headers = {"content-type": content_type} if content_type else {}
        resp = client.post(path, content=raw, headers=headers)
        settle(resp)
        assert resp.status_code == 400, f"{resp.status_code} for {raw!r} ({content_type}): {resp.text[:300]}"
        assert_idle(llm)

    check()
    assert_still_serving(live, client, llm)


def _post_fresh(live: LiveServer, path: str, body: Any) -> httpx.Response:
    with httpx.Client(base_url=live.base_url, timeout=TIMEOUT_S) as c:  # a 500 resets its connection
        resp = post_json(c, path, body)
    settle(resp)
    return resp


@pytest.mark.parametrize("prompt", [[-1], [5, U32], [[1], [10**30]]], ids=["negative", "u32-max+1", "huge"])
def test_token_ids_outside_uint32_are_400(live, llm, prompt):
    resp = _post_fresh(live, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert_idle(llm)
    assert resp.status_code == 400, resp.text
    assert assert_openai_error(resp)["param"] == "prompt"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi \ud800", "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", "\udfff"], "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "\ud83d"}]}),
], ids=["prompt", "prompt-list", "chat-content"])
def test_lone_surrogate_in_text_is_400(live, llm, path, body):
    resp = _post_fresh(live, path, body)
    assert_idle(llm)
    assert resp.status_code == 400, resp.text
    assert_openai_error(resp)


@pytest.mark.parametrize("raw", [b'{"model": "\x80"}', b"[" * 100_000], ids=["invalid-utf8", "deep-nesting"])
def test_undecodable_body_is_400_in_openai_shape(live, raw):
    with httpx.Client(base_url=live.base_url, timeout=TIMEOUT_S) as c:
        resp = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert_openai_error(resp)


@pytest.mark.parametrize("field,extra", [("max_completion_tokens", {"max_completion_tokens": 0}),
                                         ("top_logprobs", {"logprobs": True, "top_logprobs": 99})],
                         ids=["max_completion_tokens", "top_logprobs"])
def test_error_param_names_the_field_sent(client, field, extra):
    resp = post_json(client, "/v1/chat/completions",
                     {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra})
    assert resp.status_code == 400
    assert assert_openai_error(resp)["param"] == field, resp.text


def test_tiny_top_p_samples_the_most_likely_token(client, llm):
    """A nucleus smaller than the top token's probability holds only the top token: greedy's answer."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4}
    greedy = post_json(client, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]

    @fuzz(40)
    @given(top_p=st.floats(0, 1e-6, exclude_min=True))
    def check(top_p):
        resp = post_json(client, "/v1/completions", {**body, "top_p": top_p, "temperature": 1.0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == greedy, f"top_p={top_p!r}"

    check()


# -- gRPC -----------------------------------------------------------------------------------------
_u32 = st.integers(0, U32 - 1)
_f32 = st.floats(width=32)
SAMPLING_FIELDS = {
    "max_tokens": st.integers(0, MAX_TOKENS_LIMIT + 1) | st.sampled_from([2**31, U32 - 1]),
    "temperature": _f32 | st.sampled_from([0.0, 1e-30, 1e-5, 1e30]),
    "top_p": _f32 | st.sampled_from([0.0, 1e-45, 1.0]),
    "top_k": st.integers(-2, VOCAB + 1) | st.integers(-(2**31), 2**31 - 1),
    "min_p": _f32 | st.floats(0, 1, width=32),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 1) | _u32, max_size=3),
    "n": st.integers(0, 3) | st.sampled_from([MAX_N, MAX_N + 1, U32 - 1]),
    "logprobs": st.integers(0, MAX_LOGPROBS + 1) | _u32,
    "ignore_eos": st.booleans(),
    "kv_eviction": eviction,
}
_grpc_message = st.builds(pb.ChatMessage, role=st.sampled_from([*ROLES, "", "robot"]) | text, content=text)
_valid_grpc_prompt = st.fixed_dictionaries({"text": st.text(min_size=1, max_size=12)}) | st.fixed_dictionaries(
    {"token_ids": st.builds(pb.TokenIds, ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))})
_grpc_prompt = st.one_of(
    st.fixed_dictionaries({"text": text}),
    st.fixed_dictionaries({"token_ids": st.builds(pb.TokenIds, ids=st.lists(token_id | _u32, max_size=6))}),
    st.fixed_dictionaries({"chat": st.builds(pb.ChatMessages, messages=st.lists(_grpc_message, max_size=3))}),
    st.just({}),
)
_valid_grpc_sampling = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3)},
    optional={"temperature": st.sampled_from([0.0, 0.7]), "seed": st.integers(0, U32), "n": st.integers(1, 2),
              "logprobs": st.integers(0, 3), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2)})


@st.composite
def grpc_requests(draw) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prompt fields, sampling fields) of a valid request with a few of them replaced by anything."""
    prompt = draw(_grpc_prompt if draw(st.booleans()) else _valid_grpc_prompt)
    sampling = draw(_valid_grpc_sampling)
    for name in draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), max_size=3, unique=True)):
        sampling[name] = draw(SAMPLING_FIELDS[name])
    if draw(st.integers(0, 9)) == 0:
        sampling.pop("max_tokens")  # the default, 16, is over the cap
    return prompt, sampling


_GRPC_IN_RANGE = {
    "max_tokens": lambda v: 1 <= v <= MAX_TOKENS_LIMIT,
    "temperature": lambda v: math.isfinite(v) and v >= 0,
    "top_p": lambda v: math.isfinite(v) and 0 < v <= 1,
    "top_k": lambda v: v >= -1,
    "min_p": lambda v: math.isfinite(v) and 0 <= v <= 1,
    "n": lambda v: 1 <= v <= MAX_N,
    "logprobs": lambda v: v <= MAX_LOGPROBS,
    "stop": all,
    "kv_eviction": lambda v: v not in BAD_EVICTIONS,
}


def grpc_out_of_range(prompt: dict[str, Any], sampling: dict[str, Any]) -> str | None:
    if "max_tokens" not in sampling:
        return "max_tokens (default)"
    for name, ok in _GRPC_IN_RANGE.items():
        if name in sampling and not ok(sampling[name]):
            return name
    if not prompt:
        return "prompt"
    if "text" in prompt and not prompt["text"]:
        return "prompt.text"
    if "token_ids" in prompt and not all(0 <= t < VOCAB for t in prompt["token_ids"].ids or [-1]):
        return "prompt.token_ids"
    if "chat" in prompt and not all(m.role in ROLES for m in prompt["chat"].messages or [pb.ChatMessage()]):
        return "prompt.chat"
    return None


def check_grpc_answer(live: LiveServer, prompt: dict[str, Any], sampling: dict[str, Any]) -> str | None:
    """The call ends OK with a well-formed stream the request deserved, or INVALID_ARGUMENT; returns
    the error's details."""
    req = pb.GenerateRequest(**prompt, sampling=pb.SamplingOptions(**sampling))
    try:
        responses = list(live.gen.Generate(req, timeout=TIMEOUT_S))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{e.code()}: {e.details()} for {req}"
        assert e.details().strip()
        return e.details()
    reason = grpc_out_of_range(prompt, sampling)
    assert reason is None, f"accepted a request with a bad {reason}: {req}"
    n = sampling.get("n", 1)
    assert [r for r in responses if r.HasField("usage")] == responses[-1:]
    assert {r.index for r in responses if r.finish_reason} == set(range(n))
    assert responses[-1].usage.completion_tokens <= MAX_TOKENS_LIMIT * n
    return None


@pytest.mark.parametrize("name", [*SAMPLING_FIELDS, "prompt"])
def test_grpc_one_field_at_a_time(live, llm, name):
    """A valid request with one field set to anything: INVALID_ARGUMENT's details name that field."""
    value = _grpc_prompt if name == "prompt" else SAMPLING_FIELDS[name]

    @fuzz(6)
    @given(prompt=_valid_grpc_prompt, sampling=_valid_grpc_sampling, value=value)
    def check(prompt, sampling, value):
        if name == "prompt":
            prompt = value
        else:
            sampling = {**sampling, name: value}
        details = check_grpc_answer(live, prompt, sampling)
        if details is not None:
            # chat role errors come from the template, which names messages[i]
            names = ("prompt", "messages") if name == "prompt" else (name,)
            assert any(n in details for n in names), f"{details!r} for {name}={value!r}"
        assert_idle(llm)

    check()


def test_grpc_fuzzed_requests_end_ok_or_invalid_argument(live, client, llm):
    @fuzz(60)
    @given(request=grpc_requests())
    def check(request):
        check_grpc_answer(live, *request)
        assert_idle(llm)

    check()
    assert_still_serving(live, client, llm)


def _parses(raw: bytes) -> bool:
    try:
        pb.GenerateRequest.FromString(raw)
    except DecodeError:
        return False
    return True


def _raw_generate(live: LiveServer):
    return live.channel.unary_stream("/kvstrata.v1.Generation/Generate", request_serializer=lambda b: b,
                                     response_deserializer=pb.GenerateResponse.FromString)


_valid_wire = st.builds(lambda p, s: pb.GenerateRequest(**p, sampling=pb.SamplingOptions(**s)).SerializeToString(),
                        _valid_grpc_prompt, _valid_grpc_sampling)
_wire_bytes = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda b, cut: b[:cut], _valid_wire, st.integers(0, 40)),  # truncated
    st.builds(lambda b, i, x: b[:i % len(b)] + bytes([x]) + b[i % len(b) + 1:], _valid_wire,
              st.integers(0, 63), st.integers(0, 255)),  # one byte changed
)


def test_grpc_raw_wire_bytes_never_crash_the_server(live, client, llm):
    """Bytes that parse as a GenerateRequest are the servicer's to judge; the gRPC runtime refuses
    the rest before the servicer runs (with the status checked below)."""
    generate = _raw_generate(live)

    @fuzz(60)
    @given(raw=_wire_bytes)
    def check(raw):
        parses = _parses(raw)
        try:
            list(generate(raw, timeout=TIMEOUT_S))
        except grpc.RpcError as e:
            if parses:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{e.code()}: {e.details()} for {raw!r}"
                assert e.details().strip()
            else:
                assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"hung on {raw!r}"
        else:
            assert parses
        assert_idle(llm)

    check()
    assert_still_serving(live, client, llm)


def test_grpc_corrupt_wire_bytes_are_invalid_argument(live, llm):
    with pytest.raises(grpc.RpcError) as e:
        list(_raw_generate(live)(b"\x00", timeout=TIMEOUT_S))
    live.gen.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S)  # the server has logged it: see settle()
    assert_idle(llm)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{e.value.code()}: {e.value.details()!r}"
    assert e.value.details().strip()
