"""Tokenizer: GGUF byte-level BPE against transformers on a real file, SentencePiece and HF-folder
tokenizers built in fixtures, chat templates, and the streaming decoder's invariants.

The real-file tests (marked `real`) read the GGUF at `EAGLESPEC_TEST_GGUF`, skipping when that
file is absent, or else SmolLM2-135M-Instruct from the registry cache, pulled on first use; the
llama2.c test reads ../shared beside the checkout and skips when the file is absent.
"""

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eaglespec.errors import ModelLoadError
from eaglespec.tokenizer import ChatTemplateError, StreamDecoder, Tokenizer, render_chat_template

# ../shared beside the checkout (CI clones main with ../shared beside it)
LLAMA2C_TOKENIZER = Path(__file__).parents[2] / "shared/models/stories260K/tok512.bin"

TEXTS = [
    "Hello world",
    "def f(x):\n\tif x:\n        return  x**2  # square\n\n\n\tpass\n",
    "emoji 😀👍🏽 and CJK 你好世界 こんにちは 안녕",
    "numbers 12345 3.14159 1,000,000 -42 0x1F",
    "  multiple   spaces\n\n\n  and\r\nnewlines \t tabs\t\t",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "it's I'll we've DON'T they'RE",
    "x<|endoftext|>y  <|im_end|>  z",
    "Ünïcödé façade naïve — “quotes” …",
    "<|im_start|",
    "",
    " ",
    "\n",
]
# Digits after a space that are not ASCII: see test_real_gguf_smollm_digits_follow_llama_cpp
SUPERSCRIPT = "powers x² and y³, ² alone"

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer   in\nwords 😀"},
]
USER_CHAT = [{"role": "user", "content": "Hi there!"}]


# -- fixtures --------------------------------------------------------------------------------


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    try:
        from eaglespec.gguf_file import GGUFFile
    except ImportError:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        return {key: field.contents() for key, field in reader.fields.items()}
    return dict(GGUFFile.open(path).metadata)


@dataclass(frozen=True)
class Real:
    ours: Tokenizer
    ref: Any  # transformers' tokenizer for the same file
    pre: str  # tokenizer.ggml.pre


@pytest.fixture(scope="module")
def real(real_gguf: Path) -> Real:
    """Our tokenizer and transformers' for the same GGUF file."""
    pytest.importorskip("transformers")
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    meta = _read_gguf_metadata(real_gguf)
    # AutoTokenizer.from_pretrained(dir, gguf_file=name) resolves to this class for GGUF files
    # (same backend, special tokens and template); called directly it skips AutoTokenizer's
    # model-config parse through gguf.GGUFReader, which costs ~10 s for a 49k vocabulary.
    ref = TokenizersBackend.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)
    return Real(Tokenizer.from_gguf_metadata(meta), ref, str(meta.get("tokenizer.ggml.pre")))


def _byte_tokens() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


