"""The GGUF-built tokenizer against HF's GGUF tokenizer: encoding, decoding, the chat template, message
validation, and the incremental Detokenizer over multi-byte characters."""

from __future__ import annotations

import pytest

from kvstrata.worker.tokenizer import Detokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "don't won't I'm we'll y'all ALLCAPS MiXeD",
    "numbers 1234567890 3.14159 -42 1e-10 0x1F 2024-11-22",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # slow\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "héllo wörld ✓ naïve café 日本語のテキスト 한국어 مرحبا Ω≈ç√",
    "emoji 🙂👍🏽🎉 family 👨\u200d👩\u200d👧\u200d👦 math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  two leading spaces, then   three,\tand\t\ttabs",
    "newlines\n\n\nand CRLF\r\nand trailing spaces   ",
    "\n",
    " ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<|endoftext|>c<|im_start|><|im_start|>",
    "not special: <|im_star|> <im_end> |im_end|",
]
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


@pytest.fixture(scope="module")
def hf_tok(hf_reference):
    return hf_reference[0]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_hf(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


def test_special_tokens_encode_to_single_ids(tok):
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert len(ids) == 3
    assert tok.id_to_token(ids[0]) == "<|im_start|>"
    assert tok.id_to_token(ids[2]) == "<|im_end|>"
    assert ids[2] == tok.eos_token_id


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    stripped = text
    for s in SPECIAL:
        stripped = stripped.replace(s, "")
    assert tok.decode(ids) == stripped  # special tokens are skipped by default
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and\nnewlines."},
    ],
    "multi_turn_system": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "And good night?"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_hf(tok, hf_tok, name):
    conv = CONVERSATIONS[name]
    ours = tok.apply_chat_template(conv, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    assert conv[-1]["content"] in ours


def test_chat_template_without_generation_prompt(tok, hf_tok):
    conv = CONVERSATIONS["multi_turn"]
    ours = tok.apply_chat_template(conv, add_generation_prompt=False)
    assert ours == hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
    assert not ours.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages, field", [
    ([{"content": "no role"}], "role"),
    ([{"role": "user"}], "content"),
    ([{"role": "robot", "content": "beep"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": 42}], r"messages\[1\]\.content"),
    ([{"role": "user", "content": ["a", "list"]}], r"messages\[0\]\.content"),
    ([], "messages"),
    ("just a string", "messages"),
    (["not a dict"], r"messages\[0\]"),
])
def test_bad_messages_raise_value_error_naming_the_field(tok, messages, field):
    with pytest.raises(ValueError, match=field):
        tok.apply_chat_template(messages)


MULTIBYTE = "日本語のテキスト 🙂👍🏽🎉 한국어 Ω≈ç√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👨\u200d👩\u200d👧\u200d👦 end"


@pytest.mark.parametrize("stride", [1, 3])
def test_detokenizer_incremental_equals_full_decode(tok, stride):
    ids = tok.encode(MULTIBYTE)
    # the test is only meaningful if characters really are split across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    det = Detokenizer(tok)
    deltas = []
    for end in list(range(stride, len(ids), stride)) + [len(ids)]:
        deltas.append(det.step(ids[:end]))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == det.text == tok.decode(ids) == MULTIBYTE
    assert sum(1 for d in deltas if d) > 10  # text streamed out as it completed, not all at the end


def test_detokenizer_holds_back_an_incomplete_character(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1  # a byte-level split
    det = Detokenizer(tok)
    assert [det.step(ids[:k]) for k in range(1, len(ids))] == [""] * (len(ids) - 1)
    assert det.step(ids) == "🎉"
