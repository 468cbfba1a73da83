"""`Tokenizer`: a `tokenizers` backend plus the special-token facts and chat template of one
model, built from GGUF metadata, a Hugging Face folder or a llama2.c tokenizer file."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from eaglespec.errors import ModelLoadError
from eaglespec.tokenizer.chat_template import render_chat_template
from eaglespec.tokenizer.gguf_vocab import (
    PRE_SPLITS,
    GGUFSpecialIds,
    add_gguf_added_tokens,
    byte_level_backend,
    eog_by_text,
    read_tokens,
    sentencepiece_backend,
)
from eaglespec.tokenizer.hf import as_id_list, hf_chat_template, read_json, token_text
from eaglespec.tokenizer.llama2c import llama2c_metadata
from eaglespec.tokenizer.stream import StreamDecoder

# A base model's exchange as running text (Tokenizer.encode_turns): the turn, its answer, a blank
# line before the next.
RAW_TURN = "{turn}\n{answer}\n\n"


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
        tokens, types = read_tokens(meta, name)
        ids = GGUFSpecialIds.read(meta, name, len(tokens), spm=kind == "llama")
        if kind == "llama":
            backend = sentencepiece_backend(meta, tokens, types, ids.unk)
            default_add_bos = True
        else:
            pre = str(meta.get("tokenizer.ggml.pre") or "default")
            if pre not in PRE_SPLITS:
                raise ModelLoadError(
                    f"{name}: unknown tokenizer.ggml.pre {pre!r} (supported: {sorted(PRE_SPLITS)})"
                )
            backend = byte_level_backend(meta, tokens, types, PRE_SPLITS[pre])
            default_add_bos = PRE_SPLITS[pre].add_bos
        named = [i for i in (ids.bos, ids.eos, ids.unk) if i is not None]
        add_gguf_added_tokens(backend, tokens, types, named)
        eog = [i for i in (ids.eos, ids.eot, ids.eom) if i is not None] + eog_by_text(tokens)
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
        config = read_json(folder / "tokenizer_config.json")
        special_map = read_json(folder / "special_tokens_map.json")
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        texts = {k: t for k in names if (t := token_text(config.get(k, special_map.get(k))))}
        # like transformers: named and extra special tokens missing from tokenizer.json's
        # added tokens are added as special tokens
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        wanted = [*texts.values(), *(t for x in extra or () if (t := token_text(x)))]
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in wanted if t not in present]
        )
        bos = backend.token_to_id(texts["bos_token"]) if "bos_token" in texts else None
        eos = backend.token_to_id(texts["eos_token"]) if "eos_token" in texts else None
        generation = read_json(folder / "generation_config.json")
        generation = generation or read_json(folder / "config.json")
        eos_ids = [i for i in (eos,) if i is not None] + as_id_list(generation.get("eos_token_id"))
        # transformers 5 ignores tokenizer_config's add_bos_token/add_eos_token when there is a
        # tokenizer.json: its post-processor alone decides, and no post-processor adds nothing
        add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            backend,
            name=str(folder),
            bos_id=bos,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=hf_chat_template(folder, config),
            template_tokens=texts,
        )

    @classmethod
    def from_llama2c(cls, path: str | Path) -> Tokenizer:
        """Build from a llama2.c `tokenizer.bin`: the SentencePiece tokenizer it was exported
        from (see `llama2c_metadata`)."""
        return cls.from_gguf_metadata(llama2c_metadata(path))

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

    def encode_turns(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
        """Ids of user `turns` with the model's `answers` to all but the last, ready for the next
        answer: through the chat template where the model has one; a base model (none, such as
        Gemma-3-270M) sees them as running text, each turn on its own line and each exchange a
        paragraph (RAW_TURN), BOS as the model asks."""
        if len(answers) != len(turns) - 1:
            raise ValueError(
                f"{len(turns)} turns need {len(turns) - 1} answers, got {len(answers)}"
            )
        if not self.chat_template:
            done = [RAW_TURN.format(turn=t, answer=a) for t, a in zip(turns, answers, strict=False)]
            return self.encode("".join(done) + f"{turns[-1]}\n")
        messages: list[dict[str, str]] = []
        for turn, answer in zip(turns, [*answers, None], strict=True):
            messages.append({"role": "user", "content": turn})
            if answer is not None:
                messages.append({"role": "assistant", "content": answer})
        return self.encode_chat(messages)
