"""bench/ladder.py --quick on a tiny model: every rung runs (the window rung on a model with sliding
windows), the table has a row per rung with the figures the issue names, the JSON holds them, and the
plots are valid PNGs that are not blank."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import png_pixels

REPO = Path(__file__).parent.parent
BENCH = REPO / "bench"


def test_ladder_quick_writes_the_table_and_plots(tiny_dir, tmp_path):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("ladder", BENCH / "ladder.py")
    ladder = sys.modules["ladder"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(ladder)
    model = tiny_dir("gemma3")
    # /bin/false as llama.cpp: its failure leaves its row out with the reason and keeps every kvserve rung
    ladder.main(["--quick", "--models", str(model), "--out", str(tmp_path), "--kv-cache-memory", "0.002", "--tier-gib", "0.01",
                 "--llama-cpp", "/bin/false", "--repeats", "2"])  # fmt: skip
    table = (tmp_path / "ladder.md").read_text()
    assert "| llama.cpp `llama-batched-bench` | failed: /bin/false exited with status 1 |" in table
    assert "--quick: a smoke test" in table
    for rung in ladder.RUNGS:
        assert f"| {rung.name} |" in table
    assert "skipped" not in table.split("revisit workload")[0]  # tiny gemma3 has sliding windows: every rung ran
    rungs = json.loads((tmp_path / "ladder.json").read_text())["ladders"][str(model)]["rungs"]
    assert len(rungs) == len(ladder.RUNGS)
    for r in rungs:
        assert r["tokens_per_second"] > 0 and r["ttft_p99"] >= r["ttft_p50"] > 0 and r["kv_bytes_per_request"] > 0
        assert r["max_concurrent"] >= 1 and r["generated_tokens"] == 10 * ladder.QUICK.new_tokens
    for r in rungs[1:]:  # two climbs: each rung shows its slower run (the lower middle of two), both rates kept
        assert len(r["extra"]["runs_tokens_per_second"]) == 2 and round(r["tokens_per_second"], 2) == min(r["extra"]["runs_tokens_per_second"])
    first = rungs[1]
    assert (first["perplexity_delta_pct"], first["greedy_agreement"]) == (0.0, 1.0)  # the reference
    assert rungs[2]["kv_bytes_per_request"] < first["kv_bytes_per_request"]  # int8 holds less than 16-bit
    assert rungs[3]["quality_from"] == "+ int8 KV" and rungs[6]["quality_from"] == "+ int8 KV"
    assert rungs[7]["quality_from"] == ""  # SnapKV evaluated on its own
    assert rungs[3]["extra"]["prefix_hit_tokens"] > 0 and rungs[1]["extra"]["prefix_hit_tokens"] == 0
    revisit = json.loads((tmp_path / "ladder.json").read_text())["ladders"][str(model)]["revisit"]["rungs"]
    assert [r["rung"] for r in revisit] == [r.name for r in ladder.RUNGS] and revisit[0]["skipped"]
    assert all(r["tokens_per_second"] > 0 and r["generated_tokens"] == 8 * ladder.QUICK.new_tokens for r in revisit[1:])
    assert set(revisit[6]["extra"]["tier_hit_tokens"]) == {"host", "disk"}  # the tier rung has both tiers
    assert "revisit workload" in table
    for name in (model.name, f"{model.name}-revisit", "headline"):
        width, height, pixels = png_pixels((tmp_path / f"{name}.png").read_bytes())
        assert width >= 600 and height >= 300 and len(set(pixels)) > 16
    # a rung's ratios to the rung below pair the climbs: int8's row shows the median (of two: the mean) of its climbs' ratios
    climbs = [(r["extra"]["runs_tokens_per_second"], r["extra"]["runs_ttft_p50"]) for r in rungs[1:3]]
    rate = sum(a / b for a, b in zip(climbs[1][0], climbs[0][0])) / 2
    ttft = sum(a / b for a, b in zip(climbs[1][1], climbs[0][1])) / 2
    row = next(line for line in table.splitlines() if line.startswith("| + int8 KV |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[3] == f"{rate:.2f}x" and cells[5] == f"{ttft:.2f}x", (cells, rate, ttft)
    # the page written again from its JSON, running nothing, is the same page
    again = tmp_path / "again"
    ladder.main(["--from-json", str(tmp_path / "ladder.json"), "--out", str(again)])
    assert (again / "ladder.md").read_text() == table
    assert json.loads((again / "ladder.json").read_text()) == json.loads((tmp_path / "ladder.json").read_text())
    assert (again / "headline.png").stat().st_size > 0


def test_ladder_ratios_pair_the_climbs(tmp_path):
    """A slow spell in one climb falls on the rung and the rung below alike: the median of the climbs'
    ratios sees through it where the ratio of the median runs does not (the page of 2026-12-07: the tier
    rung and SnapKV on Gemma 3's mixed workload, climb by climb)."""
    sys.path.insert(0, str(BENCH))
    import ladder

    tiers, snapkv = [169.72, 128.38, 167.41], [148.14, 137.47, 168.09]
    assert abs(ladder.paired_ratios(snapkv, tiers) - 168.09 / 167.41) < 1e-12
    assert sorted(snapkv)[1] / sorted(tiers)[1] < 0.89  # what the median runs would say
    with pytest.raises(ValueError, match="3 runs against 2"):
        ladder.paired_ratios(snapkv, tiers[:2])
    page = json.loads((REPO / "docs" / "ladder" / "ladder.json").read_text())
    nan = json.loads(json.dumps(page))
    rungs = nan["ladders"]["gemma-3-270m"]["rungs"]
    rungs[2]["extra"]["runs_tokens_per_second"][0] = float("nan")
    short = json.loads(json.dumps(page))
    short["ladders"]["gemma-3-270m"]["rungs"][2]["extra"]["runs_ttft_p50"].pop()
    for name, text, reason in (("empty", '{"ladders": {}}', "no ladders in it"), ("nan", json.dumps(nan), "finite positive number"),
                               ("short", json.dumps(short), "tok/s and TTFT lists differ"), ("broken", "{", "JSONDecodeError")):  # fmt: skip
        bad = tmp_path / f"{name}.json"
        bad.write_text(text)
        out = tmp_path / f"out-{name}"
        run = subprocess.run([sys.executable, str(BENCH / "ladder.py"), "--from-json", str(bad), "--out", str(out)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 2 and "not a ladder.json this script wrote" in run.stderr and reason in run.stderr, run.stderr
        assert not out.exists()  # nothing written, not even the folder
    (tmp_path / "a-file").write_text("")
    run = subprocess.run([sys.executable, str(BENCH / "ladder.py"), "--from-json", str(REPO / "docs" / "ladder" / "ladder.json"),
                          "--out", str(tmp_path / "a-file")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "exists and is not a folder" in run.stderr, run.stderr


def test_the_ladder_page_is_what_its_recorded_runs_say(tmp_path):
    """docs/ladder/ladder.md is bench/ladder.py's page of docs/ladder/ladder.json, not edited by hand."""
    sys.path.insert(0, str(BENCH))
    import ladder

    ladder.main(["--from-json", str(REPO / "docs" / "ladder" / "ladder.json"), "--out", str(tmp_path)])
    assert (tmp_path / "ladder.md").read_text() == (REPO / "docs" / "ladder" / "ladder.md").read_text()


# llama-batched-bench's stdout as llama.cpp 0.3.36 printed it here (Gemma 3 270M, -npp 16 -ntg 4
# -npl 1,2 -t 2): the ladder's and batched_bench's llama.cpp row are read from this table
LLAMA_BATCHED_BENCH_OUTPUT = """
llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      4 |    1 |     20 |    0.028 |   577.66 |    0.043 |    93.27 |    0.071 |   283.35 |
|    16 |      4 |    2 |     40 |    0.062 |   517.10 |    0.106 |    75.72 |    0.168 |   238.76 |
"""


def test_llama_cpps_rate_is_generated_tokens_over_the_whole_job():
    sys.path.insert(0, str(BENCH))
    from batched_bench import parse_rates

    rates = parse_rates(LLAMA_BATCHED_BENCH_OUTPUT, new_tokens=4)
    assert rates.keys() == {1, 2}
    assert abs(rates[1] - 4 / 0.071) < 1e-9 and abs(rates[2] - 2 * 4 / 0.168) < 1e-9
    assert parse_rates(LLAMA_BATCHED_BENCH_OUTPUT, new_tokens=128) == {}  # another run's table


def test_batched_bench_refuses_bad_flags_before_loading_a_model():
    for flags, reason in ((["--parallel", "abc"], "positive integers"), (["--parallel", "1,-2"], "positive integers"),
                          (["--parallel", "0"], "positive integers"), (["--llama-batched-bench", "/tmp"], "not an executable file"),
                          (["--llama-batched-bench", "/nonexistent"], "not an executable file"), (["--new-tokens", "0"], "must be positive")):  # fmt: skip
        run = subprocess.run([sys.executable, str(BENCH / "batched_bench.py"), *flags], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and reason in run.stderr, (flags, run.stderr)


def test_one_rung_against_the_rung_below(tiny_dir, capsys):
    """bench/ladder_rung.py: the rung asked for and the one below it, in turns, with both ratios; a name
    the model does not climb, and the first kvserve rung (nothing below it), are refused."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("ladder_rung", BENCH / "ladder_rung.py")
    rung = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rung)
    model = str(tiny_dir("gemma3"))
    rung.main(["--quick", "--model", model, "--rung", "+ SnapKV 0.5", "--repeats", "2", "--kv-cache-memory", "0.002", "--tier-gib", "0.01"])
    out = capsys.readouterr().out
    assert out.count("+ host and disk tiers (run ") == 2 and out.count("+ SnapKV 0.5 (run ") == 2
    assert "+ SnapKV 0.5 / + host and disk tiers, the median of the repeats' ratios: tok/s " in out and "(target >= 0.97x)" in out
    for bad, message in (("+ nothing", "climbs paged, 16-bit KV"), ("paged, 16-bit KV", "no rung below it")):
        with pytest.raises(SystemExit, match=message):
            rung.main(["--quick", "--model", model, "--rung", bad, "--kv-cache-memory", "0.002"])
