"""Plain greedy decoding: eaglespec against transformers' `generate` on the same GGUF and prompt.

    python benchmarks/plain_decode.py [--model smollm2-135m] [--dtypes float32 bfloat16]
                                      [--tokens 128] [--repeats 3] [--profile]
                                      [--quant none int8]

Both engines decode the same chat-templated prompt greedily for --tokens new tokens (EOS ignored),
interleaved run by run so that drifts in machine speed hit both alike. Decode speed is measured the
same way for both: tokens after the first over the time after the first token (a streamer stamps
transformers' tokens). Medians over --repeats. `--profile` adds a per-token breakdown of
eaglespec's decode step by operator family. `--quant none int8` adds a row per quantization mode
(eaglespec only: transformers keeps its reference weights), all interleaved in the same runs.
Needs `transformers` and `accelerate` (the test extra).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from eaglespec import LLM, SamplingParams
from eaglespec.model.quant import QUANT_MODES
from eaglespec.registry import resolve_model

PROMPT = "Write a short story about a robot who learns to paint."


class _Stamps:
    """A transformers streamer that records when each generated token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_eaglespec(llm: LLM, ids: list[int], n: int) -> float:
    out = llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    assert len(out.token_ids) == n
    return out.stats.tokens_per_second


def run_transformers(model, ids: list[int], n: int) -> float:
    stamps = _Stamps()
    with torch.inference_mode():
        model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            streamer=stamps,
        )
    return (len(stamps.times) - 1) / (stamps.times[-1] - stamps.times[0])


def dense_transformers(path, dtype: torch.dtype):
    """transformers' Llama with plain dense weights: the GGUF dequantized once (by eaglespec's
    reader, under HF names, Q/K un-permuted), so both engines run the same dense math."""
    import transformers

    from eaglespec.model.checkpoint import GGUFCheckpoint

    ckpt = GGUFCheckpoint.open(path)
    config = transformers.AutoConfig.for_model(**ckpt.config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {name: ckpt.load(name, dtype) for name in ckpt.names()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def profile_step(llm: LLM, ids: list[int], steps: int = 30) -> dict[str, float]:
    """Milliseconds per decode token, by operator family."""
    from torch.profiler import ProfilerActivity, profile

    m = llm.model
    cache = m.new_cache(1, len(ids) + steps + 8)
    x = torch.tensor([ids])
    with torch.inference_mode():
        m(x, torch.arange(len(ids))[None], cache)
        cache.advance([len(ids)])
        tok = torch.tensor([[int(ids[-1])]])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                out = m(tok, torch.tensor([cache.lengths]), cache)
                cache.advance([1])
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
    families = {
        "matmul (weights)": ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm"),
        "attention (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
        "rms_norm": ("aten::_fused_rms_norm",),
    }
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    shares: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        family = next((f for f, names in families.items() if e.key in names), None)
        if family is None:
            continue
        shares[family] += e.cpu_time_total
    result = {k: v / steps / 1000 for k, v in shares.items()}
    result["everything else (small ops, Python)"] = (total - sum(shares.values())) / steps / 1000
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--quant",
        nargs="+",
        choices=QUANT_MODES,
        default=["none"],
        help="eaglespec's weight quantization (model/quant.py), one row each, interleaved run by "
        "run with the others and transformers; transformers is unchanged",
    )
    ap.add_argument(
        "--reference",
        choices=["gguf", "dense"],
        default="gguf",
        help="transformers loading the GGUF itself (its packed-weight kernels), or the same "
        "weights dequantized into a plain dense model",
    )
    args = ap.parse_args()

    import transformers

    path = resolve_model(args.model)
    print(
        f"model {path.name}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"threads {torch.get_num_threads()}, reference: transformers {args.reference}, "
        f"eaglespec quant: {args.quant}"
    )
    print(
        "| dtype | eaglespec load s | eaglespec tok/s "
        "| transformers load s | transformers tok/s | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        llms, loads = {}, {}
        for quant in args.quant:
            t = time.perf_counter()
            llms[quant] = LLM(str(path), dtype=dtype, quant=quant, draft="none", progress=False)
            loads[quant] = time.perf_counter() - t
        t = time.perf_counter()
        if args.reference == "gguf":
            ref = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
            ).eval()
        else:
            ref = dense_transformers(path, getattr(torch, dtype))
        ref_load = time.perf_counter() - t
        ids = llms[args.quant[0]].encode(PROMPT)
        for llm in llms.values():
            run_eaglespec(llm, ids, 8)  # warm-up
        run_transformers(ref, ids, 8)
        ours: dict[str, list[float]] = {quant: [] for quant in llms}
        theirs: list[float] = []
        for _ in range(args.repeats):
            for quant, llm in llms.items():
                ours[quant].append(run_eaglespec(llm, ids, args.tokens))
            theirs.append(run_transformers(ref, ids, args.tokens))
        b = statistics.median(theirs)
        for quant, runs in ours.items():
            a = statistics.median(runs)
            label = dtype if quant == "none" else f"{dtype} {quant}"
            print(
                f"| {label} | {loads[quant]:.2f} | {a:.1f} | {ref_load:.2f} | {b:.1f} "
                f"| {a / b:.2f}x |"
            )
        runs_text = "; ".join(
            f"{q}: {', '.join(f'{v:.1f}' for v in runs)}" for q, runs in ours.items()
        )
        print(f"    {dtype} runs, eaglespec {runs_text}; transformers: ", end="")
        print(", ".join(f"{v:.1f}" for v in theirs))
        if args.profile:
            for quant, llm in llms.items():
                for family, ms in profile_step(llm, ids).items():
                    print(f"    {dtype} {quant} {family}: {ms:.1f} ms/token")
        del ref, llms


if __name__ == "__main__":
    main()
