"""Tokenizer from tokenizer.json (HF directory) or from GGUF metadata, converted once and cached."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvserve.cache_dir import cache_root, file_digest
from kvserve.model.chat_template import CONTINUE_MARK, render_chat_template
from kvserve.model.detokenizer import IncrementalDetokenizer
from kvserve.model.errors import ModelLoadError, describe

log = logging.getLogger(__name__)

# a GGUF's converted tokenizer under ~/.cache/kvserve/gguf/<digest>/; v2: the family class's own parts written
# out (the first layout, "tokenizer", lacked Qwen2's NFC normalizer, which only the family class added back)
GGUF_TOKENIZER_DIR = "tokenizer-v2"

# any of these beside the weights means the directory brings a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")

# Gemma's instruction-tuned templates end a turn with <end_of_turn>, not with EOS
FAMILY_STOP_TOKENS = {"gemma3": ("<end_of_turn>",)}


class NoChatTemplateError(ValueError):
    """The checkpoint carries no chat template and none was supplied."""


class Tokenizer:
    def __init__(self, hf_tokenizer, architecture: str, family: str | None = None) -> None:
        self._tok = hf_tokenizer
        self.architecture = architecture
        self._family = family  # the transformers class whose tokenizer this reproduces, where another class reads it
        # base checkpoints ship none, and a turn format they never learned would only produce noise
        self.chat_template: str | None = hf_tokenizer.chat_template

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer underneath (grammar compilers read its vocabulary)."""
        return self._tok

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

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ...: what transformers hands a chat template besides the messages."""
        return dict(self._tok.special_tokens_map)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: a text longer than n times this is more than n tokens."""
        return max((len(t) for t in self._tok.get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    @property
    def class_name(self) -> str:
        return self._family or type(self._tok).__name__

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's own strings for these ids (byte-level 'Ġ' and all), as /tokenize's token_strs shows them."""
        return list(self._tok.convert_ids_to_tokens(list(token_ids)))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _byte_level(self) -> dict[str, int] | None:
        """GPT-2's byte-level alphabet, char -> byte, when the tokenizer encodes bytes that way."""
        if "ByteLevel" not in repr(self._tok.backend_tokenizer.decoder):
            return None
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        return {char: byte for byte, char in bytes_to_unicode().items()}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-fallback token is one byte; a multi-byte character
        can take several tokens)."""
        raw = self._tok.convert_ids_to_tokens(int(token_id))
        if raw is None:
            return b""
        if len(raw) == 6 and raw.startswith("<0x") and raw.endswith(">"):
            try:
                return bytes([int(raw[3:5], 16)])
            except ValueError:
                pass
        table = self._byte_level
        if table is not None and all(c in table for c in raw):
            return bytes(table[c] for c in raw)
        return raw.replace("\u2581", " ").encode()

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or `bytes:\\xHH...` when its bytes are not whole UTF-8 (as OpenAI shows them)."""
        data = self.token_bytes(token_id)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def incremental_detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok.backend_tokenizer)

    def apply_chat_template(self, conversation: list[dict] | list[list[dict]], tools: list[dict] | None = None,
                            documents: list | None = None, chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, return_dict: bool = False,
                            **kwargs):  # fmt: skip
        """transformers' apply_chat_template (what vLLM's get_tokenizer() gives scripts): the text
        (tokenize=False), its token ids, or {"input_ids", "attention_mask"} (return_dict=True), of one
        conversation or a list of them; add_generation_prompt defaults to False, as transformers'."""
        unsupported = sorted(k for k, v in kwargs.items() if v not in (None, False))
        if documents or unsupported:
            raise ValueError(f"apply_chat_template: {', '.join(unsupported or ['documents'])} is not supported here")
        if conversation and isinstance(conversation[0], (list, tuple)):
            return [self.apply_chat_template(c, tools, None, chat_template, add_generation_prompt, continue_final_message, tokenize,
                                             return_dict) for c in conversation]  # fmt: skip
        template = chat_template or self.chat_template
        if template is None:
            raise NoChatTemplateError("this model has no chat template (base models ship none); "
                                      "pass --chat-template (inline Jinja or a file) to supply one")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt=False")
        messages = list(conversation)
        if continue_final_message:  # the text ends where the last message's does: a mark placed after it, the rest cut
            messages[-1] = {**messages[-1], "content": messages[-1]["content"] + CONTINUE_MARK}
        text = render_chat_template(template, messages, self.special_tokens, add_generation_prompt, tools=tools)
        if continue_final_message:
            if text.count(CONTINUE_MARK) != 1:
                raise ValueError("continue_final_message: the last message's text must appear once in the rendered conversation")
            text = text[: text.index(CONTINUE_MARK)]
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)  # the template already carries BOS where the model wants it
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file path, or the Jinja text itself."""
    if value is None:
        return None
    if "{" in value or "\n" in value:  # Jinja: inline text (it may be longer than a file name can be)
        return value
    path = Path(value)
    if not path.is_file():  # no Jinja in it: a file name (a typo would otherwise become the prompt's whole text)
        what = "a directory" if path.is_dir() else "no such file"
        raise ValueError(f"--chat-template {value!r}: {what}, and not a Jinja template (no {{{{ or {{%)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template {value!r}: cannot read it as UTF-8 text ({exc})") from None


def _blame_config(directory: Path) -> None:
    """AutoTokenizer reads config.json too: when transformers rejects that file, say so."""
    from transformers import AutoConfig

    if (directory / "config.json").exists():
        try:
            AutoConfig.from_pretrained(str(directory))
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(directory / "config.json", f"transformers rejects it: {describe(exc)}") from None


def load_tokenizer(path: Path, architecture: str) -> Tokenizer | None:
    """The checkpoint's tokenizer; None for a directory with no tokenizer files (token ids only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if path.is_dir():
        found = [name for name in TOKENIZER_FILES if (path / name).exists()]
        if not found:
            log.info("%s has no tokenizer files (%s): prompts and outputs are token ids", path, ", ".join(TOKENIZER_FILES))
            return None
        try:
            return Tokenizer(AutoTokenizer.from_pretrained(str(path)), architecture)
        except Exception as exc:  # noqa: BLE001 - any failure here is the files' fault
            _blame_config(path)
            raise ModelLoadError(path / found[0], f"cannot load the tokenizer ({', '.join(found)}): {describe(exc)}") from None
    cached = cache_root() / "gguf" / file_digest(path) / GGUF_TOKENIZER_DIR
    if not (cached / "tokenizer.json").exists():
        _convert_gguf_tokenizer(path, cached)
    config = cached / "tokenizer_config.json"
    family = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    return Tokenizer(_read_converted(cached), architecture, family)


