"""Stop strings: never shown while streaming, text cut before them, chunks add up to the text."""

from __future__ import annotations

from eaglespec.textstream import TextStream


class _CharDecoder:
    """Stands in for the tokenizer's StreamDecoder: token i decodes to PIECES[i]."""

    PIECES = ["Hel", "lo", "\n", "\n", "wor", "ld", "EN", "D!"]

    def push(self, token_id: int) -> str:
        return self.PIECES[token_id]

    def flush(self) -> str:
        return ""


def _run(ids: list[int], stop: tuple[str, ...]) -> tuple[list[str], TextStream]:
    ts = TextStream(_CharDecoder(), stop)  # type: ignore[arg-type]
    chunks = [ts.push(i) for i in ids]
    chunks.append(ts.finish())
    return chunks, ts


def test_stop_string_across_tokens_is_cut_and_never_streamed() -> None:
    chunks, ts = _run([0, 1, 2, 3, 4], ("\n\n",))
    assert ts.stopped and ts.text == "Hello"
    assert "".join(chunks) == "Hello"
    assert chunks[2] == ""  # the first "\n" was held back: it could start the stop string


def test_partial_prefix_released_when_it_cannot_match() -> None:
    chunks, ts = _run([0, 1, 2, 4, 5], ("\n\n",))
    assert not ts.stopped and ts.text == "Hello\nworld"
    assert "".join(chunks) == ts.text


def test_stop_inside_a_token() -> None:
    _, ts = _run([4, 5, 6, 7], ("dEN",))
    assert ts.text == "worl"


def test_no_stop_strings_streams_everything() -> None:
    chunks, ts = _run(list(range(8)), ())
    assert chunks[:8] == _CharDecoder.PIECES and ts.text == "".join(_CharDecoder.PIECES)
