"""`eaglespec serve` and `eaglespec chat` as a user starts them: each its own process, with no
options but serve's port, so every setting is the command's default (SmolLM2 at the GGUF's own
precision, the shipped EAGLE-3 head with prompt lookup grafted in, adaptive speculation, serve's
chunked prefill). The server, driven by the real `openai` client, and the chat, driven through
standard input, answer as plain greedy decoding of the same model at the same precision does;
streamed text equals the whole answer; SIGTERM ends the server after a graceful shutdown that
keeps its calibration. Each process keeps what it learns under a temporary EAGLESPEC_HOME, not
the user's cache."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from browser import find_browser, headless_chrome
from commands import DEFAULT_MODEL as NAME
from commands import command_env, plain_text, user_home
from eaglespec import LLM

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.real


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    home = user_home(tmp_path_factory.mktemp("home"))
    port = _free_port()
    env = command_env(home)
    proc = subprocess.Popen(
        [sys.executable, "-m", "eaglespec", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"serve exited with {proc.returncode}:\n{out}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("serve did not answer /health within 180 s")
        time.sleep(0.2)
    try:
        yield url, proc, home
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.command("serve")
def test_the_served_defaults_answer_as_plain_decoding(
    served: tuple[str, subprocess.Popen, Path], default_plain: LLM
) -> None:
    url, proc, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [NAME]
    # A request that quotes its context (lookup grafts), one that does not, and a raw completion.
    quoted = (
        "Repeat this list, then add one more item: apples, pears, plums, cherries, apricots, "
        "peaches, figs."
    )
    for question in (quoted, "What is the capital of France?"):
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=48, temperature=0
        )
        ids = default_plain.tokenizer.encode_chat(messages)
        assert whole.choices[0].message.content == plain_text(default_plain, ids, 48), question
        assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
        stream = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=48, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == whole.choices[0].message.content
    prompt = "The three primary colours are"
    done = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    assert done.choices[0].text == plain_text(
        default_plain, default_plain.tokenizer.encode(prompt), 24
    )
    assert proc.poll() is None  # still serving


@pytest.mark.command("serve")
def test_the_served_defaults_answer_concurrent_and_long_prompts_as_alone(
    served: tuple[str, subprocess.Popen, Path], default_plain: LLM
) -> None:
    """Six chat requests at once, one of them a 400-token prompt the server prefills in chunks
    of 256 beside the others' decoding: each answer is plain greedy decoding's of it alone."""
    url, proc, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    notes = " ".join(
        f"Note {j}: bees visit flowers, carry nectar home and fan it until it thickens."
        for j in range(22)
    )
    questions = [
        f"{notes}\nSummarize the notes above in one sentence.",
        "Name a fruit.",
        "What is 3 times 3?",
        "Repeat after me: red, green, blue, red, green, blue.",
        "Write a Python function that adds two numbers.",
        "What is the capital of Italy?",
    ]
    ids = [default_plain.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    assert len(ids[0]) > 300  # past serve's 256-token prefill chunk
    got: dict[int, str] = {}
    start = threading.Barrier(len(questions))

    def ask(i: int) -> None:
        start.wait()
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": questions[i]}],
            max_tokens=32, temperature=0,
        )  # fmt: skip
        got[i] = r.choices[0].message.content or ""

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(ids):
        assert got[i] == plain_text(default_plain, prompt, 32), questions[i][-60:]
    assert proc.poll() is None


PAGE_QUESTION = (
    'Rewrite in the past tense: "The cat sits on the mat. It watches the birds in the garden, '
    'and it dreams of catching one of them before the sun goes down."'
)


@pytest.mark.command("serve")
def test_the_chat_page_streams_an_answer_with_its_tokens_marked(
    served: tuple[str, subprocess.Popen, Path], default_plain: LLM
) -> None:
    """The page at / in headless Chromium: speculation switched on from the page, a question
    typed and sent with Enter; the answer streams in round by round (a MutationObserver counts
    the rounds as they land), equals plain greedy decoding's answer, and every token carries its
    mark: some are the head's accepted drafts, each round ends in the target's own token.
    EAGLESPEC_SCREENSHOT=path keeps a screenshot (the README's docs/chat-page.png)."""
    browser = find_browser()
    if browser.missing:
        pytest.skip(browser.missing)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    url, _, _ = served
    driver = headless_chrome(browser)
    try:
        driver.get(url)
        wait = WebDriverWait(driver, 60)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
        assert driver.find_element(By.ID, "model").text == NAME
        driver.find_element(By.CSS_SELECTOR, 'input[name="mode"][value="on"]').click()
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-mode") == "on")
        assert httpx.get(f"{url}/eaglespec/speculation").json()["mode"] == "on"
        driver.execute_script(
            """window.seen = [];
            new MutationObserver(() => window.seen.push(document.querySelectorAll(".round").length))
              .observe(document.getElementById("log"), {childList: true, subtree: true});"""
        )
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("64")
        driver.find_element(By.ID, "prompt").send_keys(PAGE_QUESTION, Keys.ENTER)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=done]"))
        box = driver.find_element(By.CSS_SELECTOR, ".msg.assistant")
        answer = box.find_element(By.CLASS_NAME, "answer")
        assert "error" not in box.get_attribute("class"), box.text
        ids = default_plain.tokenizer.encode_chat([{"role": "user", "content": PAGE_QUESTION}])
        assert answer.get_attribute("textContent") == plain_text(default_plain, ids, 64)
        rounds = answer.find_elements(By.CLASS_NAME, "round")
        seen = [n for n in driver.execute_script("return window.seen;") if n]
        assert len(set(seen)) >= 3, seen  # the rounds arrived one by one, not all at the end
        sources = [
            [t.get_attribute("data-source") for t in r.find_elements(By.CLASS_NAME, "tok")]
            for r in rounds
        ]
        assert sum(len(s) for s in sources) == int(box.get_attribute("data-tokens"))
        assert sources[0] == ["target"]  # the prefill's token
        for s in sources[1:-1]:  # each whole round: accepted drafts, then the target's own
            # (a round without drafts, where the head's gate declined its first pick and lookup
            # found nothing, is the target's token alone)
            assert s == ["target"] or (
                set(s[:-1]) <= {"draft", "lookup"} and s[-1] in ("bonus", "corrected")
            )
        assert sum(s.count("draft") for s in sources) > 0  # the shipped head's accepted drafts
        figures = box.find_element(By.CLASS_NAME, "figures").text
        assert "tokens a round" in figures and "speculation on" in figures
        driver.find_element(By.ID, "show-rounds").click()
        assert "show-rounds" in driver.find_element(By.TAG_NAME, "body").get_attribute("class")
        if shot := os.environ.get("EAGLESPEC_SCREENSHOT"):
            driver.save_screenshot(shot)
    finally:
        driver.quit()
        httpx.post(f"{url}/eaglespec/speculation", json={"mode": "adaptive"})


