"""The model's text tokenizer (SentencePiece): role prompts in, the text stream's pieces out."""

from __future__ import annotations

from pathlib import Path

from ..core.config import TEXT_EPAD as EPAD, TEXT_PAD as PAD  # the "nothing said" tokens
from ..errors import InputError, ModelInvalidError

SYSTEM_TAG = "<system>"
# The role prompt when a user gives none (NVIDIA's server's); the tiny model's tokenizer is
# trained to hold its words.
DEFAULT_ROLE = ("You are a wise and friendly teacher. Answer questions or provide advice in a "
                "clear and engaging way.")


def not_utf8(text: str, what: str = "the role prompt") -> str | None:
    """Why `text` cannot be tokenized, or None: it holds a lone surrogate, which is how
    Python keeps a byte that is not UTF-8 (from a command line, a file read with
    surrogateescape) or JSON's escape of half a character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        found = text[error.start]
        what_is_there = (f"the byte 0x{ord(found) - 0xDC00:02x}"
                         if 0xDC80 <= ord(found) <= 0xDCFF else f"half a character "
                         f"({ascii(found)[1:-1]})")
        return f"{what} is not UTF-8 text: character {error.start + 1} is {what_is_there}"
    return None


def wrap_with_system_tags(text: str) -> str:
    """`<system> text <system>`, unless the text already carries the tags (NVIDIA's rule)."""
    text = text.strip()
    if text.startswith(SYSTEM_TAG) and text.endswith(SYSTEM_TAG):
        return text
    return f"{SYSTEM_TAG} {text} {SYSTEM_TAG}"


class TextTokenizer:
    def __init__(self, path: Path):
        import sentencepiece

        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:
            raise ModelInvalidError(f"cannot read the text tokenizer {path}: {error}") from None

    @property
    def pieces(self) -> int:
        return self.sp.get_piece_size()

    def role_prompt(self, text: str) -> list[int]:
        """Token ids of the wrapped role prompt (no BOS/EOS); an empty prompt is an error."""
        if not text.strip():
            raise InputError("the role prompt is empty")
        return list(self.sp.encode(wrap_with_system_tags(text)))

    def piece(self, token: int) -> str:
        """The text of one text-stream token as NVIDIA's offline output writes it."""
        if token == EPAD:
            return "EPAD"
        if token == PAD:
            return "PAD"
        return self.sp.id_to_piece(int(token)).replace("\u2581", " ")
