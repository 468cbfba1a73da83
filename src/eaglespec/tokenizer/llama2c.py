"""llama2.c `tokenizer.bin` files (e.g. tok512.bin), read as the GGUF-style metadata of the
SentencePiece tokenizer they were exported from."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any

from eaglespec.errors import ModelLoadError
from eaglespec.tokenizer.gguf_vocab import TokenType


def llama2c_metadata(path: str | Path) -> dict[str, Any]:
    """Read a llama2.c `tokenizer.bin`: int32 max_token_length, then per token float32 score,
    int32 byte length, bytes. Its export wrote "▁" as " " and BOS/EOS as "\\n<s>\\n" /
    "\\n</s>\\n"; this undoes both and returns the SentencePiece ("llama") GGUF key/values."""
    blob = Path(path).read_bytes()
    tokens: list[str] = []
    scores: list[float] = []
    pos = 4
    try:
        while pos < len(blob):
            score, size = struct.unpack_from("<fi", blob, pos)
            tokens.append(blob[pos + 8 : pos + 8 + size].decode("utf-8"))
            scores.append(score)
            pos += 8 + size
    except (struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a llama2.c tokenizer file ({exc})") from exc
    if pos != len(blob) or len(tokens) < 3:
        raise ModelLoadError(f"{path}: truncated llama2.c tokenizer file")
    tokens[:3] = ["<unk>", "<s>", "</s>"]
    tokens = [t.replace(" ", "▁") for t in tokens]
    byte = re.compile(r"<0x[0-9A-F]{2}>")
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE if byte.fullmatch(t) else TokenType.NORMAL for t in tokens[3:]]
    return {
        "general.name": str(path),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
    }
