"""Write a random-init Hugging Face-format checkpoint and a byte-level tokenizer, offline.

Lets the real-model configs run on a machine with no model hub access: the files have the
layout `tune download` produces (config.json, model.safetensors or the hub's numbered shards
with --shards, original/tokenizer.model),
so a config needs only its paths overridden. The weights are random, so losses are not
meaningful; speed and memory are.

    python bench/random_checkpoint.py --model torchtune.models.llama3_2.llama3_2_1b --output-dir /tmp/rand-1b
"""

import argparse
import base64
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torchtune import config
from torchtune.models.convert_weights import tune_to_hf
from torchtune.training import set_default_dtype


def write_byte_tokenizer(path: Path) -> None:
    """A tiktoken file with the 256 byte tokens only: enough for torchtune's llama3_tokenizer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path.write_text("\n".join(lines) + "\n")


def shards(sd: dict, count: int) -> list:
    """``sd`` in ``count`` files of about equal bytes, keys in order, named as the hub names
    them: model.safetensors for one, model-00001-of-0000N.safetensors for several."""
    if count == 1:
        return [("model.safetensors", sd)]
    total = sum(v.numel() * v.element_size() for v in sd.values())
    parts, done = [{} for _ in range(count)], 0
    for k, v in sd.items():
        parts[min(count - 1, done * count // total)][k] = v
        done += v.numel() * v.element_size()
    return [(f"model-{i + 1:05d}-of-{count:05d}.safetensors", part) for i, part in enumerate(parts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="torchtune model builder path")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1,
                        help="files to split the weights into, named as the hub's (the 8B "
                             "configs list model-0000{1..4}-of-00004.safetensors)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with set_default_dtype(torch.bfloat16), torch.device(device):
        model = config.instantiate(OmegaConf.create({"_component_": args.model}))
    attn = model.layers[0].attn
    dim = model.tok_embeddings.embedding_dim
    hf = {
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "hidden_size": dim,
        "head_dim": attn.head_dim,
        "vocab_size": model.tok_embeddings.num_embeddings,
        "num_hidden_layers": len(model.layers),
        "tie_word_embeddings": not hasattr(model.output, "weight"),
    }
    sd = tune_to_hf(
        {k: v.cpu().contiguous() for k, v in model.state_dict().items()},
        num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, dim=dim,
        head_dim=attn.head_dim,
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, part in shards(sd, args.shards):
        save_file({k: v.contiguous() for k, v in part.items()}, args.output_dir / name)
    (args.output_dir / "config.json").write_text(json.dumps(hf, indent=2))
    write_byte_tokenizer(args.output_dir / "original" / "tokenizer.model")
    print(f"wrote {sum(v.numel() for v in sd.values()):,} parameters to {args.output_dir}")


if __name__ == "__main__":
    main()
