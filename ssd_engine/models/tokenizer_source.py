"""The engine's tokenizer: the `tokenizer` option's folder, else the model folder's files; a dummy
model from config.json alone takes token ids only (`TokenIdsOnly`)."""

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


class TokenIdsOnly:
    """Stands in for a tokenizer where there is none: text prompts are refused in one line, and
    outputs decode to empty text (their token ids are the output). Only what the engine calls."""

    chat_template = None
    eos_token_id = None

    def __init__(self, folder: str, vocab_size: int) -> None:
        self.folder, self.vocab_size = folder, vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        raise ValueError(
            f"{self.folder} has no tokenizer (load_format='dummy' from config.json alone): pass "
            f"prompts as token ids, or tokenizer=FOLDER for text"
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def get_vocab(self) -> dict[str, int]:
        return {}


def load_tokenizer(model_path: str, tokenizer: str | None, load_format: str, vocab_size: int):
    """The tokenizer for `model_path` (see the module docstring)."""
    source = tokenizer or model_path
    if tokenizer is None and load_format == "dummy" and not has_tokenizer_files(model_path):
        return TokenIdsOnly(model_path, vocab_size)
    # imported here: a draft process without grammars never imports transformers
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
