"""Tokenizers built from GGUF metadata, Hugging Face folders or llama2.c files; chat templates;
streaming detokenization.

All tokenization runs in the `tokenizers` library: this package only assembles its pieces
(model, normalizer, pre-tokenizer, decoder, added tokens) from what the file describes.

  core.py           `Tokenizer`: encode/decode, chat, and its three constructors
  gguf_vocab.py     `tokenizers` backends from GGUF metadata (byte-level BPE, SentencePiece)
  merge_cache.py    ranked SentencePiece merges kept on disk by content (large vocabularies)
  hf.py             reading a Hugging Face tokenizer folder's JSON files and chat template
  llama2c.py        llama2.c `tokenizer.bin` → GGUF-style metadata
  chat_template.py  the Jinja environment transformers renders chat templates in
  stream.py         `StreamDecoder`: incremental detokenization
"""

from eaglespec.errors import ChatTemplateError
from eaglespec.tokenizer.chat_template import render_chat_template
from eaglespec.tokenizer.core import Tokenizer
from eaglespec.tokenizer.gguf_vocab import TokenType
from eaglespec.tokenizer.stream import StreamDecoder

__all__ = ["ChatTemplateError", "StreamDecoder", "Tokenizer", "TokenType", "render_chat_template"]
