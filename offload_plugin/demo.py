"""A tiny, offline, deterministic Llama-3.2-shaped model, tokenizer and dataset.

The demo configs under ``configs/demo/`` and the recipe tests use these so that a
fine-tune runs in seconds on a laptop CPU, with no model hub download. Files are
written by::

    python -m offload_plugin.demo prepare --output-dir /tmp/offload-plugin/demo

which creates ``tokenizer.model`` (SentencePiece), ``alpaca_tiny.json`` (alpaca-style
instruction data) and ``model/model.pt`` (a random-init checkpoint readable by
``torchtune.training.FullModelTorchTuneCheckpointer``). The same seed gives the same
files, byte for byte.
"""

import argparse
import hashlib
import io
import json
import random
import sys
from functools import partial
from pathlib import Path
from typing import List, Optional

import torch
from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.modules import TransformerDecoder

__all__ = [
    "TINY_LLAMA_ARGS",
    "tiny_llama",
    "lora_tiny_llama",
    "qlora_tiny_llama",
    "make_examples",
    "prepare",
    "check_prepared",
]

# Every quantized linear must hold a multiple of 16384 elements for NF4 (QLoRA):
# q/k/v/o are 128x128 (num_kv_heads == num_heads) and the MLP is 128x256.
TINY_LLAMA_ARGS = dict(
    vocab_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    embed_dim=128,
    intermediate_dim=256,
    max_seq_len=256,
)
DEFAULT_DIR = "/tmp/offload-plugin/demo"
TOKENIZER_FILE = "tokenizer.model"
DATA_FILE = "alpaca_tiny.json"
CHECKPOINT_FILE = "model/model.pt"

_WORDS = ["cat", "dog", "sun", "tree", "fish", "bird", "moon", "rock", "star", "leaf"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Alpaca's prompt text, so the tokenizer learns whole pieces for it.
_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
)


def tiny_llama() -> TransformerDecoder:
    """Build the tiny Llama-3.2-shaped decoder (2 layers, 128 dims, ~0.4M params).

    Returns:
        TransformerDecoder: the model with random weights.
    """
    return llama3_2(**TINY_LLAMA_ARGS)


