"""What holding replies to a grammar costs (structured outputs): output tok/s of the embedded
model at batch 1, 8 and 32, every reply held to a grammar against the same requests free, the
two alternating round by round in one engine (dtype auto, the engine's default). The grammar
is a regex that no reply completes within the budget (letters, digits and spaces), so both
sides generate every token of it; a JSON-schema row gives the same for a schema-held reply
cut at the budget. A held request also leaves the fast paths a free one takes: multi-step
bursts and the C sampler.

    .venv/bin/python benchmarks/structured_outputs.py [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import subprocess
import time

import torch

from tandem import LLM, SamplingParams
from tandem.sampling_params import StructuredOutputsParams

BATCHES = (1, 8, 32)
SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string"}, "words": {"type": "integer"}},
    "required": ["story", "words"],
}
GRAMMARS = {
    "regex [a-zA-Z0-9 ]+": StructuredOutputsParams(regex="[a-zA-Z0-9 ]+"),
    "JSON schema": StructuredOutputsParams(json=SCHEMA),
}


def rate(llm: LLM, prompts: list, params: SamplingParams, tokens: int) -> float:
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
    return len(prompts) * tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens a reply")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    print(f"# structured_outputs  {datetime.datetime.now():%Y-%m-%d %H:%M}  "
          f"{platform.machine()}  {torch.get_num_threads()} threads  commit {commit}")  # fmt: skip
    llm = LLM("default")
    prompts = [
        [{"role": "user", "content": f"Tell a short story about a lighthouse, number {i}."}]
        for i in range(max(BATCHES))
    ]
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.chat(prompts[:2], free, use_tqdm=False)  # warm
    print(f"Output tok/s, median of {args.rounds} rounds, {args.tokens} tokens a reply")
    print("| batch | grammar | free | held | held / free |")
    print("|---:|---|---:|---:|---:|")
    for batch in BATCHES:
        for name, grammar in GRAMMARS.items():
            held = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True,
                                  structured_outputs=grammar)  # fmt: skip
            rates: dict[str, list[float]] = {"free": [], "held": []}
            for _ in range(args.rounds):
                rates["free"].append(rate(llm, prompts[:batch], free, args.tokens))
                rates["held"].append(rate(llm, prompts[:batch], held, args.tokens))
            free_rate, held_rate = (statistics.median(rates[k]) for k in ("free", "held"))
            print(f"| {batch} | {name} | {free_rate:.1f} | {held_rate:.1f} | "
                  f"{held_rate / free_rate:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
