"""The cpu attention backend (decode tokens through the C kernel read in place, fp32 prompt
chunks through the C causal-attention kernel) against the torch backend (the oracle): mixed
batches, GQA groups, head sizes with and without a specialized kernel, block sizes, fp32 and
bf16, random layouts; the prompt kernel against SDPA alone; and how the backend is chosen
and built."""

from __future__ import annotations

import ctypes
import platform
import random

import pytest
import torch

from tandem.attention import backends, cpu_backend, cpu_kernel, torch_backend
from tandem.attention.metadata import build_batch

from helpers import Slice, compare_attention_backends, needs_cpu_kernels, torch_threads
from helpers import attention_tolerance as tolerance

pytestmark = needs_cpu_kernels


def run_both(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    return compare_attention_backends(
        shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed,
        torch.device("cpu"), backend=cpu_backend,
    )  # fmt: skip


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(9, 3, 64), (8, 1, 128), (4, 4, 32), (14, 2, 80), (32, 8, 128)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_torch_backend(num_heads, num_kv_heads, head_dim, dtype):
    """Fresh prompts, chunks after cached context, decodes of many lengths (on and off block
    edges) and draft verification in one step."""
    shapes = [(0, 37), (20, 13), (50, 1), (33, 4), (0, 1), (15, 1), (16, 16), (70, 2), (31, 1)]
    expected, expected_cache, got, got_cache, plan = run_both(
        shapes, num_heads, num_kv_heads, head_dim, 16, dtype
    )
    # Decodes and the tokens of requests verifying up to 16 drafts: 13 + 1 + 4 + 1 + 1 + 16 +
    # 2 + 1; the fresh prompt and the 37-token chunk go to the prompt kernel (fp32) or SDPA.
    assert len(plan.decode_rows) == 39
    torch.testing.assert_close(got, expected, **tolerance(dtype))
    assert torch.equal(got_cache, expected_cache)


@pytest.mark.parametrize("block_size", [1, 7, 32, 256])
def test_block_sizes(block_size):
    shapes = [(0, 5), (300, 1), (1, 1), (63, 3), (64, 1)]
    expected, _, got, _, _ = run_both(shapes, 6, 2, 64, block_size, torch.float32, seed=3)
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))


@pytest.mark.parametrize("seed", range(6))
def test_random_decode_layouts(seed):
    """Random batches of decodes and verification steps over random contexts, GQA groups of
    1-8, either dtype: every output row equal to the oracle's within float rounding."""
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2, 4])
    num_heads = num_kv_heads * rng.randint(1, 8)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    shapes = [(rng.randint(0, 400), rng.choice([1, 1, 1, rng.randint(2, 16)]))
              for _ in range(rng.randint(1, 40))]  # fmt: skip
    expected, _, got, _, _ = run_both(
        shapes, num_heads, num_kv_heads, rng.choice([64, 128, 48]), rng.choice([8, 16]), dtype,
        seed=seed,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, **tolerance(dtype))


