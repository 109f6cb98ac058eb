"""Prompt shapes `LLM.generate` takes, as vLLM names them (`vllm.inputs`): a string, a
`TextPrompt` or a `TokensPrompt`. They are TypedDicts, so plain dicts with the same keys work
the same; a key tandem cannot honour (multimodal data, prompt embeddings, ...) is refused
with a ValueError, never ignored."""

from __future__ import annotations

import json
from typing import Any, TypedDict, Union


class _TextPromptRequired(TypedDict):
    prompt: str  # tokenized with the model's tokenizer (special tokens added)


class TextPrompt(_TextPromptRequired, total=False):
    cache_salt: str  # prefix-cache blocks are shared only among prompts with the same salt


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, total=False):
    prompt: str  # the text of the ids, if the caller has it: echoed in RequestOutput.prompt
    cache_salt: str


PromptType = Union[str, TextPrompt, TokensPrompt]  # noqa: UP007 - a runtime alias on 3.10

# Keys of vLLM's prompt dicts that tandem has nothing to do with: refused, never dropped.
UNSUPPORTED_PROMPT_KEYS = {
    "multi_modal_data": "tandem runs text-only models",
    "mm_processor_kwargs": "tandem runs text-only models",
    "multi_modal_uuids": "tandem runs text-only models",
    "prompt_embeds": "tandem takes token ids, not embeddings",
    "token_type_ids": "tandem runs decoder-only models",
    "encoder_prompt": "tandem runs decoder-only models",
    "decoder_prompt": "tandem runs decoder-only models",
}
KNOWN_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def check_prompt_keys(prompt: dict) -> None:
    """ValueError naming any key of a prompt dict that tandem would otherwise ignore."""
    for key in prompt:
        if key in UNSUPPORTED_PROMPT_KEYS:
            raise ValueError(f"prompt key {key!r} is not supported: {UNSUPPORTED_PROMPT_KEYS[key]}")
        if key not in KNOWN_PROMPT_KEYS:
            raise ValueError(
                f"unknown prompt key {key!r}: a prompt dict has 'prompt' (text) or "
                "'prompt_token_ids', and optionally 'cache_salt'"
            )


def tool_call_arguments(arguments: str) -> dict[str, Any]:
    """A chat history's tool call arguments (OpenAI sends them as JSON text) as the object chat
    templates take, as vLLM passes them ("" is no arguments); ValueError if not an object."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise ValueError(
            f"a tool call's `arguments` must be a JSON object, as a string; got {arguments!r}"
        )
    return parsed
