"""Structured outputs: requests whose output is held to a grammar (a JSON schema, any JSON, a
regex, a choice of strings, an EBNF grammar), as vLLM's default backend does it: xgrammar
compiles the grammar against the tokenizer's vocabulary once, a matcher per request follows
its tokens, and each step its matcher gives a bitmask of the tokens that keep the output
within the grammar (tens of microseconds a row); the sampler sets every other token to -inf
(logits_processors.py). When the grammar is complete only EOS is allowed, so the reply ends.

The matchers live in the engine core beside the requests: each is advanced over the tokens
its request got since the step before (a preempted request keeps its tokens, and so its
matcher's place). xgrammar is an optional dependency (`tandem[structured]`): it is imported
when the first such request arrives, and its absence is that request's error.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class _Follower:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0  # of the request's output tokens


class StructuredOutputs:
    """The grammars of the engine core's requests, by request id."""

    def __init__(self, tokenizer_source: Path | None, vocab_size: int) -> None:
        self.tokenizer_source = tokenizer_source  # None: the engine has no tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None  # xgrammar.GrammarCompiler, made on first use
        self._followers: dict[str, _Follower] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._followers

    def __len__(self) -> int:
        return len(self._followers)

    def add(
        self, request_id: str, params: StructuredOutputsParams, eos_token_id: int | None
    ) -> None:
        """Compile the request's grammar (ValueError, naming what is wrong, if it cannot be)."""
        xgr = _xgrammar()
        compiled = self._compile(xgr, params)
        stops = None if eos_token_id is None else [eos_token_id]
        self._followers[request_id] = _Follower(
            xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        )

    def forget(self, request_id: str) -> None:
        self._followers.pop(request_id, None)

    def bitmask(self, request_id: str, output_token_ids: list[int]) -> torch.Tensor:
        """The request's allowed next tokens, as xgrammar's int32 bitmask row (bit i of word
        i // 32: token i), after its matcher has taken the tokens it got since the last call."""
        xgr = _xgrammar()
        follower = self._followers[request_id]
        for token_id in output_token_ids[follower.num_accepted :]:
            if follower.matcher.is_terminated():
                break  # past its EOS (below): nothing more to follow
            if not follower.matcher.accept_token(token_id):
                # Only a token the mask allowed can be sampled; one that is not (a stop token
                # the grammar has no place for) leaves the matcher where it was.
                logger.warning("request %s: token %d is outside its grammar", request_id, token_id)
        follower.num_accepted = len(output_token_ids)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        if follower.matcher.is_terminated():
            # It took its EOS and runs on (ignore_eos, or min_tokens not reached): only EOS
            # again, as after the grammar's end.
            bitmask.zero_()
            for token_id in follower.matcher.stop_token_ids:
                word, bit = divmod(token_id, 32)
                bitmask[0, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # as int32
        else:
            follower.matcher.fill_next_token_bitmask(bitmask)
        return bitmask[0]

    def _compile(self, xgr: Any, params: StructuredOutputsParams) -> Any:
        compiler = self._compiler or self._make_compiler(xgr)
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return compiler.compile_json_schema(
                    schema, any_whitespace=not params.disable_any_whitespace
                )
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                literals = " | ".join(_ebnf_string(choice) for choice in params.choice or ())
                return compiler.compile_grammar(f"root ::= {literals}")
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as error:  # xgrammar's errors for a bad spec
            # less its "[time] file.cc:line: " prefix
            reason = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(error)).strip()
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {reason}") from None

    def _make_compiler(self, xgr: Any) -> Any:
        if self.tokenizer_source is None:
            raise ValueError(
                "structured_outputs needs the tokenizer's vocabulary: do not pass "
                "skip_tokenizer_init=True"
            )
        from tandem.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.tokenizer_source)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured_outputs needs xgrammar: pip install 'tandem[structured]'"
        ) from None
    return xgrammar
