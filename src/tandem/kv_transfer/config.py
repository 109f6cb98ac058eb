"""How an instance takes part in disaggregated serving. Torch-free: it crosses into the
engine-core process inside EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "both")
DEFAULT_KV_PORT = 14579


@dataclass(frozen=True)
class KVTransferConfig:
    """`role`: prefill (keeps finished prompts' KV for decode instances to pull) or decode
    (pulls it). `host`: the address peers reach this instance at, for the control socket and
    the torch.distributed pair groups; `port`: a prefill instance's control port, with the
    rendezvous store of its pair groups on port + 1."""

    role: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_KV_PORT
    # A decode instance waits this long for a transfer (connecting included), or for the
    # next word of a stream, before it computes the prompt itself; a prefill instance ends a
    # stream whose prefill leg has not come within it.
    timeout: float = 30.0
    # A prefill instance keeps a finished prompt's blocks this long for a decode instance to
    # pull; then they go back to the pool (the decode side, if it ever asks, prefills locally).
    hold_seconds: float = 120.0
    # Blocks travel in chunks of about this many bytes (all layers of a run of blocks), two in
    # flight, so gathering one overlaps sending the other.
    chunk_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"a KV transfer role is prefill or decode, got {self.role!r}")
        if not 0 < self.port < 65535:
            raise ValueError(f"kv port must be in 1..65534 (port + 1 is used too), got {self.port}")
        if self.timeout <= 0 or self.hold_seconds <= 0 or self.chunk_bytes < 1:
            raise ValueError("kv transfer timeout, hold_seconds and chunk_bytes must be positive")
