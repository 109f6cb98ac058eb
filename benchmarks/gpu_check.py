"""One prepared pass on a CUDA machine (issue 11): parity with HF transformers on the GPU (both
attention backends), the engine on the GPU (async scheduling, decode graphs, the profiled KV
cache), the triton attention kernels against the torch backend at full size, and the timing
table of a Llama-3-8B-shaped model (random weights, no download) against HF transformers with
each row's roofline floor: batch-1 decode at context 128 and 4k, batch-64 and -256 decode at
1k, prefill of 2048 and 8192 tokens, a mixed step, and offline throughput.

    PYTHONPATH=src:tests python benchmarks/gpu_check.py
    PYTHONPATH=src:tests TRITON_INTERPRET=1 python benchmarks/gpu_check.py --small  # CPU dry run

Prints PASS/FAIL lines and a timing table; exits non-zero if a check failed. Ask for the H200
(`kind=nvidia-h200`): the table holds two 16 GB copies of the model and a 35 GB KV cache (for
batch 256 at context 1k), which leaves an H100 little for activations and HF's own cache. On a
lent machine (a fresh one: every triton kernel compiles, 1-2 min in all) the whole script may
outlast one 10-minute call; split it, and keep what is printed if the call is cut short:

    PYTHONUNBUFFERED=1 PYTHONPATH=src:tests python benchmarks/gpu_check.py \
        --only parity,kernels,table 2>&1 | tee $OUT/gpu_check.log
    ... --only offline,hf-compiled  # the second call
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import torch

from tandem import LLM, SamplingParams
from tandem.config import model_config_from_hf
from tandem.core.roofline import BatchSums, MachinePeaks, ModelShape, request_sums, sums_work
from tandem.engine.machine_peaks import machine_peaks
from tandem.models.llama import CausalLM
from tandem.models.loader import load_weights
from tandem.worker.model_runner import ModelRunner, RunnerConfig

from conftest import FAMILY_CONFIGS, make_hf_model
from helpers import Slice, all_token_logits, hf_logits, relative_error

FAILURES: list[str] = []
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script itself
SMALL = "--small" in sys.argv  # a scaled-down timing model, for the dry run
# The triton backend runs on CUDA; the dry run on CPU needs TRITON_INTERPRET=1 for it.
BACKENDS = (
    ("torch", "triton") if DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") else ("torch",)
)
# The interpreter's tl.dot misreads bf16, so the CPU dry run checks triton in fp16.
TRITON_HALF = "bfloat16" if DEVICE == "cuda" else "float16"


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def parity(tmp: str) -> None:
    for name, config_class, kwargs in FAMILY_CONFIGS:
        hf = make_hf_model(config_class, kwargs).to(DEVICE)
        folder = f"{tmp}/{name}"
        hf.save_pretrained(folder)
        prompts = [list(range(3, 40)), list(range(100, 117)), [5, 7, 11, 13]]
        cases = [(TRITON_HALF if dtype == "bfloat16" and backend == "triton" else dtype,
                  tolerance, backend)
                 for dtype, tolerance in [("float32", 1e-4), ("bfloat16", 5e-2)]
                 for backend in BACKENDS]  # fmt: skip
        for dtype, tolerance, backend in cases:
            runner = ModelRunner(RunnerConfig(model=folder, dtype=dtype, device=DEVICE,
                                              num_kv_blocks=16, block_size=16,
                                              attention_backend=backend))  # fmt: skip
            slices, next_block = [], 0
            for p in prompts:
                blocks = list(range(next_block, next_block + -(-len(p) // 16)))
                next_block += len(blocks)
                slices.append(Slice(p, 0, len(p), blocks))
            logits = all_token_logits(runner, slices)
            expected = torch.cat([hf_logits(hf, p) for p in prompts])
            error = relative_error(logits, expected)
            check(f"logits {name} {dtype} {backend}", error <= tolerance,
                  f"relative error {error:.2e}")  # fmt: skip
        llm = LLM(folder, device=DEVICE, dtype="float32", skip_tokenizer_init=True,
                  max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=64,
                  prefix_caching_hash_algo="sha256")  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        same = 0
        for p, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([p], device=DEVICE)
            with torch.inference_mode():
                reference = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=10,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            same += out.outputs[0].token_ids == reference[0, len(p) :].tolist()
        check(f"engine greedy {name}", same == len(prompts), f"{same}/{len(prompts)} equal")
        async_scheduling_matches(folder, prompts, name)
        decode_graphs_match(folder, prompts, name)
    memory_profile_sizes_the_cache(folder)


def async_scheduling_matches(folder: str, prompts: list[list[int]], name: str) -> None:
    """Async scheduling (the CUDA default) gives the tokens of stepping one at a time, greedy
    and seeded, with a preempting cache and stop tokens."""
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, stop_token_ids=[5, 9]),
    ]
    results = {}
    for mode in (False, True):
        llm = LLM(folder, device=DEVICE, dtype="float32", skip_tokenizer_init=True,
                  max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=6, block_size=16,
                  prefix_caching_hash_algo="sha256", async_scheduling=mode)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    check(f"async scheduling {name}", results[True] == results[False],
          f"{sum(a == b for a, b in zip(results[True], results[False], strict=True))}/"
          f"{len(prompts)} equal")  # fmt: skip


def decode_graphs_match(folder: str, prompts: list[list[int]], name: str) -> None:
    """Decode steps replayed from CUDA graphs (the CUDA default) give the tokens of eager
    steps: greedy and seeded, batches that shrink as requests finish (several graph sizes)."""
    if DEVICE != "cuda":
        return
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    params[-1] = SamplingParams(temperature=0.8, seed=11, max_tokens=9, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(folder, device=DEVICE, dtype="float32", skip_tokenizer_init=True,
                  max_num_seqs=8, num_kv_blocks=64, enforce_eager=eager)  # fmt: skip
        graphs = llm.llm_engine.core.runner.decode_graphs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outs]
        if graphs is not None:
            check(f"decode graphs captured {name}", bool(graphs.graphs), f"sizes {graphs.sizes}")
    same = sum(a == b for a, b in zip(results[True], results[False], strict=True))
    check(f"decode graphs {name}", same == len(prompts), f"{same}/{len(prompts)} equal")


def memory_profile_sizes_the_cache(folder: str) -> None:
    """With no cache size given, the cache takes what gpu_memory_utilization leaves after the
    profiling step: the instance then holds about that share of the device."""
    if DEVICE != "cuda":
        return
    free_device_memory()
    utilization = 0.3
    llm = LLM(folder, device=DEVICE, dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=utilization, max_num_seqs=8)  # fmt: skip
    runner = llm.llm_engine.core.runner
    _, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    out = llm.generate([{"prompt_token_ids": list(range(3, 40))}],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # fmt: skip
    share = reserved / total
    check("memory profile", 0.2 < share <= utilization + 0.02 and len(out[0].outputs[0].token_ids),
          f"{runner.num_kv_blocks} KV blocks; torch holds {share:.1%} of the device "
          f"(asked {utilization:.0%})")  # fmt: skip
    del llm, runner
    free_device_memory()


def triton_kernels_match() -> None:
    """The triton kernels against the torch backend at a Llama-3-8B-like head layout (32 query
    heads, 8 kv heads of 128), bf16: a mixed step (a 2048-token chunk after 1,000 cached
    tokens, 64 decodes up to 4k context, a draft verification) and a decode-only step with few
    programs (split-KV)."""
    import random

    from tandem.attention import torch_backend
    from tandem.attention.metadata import build_batch

    if "triton" not in BACKENDS:
        return
    from tandem.attention import triton_backend

    rng = random.Random(0)
    small = 32 if SMALL else 1
    steps = {
        "mixed": [(1000 // small, 2048 // small), (300 // small, 5)]
        + [(rng.randint(1, 4096 // small), 1) for _ in range(64 // small * 4)],
        "decode split-KV": [(rng.randint(2048, 8192) // small, 1) for _ in range(4)],
    }
    dtype = getattr(torch, TRITON_HALF)
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    for name, shapes in steps.items():
        torch.manual_seed(0)
        num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes)
        pool = list(range(num_blocks))
        rng.shuffle(pool)
        slices = []
        for computed, new in shapes:
            blocks = [pool.pop() for _ in range(-(-(computed + new) // block_size))]
            slices.append(Slice(list(range(computed + new)), computed, new, blocks))
        tokens = sum(n for _, n in shapes)
        cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                            device=DEVICE)  # fmt: skip
        q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=DEVICE)
        k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE)
        v = torch.randn_like(k)
        outs, caches, seconds = [], [], []
        for backend in (torch_backend, triton_backend):
            kv_cache = cache.clone()
            metadata = build_batch(slices, block_size, torch.device(DEVICE)).attn_metadata
            call = functools.partial(backend.paged_attention, q, k, v, kv_cache, metadata,
                                     head_dim**-0.5)  # fmt: skip
            with torch.inference_mode():
                outs.append(call())
                caches.append(kv_cache)
                # Storing the same k/v again changes nothing.
                seconds.append(timed(call, repeats=5 if DEVICE == "cuda" else 1))
        error = (outs[1].float() - outs[0].float()).abs().max().item()
        check(f"triton attention {name}", error <= 3e-2 and torch.equal(caches[0], caches[1]),
              f"max abs error {error:.1e}; torch {seconds[0] * 1e3:.2f} ms, triton "
              f"{seconds[1] * 1e3:.2f} ms per layer")  # fmt: skip


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int = 5) -> float:
    fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


TABLE_BACKEND = "triton" if "triton" in BACKENDS else "torch"
# Ceilings measured on the lent H200 (DESIGN.md): copy bandwidth and bf16 matmul.
H200_MEASURED = MachinePeaks("H200, measured (DESIGN.md)", 776e12, 4.25e12)


def hf_cache(hf, batch: int, context: int):
    """An HF DynamicCache holding `context` positions of `batch` rows (zeros: the timing does
    not depend on the values), built without a prefill."""
    from transformers import DynamicCache

    config = hf.config
    cache = DynamicCache()
    shape = (batch, config.num_key_value_heads, context, config.head_dim)
    for layer in range(config.num_hidden_layers):
        keys = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
        cache.update(keys, torch.zeros_like(keys), layer)
    return cache


def decode_rows(batch: int, context: int, first_block: int) -> list[Slice]:
    """`batch` requests at `context` cached tokens (the cache's contents do not matter to the
    timing), each with blocks for 16 more steps."""
    blocks_each = -(-(context + 16) // 16)
    return [
        Slice([0] * (context + 16), context, 1,
              list(range(first_block + i * blocks_each, first_block + (i + 1) * blocks_each)))
        for i in range(batch)
    ]  # fmt: skip


def time_decode(runner: ModelRunner, rows: list[Slice], steps: int = 16) -> float:
    """Median seconds per decode step over `steps` steps, in rounds from the same context."""
    context = rows[0].num_computed_tokens
    rounds = []
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        for step in range(steps):
            for row in rows:
                row.num_computed_tokens = context + step
            runner.execute(rows)
        synchronize()
        rounds.append((time.perf_counter() - start) / steps)
    for row in rows:
        row.num_computed_tokens = context
    return statistics.median(rounds)


def time_hf_decode(hf, batch: int, context: int, steps: int = 16) -> float:
    ids = torch.randint(0, 1000, (batch, 1), device=DEVICE)
    cache = hf_cache(hf, batch, context)
    hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)  # warm-up
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        hf(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    synchronize()
    return (time.perf_counter() - start) / steps


def time_hf_compiled_decode(hf, context: int, steps: int = 32) -> float:
    """HF's fast path: a static cache and the forward compiled (mode reduce-overhead), one
    generate call; seconds per new token after the first."""
    ids = torch.randint(0, 1000, (1, context), device=DEVICE)
    hf.generation_config.cache_implementation = "static"
    # generate compiles a static-cache forward itself too: one compile, this one, not two.
    disable_compile = getattr(hf.generation_config, "disable_compile", None)
    hf.generation_config.disable_compile = True
    forward = hf.forward
    hf.forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    try:
        kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))  # fmt: skip
        for _ in range(2):  # compiles
            hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, **kwargs)
        totals = {}
        for new in (1, steps):
            synchronize()
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
            synchronize()
            totals[new] = time.perf_counter() - start
        return (totals[steps] - totals[1]) / (steps - 1)
    finally:
        hf.forward = forward
        hf.generation_config.cache_implementation = None
        hf.generation_config.disable_compile = disable_compile


def floor_seconds(shape: ModelShape, peaks: MachinePeaks, work: list[tuple[int, int]]) -> float:
    """The roofline floor of a step of (cached, new) requests, each sampling one row."""
    sums = BatchSums()
    for cached, new in work:
        sums += request_sums(cached, new, True)
    step = sums_work(shape, sums)
    return max(step.flops / peaks.flops_per_second, step.bytes / peaks.bytes_per_second)


def hf_seconds(fn) -> float | None:
    """HF's time for a row, or None where it runs out of memory beside tandem's model."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        pass
    free_device_memory()  # out of the handler: its traceback held the failed call's tensors
    return None


