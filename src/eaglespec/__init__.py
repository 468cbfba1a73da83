"""eaglespec: a PyTorch LLM inference engine built around EAGLE-3 speculative decoding."""

from eaglespec.config import SamplingParams
from eaglespec.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