def lora_tiny_llama(
    lora_attn_modules: List[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
) -> TransformerDecoder:
    """Build the tiny decoder with LoRA adapters, same arguments as torchtune's LoRA builders.

    Args:
        lora_attn_modules (List[str]): attention projections that get adapters, e.g. ``["q_proj", "v_proj"]``.
        apply_lora_to_mlp (bool): also adapt the MLP projections.
        apply_lora_to_output (bool): must stay False: the output projection is tied to the embedding.
        lora_rank (int): rank of each adapter.
        lora_alpha (float): adapter scaling numerator.
        lora_dropout (float): dropout on the adapter input.
        use_dora (bool): use DoRA instead of LoRA.
        quantize_base (bool): store the frozen base weights in NF4 (QLoRA).

    Returns:
        TransformerDecoder: the model with random weights and adapters.
    """
    return lora_llama3_2(
        lora_attn_modules=lora_attn_modules,
        apply_lora_to_mlp=apply_lora_to_mlp,
        apply_lora_to_output=apply_lora_to_output,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        use_dora=use_dora,
        quantize_base=quantize_base,
        **TINY_LLAMA_ARGS,
    )


qlora_tiny_llama = partial(lora_tiny_llama, quantize_base=True)
qlora_tiny_llama.__doc__ = "Build the tiny decoder with LoRA adapters and an NF4 base (QLoRA)."


def make_examples(num_examples: int = 2000, seed: int = 0) -> List[dict]:
    """Generate alpaca-style examples of four small tasks a tiny model learns in ~100 steps.

    Args:
        num_examples (int): how many examples to generate.
        seed (int): seed of the generator; the same seed gives the same examples.

    Returns:
        List[dict]: dicts with ``instruction``, ``input`` and ``output`` strings.
    """
    rng = random.Random(seed)
    examples = []
    for i in range(num_examples):
        task = i % 4
        if task == 0:
            digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
            ex = ("Reverse the list.", " ".join(digits), " ".join(reversed(digits)))
        elif task == 1:
            digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
            ex = ("Sort the numbers.", " ".join(digits), " ".join(sorted(digits)))
        elif task == 2:
            word = rng.choice(_WORDS)
            ex = ("Repeat the word three times.", word, " ".join([word] * 3))
        else:
            start = rng.randrange(len(_LETTERS) - 6)
            ex = (
                "Write the next three letters.",
                " ".join(_LETTERS[start : start + 3]),
                " ".join(_LETTERS[start + 3 : start + 6]),
            )
        examples.append(dict(zip(("instruction", "input", "output"), ex)))
    return examples


def _train_tokenizer(examples: List[dict], vocab_size: int) -> bytes:
    import sentencepiece as spm  # imported here: only `prepare` needs it

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([_PROMPT.format(**ex) for ex in examples]),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,  # no <unk> for characters the data lacks
        num_threads=1,  # one thread keeps the trained pieces deterministic
        # Llama 2's special ids: the tokenizer wrapper sets pad to 0 itself.
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return model.getvalue()


def prepare(output_dir: str, seed: int = 0, num_examples: int = 2000) -> dict:
    """Write the tokenizer, dataset and random-init checkpoint of the tiny model.

    Args:
        output_dir (str): folder to write into (created if missing).
        seed (int): seed of the data, the tokenizer training and the weights.
        num_examples (int): number of training examples.

    Returns:
        dict: path of each written file keyed by ``tokenizer``, ``data``, ``checkpoint``.
    """
    out = Path(output_dir)
    (out / CHECKPOINT_FILE).parent.mkdir(parents=True, exist_ok=True)
    examples = make_examples(num_examples, seed)
    (out / DATA_FILE).write_text(json.dumps(examples, indent=1))
    (out / TOKENIZER_FILE).write_bytes(
        _train_tokenizer(examples, TINY_LLAMA_ARGS["vocab_size"])
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tiny_llama()
        # torchtune's builders leave the (tied) embedding at std 1, which starts the loss
        # near 100; std 0.02 (GPT-2's) starts it near ln(vocab_size) like a real model.
        torch.nn.init.normal_(model.tok_embeddings.weight, std=0.02)
        state_dict = model.state_dict()
    torch.save(state_dict, out / CHECKPOINT_FILE)
    return {
        "tokenizer": str(out / TOKENIZER_FILE),
        "data": str(out / DATA_FILE),
        "checkpoint": str(out / CHECKPOINT_FILE),
    }


def check_prepared(cfg) -> None:
    """Refuse a config on the demo model whose demo files are missing, naming the command
    that writes them.

    Without this, torchtune's checkpointer is the first to look and says only
    ``... is not a valid directory``, which does not tell a new user that the files come
    from ``python -m offload_plugin.demo prepare``. Configs on other models are left alone.

    Args:
        cfg: a recipe's config (a mapping with ``model``, ``checkpointer``, ``tokenizer``
            and optionally ``dataset`` and ``demo_dir``).

    Raises:
        FileNotFoundError: the demo model's config reads a file or folder that does not exist.
    """
    component = str(cfg.get("model", {}).get("_component_", ""))
    if not component.startswith(f"{__name__}."):
        return
    checkpointer = cfg.get("checkpointer", {})
    read = [checkpointer.get("checkpoint_dir"), cfg.get("tokenizer", {}).get("path")]
    data_files = cfg.get("dataset", {}).get("data_files")
    if isinstance(data_files, str):  # a list or a hub name is the dataset's own business
        read.append(data_files)
    missing = [str(path) for path in read if path is not None and not Path(path).exists()]
    if not missing:
        return
    demo_dir = str(cfg.get("demo_dir", DEFAULT_DIR))
    command = "python -m offload_plugin.demo prepare"
    if Path(demo_dir) != Path(DEFAULT_DIR):
        command += f" --output-dir {demo_dir}"
    raise FileNotFoundError(
        f"The demo config reads {', '.join(missing)}, which {'does' if len(missing) == 1 else 'do'} "
        "not exist. These are the tiny "
        f"demo model's files, written offline by `{command}`: run that first (it takes seconds), "
        "then this command again."
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m offload_plugin.demo",
        description="Files for the tiny offline demo model (configs/demo/).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write tokenizer, dataset and checkpoint")
    # Not /tmp/offload_plugin: run from /tmp, a folder of that name would shadow this package.
    prep.add_argument("--output-dir", default=DEFAULT_DIR)
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--num-examples", type=int, default=2000)
    args = parser.parse_args(argv)

    paths = prepare(args.output_dir, seed=args.seed, num_examples=args.num_examples)
    for name, path in paths.items():
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]
        print(f"{name:10s} {path}  sha256:{digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