@pytest.mark.command("serve")
def test_sigterm_ends_the_server_cleanly(served: tuple[str, subprocess.Popen, Path]) -> None:
    """After the requests above: SIGTERM, exit status 0, the startup report named the defaults
    (precision, the head with prompt lookup), and what serving taught the adaptive policy was
    kept under the process's EAGLESPEC_HOME."""
    _, proc, home = served
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises the signal: the status says "ended by SIGTERM"
    assert proc.returncode == -signal.SIGTERM, out
    assert "Application shutdown complete" in out
    assert "w4a8" in out or "float32" in out  # the precision line (w4a8 where the kernel runs)
    assert "EAGLE-3 head smollm2-135m" in out and "prompt-lookup tokens" in out
    assert list((home / "calibration").glob("*.json")), "serving's calibration was not kept"


@pytest.mark.command("chat")
def test_chat_command_at_its_defaults_keeps_the_conversation(
    tmp_path: Path, default_plain: LLM
) -> None:
    """`eaglespec chat` as a user runs it, turns on standard input: each answer is plain greedy
    decoding's of the conversation so far (the second turn sees the first answer), /reset
    forgets it, /exit ends the command with status 0."""
    env = command_env(user_home(tmp_path))
    turns = ["Name a fruit.", "Now name a vegetable.", "/reset", "What is 2 + 2?", "/exit"]
    proc = subprocess.run(
        [sys.executable, "-m", "eaglespec", "chat", "--max-tokens", "24"],
        input="\n".join(turns) + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "prompt-lookup tokens" in proc.stderr and "[conversation cleared]" in proc.stderr
    tok = default_plain.tokenizer
    first = [{"role": "user", "content": turns[0]}]
    a1 = plain_text(default_plain, tok.encode_chat(first), 24)
    second = [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": turns[1]}]
    a2 = plain_text(default_plain, tok.encode_chat(second), 24)
    a3 = plain_text(default_plain, tok.encode_chat([{"role": "user", "content": turns[3]}]), 24)
    assert proc.stdout == f"{a1}\n{a2}\n{a3}\n"
