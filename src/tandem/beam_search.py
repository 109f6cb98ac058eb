"""Beam search on top of the engine, as vLLM's offline `LLM.beam_search` does it.

Every step submits each live beam as a prompt for one token with `logprobs=2 * beam_width`
(Hugging Face's rule: twice the width, so beams that end at EOS cannot starve the rest), so
the engine sees ordinary requests; prefix caching makes the repeated prompts cheap. Each
candidate token of a beam's logprob row extends it; an EOS ends it (unless ignore_eos); the
`beam_width` best by score live on. At the end, finished and live beams are ranked together.

The score is vLLM's (after Hugging Face): cum_logprob / len(tokens) ** length_penalty, where
`tokens` includes the prompt and a final EOS does not count. `tokens` and `text` include the
prompt, as in vLLM.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from tandem.outputs import Logprob, RequestOutput
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.llm import LLM


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (same fields, order and defaults)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # 0: each beam's own next token is argmax (candidates are the top)
    length_penalty: float = 1.0
    # Accepted for vLLM's sake; the offline beam search has no stop strings, so no effect.
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, value in (("beam_width", self.beam_width), ("max_tokens", self.max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, value in (("temperature", self.temperature),
                            ("length_penalty", self.length_penalty)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens and the generated ones, a logprob row per generated token
    (the candidates its step saw), their summed logprob, and once returned, the decoded text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length", set on returned beams
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """vLLM's score: length-normalised cumulative logprob (a final EOS is not counted)."""
    length = len(tokens) - (1 if eos_token_id is not None and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length**length_penalty)


@dataclass
class _Instance:
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """One search over a batch of prompts, driven a step at a time by an engine, offline
    (run_beam_search) or async (AsyncLLM.beam_search): `live()` says which beams to extend (one
    engine request each: the beam's tokens as its prompt, `step_params`), `extend()` takes each
    one's logprob row of the new token, `results()` ranks the beams at the end."""

    def __init__(
        self,
        prompts: Sequence[list[int]],
        params: BeamSearchParams,
        eos_token_id: int | None,
        max_model_len: int,
    ) -> None:
        self.params = params
        self.eos = None if params.ignore_eos else eos_token_id
        self.max_model_len = max_model_len
        self.step_params = SamplingParams(
            logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature
        )
        self.num_steps = 0
        self._instances = [_Instance([BeamSearchSequence(list(p))]) for p in prompts]

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty
        )

    def live(self) -> list[tuple[_Instance, BeamSearchSequence]]:
        """The beams to extend next (none once max_tokens steps have run). A beam that fills the
        context cannot grow: it is done."""
        if self.num_steps >= self.params.max_tokens:
            return []
        for instance in self._instances:
            instance.completed += [b for b in instance.beams if len(b.tokens) >= self.max_model_len]
            instance.beams = [b for b in instance.beams if len(b.tokens) < self.max_model_len]
        return [(instance, beam) for instance in self._instances for beam in instance.beams]

    def extend(
        self,
        live: list[tuple[_Instance, BeamSearchSequence]],
        rows: Sequence[dict[int, Logprob] | None],
    ) -> None:
        """Each live beam's logprob row of its next token: every candidate extends it (an EOS
        ends the child), and each prompt keeps its beam_width best children."""
        self.num_steps += 1
        for instance in self._instances:
            instance.beams = []
        grown: dict[int, list[BeamSearchSequence]] = {}
        for (instance, beam), row in zip(live, rows, strict=True):
            for token_id, logprob in (row or {}).items():
                child = BeamSearchSequence(
                    [*beam.tokens, token_id],
                    [*beam.logprobs, row],
                    beam.cum_logprob + logprob.logprob,
                )
                if token_id == self.eos:
                    instance.completed.append(child)
                else:
                    grown.setdefault(id(instance), []).append(child)
        for instance in self._instances:
            candidates = sorted(grown.get(id(instance), []), key=self.score, reverse=True)
            instance.beams = candidates[: self.params.beam_width]

    def results(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, the beam_width best beams (finished and live ranked together), best
        first, their finish_reason set; their text is the caller's (offline it includes the
        prompt, served it does not)."""
        results = []
        for instance in self._instances:
            ranked = sorted(
                itertools.chain(instance.completed, instance.beams), key=self.score, reverse=True
            )
            best = ranked[: self.params.beam_width]
            for beam in best:
                ended = self.eos is not None and beam.logprobs and beam.tokens[-1] == self.eos
                beam.finish_reason = "stop" if ended else "length"
            results.append(best)
        return results


def first_row(output: RequestOutput) -> dict[int, Logprob] | None:
    """The logprob row of a one-token step's token (None where it has none)."""
    return (output.outputs[0].logprobs or [None])[0]


def run_beam_search(
    llm: LLM,
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """Beam search for each prompt's token ids; prompts are validated first (like generate)."""
    engine = llm.llm_engine
    if concurrency_limit is not None and concurrency_limit < 1:
        raise ValueError(f"concurrency_limit must be >= 1 or None, got {concurrency_limit}")
    limit = concurrency_limit or max(1, len(prompts))
    tokenizer = llm.get_tokenizer()
    results = []
    for start in range(0, len(prompts), limit):
        search = BeamSearch(
            prompts[start : start + limit], params, engine.processor.eos_token_id,
            engine.max_model_len,
        )  # fmt: skip
        llm.config.check_logprobs(search.step_params)  # fail before anything runs
        steps = range(params.max_tokens)
        for _ in tqdm(steps, desc="Beam search", unit="token", disable=not use_tqdm):
            live = search.live()
            if not live:
                break
            outputs = llm.generate(
                [{"prompt_token_ids": beam.tokens} for _, beam in live], search.step_params,
                use_tqdm=False,
            )  # fmt: skip
            search.extend(live, [first_row(output) for output in outputs])
        for best in search.results():
            for beam in best:
                beam.text = None if tokenizer is None else tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(best))
    return results
