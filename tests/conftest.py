import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import tiny_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_dir(tiny_root):
    def build(family: str) -> Path:
        return tiny_model_dir(family, tiny_root)

    return build


def random_prompts(count: int, low: int, high: int, seed: int = 0, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
