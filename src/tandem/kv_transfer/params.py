"""`kv_transfer_params`, vLLM's request and response field, as tandem reads and writes it.

A request to a prefill instance carries `{"do_remote_decode": true}`: the instance computes the
prompt and the first token, keeps the prompt's KV blocks, and answers with a `RemotePrefill`
dict. The router hands that dict, unchanged, to a decode instance with the same request: the
decode instance pulls the blocks it lacks and goes on from the first token, never recomputing
the prompt.

The router instead sends both legs at once, so that KV streams while the prompt is computed:
the prefill leg carries `{"do_remote_decode": true, "transfer_id": T}` and the decode leg a
`RemoteStream` naming the prefill instance and T. The prefill instance copies each block out as
soon as its step has computed it; the decode instance pulls them as they come, and the
`RemotePrefill` dict (the first token) last. A `RemotePrefill` with a transfer id (the answer
to a prefill leg that had one) is pulled the same way. Torch-free: the scheduler reads it."""

from __future__ import annotations

from array import array
from dataclasses import MISSING, asdict, dataclass
from typing import Any

from tandem.outputs import Logprob
from tandem.sampling_params import SamplingParams

try:  # a declared dependency; the engine core must import where only torch is installed
    import xxhash
except ImportError:  # pragma: no cover - exercised on bare GPU machines
    xxhash = None


def prompt_digest(token_ids: list[int]) -> str:
    """A digest of the prompt's token ids: a decode instance that tokenized the request to other
    ids (another model or tokenizer) must not take this KV."""
    data = array("q", token_ids).tobytes()
    if xxhash is not None:
        return xxhash.xxh3_128_hexdigest(data)
    import hashlib

    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class RemotePrefill:
    """Where a prompt's KV waits and what the prefill instance made of the prompt."""

    remote_engine_id: str
    remote_host: str
    remote_port: int  # the prefill instance's KV control port
    remote_request_id: str
    remote_block_ids: list[int]  # the prompt's blocks there, in order
    block_size: int
    num_prompt_tokens: int
    prompt_digest: str
    first_token_id: int
    # The first token's logprobs when the request asked: [token id, logprob, rank] rows, the
    # sampled token first.
    first_logprobs: list[list[float]] | None = None
    # The request's seeded generator after drawing the first token (base64), so a seeded
    # request samples the same tokens as on one instance.
    generator_state: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill instance found in its prefix cache
    # Set when the prefill leg streamed its KV: pulled by this id, not by block ids.
    transfer_id: str | None = None
    do_remote_prefill: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RemotePrefill:
        """Read a decode request's kv_transfer_params; ValueError naming what is wrong."""
        fields = cls.__dataclass_fields__
        missing = [
            name for name, spec in fields.items() if name not in params and spec.default is MISSING
        ]
        if missing:
            raise ValueError(
                "kv_transfer_params lacks " + ", ".join(missing) + ": pass the dict a prefill "
                "instance returned (a request with kv_transfer_params={'do_remote_decode': true})"
            )
        unknown = sorted(set(params) - set(fields))
        if unknown:
            raise ValueError(f"kv_transfer_params has unknown keys: {', '.join(unknown)}")
        checks = {
            "remote_engine_id": str, "remote_host": str, "remote_port": int,
            "remote_request_id": str, "block_size": int, "num_prompt_tokens": int,
            "prompt_digest": str, "first_token_id": int, "num_cached_tokens": int,
        }  # fmt: skip
        for name, kind in checks.items():
            value = params.get(name, 0)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{name} must be a {kind.__name__}")
        transfer_id = params.get("transfer_id")
        if transfer_id is not None:
            _check_transfer_id(transfer_id)
        block_ids = params["remote_block_ids"]
        if not isinstance(block_ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids
        ):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids")
        return cls(**params)


