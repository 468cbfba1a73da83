"""Training prompts over human-written text from the package registry, for the kinds of request
the target's self-asked prompts miss: summarising a news story or an encyclopedia article, and
short questions about a named thing.

The text comes from gensim's wheel on PyPI (its test corpora, read out of the wheel, never
installed): Lee's corpus of 300 Australian news stories (`lee_background.cor`, one story a line)
and 206 pages of a shortened English Wikipedia dump (`enwiki-latest-pages-articles1...bz2`,
MediaWiki XML; 96 articles once redirects and stubs are dropped, markup stripped by
`wiki_plain`). None of it is an
evaluation set's text. Each story and article becomes prompts the way users phrase them
(`news_prompts`, `wiki_prompts`): "Summarize: <text>" (the form of the summarisation set and of
`--summaries`), a few other openings over the same text, and questions built from an article's
title and section headings ("What is Albedo?", "Tell me about the history of Albania.").

    python -m eaglespec.train.texts --out texts.jsonl [--seed 0]

writes FastChat-style records (`{"turns": [prompt], "source": ...}`) that `eaglespec train
--data` reads like any prompt file.
"""

from __future__ import annotations

import bz2
import html
import random
import re
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglespec.errors import EaglespecError, InvalidRequestError
from eaglespec.registry import pip_download
from eaglespec.train.data import prompt_file_parser, shuffled_records, write_records

GENSIM = "gensim==4.4.0"  # the wheel the corpora are read from (pinned: its members' names)
LEE = "gensim/test/test_data/lee_background.cor"
WIKI = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"

# How a request over a given text opens (the text follows a blank line), with the share of
# texts given each; the first is the summarisation set's own form, without the blank line.
TEXT_OPENINGS = (
    ("Summarize: ", 0.6),
    ("Summarize this article in two sentences:\n\n", 0.15),
    ("What are the key points of this text?\n\n", 0.1),
    ("Write a short headline for this article:\n\n", 0.05),
    ("Explain this text in simple words:\n\n", 0.1),
)
TITLE_QUESTIONS = ("What is {t}?", "Tell me about {t}.", "Give me a short overview of {t}.")
HEADING_QUESTIONS = ("What is the {h} of {t}?", "Tell me about the {h} of {t}.")


@dataclass(frozen=True, slots=True)
class Article:
    title: str
    headings: list[str]  # section headings, in order
    paragraphs: list[str]  # plain-text paragraphs, in order


def read_wheel_texts(wheel: Path) -> tuple[list[str], str]:
    """(Lee's stories, the Wikipedia dump's XML) out of a gensim wheel."""
    try:
        with zipfile.ZipFile(wheel) as z:
            lee = z.read(LEE).decode("utf-8", errors="replace")
            wiki = bz2.decompress(z.read(WIKI)).decode("utf-8", errors="replace")
    except (OSError, zipfile.BadZipFile, KeyError) as e:  # missing, not a zip, no corpora
        raise InvalidRequestError(
            f"{wheel}: not a gensim wheel holding its test corpora ({e})"
        ) from e
    stories = [" ".join(line.split()) for line in lee.splitlines() if line.strip()]
    return stories, wiki


def _drop_nested(text: str, open_: str, close: str) -> str:
    """`text` without its (possibly nested) open_ ... close spans, innermost first."""
    o, c = re.escape(open_), re.escape(close)
    inner = re.compile(o + r"(?:(?!" + o + r")[^\0])*?" + c)
    while True:
        text, n = inner.subn("", text)
        if not n:
            return text


def wiki_plain(markup: str) -> tuple[list[str], list[str]]:
    """MediaWiki markup -> (section headings, plain paragraphs). Templates, tables, references,
    comments, files and categories dropped; links keep their shown text; bold and italics marks
    dropped. Good enough for prompts, not a full parser."""
    t = html.unescape(markup)
    t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
    t = re.sub(r"<ref[^>/]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
    t = _drop_nested(t, "{{", "}}")
    t = _drop_nested(t, "{|", "|}")
    # files, images and categories (their captions may hold links: drop innermost links first)
    t = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]", "", t)
    t = re.sub(r"\[\[[a-z\-]{2,12}:[^\]]*\]\]", "", t)  # interlanguage links
    t = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", t)  # [[a|b]] -> b, [[a]] -> a
    t = re.sub(r"\[https?://[^\s\]]+ ([^\]]*)\]", r"\1", t)  # [url text] -> text
    t = re.sub(r"\[https?://[^\]]*\]", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"<[^>]+>", "", t)
    headings, paragraphs = [], []
    for block in re.split(r"\n\s*\n", t):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
        text: list[str] = []
        for ln in lines:
            m = re.fullmatch(r"(=+)\s*(.*?)\s*\1", ln)
            if m:
                headings.append(m.group(2))
            elif not ln.startswith(("*", "#", ":", ";", "|", "!")):  # lists and table rows
                text.append(ln)
        para = " ".join(" ".join(text).split())
        if len(para.split()) >= 25:
            paragraphs.append(para)
    return headings, paragraphs


