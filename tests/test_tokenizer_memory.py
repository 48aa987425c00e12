"""A GGUF model's tokenizer is read by transformers' generic fast class, not its family class
(GemmaTokenizer, Qwen2Tokenizer), which rebuilds the vocabulary and merges in Python: the same
tokenizer (normalizer included: Qwen2's NFC), ids, texts and special tokens, in far less memory
(Gemma 3's 262,144-token vocabulary)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cache_dir import cache_root, file_digest
from kvserve.model.registry import resolve_model_path
from kvserve.model.tokenizer import GGUF_TOKENIZER_DIR, load_tokenizer

MODELS = ("gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
ARCHITECTURES = {"gemma-3-270m": "gemma3", "smollm2-135m-instruct": "llama", "qwen2.5-coder-0.5b-instruct": "qwen2"}


def _prose() -> list[str]:
    licenses = sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file())
    texts = [p.read_text(errors="replace")[:4000] for p in licenses[:6]]
    return texts + [
        "<start_of_turn>user\nWhat is a KV cache?<end_of_turn>\n<start_of_turn>model\n",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
        "  leading  spaces\n\n\ttabs and\r\nCRLF   ",
        "Emoji 😀 🏳️‍🌈, CJK 世界 日本語 한국어, accents naïve café, bytes 𝔘𝔫𝔦 ꙮ ﷽ \u200b",
        "decomposed: cafe\u0301 e\u0301te\u0301 \u1100\u1161\u11a8 \u212b \ufb01 \u2460",  # NFC changes these
        "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # code\n",
        "",
    ]


@pytest.mark.parametrize("alias", MODELS)
def test_the_generic_class_reads_the_same_tokenizer_as_the_family_class(alias):
    from transformers import AutoTokenizer

    path = resolve_model_path(alias)
    ours = load_tokenizer(path, ARCHITECTURES[alias])
    # the same files read by the family class, which adds its own parts on every read (Qwen2's NFC normalizer):
    # a cache that lacks them reads differently here
    family = AutoTokenizer.from_pretrained(str(cache_root() / "gguf" / file_digest(path) / GGUF_TOKENIZER_DIR))
    tok = ours.hf_tokenizer
    assert type(tok) is not type(family) or type(family).__name__ == "TokenizersBackend"  # the family class is not read
    assert ours.class_name == type(family).__name__  # what /tokenizer_info says
    assert tok.backend_tokenizer.to_str() == family.backend_tokenizer.to_str()  # normalizer, pre-tokenizer, model, decoder
    assert (tok.padding_side, tok.truncation_side) == (family.padding_side, family.truncation_side)
    for text in _prose():
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert ids == family.encode(text, add_special_tokens=special), (alias, text[:40], special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == family.decode(ids, skip_special_tokens=skip)
    assert len(tok) == len(family)
    assert tok.get_vocab() == family.get_vocab()
    assert tok.special_tokens_map == family.special_tokens_map
    assert [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id] == [
        family.bos_token_id, family.eos_token_id, family.pad_token_id, family.unk_token_id]  # fmt: skip
    assert tok.chat_template == family.chat_template
    assert tok.all_special_ids == family.all_special_ids
    sample = list(range(0, len(family), 97))
    assert tok.convert_ids_to_tokens(sample) == family.convert_ids_to_tokens(sample)
    import xgrammar

    def grammar_view(t) -> str:  # what structured outputs compile against
        return xgrammar.TokenizerInfo.from_huggingface(t, vocab_size=len(t)).serialize_json()

    assert grammar_view(tok) == grammar_view(family)


MEASURE = """
import gc, sys
from kvserve.heap import release_free_heap
from kvserve.cache_dir import cache_root, file_digest
from kvserve.model.registry import resolve_model_path
from kvserve.model.tokenizer import GGUF_TOKENIZER_DIR, load_tokenizer
import transformers.tokenization_utils_tokenizers  # imports are not the tokenizer's
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
path = resolve_model_path("gemma-3-270m")
load_tokenizer(path, "gemma3")  # converted and cached once, so the measured load reads the cache as a server start does
gc.collect(); release_free_heap()
before = resident()
tok = load_tokenizer(path, "gemma3")
gc.collect()
assert release_free_heap(), "glibc's malloc_trim is missing"
print(resident() - before)
"""


def test_gemma_3s_tokenizer_costs_a_fraction_of_what_the_family_class_held():
    """Gemma 3's tokenizer held ~280 MB with GemmaTokenizer, ~340 MB before the heap was trimmed;
    read by the generic class and trimmed, ~115 MB (measured on 2026-12-07)."""
    measured = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, check=True, timeout=300)
    grown = int(measured.stdout.split()[-1])
    assert grown < 180 * 2**20, f"loading Gemma 3's tokenizer grew the process by {grown / 2**20:.0f} MiB"