def _convert_gguf_tokenizer(path: Path, cached: Path) -> None:
    """The GGUF's tokenizer as transformers' family class makes it, written out whole: the family
    class adds parts of its own when it reads saved files (Qwen2Tokenizer an NFC normalizer, which
    transformers' GGUF reader leaves out; GemmaTokenizer left padding), and the generic class that
    reads the cache (_read_converted) takes the file as it is."""
    from transformers import AutoTokenizer

    log.info("converting the GGUF tokenizer of %s (once; cached in %s)", path.name, cached)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - any failure here is the file's fault
        raise ModelLoadError(path, f"cannot read the tokenizer in this GGUF file: {describe(exc)}") from None
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tokenizer.", suffix=".partial"))
    tok.save_pretrained(str(partial))
    family = AutoTokenizer.from_pretrained(str(partial))
    family.save_pretrained(str(partial))
    config_file = partial / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class=type(family).__name__, padding_side=family.padding_side, truncation_side=family.truncation_side)
    config_file.write_text(json.dumps(config, indent=2))
    try:
        os.rename(partial, cached)  # whole or not at all: a process starting beside this one never reads half of it
    except OSError:  # another process cached it first
        shutil.rmtree(partial, ignore_errors=True)


def _read_converted(cached: Path):
    """A converted GGUF tokenizer, read by transformers' generic fast class: the family classes
    (GemmaTokenizer, Qwen2Tokenizer) rebuild the vocabulary and merges in Python from tokenizer.json,
    which holds Gemma 3's 262,144 tokens and 514,906 merges twice (~280 MB against ~115 MB; the
    same tokenizer, ids and texts: tests/test_tokenizer_memory.py)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(cached))
