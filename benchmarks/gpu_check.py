"""One prepared pass on a CUDA machine: parity with HF transformers on the GPU, the engine on
the GPU, and eager forward timings of a Llama-3.2-1B-shaped model against HF.

    PYTHONPATH=src:tests python benchmarks/gpu_check.py

Prints PASS/FAIL lines and a timing table; exits non-zero if a check failed.
"""

from __future__ import annotations

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
        for dtype, tolerance in [("float32", 1e-4), ("bfloat16", 5e-2)]:
            runner = ModelRunner(RunnerConfig(model=folder, dtype=dtype, device=DEVICE,
                                              num_kv_blocks=16, block_size=16))  # fmt: skip
            slices, next_block = [], 0
            for p in prompts:
                blocks = list(range(next_block, next_block + -(-len(p) // 16)))
                next_block += len(blocks)
                slices.append(Slice(p, 0, len(p), blocks))
            logits = all_token_logits(runner, slices)
            expected = torch.cat([hf_logits(hf, p) for p in prompts])
            error = relative_error(logits, expected)
            check(f"logits {name} {dtype}", error <= tolerance, f"relative error {error:.2e}")
        llm = LLM(folder, device=DEVICE, dtype="float32", skip_tokenizer_init=True,
                  max_num_batched_tokens=32, max_num_seqs=8,
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
                  max_num_batched_tokens=32, max_num_seqs=8, num_kv_blocks=8, block_size=8,
                  prefix_caching_hash_algo="sha256", async_scheduling=mode)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    check(f"async scheduling {name}", results[True] == results[False],
          f"{sum(a == b for a, b in zip(results[True], results[False], strict=True))}/"
          f"{len(prompts)} equal")  # fmt: skip


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
    runner = ModelRunner(
        RunnerConfig(dtype=torch.bfloat16, device=DEVICE, num_kv_blocks=32 * 160), model=ours
    )

    prompt = list(range(1000, 3048))
    rows = []
    with torch.inference_mode():
        ours_prefill = timed(lambda: runner.execute([Slice(prompt, 0, 2048, list(range(128)))]))
        hf_ids = torch.tensor([prompt], device=DEVICE)
        hf_prefill = timed(lambda: hf(hf_ids, logits_to_keep=1))
        rows.append(("prefill 2048 tokens", ours_prefill, hf_prefill))
        for batch in (1, 32):
            ours_step, hf_step = decode_step_times(runner, hf, batch)
            rows.append((f"decode step, batch {batch}, context 512", ours_step, hf_step))
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
    llama_1b_timings()
    if FAILURES:
        print(f"\n{len(FAILURES)} checks failed: {', '.join(FAILURES)}")
        sys.exit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
