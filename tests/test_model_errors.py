"""Broken or partial models: one line naming the file and what is wrong (exit status 2, no traceback);
a weights-only directory serves token ids."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.errors import ModelLoadError
from server_process import launch_server, stop_server
from tiny_models import tiny_gguf


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def truncate(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


@pytest.fixture(scope="module")
def broken(tiny_dir, tiny_root, tmp_path_factory):
    """(name, model path, file the error must name, words it must say)."""
    root = tmp_path_factory.mktemp("broken")
    good = tiny_dir("llama")
    cases = []
    gguf = tiny_gguf(tiny_root)
    for fraction in (0.001, 0.5, 0.999):
        path = root / f"truncated-{fraction}.gguf"
        shutil.copy(gguf, path)
        truncate(path, fraction)
        cases.append((f"gguf truncated to {fraction}", path, path, "truncated"))
    corrupt = root / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 20)
    cases.append(("gguf corrupt", corrupt, corrupt, "corrupt"))
    not_gguf = root / "not.gguf"
    not_gguf.write_bytes(b"<html>not a model</html>")
    cases.append(("not a gguf", not_gguf, not_gguf, "not a GGUF file"))
    for fraction in (0.0001, 0.5):
        d = copy_dir(good, root / f"safetensors-{fraction}")
        truncate(d / "model.safetensors", fraction)
        cases.append((f"safetensors truncated to {fraction}", d, d / "model.safetensors", "truncated or corrupt safetensors"))
    d = copy_dir(good, root / "config-malformed")
    (d / "config.json").write_text((d / "config.json").read_text()[:-30])
    cases.append(("config.json malformed", d, d / "config.json", "not valid JSON"))
    cfg = json.loads((good / "config.json").read_text())
    for name, change, words in (
        ("hidden size", {"hidden_size": 120}, "does not match the weights"),
        ("heads", {"hidden_size": 128}, "not a multiple of the number of attention heads"),
        ("layers", {"num_hidden_layers": 4}, "does not match the weights"),
        ("missing key", {"num_attention_heads": None}, "num_attention_heads"),
        ("wrong type", {"num_hidden_layers": "three"}, "TypeError"),
        ("unsupported", {"model_type": "bert"}, "not supported"),
    ):
        d = copy_dir(good, root / f"config-{name.replace(' ', '-')}")
        changed = {k: v for k, v in {**cfg, **change}.items() if v is not None}
        (d / "config.json").write_text(json.dumps(changed))
        cases.append((f"config.json {name}", d, d / "config.json", words))
    d = copy_dir(good, root / "tokenizer-broken")
    truncate(d / "tokenizer.json", 0.5)
    cases.append(("tokenizer.json truncated", d, d / "tokenizer.json", "cannot load the tokenizer"))
    return cases


def test_each_broken_model_raises_one_line_naming_the_file(broken):
    for name, path, names, words in broken:
        with pytest.raises(ModelLoadError) as info:
            LLM(str(path), dtype="float32", kv_cache_memory=0.01)
        message = str(info.value)
        assert str(names) in message and words in message and "\n" not in message, (name, message)


@pytest.mark.parametrize("weight_dtype", ["gguf", "float32"])
def test_a_gguf_whose_head_counts_do_not_fit_its_tensors_is_one_line(tiny_root, tmp_path, weight_dtype):
    """A KV head count in the metadata that the k/v tensors do not have: one line naming the file, on
    the quantized blocks and on the dequantized path alike (llama's q/k rows are un-interleaved per
    head on both)."""
    path = tiny_gguf(str(tmp_path), quantized=True, kv_heads=3)
    proc = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--model", str(path), "--dtype", "float32",
                           "--weight-dtype", weight_dtype, "--kv-cache-memory", "0.01", "--prompt", "1 2 3",
                           "--skip-tokenizer-init"], capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "tensor/s" not in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"kvserve: error: {path}: "), lines


CLI_CASES = {
    # one of each kind through the CLI (every case is checked in-process above)
    "generate": ("gguf truncated to 0.5", "safetensors truncated to 0.5", "config.json heads"),
    "serve": ("gguf truncated to 0.999", "config.json malformed"),
}  # fmt: skip


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_cli_says_it_in_one_line_and_exits_2(broken, command):
    for name, path, names, words in (case for case in broken if case[0] in CLI_CASES[command]):
        extra = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
        proc = subprocess.run([sys.executable, "-m", "kvserve.cli", command, "--model", str(path), "--dtype", "float32",
                               "--kv-cache-memory", "0.01", *extra], capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (name, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout, name
        assert len(lines) == 1 and lines[0].startswith(f"kvserve: error: {names}: ") and words in lines[0], (name, lines)


@pytest.fixture(scope="module")
def weights_only(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("weights-only") / "llama"
    shutil.copytree(tiny_dir("llama"), d)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (d / name).unlink(missing_ok=True)
    return d


def test_a_weights_only_directory_generates_from_token_ids(weights_only, tiny_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    full = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.01).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    for llm in (LLM(str(weights_only), dtype="float32", kv_cache_memory=0.01),
                LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.01, skip_tokenizer_init=True)):  # fmt: skip
        assert llm.tokenizer is None
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
        assert out.token_ids == full.token_ids and out.text == ""
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("some text", params, use_tqdm=False)


def test_a_weights_only_server_answers_token_ids_and_refuses_text(weights_only):
    proc, url = launch_server(["--model", str(weights_only), "--port", "0", "--dtype", "float32", "--kv-cache-memory", "0.02"])
    try:
        ok = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "logprobs": 1}, timeout=60)
        assert ok.status_code == 200, ok.text
        choice = ok.json()["choices"][0]
        assert len(choice["token_ids"]) == 4 and choice["text"] == ""
        assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
                                                                 "stream": True}, timeout=60) as resp:  # fmt: skip
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]] == choice["token_ids"]
        for path, body in (("/v1/completions", {"prompt": "text", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": [5, 6], "stop": ["x"]})):  # fmt: skip
            resp = httpx.post(url + path, json=body, timeout=60)
            assert resp.status_code == 400 and "tokenizer" in resp.json()["error"]["message"], resp.text
    finally:
        stop_server(proc)
