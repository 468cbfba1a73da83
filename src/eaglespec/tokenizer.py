"""Tokenizers built from GGUF metadata, Hugging Face folders or llama2.c files; chat templates;
streaming detokenization.

All tokenization runs in the `tokenizers` library: this module only assembles its pieces
(model, normalizer, pre-tokenizer, decoder, added tokens) from what the file describes.

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

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import IntEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from eaglespec.errors import EaglespecError, ModelLoadError

__all__ = ["ChatTemplateError", "StreamDecoder", "Tokenizer", "TokenType", "render_chat_template"]


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
class _PreSplit:
    """How one `tokenizer.ggml.pre` family cuts text into words before byte-level BPE."""

    split: str | None  # isolating regex; None = the GPT-2 regex built into ByteLevel
    digits: bool = False  # split every digit on its own first (\p{N})
    ignore_merges: bool = False  # a word that is itself a token is taken whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default when `tokenizer.ggml.add_bos_token` is absent


def _family(names: str, spec: _PreSplit) -> dict[str, _PreSplit]:
    return dict.fromkeys(names.split(), spec)


# "default" (and a missing key) follow transformers: the GPT-2 regex. llama.cpp's own fallback
# regex for "default" exists only for files converted without a recognised pre-tokenizer.
_PRE_SPLITS: dict[str, _PreSplit] = {
    **_family("default gpt-2 phi-2 mpt olmo jais trillion exaone4", _PreSplit(None)),
    **_family(
        "smollm starcoder refact command-r codeshell exaone minerva-7b", _PreSplit(None, True)
    ),
    **_family(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        _PreSplit(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    ),
    **_family("dbrx smaug-bpe", _PreSplit(_LLAMA3_SPLIT)),
    **_family("qwen2 deepseek-r1-qwen kormo stablelm2 hunyuan megrez", _PreSplit(_QWEN2_SPLIT)),
    "tekken": _PreSplit(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 minimax-m2", _PreSplit(_GPT4O_SPLIT)),
}


class ChatTemplateError(EaglespecError):
    """A chat template refused the conversation (its `raise_exception`) or failed to render."""


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token facts and chat template of one model.

    BOS/EOS for `encode(add_special=True)` come from the backend's post-processor (HF folders)
    or from `wrap_ids`, the ids put before and after the text (GGUF files: `[bos]`, `[eos]` as
    `add_bos_token` / `add_eos_token` say), with no post-processor in the backend.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        name: str,  # names the model in error messages
        bos_id: int | None,
        eos_ids: Sequence[int],  # every id that ends generation, the model's EOS first
        add_bos: bool,  # whether encode(add_special=True) starts with BOS
        wrap_ids: tuple[Sequence[int], Sequence[int]] = ((), ()),
        chat_template: str | None = None,
        template_tokens: dict[str, str] | None = None,  # bos_token, eos_token, ... for templates
    ) -> None:
        self.backend = backend
        self.name = name
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.template_tokens = dict(template_tokens or {})
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._prefix, self._suffix = list(wrap_ids[0]), list(wrap_ids[1])
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # `<0xXX>` byte-fallback tokens: the stream decoder holds text back after one of these
        self.byte_ids = frozenset(
            i for b in range(256) if (i := backend.token_to_id(f"<0x{b:02X}>")) is not None
        )

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF file's key/values (plain Python values: str, int, float, lists)."""
        name = str(meta.get("general.name") or "GGUF model")
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"{name}: tokenizer model {kind!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
            )
        tokens, types = _gguf_vocab(meta, name)
        ids = _GGUFSpecialIds.read(meta, name, len(tokens), spm=kind == "llama")
        if kind == "llama":
            backend = _sentencepiece_backend(meta, tokens, types, ids.unk)
            default_add_bos = True
        else:
            pre = str(meta.get("tokenizer.ggml.pre") or "default")
            if pre not in _PRE_SPLITS:
                raise ModelLoadError(
                    f"{name}: unknown tokenizer.ggml.pre {pre!r} (supported: {sorted(_PRE_SPLITS)})"
                )
            backend = _byte_level_backend(meta, tokens, types, _PRE_SPLITS[pre])
            default_add_bos = _PRE_SPLITS[pre].add_bos
        named = [i for i in (ids.bos, ids.eos, ids.unk) if i is not None]
        _add_gguf_added_tokens(backend, tokens, types, named)
        eog = [i for i in (ids.eos, ids.eot, ids.eom) if i is not None] + _eog_by_text(tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        prefix = [ids.bos] if add_bos and ids.bos is not None else []
        suffix = [ids.eos] if add_eos and ids.eos is not None else []
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend,
            name=name,
            bos_id=ids.bos,
            eos_ids=eog,
            add_bos=bool(prefix),
            wrap_ids=(prefix, suffix),
            chat_template=str(template) if template else None,
            template_tokens={k: tokens[i] for k, i in ids.named().items() if i is not None},
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Build from a folder with tokenizer.json and tokenizer_config.json (and optionally
        chat_template.jinja / chat_template.json, special_tokens_map.json, generation_config.json,
        config.json)."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(
                f"{folder}: no tokenizer.json (only fast tokenizers are supported)"
            )
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the Rust error names the problem; the path names the file
            raise ModelLoadError(f"{folder / 'tokenizer.json'}: cannot load: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        texts = {k: t for k in names if (t := _token_text(config.get(k, special_map.get(k))))}
        # like transformers: named and extra special tokens missing from tokenizer.json's
        # added tokens are added as special tokens
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        wanted = [*texts.values(), *(t for x in extra or () if (t := _token_text(x)))]
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in wanted if t not in present]
        )
        bos = backend.token_to_id(texts["bos_token"]) if "bos_token" in texts else None
        eos = backend.token_to_id(texts["eos_token"]) if "eos_token" in texts else None
        generation = _read_json(folder / "generation_config.json")
        generation = generation or _read_json(folder / "config.json")
        eos_ids = [i for i in (eos,) if i is not None] + _as_id_list(generation.get("eos_token_id"))
        # transformers 5 ignores tokenizer_config's add_bos_token/add_eos_token when there is a
        # tokenizer.json: its post-processor alone decides, and no post-processor adds nothing
        add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            backend,
            name=str(folder),
            bos_id=bos,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=_hf_chat_template(folder, config),
            template_tokens=texts,
        )

    @classmethod
    def from_llama2c(cls, path: str | Path) -> Tokenizer:
        """Build from a llama2.c `tokenizer.bin`: int32 max_token_length, then per token float32
        score, int32 byte length, bytes. Its export wrote "▁" as " " and BOS/EOS as "\\n<s>\\n" /
        "\\n</s>\\n"; this undoes both and builds the SentencePiece tokenizer it came from."""
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
        meta = {
            "general.name": str(path),
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
        }
        return cls.from_gguf_metadata(meta)

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched whole.
        `add_special` adds BOS (and EOS) where the model asks for them."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special).ids
        if add_special and (self._prefix or self._suffix):
            return self._prefix + ids + self._suffix
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        text: str = self.backend.decode(list(ids), skip_special_tokens=skip_special)
        return text

    def stream_decoder(
        self, prompt_ids: Sequence[int] = (), *, skip_special: bool = True
    ) -> StreamDecoder:
        """A decoder for text generated after `prompt_ids` (used as context so the first word
        keeps its leading space)."""
        return StreamDecoder(self, prompt_ids, skip_special=skip_special)

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The conversation rendered by the model's Jinja chat template, as transformers does."""
        if not self.chat_template:
            raise ModelLoadError(
                f"{self.name}: the model has no chat template; pass --raw to send the prompt as "
                "plain text"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **self.template_tokens,
        )

    def encode_chat(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Ids of the rendered chat. The template writes its own BOS, so none is added again
        (transformers' `apply_chat_template(tokenize=True)`)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special=False)


class StreamDecoder:
    """Incremental detokenization: text of each new token as it arrives.

    Each `push` decodes a short window of tokens twice, with and without the tokens not yet
    released, and releases the difference (vLLM's prefix/read offsets). Text is held back while
    it ends in U+FFFD (an incomplete UTF-8 sequence) or while the last visible token is a
    `<0xXX>` byte token, whose byte-fallback decoding can still change with the next one. The
    window begins with tokens whose text was already released, so a decoder that strips the
    leading space of the first token strips the same space in both decodes, and later words
    keep theirs.
    Invariant: "".join(pushes) + flush() == decode(generated ids) when there is no prompt, and
    == decode(prompt + generated)[len(decode(prompt)):] in the usual case with one (the
    exception: a prompt ending in byte tokens that an invalid generated byte run continues).
    """

    _CONTEXT = 6  # prompt tokens kept as context for the first generated word

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *, skip_special: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # ids[:read] were released (or are prompt context); ids[read:] are held back
        self._ids = list(prompt_ids)[-self._CONTEXT :]
        self._read = len(self._ids)
        self._after_byte = False  # the last visible token is a `<0xXX>` byte token
        for token_id in self._ids:
            self._track_bytes(token_id)

    def push(self, token_id: int) -> str:
        """Text that `token_id` (and any held tokens before it) completes; may be ""."""
        self._ids.append(token_id)
        self._track_bytes(token_id)
        return "" if self._after_byte else self._release(final=False)

    def flush(self) -> str:
        """Everything still held back (end of generation)."""
        return self._release(final=True)

    def _track_bytes(self, token_id: int) -> None:
        # Byte fallback decodes a whole run of byte tokens at once (one U+FFFD per byte if the
        # run is invalid), so nothing is released while the last visible token is a byte token.
        # Skipped special tokens are invisible: the run continues across them.
        if token_id in self._tokenizer.byte_ids:
            self._after_byte = True
        elif not (self._skip_special and token_id in self._tokenizer.special_ids):
            self._after_byte = False

    def _release(self, *, final: bool) -> str:
        def decode(ids: list[int]) -> str:
            return self._tokenizer.decode(ids, skip_special=self._skip_special)

        released, text = decode(self._ids[: self._read]), decode(self._ids)
        if not final and (len(text) <= len(released) or text.endswith("\ufffd")):
            return ""
        if not text.startswith(released):
            # only a generated byte run that continues the prompt's and turns out invalid
            if not final:
                return ""
            released = released[: _common_prefix(released, text)]
        # the tokens just released become the context window for the next ones
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text[len(released) :]


# -- GGUF builders ---------------------------------------------------------------------------


def _gguf_vocab(meta: dict[str, Any], name: str) -> tuple[list[str], list[int]]:
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
class _GGUFSpecialIds:
    """The special token ids a GGUF names (`tokenizer.ggml.*_token_id`)."""

    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    eot: int | None  # end of turn (Llama 3 <|eot_id|>, ...)
    eom: int | None  # end of message (Llama 3.1 tool calls <|eom_id|>)

    @classmethod
    def read(cls, meta: dict[str, Any], name: str, n_tokens: int, *, spm: bool) -> _GGUFSpecialIds:
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


def _byte_level_backend(
    meta: dict[str, Any], tokens: list[str], types: list[int], pre: _PreSplit
) -> Backend:
    """GPT-2-style byte-level BPE. Ordinary tokens are stored in the byte alphabet already;
    a token written in other characters is re-spelled into it (transformers does the same).
    Control and user-defined tokens keep their raw text so they can be matched whole."""
    alphabet = _byte_alphabet()
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


def _sentencepiece_backend(
    meta: dict[str, Any], tokens: list[str], types: list[int], unk: int | None
) -> Backend:
    """SentencePiece BPE with byte fallback: merges ranked by the score of the merged piece."""
    scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [_split_merge(m) for m in meta.get("tokenizer.ggml.merges") or ()]
    merges = merges or _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
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


def _add_gguf_added_tokens(
    backend: Backend, tokens: list[str], types: list[int], named_ids: list[int]
) -> None:
    """Control and unknown tokens, end-of-generation tokens found by text and the BOS/EOS/UNK
    tokens become special added tokens; user-defined ones plain added tokens. Both are matched
    whole in text. A named id pointing at an ordinary token (some files set such a pad or unk)
    is left alone, or that text could never be produced again."""
    special = {i for i, kind in enumerate(types) if kind in (TokenType.CONTROL, TokenType.UNKNOWN)}
    special.update(_eog_by_text(tokens))
    special.update(i for i in named_ids if types[i] not in (TokenType.NORMAL, TokenType.BYTE))
    user = [
        i for i, kind in enumerate(types) if kind == TokenType.USER_DEFINED and i not in special
    ]
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])