@dataclass(frozen=True)
class RemoteStream:
    """A decode leg sent while its prefill leg runs: where to pull the KV from as it is
    computed. The first token and the rest of a RemotePrefill come at the end of the stream."""

    remote_host: str
    remote_port: int
    transfer_id: str
    do_remote_prefill: bool = True

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RemoteStream:
        unknown = sorted(set(params) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(
                f"kv_transfer_params has unknown keys: {', '.join(unknown)} (a streamed decode "
                "leg has remote_host, remote_port and transfer_id; a prefill instance's answer "
                "has first_token_id too)"
            )
        host, port = params.get("remote_host"), params.get("remote_port")
        if not isinstance(host, str) or not host:
            raise ValueError("kv_transfer_params.remote_host must be the prefill instance's host")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a port number")
        _check_transfer_id(params.get("transfer_id"))
        return cls(**params)


Remote = RemotePrefill | RemoteStream


def _check_transfer_id(transfer_id: Any) -> None:
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= 256:
        raise ValueError("kv_transfer_params.transfer_id must be a string of 1 to 256 characters")


def transfer_id_of(params: dict[str, Any]) -> str | None:
    """A prefill leg's transfer id: its KV streams to the decode leg that names it."""
    transfer_id = params.get("transfer_id")
    if transfer_id is not None:
        _check_transfer_id(transfer_id)
    return transfer_id


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_prefill") is True


@dataclass(frozen=True)
class KVLoad:
    """A decode instance's pull of one request's prompt KV: blocks from `first_block` on
    (those before are local prefix-cache hits, not transferred again) into the local blocks
    `block_ids`. Empty `block_ids`: the whole prompt was a local hit, nothing to pull."""

    request_id: str
    remote: Remote
    first_block: int
    block_ids: list[int]
    # A streamed pull sends the prompt's digest: the prefill side checks it is the same prompt.
    prompt_token_ids: list[int]


def first_logprobs_row(rows: list[list[float]] | None) -> dict[int, Logprob] | None:
    if rows is None:
        return None
    return {int(token_id): Logprob(logprob, int(rank)) for token_id, logprob, rank in rows}


def check_kv_transfer(
    params: dict[str, Any],
    role: str,
    prompt_token_ids: list[int],
    sampling_params: SamplingParams,
    block_size: int,
    vocab_size: int,
) -> Remote | None:
    """What a request's kv_transfer_params ask of an instance of `role` (prefill, decode or
    both): the RemotePrefill or RemoteStream to pull on a decode instance, None otherwise.
    ValueError saying what to change for params this instance cannot act on. The API process
    checks before queuing (a 400), the engine core again (its own callers)."""
    if wants_remote_decode(params):
        if role != "prefill":
            raise ValueError(_wrong_role("do_remote_decode", "prefill", role))
        if sampling_params.max_tokens != 1:
            raise ValueError(
                "a request with kv_transfer_params.do_remote_decode computes the prompt and "
                "the first token only: send max_tokens 1 (the decode instance does the rest)"
            )
        transfer_id_of(params)
        return None
    if not wants_remote_prefill(params):
        return None
    if role != "decode":
        raise ValueError(_wrong_role("do_remote_prefill", "decode", role))
    if sampling_params.prompt_logprobs is not None:
        raise ValueError(
            "prompt_logprobs need the prompt computed here, and kv_transfer_params."
            "do_remote_prefill brings it computed: send such a request without "
            "kv_transfer_params (the router sends it whole to a prefill instance)"
        )
    if "first_token_id" not in params:
        return RemoteStream.from_dict(params)
    remote = RemotePrefill.from_dict(params)
    wants_logprobs = sampling_params.logprobs is not None
    check_first_token(remote, prompt_token_ids, wants_logprobs, block_size, vocab_size)
    return remote


def check_first_token(
    remote: RemotePrefill,
    prompt_token_ids: list[int],
    wants_logprobs: bool,
    block_size: int,
    vocab_size: int,
) -> None:
    """ValueError unless `remote` is what a prefill instance made of this very prompt."""
    if remote.block_size != block_size:
        raise ValueError(
            f"the prefill instance uses blocks of {remote.block_size} tokens and this "
            f"instance {block_size}: start both with the same --block-size"
        )
    num_prompt_tokens = len(prompt_token_ids)
    if remote.num_prompt_tokens != num_prompt_tokens or remote.prompt_digest != prompt_digest(
        prompt_token_ids
    ):
        raise ValueError(
            "kv_transfer_params were computed for other prompt tokens than this request's: "
            "send the decode instance the same request as the prefill instance, and serve the "
            "same model and tokenizer on both"
        )
    if len(remote.remote_block_ids) != -(-num_prompt_tokens // block_size):
        raise ValueError("kv_transfer_params.remote_block_ids do not cover the prompt")
    if not 0 <= remote.first_token_id < vocab_size:
        raise ValueError(f"kv_transfer_params.first_token_id is not in [0, {vocab_size})")
    if wants_logprobs and remote.first_logprobs is None:
        raise ValueError(
            "the request asks for logprobs but kv_transfer_params has none for the first "
            "token: send the prefill instance the same logprobs setting"
        )


def _wrong_role(flag: str, needed: str, role: str) -> str:
    return (
        f"kv_transfer_params.{flag} asks for a {needed} instance, and this one's role is "
        f"{role}: send it to an instance started with --role {needed}"
    )
