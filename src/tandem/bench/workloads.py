"""What `tandem bench serve` sends, and when: every workload is a list of sessions (one request,
or a conversation whose turns wait for the previous answer), generated locally and deterministic
per seed. Lengths are counted in words of `words.WORDS` (one token each in SmolLM2's vocabulary
and about one in most others) or in token ids; the server's usage gives the exact counts.

- random: input/output lengths uniform in ranges; text of random words, or token-id prompts.
- chat: lengths drawn from log-normals fitted to published ShareGPT statistics (CHAT_* below).
- stutter: steady decode streams start together; long prompts arrive periodically among them.
- shared-prefix: every request is one long shared system prompt plus its own short question.
- multi-turn: conversations that re-send their whole history; each turn waits for the answer.
- jsonl: a file of {"prompt": text or token ids, "output_len": N} lines.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.words import WORDS

WORKLOADS = ("random", "chat", "stutter", "shared-prefix", "multi-turn", "jsonl")

# ShareGPT as vLLM's paper measured it (Kwon et al., "Efficient Memory Management for Large
# Language Model Serving with PagedAttention", SOSP 2023, Fig. 11): mean input 161.31 tokens,
# mean output 337.99 tokens. The paper gives means and histograms, not a spread, so the log-normal
# shapes are our choice: sigma 1.0 for prompts (a heavy tail, p99 ~ 10x the median) and 0.8 for
# answers. mu = ln(mean) - sigma^2 / 2 keeps the published means. Draws are clipped to
# [CHAT_MIN_LEN, the caps given], which lowers the means slightly.
CHAT_INPUT_MEAN, CHAT_INPUT_SIGMA = 161.31, 1.0
CHAT_OUTPUT_MEAN, CHAT_OUTPUT_SIGMA = 337.99, 0.8
CHAT_MIN_LEN = 4


@dataclass
class Turn:
    prompt: str | list[int]  # text or token ids; in a conversation, the user's new message
    output_len: int  # max_tokens (with ignore_eos: the answer's length)
    prompt_len: int  # words or token ids in `prompt`


@dataclass
class Session:
    turns: list[Turn]
    system: str | None = None  # a system prompt sent before the turns
    arrival: float | None = None  # seconds after the start, for workloads that time themselves
    tag: str = ""  # what the request is in its workload ("stream", "long", ...): plots mark it


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    params: dict = field(default_factory=dict)  # what generated it, for the JSON

    @property
    def self_timed(self) -> bool:
        return all(session.arrival is not None for session in self.sessions)

    @property
    def num_requests(self) -> int:
        return sum(len(session.turns) for session in self.sessions)


def parse_range(text: str) -> tuple[int, int]:
    """'N' or 'LO:HI' (inclusive) as a (lo, hi) pair."""
    lo, _, hi = str(text).partition(":")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length or LO:HI range: {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI: {text!r}")
    return bounds


def draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def text_of(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def token_ids_of(rng: random.Random, num_tokens: int, id_range: tuple[int, int]) -> list[int]:
    return [rng.randint(*id_range) for _ in range(num_tokens)]


def _prompt(rng: random.Random, length: int, tokens: bool, id_range: tuple[int, int]):
    return token_ids_of(rng, length, id_range) if tokens else text_of(rng, length)


def lognormal_length(rng: random.Random, mean: float, sigma: float, scale: float, cap: int) -> int:
    mu = math.log(mean * scale) - sigma**2 / 2
    return max(CHAT_MIN_LEN, min(cap, round(rng.lognormvariate(mu, sigma))))


def arrival_times(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s) of `count` requests at `rate` per second: gaps drawn from a gamma with
    shape `burstiness` (1: exponential, a Poisson process; < 1 burstier; > 1 more even) and mean
    1/rate, then scaled so the whole run averages `rate` exactly (as vLLM does). The first
    request goes at 0. rate inf: all at 0."""
    if count <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    rng = random.Random(f"arrivals-{seed}")
    times = [0.0]
    for _ in range(count - 1):
        times.append(times[-1] + rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
    if count > 1 and times[-1] > 0:
        factor = (count - 1) / rate / times[-1]
        times = [t * factor for t in times]
    return times


# -- the workloads ------------------------------------------------------------------------------


def random_workload(
    num_prompts: int,
    seed: int,
    input_len=(256, 256),
    output_len=(64, 64),
    tokens: bool = False,
    id_range=(1000, 30000),
) -> Workload:
    rng = random.Random(seed)
    sessions = []
    for _ in range(num_prompts):
        length = draw(rng, input_len)
        turn = Turn(_prompt(rng, length, tokens, id_range), draw(rng, output_len), length)
        sessions.append(Session([turn]))
    params = dict(
        input_len=list(input_len),
        output_len=list(output_len),
        prompt_format="tokens" if tokens else "text",
    )
    return Workload("random", sessions, params)


def chat_workload(
    num_prompts: int,
    seed: int,
    scale: float = 1.0,
    max_input_len: int = 2048,
    max_output_len: int = 1024,
) -> Workload:
    rng = random.Random(seed)
    sessions = []
    for _ in range(num_prompts):
        length = lognormal_length(rng, CHAT_INPUT_MEAN, CHAT_INPUT_SIGMA, scale, max_input_len)
        output = lognormal_length(rng, CHAT_OUTPUT_MEAN, CHAT_OUTPUT_SIGMA, scale, max_output_len)
        sessions.append(Session([Turn(text_of(rng, length), output, length)]))
    params = dict(
        scale=scale,
        max_input_len=max_input_len,
        max_output_len=max_output_len,
        input_mean=CHAT_INPUT_MEAN,
        input_sigma=CHAT_INPUT_SIGMA,
        output_mean=CHAT_OUTPUT_MEAN,
        output_sigma=CHAT_OUTPUT_SIGMA,
    )
    return Workload("chat", sessions, params)


def stutter_workload(
    num_prompts: int,
    seed: int,
    streams: int = 4,
    input_len=(32, 32),
    output_len=(256, 256),
    long_len: int = 1024,
    long_output_len: int = 8,
    long_start: float = 2.0,
    long_every: float = 4.0,
    tokens: bool = False,
    id_range=(1000, 30000),
) -> Workload:
    """`streams` short-prompt, long-output requests at t=0, then `num_prompts` long prompts at
    long_start, long_start + long_every, ...: how much each arrival stalls the streams."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(streams):
        length = draw(rng, input_len)
        turn = Turn(_prompt(rng, length, tokens, id_range), draw(rng, output_len), length)
        sessions.append(Session([turn], arrival=0.0, tag="stream"))
    for k in range(num_prompts):
        turn = Turn(_prompt(rng, long_len, tokens, id_range), long_output_len, long_len)
        sessions.append(Session([turn], arrival=long_start + k * long_every, tag="long"))
    params = dict(
        streams=streams,
        input_len=list(input_len),
        output_len=list(output_len),
        long_len=long_len,
        long_output_len=long_output_len,
        long_start=long_start,
        long_every=long_every,
        prompt_format="tokens" if tokens else "text",
    )
    return Workload("stutter", sessions, params)


def shared_prefix_workload(
    num_prompts: int,
    seed: int,
    prefix_len: int = 1024,
    suffix_len=(32, 32),
    output_len=(32, 32),
    tokens: bool = False,
    id_range=(1000, 30000),
) -> Workload:
    """One system prompt of `prefix_len` words ahead of every request's own question."""
    rng = random.Random(seed)
    prefix = _prompt(rng, prefix_len, tokens, id_range)
    sessions = []
    for _ in range(num_prompts):
        length = draw(rng, suffix_len)
        question = _prompt(rng, length, tokens, id_range)
        if tokens:
            turn = Turn(prefix + question, draw(rng, output_len), prefix_len + length)
            sessions.append(Session([turn], tag="shared-prefix"))
        else:
            turn = Turn(question, draw(rng, output_len), length)
            sessions.append(Session([turn], system=prefix, tag="shared-prefix"))
    params = dict(
        prefix_len=prefix_len,
        suffix_len=list(suffix_len),
        output_len=list(output_len),
        prompt_format="tokens" if tokens else "text",
    )
    return Workload("shared-prefix", sessions, params)


def multi_turn_workload(
    num_prompts: int,
    seed: int,
    turns: int = 4,
    system_len: int = 64,
    input_len=(32, 32),
    output_len=(32, 32),
) -> Workload:
    """`num_prompts` conversations of `turns` turns; each re-sends its history."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(num_prompts):
        system = text_of(rng, system_len) if system_len else None
        session_turns = []
        for _ in range(turns):
            length = draw(rng, input_len)
            session_turns.append(Turn(text_of(rng, length), draw(rng, output_len), length))
        sessions.append(Session(session_turns, system=system, tag="conversation"))
    params = dict(
        turns=turns, system_len=system_len, input_len=list(input_len), output_len=list(output_len)
    )
    return Workload("multi-turn", sessions, params)


def jsonl_workload(
    path: str | Path, num_prompts: int | None, seed: int, shuffle: bool = False
) -> Workload:
    """Lines of {"prompt": text or token ids, "output_len": N} (or "max_tokens"), optionally
    "system"; the first `num_prompts` (after a seeded shuffle if asked)."""
    sessions = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
            output_len = int(item.get("output_len", item.get("max_tokens")))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: need 'prompt' and 'output_len' ({error})") from None
        length = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        sessions.append(Session([Turn(prompt, output_len, length)], system=item.get("system")))
    if shuffle:
        random.Random(seed).shuffle(sessions)
    if num_prompts is not None:
        sessions = sessions[:num_prompts]
    return Workload("jsonl", sessions, dict(path=str(path), shuffle=shuffle))


# -- command line -----------------------------------------------------------------------------


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default="random", choices=WORKLOADS)
    group.add_argument(
        "--num-prompts",
        type=int,
        default=64,
        help="requests (multi-turn: conversations; stutter: long prompts)",
    )
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--input-len",
        type=parse_range,
        default=None,
        help="prompt words, N or LO:HI (random 256; stutter streams and multi-turn turns 32)",
    )
    group.add_argument(
        "--output-len",
        type=parse_range,
        default=None,
        help="new tokens, N or LO:HI (random 64; stutter streams 256; "
        "shared-prefix and multi-turn 32)",
    )
    group.add_argument(
        "--prompt-format",
        choices=["text", "tokens"],
        default="text",
        help="random words, or random token ids (random, stutter, shared-prefix)",
    )
    group.add_argument("--token-id-range", type=parse_range, default=(1000, 30000))
    group.add_argument(
        "--chat-scale",
        type=float,
        default=1.0,
        help="chat: multiply the ShareGPT lengths (keeps the shape)",
    )
    group.add_argument("--max-input-len", type=int, default=2048, help="chat: prompt cap")
    group.add_argument("--max-output-len", type=int, default=1024, help="chat: answer cap")
    group.add_argument("--streams", type=int, default=4, help="stutter: decode streams")
    group.add_argument("--long-prompt-len", type=int, default=1024, help="stutter")
    group.add_argument("--long-output-len", type=int, default=8, help="stutter")
    group.add_argument(
        "--long-start",
        type=float,
        default=2.0,
        help="stutter: first long prompt, s after the streams",
    )
    group.add_argument(
        "--long-every", type=float, default=4.0, help="stutter: seconds between long prompts"
    )
    group.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix")
    group.add_argument("--suffix-len", type=parse_range, default=(32, 32), help="shared-prefix")
    group.add_argument("--turns", type=int, default=4, help="multi-turn")
    group.add_argument("--system-len", type=int, default=64, help="multi-turn")
    group.add_argument("--dataset-path", default=None, help="jsonl: the file")
    group.add_argument("--shuffle", action="store_true", help="jsonl: seeded shuffle")


def build_workload(args: argparse.Namespace) -> Workload:
    tokens = args.prompt_format == "tokens"
    ids = args.token_id_range
    n, seed = args.num_prompts, args.seed
    if args.workload == "random":
        return random_workload(
            n, seed, args.input_len or (256, 256), args.output_len or (64, 64), tokens, ids
        )
    if args.workload == "chat":
        return chat_workload(n, seed, args.chat_scale, args.max_input_len, args.max_output_len)
    if args.workload == "stutter":
        return stutter_workload(
            n,
            seed,
            args.streams,
            args.input_len or (32, 32),
            args.output_len or (256, 256),
            args.long_prompt_len,
            args.long_output_len,
            args.long_start,
            args.long_every,
            tokens,
            ids,
        )
    if args.workload == "shared-prefix":
        return shared_prefix_workload(
            n, seed, args.prefix_len, args.suffix_len, args.output_len or (32, 32), tokens, ids
        )
    if args.workload == "multi-turn":
        return multi_turn_workload(
            n,
            seed,
            args.turns,
            args.system_len,
            args.input_len or (32, 32),
            args.output_len or (32, 32),
        )
    if args.dataset_path is None:
        raise ValueError("--workload jsonl needs --dataset-path FILE")
    return jsonl_workload(args.dataset_path, n, seed, args.shuffle)