def _eog_by_text(tokens: list[str]) -> list[int]:
    """End-of-generation tokens found by their text, as llama.cpp does. gpt-oss ends turns with
    <|return|>/<|call|>, so there <|end|> is not one."""
    found = {tok: i for i, tok in enumerate(tokens) if tok in _EOG_TEXTS}
    if "<|return|>" in found and "<|call|>" in found:
        found.pop("<|end|>", None)
    return sorted(found.values())


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
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


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# -- HF folder helpers -----------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config's (a string or a list
    of named templates, of which "default" is used)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


# -- chat templates --------------------------------------------------------------------------


def render_chat_template(
    template: str,
    messages: list[dict[str, str]],
    *,
    add_generation_prompt: bool = True,
    **variables: str,
) -> str:
    """Render a chat template in transformers' sandbox. Messages lose None-valued keys (as in
    transformers); `variables` are bos_token, eos_token, unk_token, pad_token."""
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    try:
        return _compile_template(template).render(
            messages=chat,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template: {exc}") from exc


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    """transformers' environment (utils/chat_template_utils.py): immutable sandbox, trim_blocks
    and lstrip_blocks, loop controls, `{% generation %}` blocks, its `tojson`, `raise_exception`,
    `strftime_now`, and restricted `dict` / `namespace`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # unlike Jinja's own tojson: no HTML escaping, and the json.dumps options exposed
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Jinja's
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for key in attrs:
            _TemplateNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())
