"""What a step asks of the machine, counted from the model's shape and the scheduled batch:
floating-point operations and bytes moved. A step's arithmetic intensity (FLOPs per byte)
against the machine's ridge point (peak FLOP/s over peak bytes/s) says which bound it is under:
decode steps re-read every weight for a few tokens (memory), long prefill chunks reuse each
weight for many (compute). Plain arithmetic, no torch: the scheduler may use it.

Counted (a matmul of m x k by k x n is 2mkn FLOPs):
- per new token, every projection (q, k, v, o, gate, up, down), in every layer;
- attention: scores and the weighted sum over the token's context (positions before it and
  itself), 4 * heads * head_dim FLOPs per context position per layer;
- the LM head only at sampled rows.
Bytes: every layer weight and the LM head once per step (the embedding only at the rows
looked up), each request's KV over its context (keys and values, each layer), the new tokens'
KV written, and per new token the activations a layer reads and writes between its matmuls.
Norms, RoPE, softmax and biases are left out: well under 1% of either count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from tandem.config import ModelConfig

# Tensors a layer reads or writes between its matmuls, per new token, in units of the hidden
# size (input, normed input, q/k/v, attention output, o output, residual, normed, MLP output)
# and of the intermediate size (gate, up, their product).
_HIDDEN_ACTIVATIONS_PER_LAYER = 8
_INTERMEDIATE_ACTIVATIONS_PER_LAYER = 3


@dataclass(frozen=True)
class ModelShape:
    """The sizes the counts need, and how many bytes each kind of number takes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: float  # per dense weight: 4 fp32, 2 bf16
    kv_bytes: int  # per cached key or value element
    activation_bytes: int  # per activation element
    # Layer weights also kept packed (models/packed.py): steps of at most packed_max_tokens
    # new tokens read these packed_weights (layers' and LM head's) as packed_bytes instead.
    packed_weights: int = 0
    packed_bytes: int = 0
    packed_max_tokens: int = 0

    @classmethod
    def of(
        cls,
        config: ModelConfig,
        weight_bytes: float,
        kv_bytes: int,
        activation_bytes: int,
        packed: tuple[int, int, int] = (0, 0, 0),
    ) -> ModelShape:
        """`packed`: (packed_weights, packed_bytes, packed_max_tokens)."""
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            weight_bytes=weight_bytes,
            kv_bytes=kv_bytes,
            activation_bytes=activation_bytes,
            packed_weights=packed[0],
            packed_bytes=packed[1],
            packed_max_tokens=packed[2],
        )

    @property
    def layer_weights(self) -> int:
        """Weights of one decoder layer's projections."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q_size + 2 * kv_size)  # q and o, k and v
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def lm_head_weights(self) -> int:
        return self.hidden_size * self.vocab_size

    @cached_property
    def work_rates(self) -> WorkRates:
        """sums_work's constants, worked out once: it runs every step."""
        layers = self.num_layers
        activations_per_token = (
            _HIDDEN_ACTIVATIONS_PER_LAYER * self.hidden_size
            + _INTERMEDIATE_ACTIVATIONS_PER_LAYER * self.intermediate_size
        ) * layers
        weight_bytes = self.weight_bytes * (self.layer_weights * layers + self.lm_head_weights)
        return WorkRates(
            flops_per_new_token=2 * self.layer_weights * layers,
            flops_per_attended=4 * self.num_heads * self.head_dim * layers,
            flops_per_sampled=2 * self.lm_head_weights,
            weight_bytes=weight_bytes,
            packed_weight_bytes=weight_bytes
            + (self.packed_bytes - self.weight_bytes * self.packed_weights),
            bytes_per_new_token=self.weight_bytes * self.hidden_size  # the embedding row
            + self.activation_bytes * activations_per_token,
            kv_bytes_per_position=self.kv_bytes * 2 * self.num_kv_heads * self.head_dim * layers,
            bytes_per_sampled=self.activation_bytes * self.vocab_size,  # logits
        )


@dataclass(frozen=True)
class WorkRates:
    """A shape's FLOPs and bytes per unit of a batch's sums (sums_work is linear in them):
    every weight read once a step (`packed_weight_bytes` for a step on the packed weights),
    and per new token, attended position, KV position (read or written) and sampled row."""

    flops_per_new_token: int
    flops_per_attended: int
    flops_per_sampled: int
    weight_bytes: float
    packed_weight_bytes: float
    bytes_per_new_token: float
    kv_bytes_per_position: float
    bytes_per_sampled: float


