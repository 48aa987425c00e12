"""`kvserve eval` on a tiny model: every column, an exact score for a lossless configuration, a
real cost for a lossy one, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from kvserve.cli import main
from kvserve.eval.text import EvalText, needle_cases, retrieved

FAST = ["--context", "192", "--max-windows", "2", "--greedy-prompts", "3", "--greedy-prompt-len", "24", "--greedy-tokens", "12",
        "--needle-lengths", "96,200,4096", "--needle-depths", "0.2,0.8", "--kv-cache-memory", "0.05", "--no-progress"]  # fmt: skip


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_scores_lossless_exactly_and_lossy_honestly(tiny_dir, capsys):
    model = str(tiny_dir("llama"))
    code, out, err = _run(capsys, "--model", model, "--json", "--config", "", "--config", "--kv-cache-dtype int8",
                          "--config", "--kv-cache-dtype int4 --kv-quant-residual 32", *FAST)  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["windows"] == 2 and report["scored_tokens"] == 2 * 191
    ref, same, int8, int4 = report["reference"], *report["configs"]
    columns = {"name", "flags", "kv_cache_dtype", "kv_hadamard", "kv_quant_sink_block", "bytes_per_token", "token_capacity", "perplexity", "perplexity_delta_pct",
               "mean_kl", "top1_agreement", "greedy_agreement", "needle", "needle_outside"}  # fmt: skip
    for row in (ref, same, int8, int4):
        assert set(row) == columns
        assert row["perplexity"] > 1.0
        # 4096 is longer than the tiny model's 512 positions: skipped, not failed
        assert set(row["needle"]) == {"96", "200", "4096"} and row["needle"]["4096"] is None
        assert all(0.0 <= row["needle"][n] <= 1.0 for n in ("96", "200"))
        assert row["needle_outside"] == {}  # --needle-question inside only
    assert ref["mean_kl"] is None and ref["perplexity_delta_pct"] is None
    assert not ref["kv_hadamard"] and not int4["kv_hadamard"]  # rotated only when asked (int8's default depends on the head dim)
    assert int4["kv_quant_sink_block"] and not ref["kv_quant_sink_block"]
    # the same flags again: the same computation, scored exactly
    assert same["mean_kl"] == 0.0 and same["perplexity_delta_pct"] == 0.0
    assert same["top1_agreement"] == 1.0 and same["greedy_agreement"] == 1.0
    assert same["needle"] == ref["needle"] and same["bytes_per_token"] == ref["bytes_per_token"]
    # lossy formats cost something measurable and save bytes
    for row, dtype in ((int8, "int8"), (int4, "int4")):
        assert row["kv_cache_dtype"] == dtype
        assert row["bytes_per_token"] < ref["bytes_per_token"] and row["token_capacity"] > ref["token_capacity"]
        assert row["mean_kl"] > 0.0 and row["top1_agreement"] < 1.0
        assert 0.0 <= row["greedy_agreement"] <= 1.0


def test_eval_table_has_every_column(tiny_dir, capsys):
    code, out, err = _run(capsys, "--model", str(tiny_dir("llama")), "--config", "--kv-cache-dtype fp8", *FAST)
    assert code == 0, err
    header = out.splitlines()[1]
    for column in ("config", "KV", "B/token", "capacity", "ppl", "Δppl", "mean KL", "top-1", "greedy", "needle 96", "needle 200", "needle 4096"):
        assert column in header
    assert out.splitlines()[3].startswith("reference") and out.splitlines()[4].startswith("--kv-cache-dtype fp8")


def test_a_config_of_one_dashed_flag_is_taken_as_the_configuration(tiny_dir, capsys):
    """argparse alone would read `--config --no-kv-key-centering` as two options and refuse it."""
    code, out, err = _run(capsys, "--model", str(tiny_dir("llama")), "--kv-cache-dtype", "int8", "--json", "--config",
                          "--no-kv-key-centering", *FAST)  # fmt: skip
    assert code == 0, err
    (plain,) = json.loads(out)["configs"]
    assert plain["flags"] == "--no-kv-key-centering" and plain["kv_cache_dtype"] == "int8" and plain["mean_kl"] > 0.0


def test_eval_scores_a_compressed_window_and_asks_needles_after_compressing(tiny_dir, capsys):
    """--score-from compresses each window's first tokens and scores the rest against the compressed
    cache; --needle-question both asks each needle with the question inside and outside the window."""
    flags = "--kv-compression snapkv --kv-budget 48 --snapkv-window 8"
    fast = [*FAST]
    fast[fast.index("--needle-lengths") + 1] = "96,200"
    code, out, err = _run(capsys, "--model", str(tiny_dir("llama")), "--json", "--score-from", "128", "--needle-question", "both",
                          "--config", "--kv-compression snapkv --kv-keep-ratio 1", "--config", flags, *fast)  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["score_from"] == 128 and report["scored_tokens"] == 2 * (192 - 128 - 1)
    ref, whole, squeezed = report["reference"], *report["configs"]
    assert set(ref["needle_outside"]) == {"96", "200"} and ref["needle_outside"] == ref["needle"]
    # keeping everything is the reference's computation; 48 of 128 tokens kept is not
    assert whole["mean_kl"] == 0.0 and whole["needle_outside"] == ref["needle_outside"]
    assert squeezed["mean_kl"] > 0.0 and squeezed["top1_agreement"] < 1.0
    assert all(0.0 <= squeezed["needle_outside"][n] <= 1.0 for n in ("96", "200"))
    code, out, err = _run(capsys, "--model", str(tiny_dir("llama")), "--score-from", "128", "--needle-question", "both",
                          "--config", flags, *fast)  # fmt: skip
    assert code == 0, err
    header = out.splitlines()[1]
    assert "needle 96" in header and "q-out 200" in header and "from position 128" in out.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "at least one --config"),
        (["--config", "--kv-cache-dtype int9"], "--config"),
        (["--config", "--model other"], "reference's model"),
        (["--config", "", "--context", "4096"], "max_model_len"),
        (["--config", "", "--text", "/nonexistent/file"], "cannot read --text"),
        (["--config", "", "--needle-depths", "1.5"], "needle-depths"),
        (["--config", "", "--score-chunk", "0"], "score-chunk"),
        (["--config", "garbage --block-size 16"], "not engine flags: garbage"),
        (["--config", "", "--greedy-tokens", "0"], "greedy-tokens"),
        (["--config", "", "--context", "192", "--score-from", "191"], "score-from"),
        (["--config", "", "--score-from", "-1"], "score-from"),
        (["--config", "", "--context", "1"], "--context must be at least 2"),
        (["--config", "", "--greedy-prompts", "100000"], "greedy-prompts"),
        (["--config", "", "--text", "/usr/bin/env"], "not a text file"),
        (["--config", "--kv-cache-dtype int4 --kv-compression snapkv --kv-keep-ratio 0.5"], "--config '--kv-cache-dtype int4"),
    ],
)
def test_eval_rejects_bad_input_with_one_line(tiny_dir, capsys, argv, message):
    code, out, err = _run(capsys, "--model", str(tiny_dir("llama")), "--kv-cache-memory", "0.05", "--no-progress", *argv)
    assert code == 2
    assert message in err and "Traceback" not in err and "usage:" not in err


@pytest.mark.parametrize("config", ["--kv-cache-memory 100000", "--max-model-len 100000"])
def test_a_config_the_engine_refuses_is_refused_before_the_reference_runs(tiny_dir, capsys, monkeypatch, config):
    """Found by QA: a --config whose pool the machine cannot hold was refused only after the reference's minutes of work."""
    import kvserve.eval.cli

    def no_run(*args, **kwargs):
        raise AssertionError("the evaluation started")

    monkeypatch.setattr(kvserve.eval.cli, "Evaluation", no_run)
    code, out, err = _run(capsys, "--model", str(tiny_dir("llama")), "--kv-cache-memory", "0.05", "--no-progress",
                          "--config", "--kv-cache-dtype int8", "--config", config)  # fmt: skip
    assert code == 2 and f"--config {config!r}" in err and "Traceback" not in err, err


class _CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_needles_are_exactly_as_long_as_asked_and_hold_their_key():
    tok = _CharTokenizer()
    text = EvalText.from_text(tok, "short filler text. ")
    assert text.prefix == [1]
    cases = needle_cases(tok, text, [300, 500], [0.0, 0.5, 1.0], seed=3)
    assert [c.length for c in cases] == [300] * 3 + [500] * 3
    for case in cases:
        assert len(case.token_ids) == case.length and case.token_ids[0] == 1
        assert case.key in "".join(chr(t) for t in case.token_ids[1:])
    assert len({c.key for c in cases}) > 1
    assert retrieved("12345", " 12345. Remember") and not retrieved("12345", " 1234") and not retrieved("12345", "none")
    assert not retrieved("12345", " 99999 then 12345")


def test_windows_and_prompts_cover_the_text():
    text = EvalText([t for t in range(1000)], [7])
    windows = text.windows(101, 20)
    assert len(windows) == 10 and all(len(w) == 101 and w[0] == 7 for w in windows)
    assert windows[1][1] == 100
    prompts = text.prompts(4, 11)
    assert [p[1] for p in prompts] == [0, 330, 660, 990]
    with pytest.raises(ValueError, match="fewer than one"):
        text.windows(5000, 2)
