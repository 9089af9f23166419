"""One rank's inference engine and the offline `LLM` API."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams"]
