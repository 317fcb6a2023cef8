"""The offline test model: a deterministic random-weight Llama and a byte-level BPE tokenizer trained locally.

Nothing is downloaded. The tokenizer is trained on this interpreter's own standard-library sources, the
weights come from a fixed seed, so two builds with the same size give byte-identical files. A stamp file
written last makes `build()` idempotent: a folder whose stamp matches the requested size is reused as is.

torch, transformers and tokenizers are imported only inside the build step (the vLLM venv has them), so the
size table and the stamp check stay importable anywhere.

    python -m stack.tiny_model OUT_DIR [--size tiny|bench] [--layers N --hidden N ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

STAMP_NAME = "kvpush-model.json"
RECIPE_VERSION = 1
SEED = 0

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Head sizes vLLM's CPU attention backend accepts (a model outside this set fails at engine start).
CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """Shape of the random Llama; `head_dim = hidden // heads`."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    max_positions: int
    vocab: int = 2048

    def problems(self) -> list[str]:
        """Why vLLM's CPU engine could not serve this shape (empty when it can)."""
        found = [f"{f.name} must be positive" for f in dataclasses.fields(self) if getattr(self, f.name) <= 0]
        if found:
            return found
        if self.hidden % self.heads:
            found.append(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        elif self.hidden // self.heads not in CPU_HEAD_SIZES:
            found.append(f"head_dim {self.hidden // self.heads} is not one of {sorted(CPU_HEAD_SIZES)}")
        if self.heads % self.kv_heads:
            found.append(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.vocab < 256 + len(SPECIAL_TOKENS):
            found.append(f"vocab {self.vocab} cannot hold the 256 byte tokens and the special tokens")
        return found

    def kv_bytes_per_token(self) -> int:
        """Float32 K and V over all layers: what one prompt token costs to move from P to D."""
        return self.layers * 2 * self.kv_heads * (self.hidden // self.heads) * 4


SIZES: Mapping[str, ModelSize] = MappingProxyType(
    {
        # The feasibility model (0.82 M params, 1 KiB of KV per token) with a 4096-token window.
        "tiny": ModelSize(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, max_positions=4096),
        # The anchors' benchmark model (4.2 M params, 4 KiB of KV per token).
        "bench": ModelSize(layers=4, hidden=256, intermediate=768, heads=4, kv_heads=2, max_positions=8192),
        # A deeper variant of the bench model (5.4 M params, 8 KiB of KV per token): 16 thin layers, so a layer is
        # 1/16 of a prefill, as in real models (32-64 layers); a 1024-token prefill takes ~155 ms on one core here
        # against ~121 ms (eager, float32), but decode is ~2.5x slower per token (bench/ANALYSIS.md, link).
        "bench-deep": ModelSize(layers=16, hidden=128, intermediate=384, heads=2, kv_heads=1, max_positions=8192),
    }
)


def resolve_size(size: str | ModelSize) -> ModelSize:
    """A named size from SIZES, or a ModelSize as given; raises ValueError for unknown or unservable ones."""
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; known: {', '.join(sorted(SIZES))}")
        size = SIZES[size]
    problems = size.problems()
    if problems:
        raise ValueError("bad model size: " + "; ".join(problems))
    return size


def stamp_for(size: ModelSize) -> dict[str, Any]:
    """Everything that determines the built files; a folder is reused only when its stamp equals this."""
    corpus = f"stdlib-{sys.version_info.major}.{sys.version_info.minor}"
    return {"recipe": RECIPE_VERSION, "seed": SEED, "corpus": corpus, "size": dataclasses.asdict(size)}


def is_built(out_dir: Path, size: str | ModelSize) -> bool:
    """True when out_dir holds a finished build of exactly this size."""
    try:
        found = json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    return bool(found == stamp_for(resolve_size(size)))


def build(out_dir: Path, size: str | ModelSize = "tiny") -> Path:
    """Build the model into out_dir unless a matching build is already there; returns out_dir.

    Safe against a concurrent builder: files are written to a private staging folder and renamed into
    place; whoever renames second discards its copy.
    """
    shape = resolve_size(size)
    out_dir = Path(out_dir)
    if is_built(out_dir, shape):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _write_files(staging, shape)
        _move_into_place(staging, out_dir, shape)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _move_into_place(staging: Path, out_dir: Path, shape: ModelSize) -> None:
    if out_dir.exists() and not is_built(out_dir, shape):
        shutil.rmtree(out_dir)  # an older recipe, another size, or a half-written folder
    try:
        staging.rename(out_dir)
    except OSError:
        if not is_built(out_dir, shape):
            raise


def _write_files(target: Path, shape: ModelSize) -> None:
    target.mkdir(parents=True)
    tokenizer = _train_tokenizer(target, shape)
    _save_model(target, shape, tokenizer)
    (target / STAMP_NAME).write_text(json.dumps(stamp_for(shape), indent=2, sort_keys=True) + "\n")


def _train_tokenizer(target: Path, shape: ModelSize) -> Any:
    # Imported by name so that type checking does not walk these large untyped-at-heart packages.
    tk = importlib.import_module("tokenizers")
    transformers = importlib.import_module("transformers")
    corpus = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=shape.vocab,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: no <unk>
    )
    tok.train(corpus, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = tk.processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=shape.max_positions,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(target))
    _make_tokenizer_config_portable(target / "tokenizer_config.json")
    return hf_tok


def _make_tokenizer_config_portable(path: Path) -> None:
    # transformers 5 saves the template to chat_template.jinja and names its own backend class; keep the
    # template inline too and use the class name both 4.x and 5.x load.
    config = json.loads(path.read_text())
    config.update(chat_template=CHAT_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _save_model(target: Path, shape: ModelSize, tokenizer: Any) -> None:
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    torch.manual_seed(SEED)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **ids,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    for name, value in ids.items():
        setattr(model.generation_config, name, value)
    model.save_pretrained(str(target), safe_serialization=True)


def _parse_args(argv: list[str] | None) -> tuple[Path, ModelSize]:
    parser = argparse.ArgumentParser(prog="python -m stack.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    for field in dataclasses.fields(ModelSize):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, type=int, dest=field.name, help=f"override the size's {field.name}")
    args = parser.parse_args(argv)
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelSize)}
    shape = dataclasses.replace(SIZES[args.size], **{k: v for k, v in overrides.items() if v is not None})
    return args.out_dir, shape


def main(argv: list[str] | None = None) -> int:
    """CLI entry: build (or reuse) the model and print its folder."""
    out_dir, shape = _parse_args(argv)
    try:
        path = build(out_dir, shape)
    except ValueError as exc:
        print(f"tiny_model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
