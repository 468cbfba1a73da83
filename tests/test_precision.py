"""model/precision.py: what `--dtype auto --quant auto` (the commands' default) runs a model at,
from the checkpoint's storage types and the machine; and the load and the CLI report it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eaglespec.cli import main
from eaglespec.config import SamplingParams
from eaglespec.generate import generate_stream
from eaglespec.model.loader import load_model
from eaglespec.model.precision import choose
from eaglespec.requests import collect_outputs


def _gguf(decoder: str, head: str | None, tied: bool = False, layers: int = 2) -> dict[str, str]:
    """Tensor name -> storage type of a small GGUF's layout."""
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    storage = {f"blk.{i}.{n}.weight": decoder for i in range(layers) for n in names}
    storage |= {f"blk.{i}.attn_norm.weight": "F32" for i in range(layers)}
    storage["token_embd.weight"] = head if tied else "Q8_0"
    if not tied and head is not None:
        storage["output.weight"] = head
    return storage


def _kernel_runs() -> None:
    return None


def _pick(dtype: str, quant: str, storage, device: str = "cpu", missing=_kernel_runs):
    p = choose(dtype, quant, device=device, storage=storage, w4a8_missing=missing)
    return p.dtype, p.quant


def test_a_4bit_gguf_runs_at_its_own_precision_on_cpu() -> None:
    assert _pick("auto", "auto", _gguf("Q4_1", "Q8_0", tied=True)) == ("bfloat16", "w4a8")
    assert _pick("auto", "auto", _gguf("Q4_K", "Q6_K")) == ("bfloat16", "w4a8")
    assert _pick("auto", "auto", _gguf("Q4_0", "Q4_0")) == ("bfloat16", "w4a8-all")
    p = choose(
        "auto", "auto", device="cpu", storage=_gguf("Q4_1", "Q8_0", True), w4a8_missing=_kernel_runs
    )
    assert "Q8_0" in p.reason  # the load report says why the head stays 8-bit


def test_a_q4_k_m_mix_counts_as_4bit() -> None:
    """Q4_K_M keeps a few matrices at Q6_K; most are Q4_K: still the 4-bit kernel."""
    storage = _gguf("Q4_K", "Q6_K", layers=4)
    storage["blk.0.ffn_down.weight"] = storage["blk.1.attn_v.weight"] = "Q6_K"
    assert _pick("auto", "auto", storage) == ("bfloat16", "w4a8")


def test_a_mostly_wider_mix_with_4bit_matrices_runs_each_at_its_width() -> None:
    """Gemma-3-270M's Q4_K_M: K-quants cannot take its 640-wide rows, so most matrices are
    Q5_0 beside Q4_K ones (and Q6_K, Q8_0): w4a8-mixed, never fewer bits than stored."""
    storage = _gguf("Q5_0", None, tied=True, layers=4)
    for i in range(4):
        storage[f"blk.{i}.attn_output.weight"] = "Q4_K"
        storage[f"blk.{i}.ffn_down.weight"] = "Q4_K" if i % 2 else "Q6_K"
    storage["blk.0.attn_v.weight"] = "Q8_0"
    assert _pick("auto", "auto", storage) == ("bfloat16", "w4a8-mixed")
    storage["blk.1.attn_q.weight"] = "F16"  # a 16-bit matrix: not the kernels' to hold
    assert _pick("auto", "auto", storage) == ("float32", "none")


def test_everything_else_runs_unquantized_in_fp32() -> None:
    assert _pick("auto", "auto", None) == ("float32", "none")  # a Hugging Face folder
    assert _pick("auto", "auto", _gguf("Q8_0", "Q8_0")) == ("float32", "none")
    assert _pick("auto", "auto", _gguf("F16", "F16")) == ("float32", "none")
    assert _pick("auto", "auto", _gguf("Q4_1", "Q8_0"), device="cuda") == ("float32", "none")
    p = choose(
        "auto",
        "auto",
        device="cpu",
        storage=_gguf("Q4_1", "Q8_0"),
        w4a8_missing=lambda: "this CPU lacks AVX-512 VNNI",
    )
    assert (p.dtype, p.quant) == ("float32", "none") and "AVX-512 VNNI" in p.reason


def test_an_explicit_choice_decides_the_other() -> None:
    storage = _gguf("Q4_1", "Q8_0")
    assert _pick("float32", "auto", storage) == ("float32", "none")  # fp32: the exact model
    assert _pick("float16", "auto", storage) == ("float16", "none")
    assert _pick("bfloat16", "auto", storage) == ("bfloat16", "w4a8")
    assert _pick("auto", "int8", None) == ("bfloat16", "int8")  # the kernels' activations
    assert _pick("auto", "none", storage) == ("float32", "none")
    assert _pick("float32", "w4a8", storage) == ("float32", "w4a8")
    p = choose("float32", "none", device="cpu", storage=storage, w4a8_missing=_kernel_runs)
    assert p.reason == ""