def wiki_articles(xml: str) -> list[Article]:
    """The dump's articles (main namespace, no redirects) with at least two paragraphs."""
    out = []
    for page in re.findall(r"<page>(.*?)</page>", xml, flags=re.S):
        title = re.search(r"<title>(.*?)</title>", page)
        ns = re.search(r"<ns>(\d+)</ns>", page)
        text = re.search(r"<text[^>]*>(.*?)</text>", page, flags=re.S)
        if not (title and text) or (ns and ns.group(1) != "0"):
            continue
        if text.group(1).lstrip().upper().startswith("#REDIRECT"):
            continue
        headings, paragraphs = wiki_plain(text.group(1))
        if len(paragraphs) >= 2:
            out.append(Article(html.unescape(title.group(1)), headings, paragraphs))
    return out


def _opening(rng: random.Random) -> str:
    return rng.choices([o for o, _ in TEXT_OPENINGS], [w for _, w in TEXT_OPENINGS])[0]


def _clip(words: list[str], lo: int, hi: int, rng: random.Random) -> str:
    return " ".join(words[: rng.randint(lo, hi)])


def news_prompts(stories: list[str], rng: random.Random) -> Iterator[tuple[str, str]]:
    """(prompt, source) per story: one request over the whole story."""
    for i, story in enumerate(stories):
        yield _opening(rng) + story, f"lee:{i}"


def wiki_prompts(articles: list[Article], rng: random.Random) -> Iterator[tuple[str, str]]:
    """(prompt, source): per article, its opening (150-600 words) under a text opening, a title
    question, up to three section questions, and a request over each later run of two or three
    paragraphs (what an article-length text to summarise looks like in parts)."""
    skip = {"references", "external links", "see also", "further reading", "notes", "bibliography"}
    for a in articles:
        words = " ".join(a.paragraphs).split()
        yield _opening(rng) + _clip(words, 150, 600, rng), f"wiki:{a.title}:lead"
        yield rng.choice(TITLE_QUESTIONS).format(t=a.title), f"wiki:{a.title}:q"
        heads = [h for h in dict.fromkeys(a.headings) if h.lower() not in skip and len(h) < 40]
        for h in rng.sample(heads, min(3, len(heads))):
            q = rng.choice(HEADING_QUESTIONS).format(h=h.lower(), t=a.title)
            yield q, f"wiki:{a.title}:h"
        i = 2
        while i < len(a.paragraphs):
            n = rng.randint(2, 3)
            part = " ".join(a.paragraphs[i : i + n]).split()
            if len(part) >= 60:
                yield _opening(rng) + " ".join(part[:600]), f"wiki:{a.title}:{i}"
            i += n


def build(wheel: Path, seed: int) -> list[dict[str, object]]:
    """Every prompt of both corpora, shuffled by `seed`, as FastChat-style records."""
    stories, xml = read_wheel_texts(wheel)
    rng = random.Random(f"{seed}:texts")
    pairs = list(news_prompts(stories, rng)) + list(wiki_prompts(wiki_articles(xml), rng))
    return shuffled_records(pairs, rng)


def main(argv: list[str] | None = None) -> None:
    ap = prompt_file_parser(__doc__)
    ap.add_argument("--wheel", type=Path, help="a gensim wheel already downloaded")
    args = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = args.wheel or pip_download(GENSIM, Path(tmp), [])
            records = build(wheel, args.seed)
    except EaglespecError as e:  # offline, or --wheel not gensim's: one line, as the CLI says it
        raise SystemExit(f"eaglespec.train.texts: error: {e}") from e
    write_records(args.out, records)
    kinds = Counter(str(r["source"]).split(":")[0] for r in records)
    print(f"{len(records)} prompts to {args.out}: {dict(kinds)}")


if __name__ == "__main__":
    main()