@pytest.fixture(scope="module")
def spm_meta() -> dict[str, Any]:
    """A hand-written SentencePiece ("llama") GGUF vocabulary: unk, BOS/EOS, 256 byte tokens,
    single characters, a few merged pieces (scores rank the merges), a control token
    <|im_start|> and a user-defined token <think>."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "a", "n", "é", "!"]
    merged = ["▁t", "he", "ll", "▁h", "or", "ld", "▁w", "▁the", "▁he", "▁hell", "▁hello", "▁wor"]
    merged += ["▁world", "an", "lo"]
    tokens = ["<unk>", "<s>", "</s>", *_byte_tokens(), *pieces, *merged, "<|im_start|>", "<think>"]
    scores = [0.0] * (3 + 256) + [-100.0 - i for i in range(len(pieces))]
    scores += [-1.0 - i for i in range(len(merged))] + [0.0, 0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(merged)) + [3, 4]
    return {
        "general.name": "tiny-spm",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    }


@pytest.fixture(scope="module")
def spm(spm_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_meta)


HF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}[SYS]{{ m['content'] | trim }}\n"
    "{% else %}<|turn|>{{ m['role'] }}: {{ m['content'] }}<|eot|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|turn|>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level BPE tokenizer.json trained here, with config files like a Hub repo."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|eot|>", "<|turn|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", *TEXTS] * 4
    backend.train_from_iterator(corpus, trainer)
    bos = ("<|bos|>", backend.token_to_id("<|bos|>"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[bos]
    )
    folder = tmp_path_factory.mktemp("hf_tok")
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eos|>", "special": True},
        "add_bos_token": False,  # ignored when there is a tokenizer.json (transformers 5)
        "clean_up_tokenization_spaces": False,
        "chat_template": HF_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return folder


@pytest.fixture(scope="module")
def hf(hf_folder: Path) -> Tokenizer:
    return Tokenizer.from_hf_folder(hf_folder)


# -- real GGUF against transformers ----------------------------------------------------------


@pytest.mark.real
@pytest.mark.parametrize("text", TEXTS)
def test_real_gguf_encode_decode_match_transformers(real: Real, text: str) -> None:
    ours, ref = real.ours, real.ref
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.encode(text, add_special=False) == ref.encode(text, add_special_tokens=False)
    with_specials = [*ids, *ours.eos_ids, *ours.special_ids]
    for skip in (True, False):
        assert ours.decode(with_specials, skip_special=skip) == ref.decode(
            with_specials, skip_special_tokens=skip
        )


@pytest.mark.real
def test_real_gguf_special_tokens(real: Real) -> None:
    ours, ref = real.ours, real.ref
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        if token in ref.get_vocab():
            assert ours.encode(token, add_special=False) == [ref.convert_tokens_to_ids(token)]
    assert ours.vocab_size == len(ref)
    assert ours.bos_id == ref.bos_token_id
    assert ours.eos_ids[0] == ref.eos_token_id
    assert ours.add_bos == bool(ref.add_bos_token)


@pytest.mark.real
def test_real_gguf_smollm_digits_follow_llama_cpp(real: Real) -> None:
    """llama.cpp's "smollm" pre-tokenizer (like SmolLM2's tokenizer.json) isolates every \\p{N}
    first; transformers' GGUF loader has no entry for it and keeps " ²" together. ASCII digits
    agree either way because the vocabulary has no merges into them."""
    if real.pre != "smollm":
        pytest.skip(f"pre-tokenizer is {real.pre!r}")
    ours, ref = real.ours, real.ref
    # <|endoftext|> ends generation in llama.cpp (by its text) beside the metadata's <|im_end|>
    assert ref.convert_tokens_to_ids("<|endoftext|>") in ours.eos_ids
    pieces = ours.backend.pre_tokenizer.pre_tokenize_str(" x² 2024")
    assert [p for p, _ in pieces] == ["Ġx", "Â²", "Ġ", "2", "0", "2", "4"]
    assert ours.decode(ours.encode(SUPERSCRIPT)) == SUPERSCRIPT
    assert ours.encode(SUPERSCRIPT) != ref.encode(SUPERSCRIPT)  # documented divergence


@pytest.mark.real
@pytest.mark.parametrize("messages", [SYSTEM_CHAT, USER_CHAT], ids=["system+user", "user"])
def test_real_gguf_chat_template_matches_transformers(
    real: Real, messages: list[dict[str, str]]
) -> None:
    ours, ref = real.ours, real.ref
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == text
    ref_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ref_ids = ref_ids if isinstance(ref_ids, list) else ref_ids["input_ids"]
    assert ours.encode_chat(messages) == ref_ids
    no_prompt = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


@pytest.mark.real
def test_real_gguf_stream_matches_decode(real: Real) -> None:
    prompt = real.ours.encode_chat(USER_CHAT)
    for text in TEXTS:
        _check_stream_with_prompt(real.ours, prompt, real.ours.encode(text, add_special=False))


@pytest.mark.real
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_real_gguf_stream_random_ids(real: Real, data: st.DataObject) -> None:
    _check_stream(real.ours, data.draw(_strategy(real.ours.vocab_size)))


# -- SentencePiece ("llama") GGUF -------------------------------------------------------------


def test_spm_encode_pieces_and_byte_fallback(spm: Tokenizer) -> None:
    tokens = spm.backend
    ids = spm.encode("hello world!\n", add_special=False)
    assert [tokens.id_to_token(i) for i in ids] == ["▁hello", "▁world", "!", "<0x0A>"]
    assert spm.add_bos and spm.encode("hello")[0] == spm.bos_id == 1
    assert spm.eos_ids == (2,)
    # "é" is a piece; "😀" falls back to its four UTF-8 bytes
    assert [tokens.id_to_token(i) for i in spm.encode("é😀", add_special=False)] == [
        "▁",
        "é",
        "<0xF0>",
        "<0x9F>",
        "<0x98>",
        "<0x80>",
    ]
    for text in ["hello world!\n", "the  world", "  lead", "é😀 ünknown", "end.\n\n"]:
        assert spm.decode(spm.encode(text)) == text


def test_spm_space_prefix_follows_llama_cpp(spm: Tokenizer) -> None:
    """A "▁" is prepended to every text run that starts the input or follows a special token
    (llama.cpp `is_prev_special`; HF legacy Llama tokenizer.json), even one starting with a
    space. transformers' GGUF loader (Metaspace, prepend_scheme="first") does neither."""
    tokens = spm.backend

    def pieces(text: str) -> list[str]:
        return [tokens.id_to_token(i) for i in spm.encode(text, add_special=False)]

    assert pieces(" hello") == ["▁", "▁hello"]
    assert pieces("<|im_start|>hello") == ["<|im_start|>", "▁hello"]
    assert pieces("<think>the") == ["<think>", "▁the"]
    assert spm.decode(spm.encode("<s>hello"), skip_special=False) == "<s><s> hello"


