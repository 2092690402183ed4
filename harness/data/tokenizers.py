"""Tokenizers a rank can use without a network: UTF-8 bytes, or a local ``tokenizer.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from harness.scenario import DataSpec


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


@dataclass
class ByteTokenizer:
    """UTF-8 bytes 0-255, then pad, bos and eos."""

    vocab_size: int = 259
    pad_id: int = 256
    bos_id: int | None = 257
    eos_id: int | None = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


# The special tokens a ``tokenizer.json`` is searched for, by name, in this order.
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>", "<|im_end|>")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")


class FileTokenizer:
    """A local ``tokenizer.json`` read with the Hugging Face ``tokenizers`` package: its bos,
    eos and pad ids are the first of ``BOS_NAMES``, ``EOS_NAMES`` and ``PAD_NAMES`` it holds."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ValueError(f"{path}: not a usable tokenizer.json ({e})") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        def tid(*names: str) -> int | None:
            for n in names:
                i = self._tok.token_to_id(n)
                if i is not None:
                    return i
            return None

        self.bos_id, self.eos_id = tid(*BOS_NAMES), tid(*EOS_NAMES)
        pad = tid(*PAD_NAMES)
        self.notes: list[str] = []  # what the file lacks, and what the harness does instead
        if pad is None:
            instead = (f"the eos token {self._tok.id_to_token(self.eos_id)} (id {self.eos_id})"
                       if self.eos_id is not None else "id 0")
            self.notes.append(f"no pad token ({', '.join(PAD_NAMES)}): batches are padded with {instead}, "
                              f"masked out of the loss")
            pad = self.eos_id if self.eos_id is not None else 0
        if self.bos_id is None:
            self.notes.append(f"no bos token ({', '.join(BOS_NAMES)}): rows start without one")
        if self.eos_id is None:
            self.notes.append(f"no eos token ({', '.join(EOS_NAMES)}): rows end without one")
        self.pad_id = pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: DataSpec) -> Tokenizer:
    return ByteTokenizer() if spec.tokenizer == "byte" else FileTokenizer(spec.tokenizer)
