"""Tokenizer: an HF `tokenizers` tokenizer plus the model's chat template.

Text enters the engine only through `encode` / `apply_chat_template` and leaves through `decode` and
the incremental `Detokenizer`, which turns a growing list of token ids into text deltas without
decoding the whole output every step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]):
        self._tok = tokenizer
        self.chat_template: str = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self.bos_token: str | None = _token_str(config.get("bos_token"))
        self.eos_token: str | None = _token_str(config.get("eos_token"))
        self.add_bos_token: bool = bool(config.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{path}: tokenizer.json not found")
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        return cls(HFTokenizer.from_file(str(tok_file)), config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        _validate_messages(messages)
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, dict):  # HF AddedToken serialisation
        return tok.get("content")
    return tok


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")


class Detokenizer:
    """Incremental detokenization for one output sequence.

    Byte-level BPE tokens can end in the middle of a UTF-8 character, so text is emitted only once it
    is complete. Two offsets bound the work per step to a few tokens:

        ids:    [ ... | prefix_offset ... read_offset | new ... ]
                        ^ context for decode ^ emitted so far
    """

    __slots__ = ("_tok", "text", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def step(self, ids: list[int]) -> str:
        """Append the text of ids[read_offset:] that is complete; return the new delta."""
        prefix = self._tok.decode(ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self.text += delta
            return delta
        return ""