def test_the_kernel_is_only_asked_about_when_it_would_be_used() -> None:
    asked = []

    def missing() -> None:
        asked.append(True)

    _pick("auto", "auto", None, missing=missing)
    _pick("float32", "auto", _gguf("Q4_1", "Q8_0"), missing=missing)
    assert not asked
    _pick("auto", "auto", _gguf("Q4_1", "Q8_0"), missing=missing)
    assert asked


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="not an x86 CPU with AVX2 or AVX-512: the kernels are not for it",
)
def test_every_cpu_kernel_builds_and_runs_where_the_cpu_takes_it() -> None:
    """On an x86 CPU with AVX2 or AVX-512 each of eaglespec's kernels builds and runs (the
    kernels' own tests skip where `available()` gives a reason, so a broken build would
    otherwise pass as a skip and the commands would fall back to fp32 unnoticed)."""
    from eaglespec.model import cpu_attention, cpu_layer, cpu_rowops, w4a8

    for kernel in (w4a8, cpu_attention, cpu_rowops, cpu_layer):
        assert kernel.available() is None, kernel.__name__


def test_a_hugging_face_folder_loads_and_generates_as_before(tiny_hf_folder: Path, capsys) -> None:
    loaded = load_model(tiny_hf_folder, dtype="auto", quant="auto")
    assert (loaded.precision.dtype, loaded.precision.quant) == ("float32", "none")
    assert str(loaded.model.dtype) == "torch.float32"
    args = ["generate", "--model", str(tiny_hf_folder), "--raw", "--max-tokens", "3", "Once"]
    assert main([*args, "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "float32, quant none (auto: not a GGUF file" in err


@pytest.mark.real
def test_the_default_model_loads_as_w4a8(real_gguf: Path) -> None:
    from eaglespec.model import w4a8

    loaded = load_model(real_gguf, dtype="auto", quant="auto")
    expected = ("bfloat16", "w4a8") if w4a8.available() is None else ("float32", "none")
    assert (loaded.precision.dtype, loaded.precision.quant) == expected
    assert str(loaded.model.dtype) == f"torch.{expected[0]}"


PROMPTS = ["Explain why the sky is blue in two sentences.", "What is 17 times 23? Show your steps."]


def _teacher_forced(model, cases: list[tuple[list[int], list[int]]]) -> tuple[float, list[float]]:
    """Share of continuation tokens that are `model`'s argmax (pooled), and its mean NLL of each
    case's continuation, reading prompt + continuation in one forward."""
    hits, total, nlls = 0, 0, []
    for prompt, cont in cases:
        ids = torch.tensor([prompt + cont])
        with torch.inference_mode():
            out = model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1]))
        logits = out.logits[0, len(prompt) - 1 : -1].float()  # the continuation's predictions
        target = torch.tensor(cont)
        hits += int((logits.argmax(-1) == target).sum())
        total += len(cont)
        nlls.append(float(torch.nn.functional.cross_entropy(logits, target)))
    return hits / total, nlls


@pytest.mark.real
def test_the_default_precision_stays_close_to_fp32(real_gguf: Path) -> None:
    """The commands' default precision (w4a8 in bf16 for this Q4_1 GGUF) against the fp32 model
    of the same file, teacher-forced on fp32's own greedy continuations: measured 2026-11-25 at
    top-1 0.89-0.97 per prompt and +0.014-0.023 nats of NLL. A conversion that is wrong but runs
    (two decoder layers swapped) must fail the same bounds, so they can catch one."""
    ref = load_model(real_gguf, dtype="float32", quant="none")
    default = load_model(real_gguf, dtype="auto", quant="auto")
    tok = ref.tokenizer
    cases = []
    for text in PROMPTS:
        prompt = tok.encode_chat([{"role": "user", "content": text}])
        params = [SamplingParams(max_tokens=48, ignore_eos=True)]
        cont = collect_outputs(generate_stream(ref.model, tok, [prompt], params))[0].token_ids
        cases.append((prompt, cont))
    top1_ref, nll_ref = _teacher_forced(ref.model, cases)
    assert top1_ref == 1.0  # fp32 reads its own greedy continuation

    def close(model) -> bool:
        top1, nll = _teacher_forced(model, cases)
        worst = max(n - r for n, r in zip(nll, nll_ref, strict=True))
        return top1 >= 0.85 and worst <= 0.06

    assert close(default.model)
    layers = default.model.layers
    layers[10], layers[11] = layers[11], layers[10]  # self-consistent, wrong
    assert not close(default.model)