@pytest.mark.parametrize("num_threads", [2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_long_decodes_split_their_contexts(num_threads, dtype):
    """Fewer work items than twice the threads (a batch-1 decode: one per kv head) cut each
    context into parts, attended to apart and merged: equal to the oracle, with parts of
    uneven length, parts that begin inside a block (blocks of 7 and 32), at 8 threads a short
    decode beside a long one, whose context has fewer chunks than there are parts (empty
    parts), and runs of verification tokens (whose earlier tokens end before the last part)."""
    with torch_threads(num_threads):
        for shapes, num_heads, num_kv_heads, head_dim, block_size in SPLIT_LAYOUTS:
            expected, _, got, _, _ = run_both(
                shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(shapes)
            )
            torch.testing.assert_close(got, expected, **tolerance(dtype))


# (shapes, heads, kv heads, head size, block size) with few work items: contexts split at 2
# threads, except the 16-token layout's 6 items (split at 8).
SPLIT_LAYOUTS = [
    ([(1000, 1)], 9, 3, 64, 16),
    ([(3000, 1), (20, 1)], 8, 1, 128, 16),
    ([(700, 1)], 4, 2, 64, 7),
    ([(1500, 1)], 9, 3, 64, 32),
    ([(1000, 5)], 9, 3, 64, 16),
    ([(900, 16)], 9, 3, 64, 16),  # runs of 10 and 6 tokens (30 and 18 query heads an item)
    ([(600, 4), (2000, 1)], 8, 1, 128, 16),
]


@needs_cpu_kernels
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])  # AVX2 + FMA; SSE2 only
def test_the_kernel_built_for_older_x86_matches_the_torch_backend(
    monkeypatch, older_x86_kernels, march
):
    """Without AVX-512, heads of 64 and 128 take AVX2's 8-lane vector item (haswell) or the
    scalar item compiled with them as constants (x86-64): runs, split contexts and mixed
    batches still equal the oracle."""
    library = older_x86_kernels(march)

    def older_kernel(dtype: torch.dtype, head_dim: int) -> ctypes._CFuncPtr:
        specialized = f"_{head_dim}" if head_dim in cpu_kernel.SPECIALIZED_HEAD_DIMS else ""
        function = getattr(library, f"paged_decode_attention_{cpu_kernel.DTYPE_SUFFIXES[dtype]}"
                                    f"{specialized}")  # fmt: skip
        function.argtypes = cpu_kernel._ARGTYPES
        return function

    monkeypatch.setattr(cpu_kernel, "kernel", older_kernel)
    layouts = [*SPLIT_LAYOUTS, ([(0, 9), (50, 1), (33, 4), (70, 2), (31, 1)], 14, 2, 80, 16)]
    with torch_threads(2):
        for dtype in (torch.float32, torch.bfloat16):
            for shapes, num_heads, num_kv_heads, head_dim, block_size in layouts:
                expected, _, got, _, _ = run_both(
                    shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=1
                )
                torch.testing.assert_close(got, expected, **tolerance(dtype))


def causal_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """SDPA in `dtype` with query i of T at position len(keys) − T + i, as fp32."""
    num_queries, context_len = query.shape[0], keys.shape[0]
    positions = torch.arange(context_len - num_queries, context_len)
    mask = torch.arange(context_len)[None, :] <= positions[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        *(x.to(dtype).transpose(0, 1)[None] for x in (query, keys, values)),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1).float()


# (queries, context, heads, kv heads, head size): rows of a work item (16 tokens × the GQA
# group) whole and cut, key blocks of 64 whole and cut, a context before the chunk, head sizes
# of 8 to 128 (72: a part of 8 lanes after the 16-lane parts).
PREFILL_SHAPES = [
    (1, 1, 1, 1, 8), (5, 5, 2, 1, 64), (17, 17, 9, 3, 64), (64, 64, 8, 8, 64),
    (100, 300, 4, 2, 128), (130, 131, 6, 2, 72), (33, 97, 32, 8, 128), (200, 200, 9, 3, 64),
]  # fmt: skip


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
@pytest.mark.parametrize("num_threads", [1, 2, 8])
def test_prefill_kernel_matches_causal_sdpa(shape, num_threads):
    """Queries and output as views with gaps between tokens (a chunk's rows of a fused QKV
    projection and of the step's output), keys and values both contiguous and strided."""
    num_queries, context_len, num_heads, num_kv_heads, head_dim = shape
    generator = torch.Generator().manual_seed(context_len)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(context_len, width, generator=generator)
    query = qkv[-num_queries:, : num_heads * head_dim].view(num_queries, num_heads, head_dim)
    kv_shape = (context_len, num_kv_heads, head_dim)
    keys = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(kv_shape)
    values = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(kv_shape)
    expected = causal_reference(query, keys, values, head_dim**-0.5)
    for k, v in ((keys, values), (keys.contiguous(), values.contiguous())):
        # The output's rows: a view of a wider buffer, a head and rows beside them untouched.
        buffer = torch.full((num_queries + 3, num_heads + 1, head_dim), 7.0)
        out = buffer[1:-2, :num_heads]
        with torch_threads(num_threads):
            cpu_kernel.prefill_attention(query, k, v, head_dim**-0.5, out)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        untouched = torch.ones_like(buffer, dtype=torch.bool)
        untouched[1:-2, :num_heads] = False
        assert (buffer[untouched] == 7.0).all()


