"""eaglespec: a PyTorch LLM inference engine built around EAGLE-3 speculative decoding."""

from eaglespec.config import SamplingParams, TreeConfig
from eaglespec.llm import LLM

__all__ = ["LLM", "SamplingParams", "TreeConfig"]
__version__ = "0.1.0"
