"""Decode steps on a CPU in one C call for all the decoder layers (csrc/decode_forward.c).

A batch-1 decode step of a small model is mostly Python and op dispatch: ~25 torch ops per
layer, each costing more than its arithmetic. Where every linear layer's weight is packed for
the C kernel (GGUF Q4_0 / Q4_1 / Q8_0) and attention runs on the cpu backend, the whole layer
stack of a step whose tokens are all decode tokens (attention/metadata.py's: a request's one
new token, the tokens verifying its drafts, a short prompt chunk) runs in C, through
the kernels the layer-by-layer path calls, from the token ids (the embedding rows) to the
final norm, and for a greedy batch-1 step on through the packed LM head to the logits and
their argmax. This is the CPU's counterpart of worker/cuda_graphs.py: the model runner asks
`fits(batch)`, then `run(batch)` for the final hidden states or `logits_and_argmax(batch)`,
or, for multi-step scheduling, `decode_steps(batch, ...)`: several such steps of one request
in one call, each fed the token the one before chose (its argmax, or the C sampler's draw).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tandem.attention import cpu_backend, cpu_kernel
from tandem.attention.metadata import BatchInputs
from tandem.models.layers import Linear
from tandem.models.llama import CausalLM
from tandem.models.packed import PackedWeight
from tandem.worker.inference_mode import inference_mode
from tandem.worker.sampler import BurstDraws

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _PackedMatrix(ctypes.Structure):
    _fields_ = [("codes", _ptr), ("scales", _ptr), ("quant_type", _i64),
                ("out_features", _i64), ("bias", _ptr)]  # fmt: skip


class _DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_attention_norm", _ptr), ("qkv", _PackedMatrix),
                ("o", _PackedMatrix), ("gate_up", _PackedMatrix), ("down", _PackedMatrix),
                ("kv_cache", _ptr)]  # fmt: skip


class _DecodeModel(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64),
                ("num_kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("num_blocks", _i64), ("block_size", _i64), ("int8_min_tokens", _i64),
                ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_DecodeLayer)),
                ("embedding", _ptr), ("embedding_bf16", _i64), ("vocab_size", _i64),
                ("cos_sin", _ptr), ("max_positions", _i64), ("final_norm", _ptr),
                ("head", _PackedMatrix), ("head_int8", _i64)]  # fmt: skip


class _DecodeStep(ctypes.Structure):
    _fields_ = [("num_tokens", _i64), ("input_ids", _ptr), ("positions", _ptr),
                ("slot_mapping", _ptr), ("block_table", _ptr), ("block_table_stride", _i64),
                ("token_rows", _ptr), ("token_requests", _ptr),
                ("token_seq_lens", _ptr)]  # fmt: skip


class _RowsSampling(ctypes.Structure):
    _fields_ = [("temperature", _ptr), ("top_p", _ptr), ("min_p", _ptr), ("top_k", _ptr),
                ("uniforms", _ptr), ("scratch", _ptr)]  # fmt: skip


# The embedding tables the C step reads (its rows widened to fp32), by torch dtype.
_EMBEDDING_BF16 = {torch.float32: 0, torch.bfloat16: 1}


def unsupported_reason(model: CausalLM) -> str | None:
    """Why the model's decode steps cannot run fused (None: they can)."""
    config = model.config
    layers = model.model.layers
    if config.qk_norm:
        return "the model normalizes queries and keys"
    embedding = model.model.embed_tokens.weight
    if embedding.dtype not in _EMBEDDING_BF16:
        return f"the embedding is {embedding.dtype}"
    rotary = model.model.rotary.cos_sin
    if rotary.dtype != torch.float32 or rotary.shape[1] != config.head_dim:
        return "the rotary table is not one fp32 row of head_dim per position"
    for layer in layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)  # fmt: skip
        if any(linear.packed is None or linear.packed.codes is None for linear in linears):
            return "not every linear layer has packed weights for the C kernel"
        if layer.self_attn.paged_attention is not cpu_backend.paged_attention:
            return "attention does not run on the cpu backend"
        if layer.self_attn.kv_cache.dtype not in cpu_kernel.DTYPE_SUFFIXES:
            return f"the cache is {layer.self_attn.kv_cache.dtype}"
    return None


