"""A tiny character-level tokenizer with a chat template (ids 0-2 ``<pad>``, ``<bos>``, ``<eos>``
as in ``tiny_moe_config``, then ``<unk>``, the chat markers and one id per lower-cased character
of `CHARACTERS`), and ``python -m r3lightning.app.models.tiny_tokenizer DIR`` writing a tiny
checkpoint with it that ``model=hf_checkpoint model.path=DIR`` loads (offline)."""

from __future__ import annotations

import argparse
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=?.,:()"

# <|role|>content<|end|> per message, then <|assistant|> when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tiny_tokenizer():
    """The tiny character-level tokenizer, with its chat template.

    Returns:
        A ``PreTrainedTokenizerFast`` of ``len(SPECIAL_TOKENS + CHAT_MARKERS) + len(CHARACTERS)``
        ids; its pad, bos and eos ids are the tiny models' (0, 1, 2).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*SPECIAL_TOKENS, *CHAT_MARKERS, *CHARACTERS]
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join back without separators
    specials = dict(zip(("pad_token", "bos_token", "eos_token", "unk_token"), SPECIAL_TOKENS, strict=True))
    markers = {"additional_special_tokens": list(CHAT_MARKERS), "chat_template": CHAT_TEMPLATE}
    return PreTrainedTokenizerFast(tokenizer_object=core, **specials, **markers)


def save_tiny_checkpoint(directory: str | Path, *, family: str = "qwen3_moe", seed: int = 0) -> Path:
    """Writes a tiny fp32 MoE checkpoint with its tokenizer, which ``model=hf_checkpoint
    model.path=DIR`` loads offline.

    Args:
        directory: Where to write; created if missing.
        family: One of ``TINY_FAMILIES``.
        seed: Seeds the random weights.

    Returns:
        ``directory``.
    """
    from r3lightning.app.models.tiny import build_tiny_moe, tiny_family_config

    directory = Path(directory)
    tokenizer = build_tiny_tokenizer()
    ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "bos", "eos")}
    build_tiny_moe(tiny_family_config(family, **ids), seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    """The command line: ``python -m r3lightning.app.models.tiny_tokenizer DIR [--family F] [--seed S]``.

    Args:
        argv: The arguments; None: ``sys.argv[1:]``.
    """
    parser = argparse.ArgumentParser(description="Write a tiny MoE checkpoint with a chat tokenizer.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--family", default="qwen3_moe")
    parser.add_argument("--seed", type=int, default=0)
    print(save_tiny_checkpoint(**vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
