"""Test helpers: driving the model runner without a scheduler, and the scheduler without a
model runner."""

from __future__ import annotations

import contextlib
import ctypes
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tandem.attention import cpu_kernel
from tandem.attention.metadata import build_batch, forward_context
from tandem.core.scheduler import SchedulerOutput
from tandem.worker.model_runner import ModelRunner


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# Tests of the C kernels (attention/csrc/): skipped where no C compiler builds them.
def cpu_has(flag: str) -> bool:
    """Whether this CPU reports `flag` (/proc/cpuinfo: Linux only; elsewhere no)."""
    try:
        return f" {flag} " in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def kernels_built_for(march: str, folder: Path) -> ctypes.CDLL:
    """The kernel library built for an older x86 level (`-march=haswell`: AVX2; `x86-64`: SSE2
    only) into `folder`: the machines tandem runs on differ. Skips where this CPU cannot run
    that build's AVX2."""
    if march == "haswell" and not cpu_has("avx2"):
        pytest.skip("this CPU has no AVX2")
    flags = [f"-march={march}" if flag == "-march=native" else flag for flag in cpu_kernel.FLAGS]
    target = folder / "kernels.so"
    cpu_kernel._build(cpu_kernel._compiler(), target, flags)
    return ctypes.CDLL(str(target))


needs_cpu_kernels = pytest.mark.skipif(
    cpu_kernel.load_library() is None, reason="no C compiler: the CPU kernels are not built"
)


@dataclass
class Slice:
    token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int] = field(default_factory=list)


def all_token_logits(runner: ModelRunner, requests: list[Slice]) -> torch.Tensor:
    """Logits at every new token of the step (the runner itself only returns sampled rows)."""
    batch = build_batch(requests, runner.block_size, runner.device)
    with torch.inference_mode(), forward_context(batch.attn_metadata):
        hidden = runner.model(batch.input_ids, batch.positions)
        return runner.model.compute_logits(hidden)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids], device=model.device)).logits[0].float()


def llama_cpp_permute(weight, num_heads: int):
    """llama.cpp's conversion-time interleave of Q/K rows (the inverse of what tandem undoes)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def write_gguf(path, hf_model, arch: str, qtypes: dict[str, str], default_qtype: str = "F32"):
    """Write `hf_model` as a GGUF file the way llama.cpp's converter lays it out. `qtypes` maps
    a GGUF tensor-name fragment (e.g. "attn_q") to a quant type for matrices that contain it."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quant_shape_to_byte_shape, quants

    config = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.float().numpy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.{kind}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight",
            }[name]
        if arch == "llama" and ".attn_q." in gguf_name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        if arch == "llama" and ".attn_k." in gguf_name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = "F32"
        if array.ndim == 2:
            qtype = next((q for frag, q in qtypes.items() if frag in gguf_name), default_qtype)
        if qtype == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
        else:
            kind = GGMLQuantizationType[qtype]
            try:
                data = quants.quantize(array, kind)
            except (NotImplementedError, quants.QuantError):  # not writable by gguf: zero bytes
                data = np.zeros(quant_shape_to_byte_shape(array.shape, kind), dtype=np.uint8)
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


NEAR_TIE = 1e-3  # top-2 logprob gap under which fp32 noise may flip an argmax


def first_near_tie(logprobs) -> int:
    """Index of the first generated position whose top-2 logprob gap is under NEAR_TIE."""
    for position, row in enumerate(logprobs):
        top = sorted((lp.logprob for lp in row.values()), reverse=True)
        if len(top) >= 2 and top[0] - top[1] < NEAR_TIE:
            return position
    return len(logprobs)


def assert_same_until_tie(tokens: list[int], reference: list[int], reference_logprobs) -> None:
    """Equal greedy tokens up to the reference's first near-tie (a different batching may flip
    the argmax there through fp32 noise); fully equal when there is none."""
    limit = first_near_tie(reference_logprobs)
    assert tokens[:limit] == reference[:limit]
    if limit == len(reference):
        assert tokens == reference


def assert_hf_greedy(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], num_tokens: int
) -> None:
    """`num_tokens` generated tokens, each HF's argmax given the prompt and the tokens before
    it, or within NEAR_TIE of it (fp32 noise may flip a near-tie). One teacher-forced forward
    checks all the positions that a token-by-token HF generate would, and goes on past a
    near-tie."""
    assert len(tokens) == num_tokens, f"{len(tokens)} tokens generated, not {num_tokens}"
    logits = hf_logits(model, prompt + tokens[:-1])[len(prompt) - 1 :]
    logprobs = torch.log_softmax(logits, -1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]
    shortfall = logprobs.max(-1).values - chosen
    worst = int(shortfall.argmax())
    assert shortfall[worst] < NEAR_TIE, (
        f"token {worst} ({tokens[worst]}) is {float(shortfall[worst]):.4f} nats under HF's "
        f"argmax {int(logprobs[worst].argmax())}"
    )


def random_prompts(count: int, vocab: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def compare_attention_backends(
    shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, device,
    oracle_device: str = "cpu", backend=None,
):  # fmt: skip
    """One step of (cached, new) requests through the torch backend (the oracle, on
    `oracle_device`) and `backend` (a backend module, default triton's; on `device`), each on
    its own copy of one cache: (expected output, expected cache, output, cache, the plan of
    the backend under test), on the CPU."""
    from tandem.attention import torch_backend

    if backend is None:
        from tandem.attention import triton_backend as backend

    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 7
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    slices = []
    for computed, new in shapes:
        blocks = [pool.pop() for _ in range(-(-(computed + new) // block_size))]
        slices.append(Slice(list(range(computed + new)), computed, new, blocks))
    num_tokens = sum(n for _, n in shapes)
    # q and k as views of one projection, like the model's (strided, not contiguous).
    qk = torch.randn(num_tokens, num_heads + num_kv_heads, head_dim, dtype=dtype)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5

    def run(backend, kv_cache, device):
        batch = build_batch(slices, block_size, device)
        out = backend.paged_attention(
            q.to(device), k.to(device), v.to(device), kv_cache, batch.attn_metadata, scale
        )
        return out.cpu(), kv_cache.cpu(), batch.attn_metadata.backend_plan

    oracle = torch.device(oracle_device)
    expected, expected_cache, _ = run(torch_backend, cache.clone().to(oracle), oracle)
    got, got_cache, plan = run(backend, cache.clone().to(device), device)
    return expected, expected_cache, got, got_cache, plan


def attention_tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


class AllowingGuard:
    """A speculation guard that lets every step verify drafts: for tests of the step-cost
    model's draft choice or a proposer's cost forecast alone, out of the measured check's
    reach."""

    probing = False

    def allows(self, num_decodes: int, greedy: bool = False) -> bool:
        return True

    def peek(self, num_decodes: int, greedy: bool = False) -> bool:
        return True

    def observe(self, *args: object) -> None:
        pass


def in_order(output: SchedulerOutput, tokens_by_id: dict[str, list[int]]) -> list[list[int]]:
    """A step's sampled tokens, given by request id, as the model runner lists them for
    Scheduler.update_from_output: per sampling entry, in the step's order."""
    return [tokens_by_id[entry.request_id] for entry in output.scheduled if entry.sample]
