"""The CLI's defaults and its errors."""

from kvserve.cli import build_parser
from kvserve.config import EngineConfig


def test_the_default_model_is_the_instruction_tuned_one():
    for command in (["serve"], ["generate", "--prompt", "x"]):
        assert build_parser().parse_args(command).model == "smollm2-135m-instruct"
    assert EngineConfig().model == "smollm2-135m-instruct"