def test_spm_without_space_prefix(spm_meta: dict[str, Any]) -> None:
    tok = Tokenizer.from_gguf_metadata({**spm_meta, "tokenizer.ggml.add_space_prefix": False})
    assert [tok.backend.id_to_token(i) for i in tok.encode("hello", add_special=False)] == [
        "he",
        "ll",
        "o",
    ]
    assert tok.decode(tok.encode(" hello")) == " hello"


def test_spm_merges_match_transformers(spm_meta: dict[str, Any]) -> None:
    """Where the space-prefix rules agree (text not starting with a space, no special token
    before it), encoding equals transformers' GGUF SentencePiece builder."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        add_gguf_special_tokens,
        sentencepiece_tokenizer,
    )

    spec = {
        "tokenizer_type": "llama",
        "tokens": spm_meta["tokenizer.ggml.tokens"],
        "scores": spm_meta["tokenizer.ggml.scores"],
        "token_type": spm_meta["tokenizer.ggml.token_type"],
    }
    ref = add_gguf_special_tokens(sentencepiece_tokenizer(spec), spec)
    ours = Tokenizer.from_gguf_metadata(spm_meta)
    for text in ["hello world", "the world hello", "an andante", "lol é😀\n\nx", "a b  c"]:
        ids = ours.encode(text, add_special=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.fixture
def merges_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Ranked merges kept for every vocabulary size, in a fresh folder; counts the rankings."""
    from eaglespec.tokenizer import gguf_vocab, merge_cache

    monkeypatch.setattr(merge_cache, "CACHED_FROM", 0)
    monkeypatch.setattr(merge_cache, "cache_dir", lambda: tmp_path)
    seen = {"ranked": 0, "folder": tmp_path / "tokenizer"}
    rank = gguf_vocab._merges_from_scores

    def counted(*args: Any) -> Any:
        seen["ranked"] += 1
        return rank(*args)

    monkeypatch.setattr(gguf_vocab, "_merges_from_scores", counted)
    return seen


def test_spm_merges_are_kept_and_read_back(spm_meta: dict[str, Any], merges_kept) -> None:
    """The first build ranks the merges and keeps them; the next reads them instead of ranking,
    and builds the very same tokenizer."""
    first = Tokenizer.from_gguf_metadata(spm_meta)
    assert merges_kept["ranked"] == 1 and len(list(merges_kept["folder"].iterdir())) == 1
    again = Tokenizer.from_gguf_metadata(spm_meta)
    assert merges_kept["ranked"] == 1  # read, not ranked
    assert again.backend.to_str() == first.backend.to_str()
    for text in TEXTS:
        assert again.encode(text) == first.encode(text)


