"""One prepared pass on a CUDA machine: parity with HF transformers on the GPU (both attention
backends), the engine on the GPU, the triton attention kernels against the torch backend at
full size, and eager forward timings of a Llama-3.2-1B-shaped model against HF.

    PYTHONPATH=src:tests python benchmarks/gpu_check.py

Prints PASS/FAIL lines and a timing table; exits non-zero if a check failed.
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
        cases = [(dtype, tolerance, backend)
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
    import gc

    if DEVICE != "cuda":
        return
    gc.collect()
    torch.cuda.empty_cache()
    utilization = 0.3
    llm = LLM(folder, device=DEVICE, dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=utilization)  # fmt: skip
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
    gc.collect()
    torch.cuda.empty_cache()


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
    # The interpreter's tl.dot misreads bf16, so the CPU dry run checks in fp16.
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
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


def decode_step_times(runner: ModelRunner, hf, batch: int, steps: int = 16) -> tuple[float, float]:
    """Median seconds per decode step over `steps` steps from a 512-token context, both
    engines (each run restarts from the same context; the prefill is not timed)."""
    from transformers import DynamicCache

    context = 512
    slices = [Slice(list(range(context + steps)), 0, context, list(range(i * 40, i * 40 + 40)))
              for i in range(batch)]  # fmt: skip
    runner.execute(slices)
    ids = torch.randint(0, 1000, (batch, context + steps), device=DEVICE)
    ours, theirs = [], []
    for _ in range(4):
        synchronize()
        start = time.perf_counter()
        for step in range(steps):
            for s in slices:
                s.num_computed_tokens, s.num_new_tokens = context + step, 1
            runner.execute(slices)
        synchronize()
        ours.append((time.perf_counter() - start) / steps)
        cache = DynamicCache()
        hf(ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        synchronize()
        start = time.perf_counter()
        for step in range(steps):
            position = context + step
            hf(ids[:, position : position + 1], past_key_values=cache, use_cache=True,
               logits_to_keep=1)  # fmt: skip
        synchronize()
        theirs.append((time.perf_counter() - start) / steps)
    return statistics.median(ours[1:]), statistics.median(theirs[1:])


def llama_1b_timings() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=128256 // (16 if SMALL else 1), hidden_size=2048 // (8 if SMALL else 1),
        intermediate_size=8192 // (8 if SMALL else 1), num_hidden_layers=2 if SMALL else 16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device(DEVICE):
        hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    config = model_config_from_hf({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    with torch.device("meta"):
        ours = CausalLM(config).to(torch.bfloat16)
    ours.to_empty(device=DEVICE)
    ours.model.rotary.build_table()
    load_weights(ours, iter(hf.state_dict().items()))
    prompt = list(range(1000, 3048))
    rows = []
    hf_ids = torch.tensor([prompt], device=DEVICE)
    setups = [(backend, 0) for backend in BACKENDS]
    if DEVICE == "cuda":
        setups.append(("triton", 32))  # + decode steps replayed from CUDA graphs
    for backend, graph_batch in setups:  # each runner binds its cache and backend to the layers
        runner = ModelRunner(
            RunnerConfig(dtype=torch.bfloat16, device=DEVICE, num_kv_blocks=32 * 160,
                         attention_backend=backend, decode_graph_max_batch=graph_batch,
                         max_model_len=8192),
            model=ours,
        )  # fmt: skip
        if graph_batch:
            backend += " + CUDA graphs"
        with torch.inference_mode():
            prefill = timed(lambda r=runner: r.execute([Slice(prompt, 0, 2048, list(range(128)))]))
            hf_prefill = timed(lambda: hf(hf_ids, logits_to_keep=1))
            rows.append((f"prefill 2048 tokens, {backend}", prefill, hf_prefill))
            for batch in (1, 32):
                ours_step, hf_step = decode_step_times(runner, hf, batch)
                rows.append((f"decode step, batch {batch}, context 512, {backend}", ours_step,
                             hf_step))  # fmt: skip
        del runner
    print(f"\n# gpu_check  {device_name()}  torch {torch.__version__}  "
          "Llama-3.2-1B-shaped, random bf16 weights, eager")  # fmt: skip
    print("| case | tandem ms | HF ms | tandem speed-up |")
    print("|---|---:|---:|---:|")
    for name, ours_s, hf_s in rows:
        print(f"| {name} | {ours_s * 1e3:.2f} | {hf_s * 1e3:.2f} | {hf_s / ours_s:.2f}× |")


def main() -> None:
    import tempfile

    print(f"device: {device_name()}  torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        parity(tmp)
    triton_kernels_match()
    llama_1b_timings()
    if FAILURES:
        print(f"\n{len(FAILURES)} checks failed: {', '.join(FAILURES)}")
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
