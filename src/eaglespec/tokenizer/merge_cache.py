"""Ranked SentencePiece merges kept on disk, by the content they were ranked from.

A GGUF "llama" vocabulary without `tokenizer.ggml.merges` has its BPE merges derived from the
pieces' scores (gguf_vocab.py); for Gemma-3's 262,144 pieces that ranking takes 2.5-3 s of every
load on the 2-core VM, while reading the ranked list back takes about 0.3 s. The list depends only
on the tokens and their scores, so it is stored under a digest of exactly those (and of this
format's version), never under a file's name or path: a changed vocabulary can never meet a stale
list. Each file carries a digest of its own payload, so a truncated or damaged one is ranked anew
and rewritten; a cache folder that cannot be written only costs the ranking.

    $EAGLESPEC_HOME/tokenizer/merges-<digest>.bin:
        MAGIC (8 bytes) | sha256 of the payload (32) | payload: int32 (left id, right id) pairs
"""

from __future__ import annotations

import array
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from eaglespec.paths import cache_dir

Merges = list[tuple[str, str]]

# The fewest pieces whose merges are kept: below it ranking takes well under a second.
CACHED_FROM = 32768
# Part of every key: change it whenever the ranking (gguf_vocab._merges_from_scores) changes.
MAGIC = b"esmerge1"


def merges_file(tokens: list[str], scores: list[float]) -> Path:
    """Where the merges ranked from these tokens and scores are kept."""
    key = hashlib.sha256(MAGIC + len(tokens).to_bytes(8, "little"))
    key.update("\0".join(tokens).encode("utf-8", "surrogatepass"))
    key.update(array.array("d", scores).tobytes())
    return cache_dir() / "tokenizer" / f"merges-{key.hexdigest()[:32]}.bin"


def cached_merges(
    tokens: list[str],  # the vocabulary in id order (duplicates allowed: the last id wins)
    scores: list[float],  # one per token
    vocab: dict[str, int],  # token -> id, as the BPE model is built with
    rank: Callable[[], Merges],  # ranks them when no stored list is found
) -> Merges:
    """`rank()`'s merges, read from the cache where a list for these tokens and scores is kept
    (large vocabularies only), else ranked and kept for the next load."""
    if len(tokens) < CACHED_FROM:
        return rank()
    path = merges_file(tokens, scores)
    stored = _read(path, len(tokens))
    if stored is not None:
        return [(tokens[a], tokens[b]) for a, b in zip(stored[::2], stored[1::2], strict=True)]
    merges = rank()
    _write(path, array.array("i", [vocab[p] for merge in merges for p in merge]))
    return merges


def _read(path: Path, n_tokens: int) -> array.array | None:
    """The stored id pairs, or None where the file is missing, damaged or not for this size."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    header = len(MAGIC) + 32
    payload = blob[header:]
    if blob[: len(MAGIC)] != MAGIC or hashlib.sha256(payload).digest() != blob[len(MAGIC) : header]:
        return None
    ids = array.array("i")
    if len(payload) % (2 * ids.itemsize):
        return None
    ids.frombytes(payload)
    if ids and (min(ids) < 0 or max(ids) >= n_tokens):
        return None
    return ids


def _write(path: Path, ids: array.array) -> None:
    """Store the id pairs atomically (a reader sees the old file or the whole new one)."""
    payload = ids.tobytes()
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp = Path(f.name)
            f.write(MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError as err:  # a read-only or full cache: the next load ranks them again
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        print(f"[tokenizer: ranked merges not kept in {path.parent}: {err}]", file=sys.stderr)
