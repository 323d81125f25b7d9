"""Write a random-init Hugging Face-format checkpoint and a byte-level tokenizer, offline.

Lets the real-model configs run on a machine with no model hub access: the files have the
layout `tune download` produces (config.json, model.safetensors or the hub's numbered shards
with --shards, pytorch_model-*.bin shards with --bin, and a tokenizer torchtune's builders
read: original/tokenizer.model for Llama 3 (tiktoken) and, with --tokenizer sentencepiece,
for Gemma and Mistral; vocab.json and merges.txt with --tokenizer qwen), so a config needs only
its paths overridden. Every tokenizer knows the 256 bytes and nothing more. The weights are
random, so losses are not meaningful; speed and memory are.

    python bench/random_checkpoint.py --model torchtune.models.llama3_2.llama3_2_1b --output-dir /tmp/rand-1b
    python bench/random_checkpoint.py --model torchtune.models.mistral.mistral_7b --output-dir /tmp/rand-mistral \
        --shards 2 --bin --tokenizer sentencepiece
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


def write_sentencepiece_tokenizer(path: Path) -> None:
    """A SentencePiece model of <unk>, <s>, </s> and the 256 byte pieces (every text falls
    back to its bytes), unnormalized: enough for torchtune's gemma_tokenizer and
    mistral_tokenizer."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    model = spm.ModelProto()
    model.trainer_spec.model_type = spm.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.eos_id = 0, 1, 2
    model.trainer_spec.pad_id = -1  # (torchtune's tokenizers set 0)
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = False
    kind = spm.ModelProto.SentencePiece
    for piece, type_ in [("<unk>", kind.UNKNOWN), ("<s>", kind.CONTROL), ("</s>", kind.CONTROL)] + [
            (f"<0x{b:02X}>", kind.BYTE) for b in range(256)]:
        model.pieces.add(piece=piece, type=type_, score=0.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


def write_qwen_tokenizer(folder: Path) -> None:
    """vocab.json with the 256 byte tokens (in the byte-to-unicode alphabet of byte-level
    BPE) and a merges.txt with no merges: enough for torchtune's qwen2_5_tokenizer, whose
    special tokens have their own ids."""
    from torchtune.models.qwen2._tokenizer import bytes_to_unicode

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({ch: b for b, ch in bytes_to_unicode().items()}))
    (folder / "merges.txt").write_text("#version: 0.2\n")


def shards(sd: dict, count: int, bin_files: bool = False) -> list:
    """``sd`` in ``count`` files of about equal bytes, keys in order, named as the hub names
    them: model.safetensors for one, model-00001-of-0000N.safetensors for several, or
    pytorch_model-00001-of-0000N.bin (Mistral's configs list those)."""
    if count == 1 and not bin_files:
        return [("model.safetensors", sd)]
    total = sum(v.numel() * v.element_size() for v in sd.values())
    parts, done = [{} for _ in range(count)], 0
    for k, v in sd.items():
        parts[min(count - 1, done * count // total)][k] = v
        done += v.numel() * v.element_size()
    name = "pytorch_model-{:05d}-of-{:05d}.bin" if bin_files else "model-{:05d}-of-{:05d}.safetensors"
    return [(name.format(i + 1, count), part) for i, part in enumerate(parts)]


def to_hf(model, builder: str) -> tuple:
    """The model's weights under the hub's names, by the conversion torchtune's checkpointer
    reverses for the builder's family, and the config.json fields it reads."""
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
    sd = {k: v.cpu().contiguous() for k, v in model.state_dict().items()}
    shape = dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, dim=dim)
    if ".gemma2." in builder:
        from torchtune.models.gemma2._convert_weights import gemma2_tune_to_hf

        return gemma2_tune_to_hf(sd, **shape, head_dim=attn.head_dim), hf
    if ".qwen2" in builder:  # (qwen2 and qwen2_5)
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

        return qwen2_tune_to_hf(sd, **shape, tie_word_embeddings=hf["tie_word_embeddings"]), hf
    return tune_to_hf(sd, **shape, head_dim=attn.head_dim), hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="torchtune model builder path")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an argument for the builder (repeatable; e.g. for a component builder)")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1,
                        help="files to split the weights into, named as the hub's (the 8B "
                             "configs list model-0000{1..4}-of-00004.safetensors)")
    parser.add_argument("--bin", action="store_true", help="pytorch_model-*.bin shards (torch.save) instead")
    parser.add_argument("--tokenizer", choices=("tiktoken", "sentencepiece", "qwen"), default="tiktoken")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    builder = OmegaConf.create({"_component_": args.model, **OmegaConf.from_dotlist(args.arg)})
    with set_default_dtype(torch.bfloat16), torch.device(device):
        model = config.instantiate(builder)
    sd, hf = to_hf(model, args.model)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, part in shards(sd, args.shards, args.bin):
        part = {k: v.contiguous() for k, v in part.items()}
        torch.save(part, args.output_dir / name) if args.bin else save_file(part, args.output_dir / name)
    (args.output_dir / "config.json").write_text(json.dumps(hf, indent=2))
    if args.tokenizer == "qwen":
        write_qwen_tokenizer(args.output_dir)
    elif args.tokenizer == "sentencepiece":
        write_sentencepiece_tokenizer(args.output_dir / "original" / "tokenizer.model")
    else:
        write_byte_tokenizer(args.output_dir / "original" / "tokenizer.model")
    print(f"wrote {sum(v.numel() for v in sd.values()):,} parameters to {args.output_dir}")


if __name__ == "__main__":
    main()