def test_spm_merges_kept_by_content(spm_meta: dict[str, Any], merges_kept) -> None:
    """Another score or another token is another key: never a stale list. A duplicated token
    (the last id wins, as the BPE vocabulary has it) reads back as ranked."""
    Tokenizer.from_gguf_metadata(spm_meta)
    scores = list(spm_meta["tokenizer.ggml.scores"])
    tokens = list(spm_meta["tokenizer.ggml.tokens"])
    scores[tokens.index("▁h")], scores[tokens.index("he")] = -50.0, -0.5  # "he" now merges first
    tokens[tokens.index("<think>")] = "he"
    changed = {**spm_meta, "tokenizer.ggml.scores": scores, "tokenizer.ggml.tokens": tokens}
    built = Tokenizer.from_gguf_metadata(changed)
    assert merges_kept["ranked"] == 2 and len(list(merges_kept["folder"].iterdir())) == 2
    assert Tokenizer.from_gguf_metadata(changed).backend.to_str() == built.backend.to_str()
    assert merges_kept["ranked"] == 2
    plain = Tokenizer.from_gguf_metadata(spm_meta)
    assert built.encode("the hello") != plain.encode("the hello")  # the scores moved the merge


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "out of range"])
def test_spm_damaged_merges_are_ranked_again(
    spm_meta: dict[str, Any], merges_kept, damage: str
) -> None:
    """A damaged or foreign file is never read as merges: they are ranked again and the file is
    rewritten whole."""
    from eaglespec.tokenizer import merge_cache

    first = Tokenizer.from_gguf_metadata(spm_meta).backend.to_str()
    (path,) = merges_kept["folder"].iterdir()
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[-3] ^= 0x10
    elif damage == "truncate":
        blob = blob[:-6]
    elif damage == "empty":
        blob = bytearray()
    else:  # a well-formed file whose ids do not fit this vocabulary
        payload = (10**6).to_bytes(4, "little") * 2
        blob = bytearray(merge_cache.MAGIC + hashlib.sha256(payload).digest() + payload)
    path.write_bytes(bytes(blob))
    assert Tokenizer.from_gguf_metadata(spm_meta).backend.to_str() == first
    assert merges_kept["ranked"] == 2
    Tokenizer.from_gguf_metadata(spm_meta)
    assert merges_kept["ranked"] == 2  # the rewritten file reads back


