"""tandem: an LLM inference engine built around the prefill/decode split."""

from typing import Any

from tandem.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tandem.inputs import PromptType, TextPrompt, TokensPrompt
from tandem.outputs import CompletionOutput, RequestOutput
from tandem.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "PromptType",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; `tandem.core` (a torch-free simulator's entry) must not.
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
