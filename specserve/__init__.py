"""specserve: speculative-decoding LLM inference engine and server."""

from specserve.inputs import TokensPrompt
from specserve.llm import LLM
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "TokensPrompt"]
