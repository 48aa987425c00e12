"""Bad input raises ValueError naming the field or path."""

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir("qwen2")), dtype="float32", kv_cache_memory=0.01, max_model_len=64)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], use_tqdm=False)


def test_prompt_over_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 64], use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["num_running"] == 0


def test_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="got bool True"):  # found by QA: the server refused them, the API took them as 1
        llm.generate([[5, True]], use_tqdm=False)
    numpy = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match="tolist"):
        llm.generate([list(numpy.array([5, 6]))], use_tqdm=False)


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", 0), ("max_tokens", -3), ("top_p", 0.0), ("top_p", 1.5), ("temperature", -0.1), ("top_k", -2), ("min_p", 2.0)],
)
def test_bad_sampling_params(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM("/no/such/model")


@pytest.mark.parametrize(
    "field,value", [("block_size", 0), ("max_num_seqs", -1), ("kv_cache_memory", 0), ("dtype", "int3"), ("max_model_len", 0),
                    ("kv_cache_memory", "1"), ("kv_quant_residual", 70000), ("sink_tokens", 100), ("prefill_step_tokens", -1),
                    ("prefill_step_tokens", True), ("prefill_step_tokens", 1.5)],
)
def test_bad_engine_config(field, value):
    extra = {"kv_compression": "streaming", "kv_budget": 8} if field == "sink_tokens" else {}  # more sinks than the budget keeps
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value}, **extra).eviction


def test_a_pool_larger_than_the_machine_is_refused_before_it_is_allocated(tiny_dir):
    """Found by QA: --kv-cache-memory 1e9 grew the process to 16 GB on its way to a MemoryError."""
    import torch

    from kvserve.device_memory import device_memory_bytes

    more = device_memory_bytes(torch.device("cpu")) / 2**30 * 2
    with pytest.raises(ValueError, match="more than this cpu device gives"):
        LLM(str(tiny_dir("qwen2")), dtype="float32", kv_cache_memory=more)


