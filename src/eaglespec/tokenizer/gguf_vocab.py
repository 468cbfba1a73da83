"""`tokenizers` backends from GGUF metadata.

GGUF `tokenizer.ggml.model`:
  "gpt2"   byte-level BPE. `tokenizer.ggml.pre` picks the pre-tokenizer split (the table below,
           taken from llama.cpp `src/llama-vocab.cpp`; regexes as the models' tokenizer.json).
  "llama"  SentencePiece BPE: merges derived from the token scores (as transformers does), byte
           fallback to `<0xXX>` tokens, a "▁" space prefix on every text run that follows the start
           or a special token (llama.cpp and the original Llama tokenizer.json, i.e. HF "legacy").
Control and unknown tokens (see `TokenType`) become special added tokens (matched whole in text,
skipped by `decode(skip_special=True)`); user-defined tokens become plain added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from eaglespec.errors import ModelLoadError
from eaglespec.tokenizer.merge_cache import cached_merges


class TokenType(IntEnum):
    """llama.cpp's token types (`tokenizer.ggml.token_type`)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3  # <s>, <|im_start|>: special, skipped when decoding with skip_special
    USER_DEFINED = 4  # <think>: matched whole in text, decoded as text
    UNUSED = 5
    BYTE = 6  # <0x0A>: SentencePiece byte fallback


# Token texts llama.cpp treats as end-of-generation whatever the metadata says (llama-vocab.cpp).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    }
)  # fmt: skip

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreSplit:
    """How one `tokenizer.ggml.pre` family cuts text into words before byte-level BPE."""

    split: str | None  # isolating regex; None = the GPT-2 regex built into ByteLevel
    digits: bool = False  # split every digit on its own first (\p{N})
    ignore_merges: bool = False  # a word that is itself a token is taken whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when `tokenizer.ggml.add_bos_token` is absent


def _family(names: str, spec: PreSplit) -> dict[str, PreSplit]:
    return dict.fromkeys(names.split(), spec)


# "default" (and a missing key) follow transformers: the GPT-2 regex. llama.cpp's own fallback
# regex for "default" exists only for files converted without a recognised pre-tokenizer.
PRE_SPLITS: dict[str, PreSplit] = {
    **_family("default gpt-2 phi-2 mpt olmo jais trillion exaone4", PreSplit(None)),
    **_family(
        "smollm starcoder refact command-r codeshell exaone minerva-7b", PreSplit(None, True)
    ),
    **_family(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        PreSplit(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    ),
    **_family("dbrx smaug-bpe", PreSplit(_LLAMA3_SPLIT)),
    **_family("qwen2 deepseek-r1-qwen kormo stablelm2 hunyuan megrez", PreSplit(_QWEN2_SPLIT)),
    "tekken": PreSplit(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 minimax-m2", PreSplit(_GPT4O_SPLIT)),
}


def read_tokens(meta: dict[str, Any], name: str) -> tuple[list[str], list[int]]:
    """The token strings and their llama.cpp token types (all normal when the file has none)."""
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens") or ()]
    if not tokens:
        raise ModelLoadError(f"{name}: GGUF metadata has no tokenizer.ggml.tokens")
    types = [
        int(t) for t in meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    ]
    if len(types) != len(tokens):
        raise ModelLoadError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
    return tokens, types


@dataclass(frozen=True, slots=True)
class GGUFSpecialIds:
    """The special token ids a GGUF names (`tokenizer.ggml.*_token_id`)."""

    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    eot: int | None  # end of turn (Llama 3 <|eot_id|>, ...)
    eom: int | None  # end of message (Llama 3.1 tool calls <|eom_id|>)

    @classmethod
    def read(cls, meta: dict[str, Any], name: str, n_tokens: int, *, spm: bool) -> GGUFSpecialIds:
        def get(key: str, default: int | None = None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}_token_id", default)
            if value is not None and not 0 <= int(value) < n_tokens:
                raise ModelLoadError(
                    f"{name}: tokenizer.ggml.{key}_token_id = {value} is out of range"
                )
            return None if value is None else int(value)

        # llama.cpp's defaults for SentencePiece files that leave the ids out: <unk> <s> </s>
        return cls(
            bos=get("bos", 1 if spm else None),
            eos=get("eos", 2 if spm else None),
            unk=get("unknown", 0 if spm else None),
            pad=get("padding"),
            eot=get("eot"),
            eom=get("eom"),
        )

    def named(self) -> dict[str, int | None]:
        """The ids under the names chat templates use."""
        return {
            "bos_token": self.bos,
            "eos_token": self.eos,
            "unk_token": self.unk,
            "pad_token": self.pad,
        }


def byte_level_backend(
    meta: dict[str, Any], tokens: list[str], types: list[int], pre: PreSplit
) -> Backend:
    """GPT-2-style byte-level BPE. Ordinary tokens are stored in the byte alphabet already;
    a token written in other characters is re-spelled into it (transformers does the same).
    Control and user-defined tokens keep their raw text so they can be matched whole."""
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (TokenType.CONTROL, TokenType.USER_DEFINED) and not set(tok) <= spelled:
            tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab[tok] = i  # on duplicates the last id wins, as in llama.cpp and transformers
    merges = [_split_merge(m) for m in meta.get("tokenizer.ggml.merges") or ()]
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False)
    )
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre.split is None))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps) if len(steps) > 1 else steps[0]
    backend.decoder = decoders.ByteLevel()
    return backend


