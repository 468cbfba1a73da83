// eaglespec's chat page: a conversation through the OpenAI-compatible API (streamed), each
// answer's tokens marked by how they landed. The marks come from the `provenance` extension
// (README.md, Serving): every streamed chunk of a speculation round carries
// {"drafted", "accepted", "tokens": [{"text", "source"}]}, source one of draft, lookup, bonus,
// corrected, target. No build step and no network beyond this server.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log");
const state = { model: null, messages: [], busy: false };

async function init() {
  const models = await (await fetch("/v1/models")).json();
  state.model = models.data[0].id;
  $("model").textContent = state.model;
  showMode(await (await fetch("/eaglespec/speculation")).json());
  for (const input of document.querySelectorAll('input[name="mode"]')) {
    input.addEventListener("change", () => setMode(input.value));
  }
  $("show-rounds").addEventListener("change", (e) => {
    document.body.classList.toggle("show-rounds", e.target.checked);
  });
  $("ask").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("clear").addEventListener("click", () => { state.messages = []; log.replaceChildren(); });
  document.body.dataset.ready = "true";
}

function showMode(s) {
  for (const input of document.querySelectorAll('input[name="mode"]')) {
    input.checked = input.value === s.mode;
    input.disabled = !s.modes.includes(input.value);
  }
  document.body.dataset.mode = s.mode;
}

async function setMode(mode) {
  const r = await fetch("/eaglespec/speculation", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ mode }),
  });
  showMode(r.ok ? await r.json() : await (await fetch("/eaglespec/speculation")).json());
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  if (text) div.textContent = text;
  log.append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// One answer's running figures: tokens, time, rounds, acceptance by draft position.
class Figures {
  constructor(mode) {
    this.mode = mode;
    this.sent = performance.now();
    this.first = null;
    this.last = null;
    this.tokens = 0;
    this.rounds = 0; // target forwards after the prefill's
    this.roundTokens = 0;
    this.proposed = [];
    this.accepted = [];
  }

  add(p) {
    const now = performance.now();
    if (this.first === null) this.first = now;
    else { this.rounds += 1; this.roundTokens += p.tokens.length; }
    this.last = now;
    this.tokens += p.tokens.length;
    for (let j = 0; j < p.drafted; j++) {
      this.proposed[j] = (this.proposed[j] || 0) + 1;
      this.accepted[j] = (this.accepted[j] || 0) + (j < p.accepted ? 1 : 0);
    }
  }

  text() {
    if (this.first === null) return "waiting for the first token...";
    const parts = [`${this.tokens} tokens`];
    const decode = (this.last - this.first) / 1000;
    if (this.tokens > 1 && decode > 0) {
      parts.push(`${((this.tokens - 1) / decode).toFixed(1)} tok/s after the first`);
    }
    parts.push(`first token ${Math.round(this.first - this.sent)} ms`);
    if (this.rounds) parts.push(`${(this.roundTokens / this.rounds).toFixed(2)} tokens a round`);
    if (this.proposed.length) {
      const rates = this.proposed.map((n, j) => (this.accepted[j] / n).toFixed(2));
      parts.push(`accepted by draft position ${rates.join(" / ")}`);
    }
    parts.push(`speculation ${this.mode}`);
    return parts.join(" · ");
  }
}

function renderRound(answer, p, index) {
  const round = document.createElement("span");
  round.className = "round";
  round.title = `round ${index}: ${p.accepted} of ${p.drafted} drafts accepted`;
  for (const t of p.tokens) {
    const tok = document.createElement("span");
    tok.className = `tok src-${t.source}`;
    tok.dataset.source = t.source;
    tok.textContent = t.text;
    round.append(tok);
  }
  answer.append(round);
}

async function send() {
  const text = $("prompt").value.trim();
  if (!text || state.busy || !state.model) return;
  state.busy = true;
  $("send").disabled = true;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  const box = bubble("assistant");
  const answer = document.createElement("div");
  answer.className = "answer";
  const figs = document.createElement("div");
  figs.className = "figures";
  box.append(answer, figs);
  box.dataset.state = "streaming";
  const figures = new Figures(document.body.dataset.mode);
  let content = "";
  let rounds = 0;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model: state.model,
        messages: state.messages,
        stream: true,
        provenance: true,
        max_tokens: Number($("max-tokens").value) || 256,
        temperature: Number($("temperature").value) || 0,
      }),
    });
    if (!r.ok) throw new Error((await r.json()).error?.message || `HTTP ${r.status}`);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        const choice = chunk.choices[0];
        if (!choice) continue;
        if (choice.provenance) {
          renderRound(answer, choice.provenance, rounds++);
          figures.add(choice.provenance);
        } else if (choice.delta?.content) {
          answer.append(choice.delta.content); // a chunk without marks: plain text
        }
        content += choice.delta?.content || "";
        figs.textContent = figures.text();
        box.dataset.tokens = String(figures.tokens);
      }
    }
    state.messages.push({ role: "assistant", content });
  } catch (err) {
    state.messages.pop(); // the question goes unanswered: ask again or something else
    box.classList.add("error");
    figs.textContent = `error: ${err.message}`;
  } finally {
    box.dataset.state = "done";
    state.busy = false;
    $("send").disabled = false;
    box.scrollIntoView({ block: "end" });
  }
}

init();
