"""The `kvstrata` command, run as a user runs it: a subprocess with real arguments."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import needs_model


def kvstrata(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstrata.cluster.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


@needs_model
def test_generate_json_from_prompt_file(tmp_path, llm):
    f = tmp_path / "prompts.txt"
    f.write_text("The capital of France is\n\nOne, two, three,\n")
    r = kvstrata("generate", "--prompt-file", str(f), "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 2  # the blank line is skipped
    for obj in lines:
        assert set(obj) == {"prompt_token_ids", "token_ids", "text", "num_cached_tokens", "finish_reason"}
        assert 1 <= len(obj["token_ids"]) <= 8
        assert obj["finish_reason"] in ("stop", "length")
    # the CLI is the same engine: greedy tokens equal the in-process API's
    from kvstrata import SamplingParams

    ref = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert lines[0]["token_ids"] == ref.outputs[0].token_ids
    assert lines[0]["prompt_token_ids"] == ref.prompt_token_ids


@needs_model
def test_generate_chat_plain_text():
    r = kvstrata("generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["generate", "--prompt-file", "/no/such/file"], "--prompt-file"),
    (["generate", "--model", "/no/such/model", "--prompt", "hi"], "not found"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature"),
])
def test_generate_bad_input_is_one_line_and_nonzero(args, needle):
    r = kvstrata(*args)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # argparse may print its usage above; the error is one line
    assert last.startswith("kvstrata generate: error:")
    assert needle in last


def test_help_lists_commands():
    r = kvstrata("--help")
    assert r.returncode == 0
    assert "generate" in r.stdout and "size" in r.stdout