def sentencepiece_backend(
    meta: dict[str, Any], tokens: list[str], types: list[int], unk: int | None
) -> Backend:
    """SentencePiece BPE with byte fallback: merges ranked by the score of the merged piece."""
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    if len(scores) != len(tokens):
        raise ModelLoadError(
            f"{meta.get('general.name') or 'GGUF model'}: tokenizer.ggml.scores has "
            f"{len(scores)} entries for {len(tokens)} tokens"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [_split_merge(m) for m in meta.get("tokenizer.ggml.merges") or ()]
    if not merges:  # ranked from the scores: kept on disk for large vocabularies
        merges = cached_merges(
            tokens,
            scores,
            vocab,
            lambda: _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True))),
        )
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=any(kind == TokenType.BYTE for kind in types),
        )
    )
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer runs on each text run between added tokens, so the "▁" prefix also follows
    # every special token, as in llama.cpp (`is_prev_special`) and HF's legacy Llama tokenizer.
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend("▁"), replace]) if space_prefix else replace
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, best merged score first (transformers'
    `generate_merges`; ties by longer left piece, then token order)."""
    ranked: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        local = [(a, b, score) for a, b in splits if a in vocab and b in vocab]
        ranked.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in ranked]


def add_gguf_added_tokens(
    backend: Backend, tokens: list[str], types: list[int], named_ids: list[int]
) -> None:
    """Control and unknown tokens, end-of-generation tokens found by text and the BOS/EOS/UNK
    tokens become special added tokens; user-defined ones plain added tokens. Both are matched
    whole in text. A named id pointing at an ordinary token (some files set such a pad or unk)
    is left alone, or that text could never be produced again."""
    special = {i for i, kind in enumerate(types) if kind in (TokenType.CONTROL, TokenType.UNKNOWN)}
    special.update(eog_by_text(tokens))
    special.update(i for i in named_ids if types[i] not in (TokenType.NORMAL, TokenType.BYTE))
    user = [
        i for i, kind in enumerate(types) if kind == TokenType.USER_DEFINED and i not in special
    ]
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])


def eog_by_text(tokens: list[str]) -> list[int]:
    """End-of-generation tokens found by their text, as llama.cpp does. gpt-oss ends turns with
    <|return|>/<|call|>, so there <|end|> is not one."""
    found = {tok: i for i, tok in enumerate(tokens) if tok in _EOG_TEXTS}
    if "<|return|>" in found and "<|call|>" in found:
        found.pop("<|end|>", None)
    return sorted(found.values())


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table (`bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise ModelLoadError(f"malformed tokenizer merge {merge!r} (expected 'left right')")
    return left, right
