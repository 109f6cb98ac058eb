"""Speculative decoding on the embedded model (issue 12): output tok/s and acceptance with each
proposer against no speculation, on an input-grounded workload (copy, correct, extract or
summarise a given text) and a free-writing one, at batch 1, 8, 32 and 64, in one run, engines
alternating round by round. Two groups, each against its own plain engine: `auto` (the default
dtype: bf16 with packed 4-bit weights for small steps on this kind of CPU) with the n-gram
proposer, adaptive and forced to verify everything it finds; `float32` with the draft model
that needs no download, the embedded model in dtype "auto" drafting for its fp32 self.

Greedy decoding of NEW_TOKENS tokens each (ignore_eos), so every engine emits as many tokens,
the same ones up to near-ties (bf16 has many): the comparison is time. A run takes its prompts
`batch` at a time: 4 at batch 1, 32 at batch 8 (MIN_RUN_PROMPTS), one group above. The texts are
the docstrings of Python standard-library modules: local, and different from each other. tok/s
is each engine's best round; "x" (speedup) is the median over rounds of its tok/s over the plain
engine's in the same round, the engines' order reversed every other round (a ratio of best
rounds was as noisy as this machine: adaptive engines that verified no drafts read 0.94-1.13x
their plain twins).
Nothing else may compute meanwhile (two OpenMP processes on 2 cores slow each other 10-30x).

    .venv/bin/python benchmarks/spec_decode.py [--rounds 2] [--batches 1 8 32 64]
        [--groups auto float32]
    .venv/bin/python benchmarks/spec_decode.py --step-times [--contexts 300] [--groups auto]
        # what verifying k drafts costs

`--step-times`: one request's step (ModelRunner.run) over a context of 300 tokens (or each of
`--contexts`) with 1 to 10 new tokens (the last known token and 0 to 9 drafts), per dtype (the
groups' names), best of 3 x 10 steps: what a verification step costs against a plain decode
step on this machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.core.scheduler import ScheduledRequest
from tandem.core.spec_stats import SpecDecodeStats

NEW_TOKENS = 128
BATCH_1_PROMPTS = 4  # batch 1 runs this many prompts one after another
# Smaller batches run groups of `batch` prompts one after another, as many as make this many
# prompts: a batch of 8 ran in 0.5-0.7 s (the default dtype), too short for this machine,
# whose rate moves by +-5% from one such run to the next.
MIN_RUN_PROMPTS = 32
RESULTS = Path("benchmarks/results/spec_decode.json")
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
DRAFT = {"model": "default", "num_speculative_tokens": 3}
GROUPS = {  # group -> engine -> (dtype, speculative_config); "none" is the group's baseline
    "auto": {
        "none": ("auto", None),
        "ngram adaptive": ("auto", NGRAM),
        "ngram forced": ("auto", {**NGRAM, "adaptive": False}),
    },
    "float32": {
        "none": ("float32", None),
        "draft adaptive": ("float32", DRAFT),
        "draft forced": ("float32", {**DRAFT, "adaptive": False}),
    },
}
MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "colorsys", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "dis", "doctest", "email", "enum", "filecmp", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq",
    "hmac", "html", "imaplib", "inspect", "io", "ipaddress", "json", "keyword", "linecache",
    "locale", "logging", "lzma", "mailbox", "mimetypes", "numbers", "operator", "optparse",
    "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint", "profile",
    "pstats", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "struct",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "turtle", "typing", "unittest", "uuid", "warnings", "wave", "weakref",
    "webbrowser", "zipfile", "zipimport",
)  # fmt: skip
TASKS = (
    "Copy the following text exactly, word for word:\n\n{text}",
    "Correct any spelling mistakes in the following text and return the whole text:\n\n{text}",
    "{text}\n\nQuote the sentences of the text above that describe what the module does.",
    "Summarise the following text, reusing its wording:\n\n{text}",
)
TOPICS = (
    "a lighthouse keeper", "a robot learning to paint", "the first day of spring",
    "a lost city under the sea", "a chess tournament", "a dragon who is afraid of fire",
    "a train journey across a desert", "a baker who bakes at midnight", "an old clock",
    "a village without music", "a friendship between a cat and a crow", "the last library",
)  # fmt: skip
FREE_TASKS = (
    "Write a short story about {topic}.",
    "Write a poem about {topic}.",
    "Describe {topic} in a few paragraphs, inventing every detail.",
)


def grounded_texts(count: int) -> list[str]:
    """Passages of standard-library docstrings, 300-700 characters cut at a sentence: the
    first of each module's, then second ones, until there are `count`."""
    passages: list[list[str]] = []
    for name in MODULES:
        doc = (importlib.import_module(name).__doc__ or "").strip()
        own = []
        while len(doc) >= 300 and len(own) < 3:
            cut = doc[:700]
            end = cut.rfind(". ")
            passage = cut[: end + 1] if end > 300 else cut
            own.append(passage)
            doc = doc[len(passage) :].strip()
        passages.append(own)
    texts = [own[rank] for rank in range(3) for own in passages if len(own) > rank]
    if len(texts) < count:
        raise RuntimeError(f"found {len(texts)} passages, need {count}")
    return texts[:count]