class CpuDecode:
    """The fused decode forward of one model over its bound KV caches; holds the C structures
    (and fp32 copies of the norms and biases) they point into."""

    def __init__(self, model: CausalLM, max_tokens: int, int8_min_tokens: int = 0) -> None:
        """`int8_min_tokens`: steps of at least this many tokens multiply int8 activations
        (models/packed.py; 0: none)."""
        config = model.config
        self.model = model
        self.max_tokens = max_tokens
        attention = model.attention_layers()
        self.kv_caches = [layer.kv_cache for layer in attention]
        self._first_attention = attention[0]  # fits() checks its cache is still bound
        self._kept: list[torch.Tensor] = []
        layers = (_DecodeLayer * len(model.model.layers))()
        for index, layer in enumerate(model.model.layers):
            layers[index] = _DecodeLayer(
                self._fp32(layer.input_layernorm.weight),
                self._fp32(layer.post_attention_layernorm.weight),
                self._matrix(layer.self_attn.qkv_proj),
                self._matrix(layer.self_attn.o_proj),
                self._matrix(layer.mlp.gate_up_proj),
                self._matrix(layer.mlp.down_proj),
                self.kv_caches[index].data_ptr(),
            )
        self._layers = layers
        _, num_blocks, block_size, _, _ = self.kv_caches[0].shape
        decoder = model.model
        embedding = decoder.embed_tokens.weight.detach().contiguous()
        cos_sin = decoder.rotary.cos_sin.contiguous()
        self._kept += [embedding, cos_sin]
        # The LM head, where its packed weights take one-row steps (compute_logits_and_argmax's
        # condition): a greedy batch-1 step may end in its argmax pass.
        head = model.lm_head_packed
        # Its logits and token (logits_and_argmax's buffers); None: no head here.
        self._head_outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        head_matrix, head_int8 = _PackedMatrix(), 0
        # decode_steps' rows: as many as the layers and the head take packed, where it runs.
        self.max_burst_rows = 0
        self._head_int8_min_tokens = 0
        if head is not None and head.codes is not None and head.max_tokens >= 1:
            self.max_burst_rows = min(max_tokens, head.max_tokens)
            self._head_int8_min_tokens = head.int8_min_tokens
            self._head_outputs = (
                torch.empty(1, head.out_features),
                torch.empty(1, dtype=torch.int64),
            )
            head_matrix = self._packed(head, None)
            head_int8 = int(head.one_row_int8)
        self._model = _DecodeModel(
            config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size, num_blocks,
            block_size, int8_min_tokens, config.rms_norm_eps, attention[0].scale, layers,
            embedding.data_ptr(), _EMBEDDING_BF16[embedding.dtype], embedding.shape[0],
            cos_sin.data_ptr(), cos_sin.shape[0], self._fp32(decoder.norm.weight), head_matrix,
            head_int8,
        )  # fmt: skip
        self._hidden_size = config.hidden_size
        self._one_row = torch.empty(1, config.hidden_size)  # logits_and_argmax's final hidden
        self._sampling_scratch: torch.Tensor | None = None  # decode_steps' C sampler's
        # The model's dtype, for the final hidden states (None: fp32, as the C step writes).
        self._out_dtype = None if embedding.dtype == torch.float32 else embedding.dtype
        library = cpu_kernel.load_library()
        assert library is not None  # unsupported_reason() said the weights are packed for it
        suffix = cpu_kernel.DTYPE_SUFFIXES[self.kv_caches[0].dtype]
        self._function = getattr(library, f"decode_step_{suffix}")
        self._steps_function = getattr(library, f"decode_steps_{suffix}")

    def _fp32(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        copy = tensor.detach().float().contiguous().clone()
        self._kept.append(copy)
        return copy.data_ptr()

    def _matrix(self, linear: Linear) -> _PackedMatrix:
        assert linear.packed is not None
        return self._packed(linear.packed, linear.bias)

    def _packed(self, packed: PackedWeight, bias: torch.Tensor | None) -> _PackedMatrix:
        assert packed.codes is not None and packed.scales is not None
        return _PackedMatrix(
            packed.codes.data_ptr(), packed.scales.data_ptr(),
            cpu_kernel.QUANT_TYPE_IDS[packed.quant_type], packed.out_features, self._fp32(bias),
        )  # fmt: skip

    def fits(self, batch: BatchInputs) -> bool:
        """Every token of the step is a decode token (one of a request's few new tokens), few
        enough for the packed weights, over the caches this was built for."""
        md = batch.attn_metadata
        num_tokens = batch.input_ids.shape[0]
        return (
            num_tokens <= self.max_tokens
            and len(md.prefill_indices_cpu) == 0
            and len(md.decode_token_indices_cpu) == num_tokens
            and self._first_attention.kv_cache is self.kv_caches[0]
        )

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """The final hidden states `[T, hidden]` in the model's dtype."""
        final = torch.empty(batch.input_ids.shape[0], self._hidden_size)
        self._step(batch, final, None, None)
        return final if self._out_dtype is None else final.to(self._out_dtype)

    def logits_and_argmax(self, batch: BatchInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of one token: its logits `[1, vocab]` (fp32) and their first argmax `[1]`
        from the packed LM head's pass (compute_logits_and_argmax's answer), in the same call
        as the layers; None where the head is not packed here or the step has more tokens.
        Both are buffers the next such step overwrites, as a CUDA graph's outputs are (a new
        196 KB logits tensor a step cost its allocation's page faults)."""
        if self._head_outputs is None or batch.input_ids.shape[0] != 1:
            return None
        logits, token = self._head_outputs
        self._step(batch, self._one_row, logits, token)
        return logits, token

    def decode_steps(
        self,
        batch: BatchInputs,
        num_blocks: Sequence[int],
        num_steps: int,
        stop_token_ids: Sequence[frozenset[int]],
        draws: BurstDraws | None = None,
    ) -> list[list[int]]:
        """A decode of the batch's tokens (one per request, at most max_burst_rows) and up to
        `num_steps - 1` more steps, each row fed the token it chose the step before (its
        argmax, or with `draws` the C sampler's draw from its logits, as the sampler makes
        it), in one C call (multi-step scheduling: no Python between the forwards); each
        request's tokens, ending after the step where one is among its `stop_token_ids`. Each
        request's `num_blocks` blocks must hold the positions of all `num_steps` tokens fed."""
        rows = batch.input_ids.shape[0]
        assert self._head_outputs is not None and 0 < rows <= self.max_burst_rows
        tokens = np.empty((num_steps, rows), dtype=np.int64)
        stops = np.fromiter((t for ids in stop_token_ids for t in ids), dtype=np.int64)
        offsets = np.cumsum([0, *map(len, stop_token_ids)], dtype=np.int64)
        blocks = np.asarray(num_blocks, dtype=np.int64)
        logits, final = self._head_outputs[0], self._one_row
        if rows > 1:
            logits, final = torch.empty(rows, logits.shape[1]), torch.empty(rows, final.shape[1])
        sampling = None
        if draws is not None:  # (its tensors live on in these names through the call)
            temperature, top_k, top_p, min_p, uniforms = cpu_kernel.sampling_columns(
                draws.temperature, draws.top_k, draws.top_p, draws.min_p, draws.uniforms
            )
            assert uniforms.shape == (num_steps, rows)
            sampling = _RowsSampling(
                temperature=temperature.data_ptr(), top_p=top_p.data_ptr(),
                min_p=min_p.data_ptr(), top_k=top_k.data_ptr(), uniforms=uniforms.data_ptr(),
                scratch=self._scratch(logits),
            )  # fmt: skip
        count = self._call(
            self._steps_function, batch, final, logits, tokens.ctypes.data, blocks.ctypes.data,
            num_steps, stops.ctypes.data, offsets.ctypes.data,
            0 < self._head_int8_min_tokens <= rows,
            None if sampling is None else ctypes.addressof(sampling),
        )  # fmt: skip
        return tokens[:count].T.tolist()

    def _scratch(self, logits: torch.Tensor) -> int:
        """The C sampler's scratch for every thread (kept between calls)."""
        size = cpu_kernel.sampling_scratch_bytes(torch.get_num_threads(), logits.shape[1])
        if self._sampling_scratch is None or self._sampling_scratch.numel() < size:
            self._sampling_scratch = torch.empty(size, dtype=torch.uint8)
        return self._sampling_scratch.data_ptr()

    def _step(
        self,
        batch: BatchInputs,
        final: torch.Tensor,
        logits: torch.Tensor | None,
        token: torch.Tensor | None,
    ) -> None:
        """One step into `final` (fp32 [T, hidden]) and, given, the head's outputs."""
        self._call(
            self._function, batch, final, logits, None if token is None else token.data_ptr()
        )

    @inference_mode
    def _call(
        self,
        function: Callable[..., int],
        batch: BatchInputs,
        final: torch.Tensor,
        logits: torch.Tensor | None,
        *arguments: int | None,
    ) -> int:
        """A C call over the batch's arrays (int64 and contiguous: attention/metadata.py
        builds them so), `arguments` after the outputs; its status (>= 0) or an error."""
        md = batch.attn_metadata
        input_ids, block_table = batch.input_ids, md.block_table
        arrays = cpu_backend.decode_token_arrays(md)
        step = _DecodeStep(
            input_ids.shape[0], input_ids.data_ptr(), batch.positions.data_ptr(),
            md.slot_mapping.data_ptr(), block_table.data_ptr(), block_table.stride(0),
            *(a.ctypes.data for a in arrays),
        )  # fmt: skip
        status = function(
            ctypes.byref(self._model), ctypes.byref(step), final.data_ptr(),
            None if logits is None else logits.data_ptr(), *arguments, torch.get_num_threads(),
        )  # fmt: skip
        if status == -1:
            raise MemoryError("the fused decode step could not allocate its buffers")
        if status == -2:
            raise ValueError("a token id or position of the step is outside the model's tables")
        if status == -4:
            raise ValueError("a decode step's position is past the request's blocks")
        if status < 0:
            raise RuntimeError(f"the fused decode step refused the call (status {status})")
        return status