def test_a_pool_that_fits_the_limit_but_not_beside_the_weights_is_one_plain_error(tiny_dir):
    """Found by QA: under ulimit -v, a pool below the limit that did not fit beside the loaded
    weights died in the allocator with a traceback. The pool here asks for 90% of a limit that
    leaves 1 GiB past what the process already maps."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource
        from kvserve import LLM
        mapped = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
        limit = mapped + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            LLM({str(tiny_dir("qwen2"))!r}, dtype="float32", kv_cache_memory=0.9 * limit / 2**30)
        except ValueError as exc:
            print("REFUSED", exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "REFUSED kv_cache_memory=" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "do not fit in what this cpu device gives this process" in done.stdout


def test_top_takes_host_and_port_and_refuses_bad_intervals(capsys):
    from kvserve.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["top", "127.0.0.1:9"]).url == "http://127.0.0.1:9"
    for interval in ("-1", "nan", "0"):
        with pytest.raises(SystemExit):
            parser.parse_args(["top", "--interval", interval])
        assert "positive number of seconds" in capsys.readouterr().err


def test_the_cli_names_the_flag_of_a_bad_value(capsys):
    from kvserve.cli import main

    assert main(["generate", "--prompt", "x", "--kv-keep-ratio", "1.5"]) == 2
    assert "--kv-keep-ratio (kv_keep_ratio) must be in (0, 1]" in capsys.readouterr().err


def test_an_int4_flag_beside_another_cache_is_refused_not_ignored():
    """Found by QA: `kvserve serve --kv-quant-residual 64` started a float cache and ignored the flag."""
    from kvserve.cli import build_parser
    from kvserve.engine_args import engine_config_from_args

    parser = build_parser()
    for flags in (["--kv-quant-residual", "64"], ["--no-kv-quant-sink-block"], ["--kv-cache-dtype", "int8", "--kv-quant-group-size", "16"]):
        with pytest.raises(ValueError, match="applies to --kv-cache-dtype int4 or int2"):
            engine_config_from_args(parser.parse_args(["serve", *flags]))
    config = engine_config_from_args(parser.parse_args(["serve", "--kv-cache-dtype", "int2", "--kv-quant-residual", "64"]))
    assert (config.kv_quant_residual, config.kv_quant_group_size, config.kv_quant_sink_block) == (64, 32, True)
    config = engine_config_from_args(parser.parse_args(["serve"]))
    assert (config.kv_quant_residual, config.kv_quant_group_size, config.kv_quant_sink_block) == (128, 32, True)
    # kvserve eval: flags given to the command apply to the rows they fit (the reference is not int4)
    config = engine_config_from_args(parser.parse_args(["serve", "--kv-quant-residual", "64"]), strict_kivi_flags=False)
    assert config.kv_quant_residual == 64 and config.kv_cache_dtype not in ("int4", "int2")


def test_max_model_len_beyond_capacity(tiny_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_dir("qwen2")), dtype="float32", num_kv_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len must be at least 2"):
        LLM(str(tiny_dir("qwen2")), dtype="float32", kv_cache_memory=0.01, max_model_len=1)


def test_unknown_engine_argument(tiny_dir):
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM(str(tiny_dir("qwen2")), max_num_seq=4)


@pytest.mark.parametrize("salt", ["\ud800", 5, b"x", "", "s" * 1025])
def test_bad_cache_salts_are_refused_before_anything_is_queued(llm, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, cache_salt=salt)
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["num_running"] == 0
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, cache_salt="ok")[0].token_ids) == 2


def test_a_prompt_that_is_not_unicode_is_refused(llm):
    with pytest.raises(ValueError, match="unpaired surrogate"):
        llm.generate("hi \ud800 there", SamplingParams(max_tokens=2), use_tqdm=False)


# ---------------------------------------------------------------- the API's messages, as a newcomer reads them
def _api_message(model, body: dict) -> tuple[str, str | None]:
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from kvserve.server.errors import validation_message

    with pytest.raises(ValidationError) as info:
        model(**body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return validation_message(RequestValidationError(errors))


def test_api_errors_name_the_field_once_and_never_say_body():
    from kvserve.server.protocol import CompletionRequest

    message, param = _api_message(CompletionRequest, {"prompt": "hi", "cache_salt": ""})
    assert param == "cache_salt" and message.startswith("cache_salt must") and message.count("cache_salt") == 1, message
    message, param = _api_message(CompletionRequest, {"prompt": "hi", "cache_salt": "\ud800"})
    assert param == "cache_salt" and not message.startswith("body"), message
    message, param = _api_message(CompletionRequest, {"prompt": "hi", "temperature": "hot"})
    assert (message, param) == ("temperature: Input should be a number", "temperature")


def test_a_message_without_content_is_refused_unless_an_assistants():
    from kvserve.server.protocol import ChatCompletionRequest

    for role in ("user", "system", "developer", "tool"):
        message, param = _api_message(ChatCompletionRequest, {"messages": [{"role": role}]})
        assert (message, param) == (f"messages.0: a {role} message needs its content", "messages")
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calls}])
    assert body.messages[1].text() == ""


def test_integral_floats_are_integers_as_openai_takes_them():
    from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

    body = CompletionRequest(prompt="hi", max_tokens=3.0, n=2.0, top_k=40.0, logprobs=1.0)
    assert (body.max_tokens, body.n, body.top_k, body.logprobs) == (3, 2, 40, 1) and isinstance(body.max_tokens, int)
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_completion_tokens=8.0).max_completion_tokens == 8
    seeded = CompletionRequest(prompt="hi", seed=7.0, stop_token_ids=[2.0, 5])
    assert (seeded.seed, seeded.stop_token_ids) == (7, [2, 5]) and isinstance(seeded.seed, int)
    for bad in (3.5, "3", True):
        assert _api_message(CompletionRequest, {"prompt": "hi", "seed": bad})[1] == "seed", bad
    for bad in (3.5, "3", True, float("inf")):
        message, param = _api_message(CompletionRequest, {"prompt": "hi", "max_tokens": bad})
        assert param == "max_tokens", (bad, message)


def test_too_many_prompts_blame_the_prompt_not_n():
    from types import SimpleNamespace

    from kvserve.server.errors import APIError
    from kvserve.server.serving_engine import OpenAIServing

    server = SimpleNamespace(config=SimpleNamespace(max_waiting_requests=256))
    with pytest.raises(APIError) as info:
        OpenAIServing.check_choices(server, 300, 1)
    assert info.value.param == "prompt" and "300 prompts" in info.value.message and "n=" not in info.value.message
    with pytest.raises(APIError) as info:
        OpenAIServing.check_choices(server, 100, 3)
    assert info.value.param == "n" and "100 prompts x n=3" in info.value.message
    OpenAIServing.check_choices(server, 256, 1)


def test_a_truncated_gguf_header_is_one_plain_line(tmp_path):
    from kvserve.model.errors import ModelLoadError
    from kvserve.model.loader import open_gguf

    path = tmp_path / "short.gguf"
    path.write_bytes(b"GGUF" + bytes([3, 0, 0, 0]) + bytes(9))  # a header cut inside its counts
    with pytest.raises(ModelLoadError) as info:
        open_gguf(path)
    message = str(info.value)
    assert "truncated or corrupt GGUF file" in message and "header" in message
    assert not any(word in message for word in ("numpy", "dtype", "buffer", "Error:")), message