@dataclass(frozen=True)
class StepWork:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0


class ScheduledWork(Protocol):
    """One request's part of a step (the scheduler's ScheduledRequest is one): tokens it had,
    tokens it adds, whether it samples, the drafts among its new tokens."""

    num_computed_tokens: int
    num_new_tokens: int
    sample: bool
    draft_token_ids: Sequence[int]


@dataclass(frozen=True)
class BatchSums:
    """What a step's counts depend on, summed over its requests (so a plan can add and remove
    requests one at a time): new tokens, the positions those tokens attend to, the positions
    whose KV is read, and the rows sampled."""

    num_new_tokens: int = 0
    num_attended: int = 0
    num_context: int = 0
    num_sampled: int = 0

    def __add__(self, other: BatchSums) -> BatchSums:
        return BatchSums(
            self.num_new_tokens + other.num_new_tokens,
            self.num_attended + other.num_attended,
            self.num_context + other.num_context,
            self.num_sampled + other.num_sampled,
        )

    def __sub__(self, other: BatchSums) -> BatchSums:
        return BatchSums(
            self.num_new_tokens - other.num_new_tokens,
            self.num_attended - other.num_attended,
            self.num_context - other.num_context,
            self.num_sampled - other.num_sampled,
        )


def request_sums(
    num_computed_tokens: int, num_new_tokens: int, sample: bool, num_draft_tokens: int = 0
) -> BatchSums:
    """One request's part: a token at position p attends to p + 1 positions. A request that
    verifies draft tokens (counted in its new tokens) samples one row more per draft."""
    before, new = num_computed_tokens, num_new_tokens
    num_sampled = (1 + num_draft_tokens) if sample else 0
    return BatchSums(new, new * before + new * (new + 1) // 2, before + new, num_sampled)


def batch_sums(batch: Iterable[ScheduledWork]) -> BatchSums:
    total = BatchSums()
    for work in batch:
        total += request_sums(
            work.num_computed_tokens, work.num_new_tokens, work.sample, len(work.draft_token_ids)
        )
    return total


def sums_work(shape: ModelShape, sums: BatchSums) -> StepWork:
    """The FLOPs and bytes of one forward over a batch with these sums (see the module's
    docstring)."""
    rates = shape.work_rates
    num_new, num_sampled = sums.num_new_tokens, sums.num_sampled
    flops = (
        rates.flops_per_new_token * num_new
        + rates.flops_per_attended * sums.num_attended
        + rates.flops_per_sampled * num_sampled
    )
    weight_bytes = (
        rates.packed_weight_bytes if num_new <= shape.packed_max_tokens else rates.weight_bytes
    )
    num_bytes = (
        weight_bytes
        + rates.bytes_per_new_token * num_new
        + rates.kv_bytes_per_position * (sums.num_context + num_new)  # read, write
        + rates.bytes_per_sampled * num_sampled
    )
    return StepWork(float(flops), float(num_bytes))


@dataclass(frozen=True)
class MachinePeaks:
    """What the machine can do at best: FLOP/s at the dtype the model runs in, and bytes/s."""

    name: str
    flops_per_second: float
    bytes_per_second: float

    @property
    def ridge_point(self) -> float:
        """The intensity above which a step is compute-bound."""
        return self.flops_per_second / self.bytes_per_second


@dataclass(frozen=True)
class StepRoofline:
    flops: float
    bytes: float
    flops_per_second: float  # achieved
    bytes_per_second: float  # achieved
    mfu: float  # achieved FLOP/s over the peak
    mbu: float  # achieved bytes/s over the peak
    bound: str  # "compute" or "memory"


def place_step(work: StepWork, step_time: float, peaks: MachinePeaks) -> StepRoofline:
    """Where a step that took `step_time` seconds sits against the machine's roofline."""
    flop_rate = work.flops / step_time if step_time > 0 else 0.0
    byte_rate = work.bytes / step_time if step_time > 0 else 0.0
    return StepRoofline(
        flops=work.flops,
        bytes=work.bytes,
        flops_per_second=flop_rate,
        bytes_per_second=byte_rate,
        mfu=flop_rate / peaks.flops_per_second,
        mbu=byte_rate / peaks.bytes_per_second,
        bound="compute" if work.intensity >= peaks.ridge_point else "memory",
    )
