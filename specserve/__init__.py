"""specserve: speculative-decoding LLM inference engine and server."""

from specserve.inputs import TokensPrompt
from specserve.llm import LLM
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TokensPrompt"]
