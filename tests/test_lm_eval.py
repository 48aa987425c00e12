"""lm-evaluation-harness against a kvserve server, for real (`lm_eval` CLI, no hub): its
local-completions model scores a multiple-choice and a rolling log-likelihood task through echo and
the remote tokenizer (/tokenizer_info, /tokenize), and the per-document log-likelihoods equal the
same harness run in-process on `transformers` with the same weights; local-chat-completions runs a
generate_until task; an int4 KV server gives the quality gate next to the 16-bit one."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.chat_template import render_chat_template
from lm_eval_tasks import write_tasks
from server_process import launch_server, stop_server
from test_server import CHAT_TEMPLATE

SERVER_FLAGS = ["--dtype", "float32", "--port", "0", "--kv-cache-memory", "0.02", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def model_dir(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    return write_tasks(tmp_path_factory.mktemp("lm-eval-tasks"))


def lm_eval(out: Path, tasks_dir: Path, model: str, model_args: str, task: str, *extra: str) -> dict[str, list[dict]]:
    """Run the lm_eval CLI; returns each task's logged samples, by doc_id."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "datasets")}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", task, "--include_path", str(tasks_dir),
           "--output_path", str(out), "--log_samples", *extra]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    samples = {}
    for name in task.split(","):
        (path,) = glob.glob(str(out / "**" / f"samples_{name}_*.jsonl"), recursive=True)
        samples[name] = sorted((json.loads(line) for line in Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples


def loglikelihoods(samples: list[dict]) -> list[list[tuple[float, bool]]]:
    """Per document, each request's (log-likelihood, is_greedy) (a rolling one has no is_greedy)."""
    out = []
    for sample in samples:
        rows = sample["filtered_resps"]  # multiple choice: [[ll, is_greedy], ...]; rolling: [ll]
        rows = rows if isinstance(rows[0], list) else [rows]
        out.append([(float(r[0]), len(r) > 1 and r[1] == "True") for r in rows])
    return out


def completions_args(url: str) -> str:
    return f"base_url={url}/v1/completions,model=tiny,tokenizer_backend=remote,max_length=512,num_concurrent=1,max_retries=1"


@pytest.fixture(scope="module")
def transformers_run(model_dir, tasks, tmp_path_factory) -> dict[str, list[dict]]:
    """The harness's own transformers backend on the same weights, in float32."""
    return lm_eval(tmp_path_factory.mktemp("hf"), tasks, "hf", f"pretrained={model_dir},dtype=float32", "kvserve_choice,kvserve_perplexity",
                   "--device", "cpu")  # fmt: skip


def test_loglikelihood_tasks_through_kvserve_equal_transformers(model_dir, tasks, tmp_path, transformers_run):
    proc, url = launch_server(["--model", str(model_dir), *SERVER_FLAGS])
    try:
        ours = lm_eval(tmp_path, tasks, "local-completions", completions_args(url), "kvserve_choice,kvserve_perplexity")
    finally:
        stop_server(proc)
    for task in ("kvserve_choice", "kvserve_perplexity"):
        mine, theirs = loglikelihoods(ours[task]), loglikelihoods(transformers_run[task])
        assert len(mine) == len(theirs) == 8
        for doc, (a, b) in enumerate(zip(mine, theirs)):
            assert [v for v, _ in a] == pytest.approx([v for v, _ in b], abs=1e-3), (task, doc)
            assert [g for _, g in a] == [g for _, g in b], (task, doc)
    choices = loglikelihoods(ours["kvserve_choice"])
    assert len({max(range(4), key=lambda i: doc[i][0]) for doc in choices}) > 1  # the scores tell the choices apart


def test_int4_kv_quality_gate(model_dir, tasks, tmp_path, transformers_run):
    """The same perplexity task against --kv-cache-dtype int4: lossy (the scores move) and close."""
    proc, url = launch_server(["--model", str(model_dir), *SERVER_FLAGS, "--kv-cache-dtype", "int4", "--max-num-batched-tokens", "32"])
    try:
        int4 = lm_eval(tmp_path, tasks, "local-completions", completions_args(url), "kvserve_perplexity")
    finally:
        stop_server(proc)
    lossy = [doc[0][0] for doc in loglikelihoods(int4["kvserve_perplexity"])]
    exact = [doc[0][0] for doc in loglikelihoods(transformers_run["kvserve_perplexity"])]
    assert lossy != pytest.approx(exact, abs=1e-3)  # int4 was on: its rows read quantized keys and values
    assert sum(lossy) == pytest.approx(sum(exact), rel=0.05)


def test_generate_until_through_chat_completions(model_dir, tasks, tmp_path):
    proc, url = launch_server(["--model", str(model_dir), *SERVER_FLAGS, "--chat-template", CHAT_TEMPLATE])
    try:
        samples = lm_eval(tmp_path, tasks, "local-chat-completions", f"base_url={url}/v1/chat/completions,model=tiny,num_concurrent=1,"
                          "max_retries=1", "kvserve_generate", "--apply_chat_template")["kvserve_generate"]  # fmt: skip
    finally:
        stop_server(proc)
    reference = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02)
    tokenizer = reference.tokenizer
    prompts = [tokenizer.encode(render_chat_template(CHAT_TEMPLATE, [{"role": "user", "content": s["doc"]["question"]}],
                                                     tokenizer.special_tokens), add_special_tokens=False) for s in samples]  # fmt: skip
    expected = reference.generate(prompts, SamplingParams(max_tokens=8, temperature=0, stop=["\n"]), use_tqdm=False)
    assert [s["filtered_resps"][0] for s in samples] == [o.text for o in expected]
