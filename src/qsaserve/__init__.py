"""qsaserve: a small, fast, faithful LLM serving engine."""
from qsaserve.config import EngineConfig
from qsaserve.entrypoints.llm import LLM
from qsaserve.errors import InvalidRequestError
from qsaserve.outputs import CompletionOutput, Logprob, RequestOutput
from qsaserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob", "InvalidRequestError"]
__version__ = "0.1.0"
