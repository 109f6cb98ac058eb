"""Speculative decoding's counters since start: what the scheduler's acceptance estimates
start from, and what the engine reports (StepStats, SchedulerStats, /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Speculative decoding since start (cumulative, vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications: requests that verified drafts in a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: verifications whose (i + 1)-th draft was accepted.
    accepted_per_position: list[int] = field(default_factory=list)
    num_rejections: int = 0  # verifications that rejected a draft (at most one each)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification emits on average: the accepted drafts plus the target's."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_rejections += num_accepted < num_drafts
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