def workloads(llm: LLM, count: int) -> dict[str, list[str]]:
    tokenizer = llm.get_tokenizer()

    def chat(content: str) -> str:
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    texts = grounded_texts(count)
    grounded = [chat(TASKS[i % len(TASKS)].format(text=t)) for i, t in enumerate(texts)]
    free = [
        chat(FREE_TASKS[i % len(FREE_TASKS)].format(topic=TOPICS[i % len(TOPICS)]))
        for i in range(count)
    ]
    return {"input-grounded": grounded, "free-writing": free}


def run(llm: LLM, prompts: list[str], batch: int) -> tuple[float, int, SpecDecodeStats]:
    """Seconds and output tokens for `prompts`, `batch` at a time, and the speculation
    counters it added."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    stats = llm.llm_engine.core.spec_decode_stats  # updated in place
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    groups = [prompts[start : start + batch] for start in range(0, len(prompts), batch)]
    start = time.perf_counter()
    tokens = 0
    for group in groups:
        outputs = llm.generate(group, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    seconds = time.perf_counter() - start
    after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    added = SpecDecodeStats(*(now - then for now, then in zip(after, before, strict=True)))
    return seconds, tokens, added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--step-times", action="store_true")
    parser.add_argument("--contexts", type=int, nargs="+", default=[300])
    args = parser.parse_args()
    if args.step_times:
        step_times(args.groups, args.contexts)
        return
    rows = []
    for group in args.groups:
        rows += run_group(group, args.batches, args.rounds)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    header = {
        "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
        "machine": platform.machine(),
        "commit": commit,
        "rounds": args.rounds,
        "new_tokens": NEW_TOKENS,
        "ngram": NGRAM,
        "draft": DRAFT,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**header, "rows": rows}, indent=1))
    print(json.dumps(header))


def step_times(dtypes: list[str], contexts: list[int], max_tokens: int = 10) -> None:
    for dtype in dtypes:
        runner = LLM("default", dtype=dtype).llm_engine.core.runner
        for context in contexts:
            token_ids = list(range(100, 100 + context + max_tokens))
            block_ids = list(range(-(-(context + max_tokens) // runner.block_size)))
            best: dict[int, float] = {}
            for _ in range(3):
                for num_new in range(1, max_tokens + 1):
                    request = ScheduledRequest(
                        "r", token_ids, context, num_new, block_ids, True, []
                    )
                    drafts = [token_ids[context + 1 : context + num_new]]
                    runner.run([request], [True], None, 0, drafts)
                    start = time.perf_counter()
                    for _ in range(10):
                        runner.run([request], [True], None, 0, drafts)
                    seconds = (time.perf_counter() - start) / 10
                    best[num_new] = min(best.get(num_new, seconds), seconds)
            times = "  ".join(f"{n}: {1000 * s:.1f}" for n, s in best.items())
            print(f"{dtype:8s} context {context:5d} step ms by new tokens: {times}", flush=True)


def run_group(group: str, batches: list[int], rounds: int) -> list[dict]:
    engines = {
        name: LLM("default", dtype=dtype, speculative_config=config)
        for name, (dtype, config) in GROUPS[group].items()
    }
    prompts = workloads(next(iter(engines.values())), max(*batches, MIN_RUN_PROMPTS))
    for llm in engines.values():  # warm up: kernels, allocator, the step-cost model's fit
        llm.generate(prompts["input-grounded"][:8], SamplingParams(max_tokens=32), use_tqdm=False)
    rows = []
    for workload, texts in prompts.items():
        for batch in batches:
            chosen = texts[: BATCH_1_PROMPTS if batch == 1 else max(batch, MIN_RUN_PROMPTS)]
            best: dict[str, tuple[float, int, SpecDecodeStats]] = {}
            rates: dict[str, list[float]] = {name: [] for name in engines}
            for round_index in range(rounds):
                order = list(engines.items())
                for name, llm in order if round_index % 2 == 0 else order[::-1]:
                    result = run(llm, chosen, batch)
                    rates[name].append(result[1] / result[0])
                    if name not in best or result[0] < best[name][0]:
                        best[name] = result
            counts = {name: result[1] for name, result in best.items()}
            if len(set(counts.values())) != 1:
                print(f"  note: token counts differ (near-ties): {counts}")
            for name, (seconds, tokens, stats) in best.items():
                ratios = [a / b for a, b in zip(rates[name], rates["none"], strict=True)]
                row = {
                    "group": group,
                    "workload": workload,
                    "batch": batch,
                    "engine": name,
                    "tok_s": tokens / seconds,
                    "speedup": statistics.median(ratios),
                    "speedup_by_round": ratios,
                    "acceptance": stats.acceptance_rate,
                    "mean_accepted_length": stats.mean_acceptance_length,
                    "drafts_per_token": stats.num_draft_tokens / tokens,
                }
                rows.append(row)
                print(
                    f"{group:8s}{workload:15s} batch {batch:3d} {name:15s} "
                    f"{row['tok_s']:7.1f} tok/s "
                    f"{row['speedup']:5.2f}x  acceptance {row['acceptance']:.2f}  "
                    f"mean accepted length {row['mean_accepted_length']:.2f}  "
                    f"drafts/token {row['drafts_per_token']:.2f}",
                    flush=True,
                )
    return rows


if __name__ == "__main__":
    main()