def free_device_memory() -> None:
    import gc

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def tandem_rows(hf, config, shape: ModelShape, peaks: MachinePeaks, div: int) -> list[tuple]:
    """The table's rows from tandem's copy of the HF model's weights, which (with its KV
    cache, held by the model's layers) is freed on return: the offline section's engine
    sizes its cache by the memory left free."""
    with torch.device("meta"):
        ours = CausalLM(config).to(torch.bfloat16)
    ours.to_empty(device=DEVICE)
    ours.model.rotary.build_table()
    load_weights(ours, iter(hf.state_dict().items()))
    rows = table_rows(ours, hf, shape, peaks, div)
    del ours
    free_device_memory()
    return rows


def table_rows(ours, hf, shape: ModelShape, peaks: MachinePeaks, div: int) -> list[tuple]:
    """(case, tandem s, HF s or None, floor s) for each row of the table."""
    big_batch = 256 // div
    runner = ModelRunner(
        RunnerConfig(dtype=torch.bfloat16, device=DEVICE, attention_backend=TABLE_BACKEND,
                     num_kv_blocks=big_batch * 66 + 1200,
                     decode_graph_max_batch=big_batch if DEVICE == "cuda" else 0,
                     max_model_len=16384),
        model=ours,
    )  # fmt: skip
    rows = []  # (case, tandem s, HF s or None, floor s)
    with torch.inference_mode():
        for batch, context in [(1, 128), (1, 4096 // div), (64 // div, 1024 // div),
                               (big_batch, 1024 // div)]:  # fmt: skip
            ours_s = time_decode(runner, decode_rows(batch, context, 0))
            hf_s = hf_seconds(lambda b=batch, c=context: time_hf_decode(hf, b, c))
            floor = floor_seconds(shape, peaks, [(context, 1)] * batch)
            rows.append((f"decode, batch {batch}, context {context}", ours_s, hf_s, floor))
            print(f"  {rows[-1][0]} done", flush=True)
        prefills = {}
        for length in (2048 // div, 8192 // div):
            prompt = Slice([0] * length, 0, length, list(range(-(-length // 16))))
            prefills[length] = timed(lambda p=prompt, r=runner: r.execute([p]), repeats=3)
            hf_ids = torch.randint(0, 1000, (1, length), device=DEVICE)
            hf_s = hf_seconds(lambda i=hf_ids: timed(lambda: hf(i, logits_to_keep=1), repeats=3))
            rows.append((f"prefill {length} tokens", prefills[length], hf_s,
                         floor_seconds(shape, peaks, [(0, length)])))  # fmt: skip
        chunk = 2048 // div
        mixed = [Slice([0] * chunk, 0, chunk, list(range(-(-chunk // 16))))]
        mixed += decode_rows(64 // div, 1024 // div, -(-chunk // 16))
        mixed_s = timed(lambda r=runner: r.execute(mixed), repeats=3)
        mixed_floor = floor_seconds(shape, peaks, [(0, chunk)] + [(1024 // div, 1)] * (64 // div))
        rows.append((f"mixed: {chunk}-token chunk + {64 // div} decodes at {1024 // div} "
                     f"({mixed_s / prefills[chunk]:.2f}x the chunk alone)", mixed_s, None,
                     mixed_floor))  # fmt: skip
    del runner
    return rows


def llama_8b_table(tmp: str, sections: set[str]) -> None:
    """The issue's table on a Llama-3-8B-shaped model with random bf16 weights: tandem (its
    CUDA defaults: triton attention, decode graphs) against HF transformers in the same run,
    each row with its roofline floor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128)  # fmt: skip
    if SMALL:
        sizes = dict(vocab_size=4096, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64)  # fmt: skip
    hf_config = LlamaConfig(**sizes, max_position_embeddings=16384, rope_theta=500000.0,
                            tie_word_embeddings=False)  # fmt: skip
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: an fp32 copy first would need 32 GB
    try:
        with torch.device(DEVICE):
            hf = LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    config = model_config_from_hf({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    shape = ModelShape.of(config, 2, 2, 2)
    peaks = (
        H200_MEASURED
        if "H200" in device_name()
        else machine_peaks(torch.device(DEVICE), torch.bfloat16)
    )
    div = 16 if SMALL else 1
    if "table" in sections:
        print_table(tandem_rows(hf, config, shape, peaks, div), peaks)
    # The table is out before anything that could outlast the device's time.
    if "offline" in sections:
        offline_throughput(tmp, hf)
    if DEVICE == "cuda" and "hf-compiled" in sections:
        try:
            with torch.inference_mode():
                compiled = time_hf_compiled_decode(hf, 128)
            print(f"HF static cache + torch.compile, batch-1 decode at context 128: "
                  f"{compiled * 1e3:.2f} ms/token")  # fmt: skip
        except Exception as error:  # its compile is HF's business: report, go on
            print(f"  HF compiled decode failed: {type(error).__name__}: {error}")


def print_table(rows: list[tuple], peaks: MachinePeaks) -> None:
    if rows:
        graphs = ", decode graphs" if DEVICE == "cuda" else ""
        print(f"\n# gpu_check  {device_name()}  torch {torch.__version__}  Llama-3-8B-shaped"
              f"{' (scaled down)' if SMALL else ''}, random bf16 weights; tandem: {TABLE_BACKEND} "
              f"attention{graphs}; floor: {peaks.name}")  # fmt: skip
        print("| case | tandem ms | HF ms | tandem / HF speed-up | floor ms | tandem / floor |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, ours_s, hf_s, floor in rows:
            hf_text = "—" if hf_s is None else f"{hf_s * 1e3:.2f}"
            speedup = "—" if hf_s is None else f"{hf_s / ours_s:.2f}×"
            print(f"| {name} | {ours_s * 1e3:.2f} | {hf_text} | {speedup} | {floor * 1e3:.2f} | "
                  f"{ours_s / floor:.2f}× |")  # fmt: skip


def offline_throughput(tmp: str, hf) -> None:
    """500 random requests of 1,024 prompt tokens and 256 new ones through LLM.generate
    against HF generate in batches of 64 (timed on the first two batches)."""
    num_requests, prompt_len, new_tokens = (8, 64, 16) if SMALL else (500, 1024, 256)
    folder = f"{tmp}/llama-8b-shaped"
    hf.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 1000, (num_requests, prompt_len), generator=generator)
    llm = LLM(folder, device=DEVICE, dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=0.6 if DEVICE == "cuda" else None,
              **({} if DEVICE == "cuda" else {"num_kv_blocks": 512}))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params,
                        use_tqdm=False)  # fmt: skip
    ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    del llm, outs
    free_device_memory()
    hf_batches = [prompts[i : i + 64].to(DEVICE) for i in range(0, min(128, num_requests), 64)]
    synchronize()
    start = time.perf_counter()
    hf_tokens = 0
    with torch.inference_mode():
        for ids in hf_batches:
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
            hf_tokens += out[:, prompt_len:].numel()
    synchronize()
    theirs = hf_tokens / (time.perf_counter() - start)
    print(
        f"offline, {num_requests} requests x ({prompt_len} in, {new_tokens} out): tandem "
        f"{ours:.0f} tok/s, HF {theirs:.0f} tok/s (batches of 64, first "
        f"{sum(len(b) for b in hf_batches)} requests): {ours / theirs:.1f}×"
    )


SECTIONS = ("parity", "kernels", "table", "hf-compiled", "offline")


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="scaled-down shapes: a dry run")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} "
                        "(default: all; split them over calls when time is short)")  # fmt: skip
    sections = set(parser.parse_args().only.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}: choose from {', '.join(SECTIONS)}")
    print(f"device: {device_name()}  torch {torch.__version__}", flush=True)
    started = time.perf_counter()

    def done(section: str) -> None:  # device time is scarce: say where it went
        print(f"[{section} done at {time.perf_counter() - started:.0f} s]", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        if "parity" in sections:
            parity(tmp)
            done("parity")
        if "kernels" in sections:
            triton_kernels_match()
            done("kernels")
            from tandem.attention import torch_backend

            torch_backend._workspaces.clear()  # ~2 GB of gathers the table does not need
            free_device_memory()
        if sections & {"table", "hf-compiled", "offline"}:
            llama_8b_table(tmp, sections)
            done("table")
    if FAILURES:
        print(f"\n{len(FAILURES)} checks failed: {', '.join(FAILURES)}")
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