def test_spm_merges_without_a_writable_cache(
    spm_meta: dict[str, Any], merges_kept, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys
) -> None:
    """A cache folder that cannot be made costs only the ranking, said on stderr; no temporary
    file is left behind."""
    from eaglespec.tokenizer import merge_cache

    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(merge_cache, "cache_dir", lambda: blocker)
    built = Tokenizer.from_gguf_metadata(spm_meta)
    assert "ranked merges not kept" in capsys.readouterr().err
    assert built.encode("hello world") == Tokenizer.from_gguf_metadata(spm_meta).encode(
        "hello world"
    )
    assert merges_kept["ranked"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["a file"]


def test_spm_small_vocabularies_are_not_kept(spm_meta: dict[str, Any], tmp_path: Path) -> None:
    """Below CACHED_FROM pieces the ranking is cheap and nothing is written."""
    from eaglespec.tokenizer import merge_cache

    assert len(spm_meta["tokenizer.ggml.tokens"]) < merge_cache.CACHED_FROM
    Tokenizer.from_gguf_metadata(spm_meta)
    folder = merge_cache.cache_dir() / "tokenizer"
    assert not folder.exists() or not any(folder.glob("merges-*"))


def test_spm_scores_of_another_length_are_named(spm_meta: dict[str, Any]) -> None:
    scores = spm_meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.scores has .* entries for"):
        Tokenizer.from_gguf_metadata({**spm_meta, "tokenizer.ggml.scores": scores})


def test_spm_chat_template(spm: Tokenizer) -> None:
    ids = spm.encode_chat(USER_CHAT)
    assert ids[0] == spm.backend.token_to_id("<|im_start|>")  # no BOS added to chat ids
    assert spm.apply_chat_template(USER_CHAT).endswith("<|im_start|>assistant\n")


def test_turns_through_the_template_or_as_running_text(spm_meta: dict[str, Any]) -> None:
    """Tokenizer.encode_turns: the chat template where there is one; a base model's file has
    none and its turns and answers become running text (bench and training data alike)."""
    chat = Tokenizer.from_gguf_metadata(spm_meta)
    turns, answers = ["hi there", "and now"], ["hello"]
    messages = [
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and now"},
    ]
    assert chat.encode_turns(turns, answers) == chat.encode_chat(messages)
    base = Tokenizer.from_gguf_metadata(
        {k: v for k, v in spm_meta.items() if k != "tokenizer.chat_template"}
    )
    assert base.encode_turns(turns, answers) == base.encode("hi there\nhello\n\nand now\n")
    assert base.encode_turns(["hi there"], []) == base.encode("hi there\n")
    with pytest.raises(ValueError, match="2 turns need 1 answers"):
        base.encode_turns(turns, [])


def _llama2c_reference(text: str, vocab: list[str], scores: list[float]) -> list[int]:
    """llama2.c run.c `encode` (no BOS): dummy-prefix space, code points or their bytes, then
    repeatedly merge the adjacent pair whose concatenation is the best-scoring token."""
    lookup = {t: i for i, t in enumerate(vocab)}
    ids: list[int] = []
    for ch in " " + text if text else "":
        ids += [lookup[ch]] if ch in lookup else [b + 3 for b in ch.encode()]
    while True:
        best = max(
            (
                (scores[j], -i, i, j)
                for i in range(len(ids) - 1)
                if (j := lookup.get(vocab[ids[i]] + vocab[ids[i + 1]], -1)) >= 0
            ),
            default=None,
        )
        if best is None:
            return ids
        ids[best[2] : best[2] + 2] = [best[3]]


def test_llama2c_tokenizer_matches_llama2c_encode() -> None:
    if not LLAMA2C_TOKENIZER.is_file():
        pytest.skip(f"{LLAMA2C_TOKENIZER} not present")
    tok = Tokenizer.from_llama2c(LLAMA2C_TOKENIZER)
    blob, pos, vocab, scores = LLAMA2C_TOKENIZER.read_bytes(), 4, [], []
    while pos < len(blob):
        score, size = struct.unpack_from("<fi", blob, pos)
        vocab.append(blob[pos + 8 : pos + 8 + size].decode())
        scores.append(score)
        pos += 8 + size
    assert tok.vocab_size == len(vocab) == 512
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (1, (2,), True)
    texts = [
        "Once upon a time, there was a little girl named Lily. She liked to play.",
        '"Hello!"  said Tom.\n\nThe end. 😀 café ™',
        "  leading spaces",
        "x",
    ]
    for text in texts:
        ids = tok.encode(text, add_special=False)
        assert ids == _llama2c_reference(text, vocab, scores), text
        assert tok.decode(ids) == text


# -- HF folder -------------------------------------------------------------------------------


def test_hf_folder_matches_transformers(hf_folder: Path, hf: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    for text in [*TEXTS, "<|turn|>user: hi<|eot|>"]:
        ids = hf.encode(text)
        assert ids == ref.encode(text), text
        assert hf.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert hf.decode(ids, skip_special=False) == ref.decode(ids)
    for messages in (SYSTEM_CHAT, USER_CHAT):
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert hf.apply_chat_template(messages) == text
        ref_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ref_ids = ref_ids if isinstance(ref_ids, list) else ref_ids["input_ids"]
        assert hf.encode_chat(messages) == ref_ids


def test_hf_folder_special_ids(hf: Tokenizer) -> None:
    bos, eos = (hf.backend.token_to_id(t) for t in ("<|bos|>", "<|eos|>"))
    assert hf.bos_id == bos and hf.add_bos
    assert eos == 1
    assert hf.eos_ids == (1, 2)  # tokenizer_config's eos, then generation_config's list
    assert hf.encode("hello")[0] == bos
    assert hf.encode("hello", add_special=False)[0] != bos


def test_hf_folder_chat_template_file_wins(hf_folder: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_folder / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template(USER_CHAT) == "Hi there!!"


# -- byte-level pre-tokenizer families --------------------------------------------------------


def _byte_level_meta(pre: str | None) -> dict[str, Any]:
    from eaglespec.tokenizer.gguf_vocab import byte_alphabet

    tokens = ["<|endoftext|>", *byte_alphabet().values(), "Ġt", "he", "Ġthe"]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


@pytest.mark.parametrize(
    ("pre", "words"),
    [
        (None, ["Ġ12345", "Ġabc", "'s", "ĠĠ", "Ġx"]),
        ("gpt-2", ["Ġ12345", "Ġabc", "'s", "ĠĠ", "Ġx"]),
        ("smollm", ["Ġ", "1", "2", "3", "4", "5", "Ġabc", "'s", "ĠĠ", "Ġx"]),
        ("llama-bpe", ["Ġ", "123", "45", "Ġabc", "'s", "ĠĠ", "Ġx"]),
        ("qwen2", ["Ġ", "1", "2", "3", "4", "5", "Ġabc", "'s", "ĠĠ", "Ġx"]),
    ],
)
def test_byte_level_pre_tokenizer_families(pre: str | None, words: list[str]) -> None:
    tok = Tokenizer.from_gguf_metadata(_byte_level_meta(pre))
    assert [w for w, _ in tok.backend.pre_tokenizer.pre_tokenize_str(" 12345 abc's   x")] == words
    assert tok.encode(" the", add_special=False) == [tok.backend.token_to_id("Ġthe")]
    assert tok.add_bos is (pre == "llama-bpe")  # llama.cpp's default for Llama 3 files


def test_every_supported_pre_tokenizer_builds() -> None:
    from eaglespec.tokenizer.gguf_vocab import PRE_SPLITS

    text = "Hello, World's 2024 x²  \n\tcafé 你好"
    for pre in PRE_SPLITS:
        tok = Tokenizer.from_gguf_metadata(_byte_level_meta(pre))
        assert tok.decode(tok.encode(text)) == text, pre


def test_gguf_eos_ids_from_metadata_and_text() -> None:
    meta = _byte_level_meta("llama-bpe")
    tokens = [*meta["tokenizer.ggml.tokens"], "<|eot_id|>", "<|eom_id|>", "<|im_end|>"]
    meta |= {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"] + [3, 3, 1],
        "tokenizer.ggml.eot_token_id": len(tokens) - 3,
        "tokenizer.ggml.add_bos_token": False,
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    n = len(tokens)
    assert tok.eos_ids == (0, n - 3, n - 2, n - 1)
    assert tok.add_bos is False
    # <|im_end|> is typed normal here but is an end-of-generation text: matched whole anyway
    assert tok.encode("a<|im_end|>", add_special=False)[-1] == n - 1


# -- errors ----------------------------------------------------------------------------------


def test_unknown_tokenizer_model_is_named(spm_meta: dict[str, Any]) -> None:
    with pytest.raises(ModelLoadError, match="'bert'"):
        Tokenizer.from_gguf_metadata({**spm_meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match="'mystery-pre'"):
        Tokenizer.from_gguf_metadata(_byte_level_meta("mystery-pre"))
    with pytest.raises(ModelLoadError, match="out of range"):
        Tokenizer.from_gguf_metadata({**spm_meta, "tokenizer.ggml.eos_token_id": 10**6})
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(Path("/nonexistent-folder"))


def test_missing_chat_template_suggests_raw(spm_meta: dict[str, Any]) -> None:
    meta = {k: v for k, v in spm_meta.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.chat_template is None
    with pytest.raises(ModelLoadError, match="no chat template.*--raw"):
        tok.apply_chat_template(USER_CHAT)
    with pytest.raises(ModelLoadError, match="--raw"):
        tok.encode_chat(USER_CHAT)


# -- chat template environment ---------------------------------------------------------------


FEATURE_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}{%- if m.role == 'bad' -%}{{ raise_exception('no bad roles') }}"
    "{%- endif -%}{%- set ns.n = ns.n + 1 -%}"
    "{%- if loop.index > 5 %}{% break %}{% endif -%}"
    "{{ m | tojson }}|{{ dict(a=1) | tojson(indent=1) }}"
    "{% generation %}{{ m.content }}{% endgeneration %}\n"
    "{%- endfor -%}{{ ns.n }}{{ bos_token }}{{ eos_token }}{{ strftime_now('%Y') | length }}"
    "{%- if add_generation_prompt %}<go>{% endif %}"
)


def test_chat_template_environment_matches_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [
        {"role": "user", "content": "<b>&'\"é</b>"},
        {"role": "assistant", "content": "ok"},
    ]
    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=FEATURE_TEMPLATE,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    ours = render_chat_template(FEATURE_TEMPLATE, messages, bos_token="<s>", eos_token="</s>")
    assert ours == rendered[0]
    # None-valued keys are dropped first, as transformers' apply_chat_template does
    with_none = [{**messages[0], "name": None}, messages[1]]
    assert (
        render_chat_template(FEATURE_TEMPLATE, with_none, bos_token="<s>", eos_token="</s>") == ours
    )
    assert '"<b>&\'\\"é</b>"' in ours  # tojson: no HTML escaping, no ASCII escaping


def test_chat_template_raise_exception_and_sandbox() -> None:
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        render_chat_template(FEATURE_TEMPLATE, [{"role": "bad", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.append(1) }}", [])  # immutable sandbox
    with pytest.raises(ChatTemplateError):
        render_chat_template("{% for %}", [])


# -- streaming decoder -----------------------------------------------------------------------


def _check_stream(tok: Tokenizer, ids: list[int]) -> None:
    """Pushing `ids` one by one: the chunks concatenate to decode(ids), and no chunk shows
    U+FFFD unless the full decode has one."""
    decoder = tok.stream_decoder()
    chunks = [decoder.push(i) for i in ids] + [decoder.flush()]
    full = tok.decode(ids)
    assert "".join(chunks) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in c for c in chunks)


def _check_stream_with_prompt(tok: Tokenizer, prompt: list[int], ids: list[int]) -> None:
    decoder = tok.stream_decoder(prompt)
    chunks = [decoder.push(i) for i in ids] + [decoder.flush()]
    prompt_text = tok.decode(prompt)
    full = tok.decode(prompt + ids)
    assert full.startswith(prompt_text)
    assert "".join(chunks) == full[len(prompt_text) :]
    assert not any("\ufffd" in c for c in chunks)


@pytest.mark.parametrize("which", ["spm", "hf"])
def test_stream_text_split_across_byte_tokens(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    prompt = tok.encode("hello")
    for text in ["hello world", "é😀 the 你好\nwor ld", " two  spaces", "😀", "<think>x"]:
        ids = tok.encode(text, add_special=False)
        _check_stream(tok, ids)
        _check_stream_with_prompt(tok, prompt, ids)


def test_stream_keeps_leading_space_and_holds_partial_bytes(spm: Tokenizer) -> None:
    decoder = spm.stream_decoder(spm.encode("hello"))
    assert decoder.push(spm.backend.token_to_id("▁world")) == " world"
    emoji = spm.encode("😀", add_special=False)[1:]  # the four byte tokens after "▁"
    assert [decoder.push(i) for i in emoji] == ["", "", "", ""]
    assert decoder.push(spm.backend.token_to_id("!")) == "😀!"
    assert decoder.flush() == ""


def test_stream_byte_level_emoji_over_four_tokens(hf: Tokenizer) -> None:
    """Byte-level BPE: an emoji spelled one byte per token appears only when complete."""
    ids = [hf.backend.token_to_id(t) for t in "ðŁĺĢ"]  # F0 9F 98 80 in GPT-2's byte alphabet
    decoder = hf.stream_decoder(hf.encode("hi"))
    assert [decoder.push(i) for i in ids] == ["", "", "", "😀"]


def _strategy(vocab_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, vocab_size - 1), max_size=30)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stream_random_ids_spm(data: st.DataObject, spm: Tokenizer) -> None:
    """Mostly byte tokens (259 of 291 ids), with specials and pieces between them."""
    ids = data.draw(_strategy(spm.vocab_size))
    _check_stream(spm, ids)
    prompt = data.draw(st.lists(st.integers(0, spm.vocab_size - 1), max_size=4))
    decoder: StreamDecoder = spm.stream_decoder(prompt)
    chunks = [decoder.push(i) for i in ids] + [decoder.flush()]
    if "\ufffd" not in spm.decode(prompt + ids):
        assert not any("\ufffd" in c for c in chunks)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_random_ids_hf(data: st.DataObject, hf: Tokenizer) -> None:
    _check_stream(hf, data.draw(_strategy(hf.vocab_size)))
