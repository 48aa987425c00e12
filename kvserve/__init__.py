"""kvserve: an LLM inference engine and server built around the KV cache."""

from kvserve.engine.beam import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from kvserve.engine.llm import LLM
from kvserve.lora.request import LoRARequest
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
