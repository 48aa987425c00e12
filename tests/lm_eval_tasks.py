"""lm-evaluation-harness tasks built from local prose (no hub): a multiple-choice task, a rolling
log-likelihood (perplexity) task and a generate_until task, as YAML + JSON lines in one directory
that `lm_eval --include_path DIR` reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

LICENSE = Path("/usr/share/common-licenses/GPL-3")
TASKS = ("kvserve_choice", "kvserve_perplexity", "kvserve_generate")


def _sentences(text: str, low: int, high: int) -> list[str]:
    flat = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+", flat) if low <= len(s.strip()) <= high]


def write_tasks(root: Path, docs: int = 8, paragraph_chars: int = 900) -> Path:
    """Write the three tasks under root; returns root (for --include_path)."""
    text = LICENSE.read_text()
    sentences = _sentences(text, 60, 160)[: docs * 4]
    choice_docs = []
    for i in range(docs):
        group = sentences[4 * i : 4 * i + 4]
        cut = [s.index(" ", len(s) // 2) for s in group]
        answer = i % 4
        endings = [s[c:] for s, c in zip(group, cut)]
        choice_docs.append({"context": group[answer][: cut[answer]], "choices": endings, "answer": answer})
    flat = re.sub(r"\s+", " ", text)
    paragraphs = [flat[k : k + paragraph_chars] for k in range(2000, 2000 + docs * paragraph_chars, paragraph_chars)]
    generate_docs = [{"question": d["context"], "answer": d["choices"][d["answer"]]} for d in choice_docs]
    data = {"kvserve_choice": choice_docs, "kvserve_perplexity": [{"text": p} for p in paragraphs], "kvserve_generate": generate_docs}
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = lambda name: f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / (name + '.jsonl')}\ntest_split: test\n"  # noqa: E731
    (root / "kvserve_choice.yaml").write_text(common("kvserve_choice") + (
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    ))  # fmt: skip
    (root / "kvserve_perplexity.yaml").write_text(common("kvserve_perplexity") + (
        "output_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\n"
        "doc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    ))  # fmt: skip
    (root / "kvserve_generate.yaml").write_text(common("kvserve_generate") + (
        "output_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n"
    ))  # fmt: skip
    return root


if __name__ == "__main__":  # python tests/lm_eval_tasks.py DIR [--docs N] [--paragraph-chars N]: the tasks, for lm_eval --include_path DIR
    import argparse

    parser = argparse.ArgumentParser(description="write kvserve_choice, kvserve_perplexity and kvserve_generate under DIR")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--docs", type=int, default=8, help="documents per task (default: 8)")
    parser.add_argument("--paragraph-chars", type=int, default=900, help="characters per perplexity document (default: 900)")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(write_tasks(args.dir.resolve(), args.docs, args.paragraph_chars))