def test_prefill_kernel_carries_large_scores():
    """Scores in the hundreds, one key far above the rest: the online softmax's running max
    and rescaling keep every row finite, as close to fp64 as torch's fp32 SDPA gets (scores
    this large carry fp32's rounding into the weights)."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(70, 4, 64, generator=generator) * 30
    keys = torch.randn(150, 2, 64, generator=generator) * 30
    keys[100] *= 5  # later rows see a new maximum in their last key blocks
    values = torch.randn(150, 2, 64, generator=generator)
    out = torch.empty(70, 4, 64)
    cpu_kernel.prefill_attention(query, keys, values, 0.125, out)
    assert torch.isfinite(out).all()
    exact = causal_reference(query, keys, values, 0.125)
    sdpa = causal_reference(query, keys, values, 0.125, torch.float32)
    assert (out - exact).abs().max() <= 1.5 * (sdpa - exact).abs().max() + 1e-5


def test_prefill_kernel_refuses_what_it_cannot_take_and_skips_empty_chunks():
    query, keys = torch.randn(4, 2, 16), torch.randn(3, 1, 16)
    out = torch.empty(4, 2, 16)
    with pytest.raises(ValueError, match="at least as many keys"):
        cpu_kernel.prefill_attention(query, keys, keys, 0.25, out)  # fewer keys than queries
    with pytest.raises(ValueError, match="multiple of 8"):
        narrow = torch.randn(4, 2, 12)
        cpu_kernel.prefill_attention(narrow, torch.randn(4, 1, 12), torch.randn(4, 1, 12),
                                     0.25, torch.empty(4, 2, 12))  # fmt: skip
    with pytest.raises(ValueError, match="fp32"):
        cpu_kernel.prefill_attention(query, keys.double(), keys.double(), 0.25, out)
    cpu_kernel.prefill_attention(query[:0], keys[:0], keys[:0], 0.25, out[:0])  # nothing to do


def test_prefill_chunks_take_the_kernel_in_fp32_and_bf16(monkeypatch):
    """fp32 and bf16 queries go through the kernel (here counted; bf16 widened to fp32 for it),
    heads of 12 through the torch backend's SDPA; all equal the oracle."""
    calls = []
    kernel = cpu_kernel.prefill_attention
    monkeypatch.setattr(
        cpu_kernel, "prefill_attention", lambda *args: calls.append(1) or kernel(*args)
    )
    for dtype, head_dim, expected_calls in (
        (torch.float32, 64, 2),
        (torch.bfloat16, 64, 2),
        (torch.float32, 12, 0),  # not a multiple of 8
    ):
        calls.clear()
        shapes = [(0, 40), (25, 30), (60, 1)]
        expected, _, got, _, _ = run_both(shapes, 9, 3, head_dim, 16, dtype)
        torch.testing.assert_close(got, expected, **tolerance(dtype))
        assert len(calls) == expected_calls


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set levels")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_the_prefill_kernel_built_for_older_x86_matches_sdpa(older_x86_kernels, march):
    """Its vectors are GCC's generic ones: AVX2 registers (haswell) or SSE2 pairs (x86-64)."""
    function = older_x86_kernels(march).prefill_attention_f32
    function.argtypes = cpu_kernel.PREFILL_ARGTYPES
    function.restype = ctypes.c_int
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(45, 6, 72, generator=generator)
    keys, values = torch.randn(2, 80, 2, 72, generator=generator)
    out = torch.empty(45, 6, 72)
    status = function(
        query.data_ptr(), query.stride(0), query.stride(1), keys.data_ptr(), values.data_ptr(),
        keys.stride(0), keys.stride(1), 45, 80, 6, 2, 72, 72**-0.5, out.data_ptr(),
        out.stride(0), out.stride(1), 2,
    )  # fmt: skip
    assert status == 0
    torch.testing.assert_close(out, causal_reference(query, keys, values, 72**-0.5),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_large_scores_do_not_overflow():
    """Scores in the hundreds (softmax's running max must carry them): still the oracle's."""
    torch.manual_seed(0)
    cache = torch.randn(2, 8, 16, 2, 64) * 30
    query = torch.randn(1, 4, 64) * 30
    key, value = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    request = Slice(list(range(100)), 99, 1, [5, 2, 7, 0, 1, 3, 4])
    outputs = []
    for backend in (torch_backend, cpu_backend):
        metadata = build_batch([request], 16, torch.device("cpu")).attn_metadata
        outputs.append(backend.paged_attention(query, key, value, cache.clone(), metadata, 0.125))
    assert torch.isfinite(outputs[1]).all()
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


def test_auto_picks_the_cpu_backend_on_cpu_and_vllm_names_map():
    assert backends.resolve_attention_backend("auto", "cpu") == "cpu"
    assert backends.resolve_attention_backend("CPU_ATTN", "cpu") == "cpu"
    assert backends.resolve_attention_backend("TORCH_SDPA", "cpu") == "torch"
    with pytest.raises(ValueError, match="runs on the CPU"):
        backends.resolve_attention_backend("cpu", "cuda")


def test_unsupported_shapes_run_on_the_torch_backend(caplog):
    function = backends.attention_function("cpu", torch.float16, 8, 2, 64)
    assert function is torch_backend.paged_attention
    assert "run on the torch backend" in caplog.text
    assert backends.attention_function("cpu", torch.bfloat16, 8, 2, 64) is (
        cpu_backend.paged_attention
    )


def test_without_a_compiler_auto_falls_back_and_cpu_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernel.load_library.cache_clear()
    try:
        assert cpu_kernel.load_library() is None
        assert backends.resolve_attention_backend("auto", "cpu") == "torch"
        with pytest.raises(ValueError, match="C compiler"):
            backends.resolve_attention_backend("cpu", "cpu")
    finally:
        cpu_kernel.load_library.cache_clear()


def test_the_library_is_cached_per_cpu(monkeypatch, tmp_path):
    """A cache shared by machines of different CPUs holds one library per CPU: code built
    with -march=native for one never loads on another."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    built = []
    for identity in ("model name: A\nflags: avx2", "model name: B\nflags: avx512f"):
        monkeypatch.setattr(cpu_kernel, "_cpu_identity", lambda identity=identity: identity)
        cpu_kernel.load_library.cache_clear()
        try:
            assert cpu_kernel.load_library() is not None
        finally:
            cpu_kernel.load_library.cache_clear()
        built.append(sorted(p.name for p in (tmp_path / "kernels").iterdir()))
    assert len(built[0]) == 1 and len(built[1]) == 2


def test_largest_supported_shape_and_a_strided_query():
    """The kernel's buffers at their limits (a GQA group of 32, heads of 256, blocks of 256),
    and a query whose head dimension is not contiguous (copied before the call)."""
    expected, _, got, _, _ = run_both([(300, 1), (2, 1), (40, 3)], 32, 1, 256, 256,
                                      torch.float32, seed=4)  # fmt: skip
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))

    torch.manual_seed(5)
    cache = torch.randn(2, 6, 16, 2, 64)
    strided = torch.randn(2, 64, 8).transpose(1, 2)  # [T, H, D], last stride 8
    key, value = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    requests = [Slice(list(range(40)), 39, 1, [3, 0, 5]), Slice(list(range(9)), 8, 1, [1])]
    outputs = []
    for backend, query in ((torch_backend, strided.contiguous()), (cpu_backend, strided)):
        metadata = build_batch(requests, 16, torch.device("cpu")).attn_metadata
        outputs.append(backend.paged_attention(query, key, value, cache.clone(), metadata, 0.125))
    torch.testing.assert_close(outputs[1], outputs[0], **tolerance(torch.float32))


def test_cpu_backend_is_refused_off_the_cpu():
    with pytest.raises(ValueError, match="runs on the CPU"):
        backends.resolve_attention_backend("cpu", "mps")
    assert backends.resolve_attention_backend("auto", "mps") == "torch"
