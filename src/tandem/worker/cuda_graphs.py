"""Decode-only steps replayed from CUDA graphs: a decode step of a small model is launch-bound
(hundreds of small kernels whose launches cost more than their work), and a graph launches
them all at once. Graphs need fixed shapes and fixed addresses, so a decode-only batch of B
requests is padded to the next captured size (1, 2, 4, 8, then steps of 8) and its inputs are
copied into static buffers that the graph of that size reads: padded rows store nothing
(slot -1) and attend to one key, and their outputs are dropped. Mixed batches run eagerly.

Only the triton attention backend is captured (the torch backend plans its calls on the
host). Off CUDA the same padded path runs eagerly, so tests check it on CPU (under
TRITON_INTERPRET=1) against the unpadded one."""

from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from tandem.attention.metadata import AttentionMetadata, BatchInputs, forward_context
from tandem.attention.triton_backend import decode_plan

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8, up to the first that holds `max_batch`."""
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    return sizes + list(range(8, max_batch + 8, 8)) if max_batch > 4 else [*sizes, max_batch]


class DecodeGraphs:
    """Static inputs and one graph per captured batch size, over one model and its caches."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int,
        max_blocks_per_request: int,
        block_size: int,
        queries_per_kv: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.queries_per_kv = queries_per_kv
        self.num_kv_heads = num_kv_heads
        self.sizes = capture_sizes(max_batch)
        largest = self.sizes[-1]
        with torch.device(device):
            self.input_ids = torch.zeros(largest, dtype=torch.int64)
            self.positions = torch.zeros(largest, dtype=torch.int64)
            self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64)
            self.seq_lens = torch.ones(largest, dtype=torch.int64)
            self.query_start_loc = torch.arange(largest + 1, dtype=torch.int64)
            self.block_table = torch.zeros(largest, max_blocks_per_request, dtype=torch.int64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, batch: BatchInputs) -> bool:
        """A decode-only batch (one new token per request, nothing else asked of the forward)
        that a captured size holds."""
        md = batch.attn_metadata
        num_tokens = len(md.query_start_loc_cpu) - 1
        return (
            batch.prompt_logits is None
            and int(md.query_start_loc_cpu[-1]) == num_tokens
            and num_tokens <= self.sizes[-1]
            and md.block_table.shape[1] <= self.block_table.shape[1]
        )

    def _metadata(self, size: int) -> AttentionMetadata:
        """The static buffers' first `size` rows as a step's metadata, with its decode plan."""
        rows = np.arange(size)
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            query_start_loc_cpu=np.arange(size + 1),
            seq_lens_cpu=np.ones(size, dtype=np.int64),
            num_computed_tokens_cpu=np.zeros(size, dtype=np.int64),
            decode_token_indices_cpu=rows,
            decode_token_requests_cpu=rows,
            decode_token_seq_lens_cpu=np.ones(size, dtype=np.int64),
            prefill_indices_cpu=np.zeros(0, dtype=np.int64),
            block_size=self.block_size,
        )
        metadata.backend_plan = decode_plan(
            size, self.queries_per_kv, self.num_kv_heads, self.device
        )
        return metadata

    def _forward(self, size: int) -> torch.Tensor:
        with forward_context(self._metadata(size)):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, largest first, sharing one memory pool. The garbage collector
        stays out of the capture: tensors it frees there could touch the allocator mid-capture."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        gc.collect()
        gc.disable()
        try:
            for size in reversed(self.sizes):
                for _ in range(2):  # compiles the kernels and settles the allocator
                    self._forward(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
        finally:
            gc.enable()
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs of decode steps for batch sizes %s in %.1f s",
            ", ".join(map(str, self.sizes)), time.perf_counter() - start,
        )  # fmt: skip

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """Hidden states of a batch that `fits`: its inputs copied into the static buffers of
        the smallest size that holds it, the graph replayed (or, off CUDA, the same padded
        forward run eagerly)."""
        md = batch.attn_metadata
        num_tokens = len(md.query_start_loc_cpu) - 1
        size = next(s for s in self.sizes if s >= num_tokens)
        self.input_ids[:num_tokens].copy_(batch.input_ids)
        self.positions[:num_tokens].copy_(batch.positions)
        self.slot_mapping[:num_tokens].copy_(md.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)  # padded rows store nothing
        self.seq_lens[:num_tokens].copy_(md.seq_lens)
        self.seq_lens[num_tokens:size].fill_(1)  # and attend to one (stale) key
        self.block_table[:num_tokens, : md.block_table.shape[1]].copy_(md.block_table)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:num_tokens]
        graph.replay()
        return self.outputs[size][:num_tokens]
