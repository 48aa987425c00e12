"""kvserve: an LLM inference engine and server built around the KV cache."""

from kvserve.engine.llm import LLM
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
