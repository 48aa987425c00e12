"""Tokenizer from tokenizer.json (HF directory) or from GGUF metadata, converted once and cached."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvserve.cache_dir import cache_root, file_digest
from kvserve.model.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

# Gemma base checkpoints ship no chat template; this is the family's turn format.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else ('user' if message['role'] == 'system' else message['role']) %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FAMILY_CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}
FAMILY_STOP_TOKENS = {"gemma3": ("<end_of_turn>",)}


class Tokenizer:
    def __init__(self, hf_tokenizer, architecture: str) -> None:
        self._tok = hf_tokenizer
        self.architecture = architecture
        self.chat_template: str | None = hf_tokenizer.chat_template or FAMILY_CHAT_TEMPLATES.get(architecture)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def extra_stop_token_ids(self) -> tuple[int, ...]:
        ids = []
        for token in FAMILY_STOP_TOKENS.get(self.architecture, ()):
            token_id = self._tok.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != self._tok.unk_token_id:
                ids.append(token_id)
        return tuple(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def incremental_detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok.backend_tokenizer)

    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None) -> list[int]:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; pass --chat-template to supply one")
        text = self._tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        # the template already carries BOS where the model wants it
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(path: Path, architecture: str) -> Tokenizer:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if path.is_dir():
        return Tokenizer(AutoTokenizer.from_pretrained(str(path)), architecture)
    cached = cache_root() / "gguf" / file_digest(path) / "tokenizer"
    if (cached / "tokenizer.json").exists():
        return Tokenizer(AutoTokenizer.from_pretrained(str(cached)), architecture)
    log.info("converting the GGUF tokenizer of %s (once; cached in %s)", path.name, cached)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cached.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(cached))
    return Tokenizer(tok, architecture)
