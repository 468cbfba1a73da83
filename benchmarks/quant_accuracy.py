"""Accuracy of quantized (or lower-precision) eaglespec models against the fp32 model, greedy.

    python benchmarks/quant_accuracy.py --eval-dir DIR [--model smollm2-135m] [--per-file 2]
        [--tokens 128] [--configs bfloat16:none bfloat16:int8 float32:int8] [--json OUT]

Prompts: the first turn of the first --per-file questions of every `*.jsonl` file in --eval-dir
(FastChat format: one JSON object per line with a `turns` list), chat-templated.

For each prompt the fp32 model (quant none) decodes greedily up to --tokens tokens (stopping at EOS
unless --ignore-eos); that continuation is the reference. For each candidate `dtype:quant`:

- greedy agreement: the candidate decodes greedily on its own; matched = length of the common
  prefix with the reference (a shorter or longer output counts as a divergence where it ends).
- teacher-forced top-1: the candidate reads the reference continuation and predicts each next
  token; the share of positions where its argmax is the reference token (no compounding).
- NLL: the mean negative log-likelihood of the reference tokens under the candidate, against the
  same under fp32 (the reference's own NLL). The continuation is scored in chunks of --chunk
  tokens after a prefill of the prompt: chunks of at most 64 rows take the same int8 kernel as
  decoding (model/quant.py). Other ops round differently for T = 32 than for T = 1, so at near-ties
  teacher-forced argmaxes can differ from step-by-step decoding; --chunk 1 is exact (slower).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eaglespec import LLM, SamplingParams
from eaglespec.model.llama import Transformer


@dataclass
class PromptResult:
    source: str  # file and question index, e.g. gsm8k_question.jsonl#0
    prompt_tokens: int
    reference_tokens: int
    identical: bool  # the candidate's greedy output equals the reference
    matched: int  # common greedy prefix with the reference
    top1: float  # teacher-forced top-1 agreement with the reference tokens
    nll: float  # mean NLL of the reference tokens under the candidate
    reference_nll: float  # the same under fp32


def load_prompts(eval_dir: Path, per_file: int) -> list[tuple[str, str]]:
    """(source, first turn) of the first `per_file` questions of each jsonl file, by file name."""
    files = sorted(eval_dir.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"no *.jsonl files in {eval_dir}")
    prompts = []
    for path in files:
        with path.open() as f:
            for i, line in zip(range(per_file), f, strict=False):
                prompts.append((f"{path.name}#{i}", json.loads(line)["turns"][0]))
    return prompts


@torch.inference_mode()
def score(model: Transformer, prompt: list[int], cont: list[int], chunk: int) -> torch.Tensor:
    """(len(cont), V) fp32 logits predicting each token of `cont` after `prompt`: one prefill of
    the prompt, then cont[:-1] fed in chunks through the cache."""
    cache = model.new_cache(1, len(prompt) + len(cont))
    n = len(prompt)
    x, pos = torch.tensor([prompt]), torch.arange(n)[None]
    out = [model(x, pos, cache, logit_index=torch.tensor([[n - 1]])).logits[0]]  # (1, V)
    cache.advance([n])
    feed = cont[:-1]
    for start in range(0, len(feed), chunk):
        ids = feed[start : start + chunk]
        pos = torch.arange(n + start, n + start + len(ids))[None]
        out.append(model(torch.tensor([ids]), pos, cache).logits[0])  # (T, V)
        cache.advance([len(ids)])
    return torch.cat(out)


def nll_and_top1(logits: torch.Tensor, cont: list[int]) -> tuple[float, float]:
    target = torch.tensor(cont)
    nll = torch.nn.functional.cross_entropy(logits, target)
    top1 = (logits.argmax(-1) == target).float().mean()
    return float(nll), float(top1)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--eval-dir", type=Path, required=True, help="folder of FastChat *.jsonl files")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-file", type=int, default=2, help="questions per file")
    ap.add_argument("--tokens", type=int, default=128, help="reference continuation length")
    ap.add_argument("--ignore-eos", action="store_true", help="always decode --tokens tokens")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["bfloat16:none", "bfloat16:int8", "float32:int8"],
        help="candidates as dtype:quant, each compared with float32:none",
    )
    ap.add_argument("--chunk", type=int, default=32, help="tokens per scoring forward")
    ap.add_argument("--json", type=Path, help="write every per-prompt result here")
    args = ap.parse_args()

    prompts = load_prompts(args.eval_dir, args.per_file)
    ref = LLM(args.model, dtype="float32", quant="none", draft="none", progress=False)
    candidates = {}
    for spec in args.configs:
        dtype, quant = spec.split(":")
        candidates[spec] = LLM(args.model, dtype=dtype, quant=quant, draft="none", progress=False)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=args.ignore_eos)
    print(f"model {ref.loaded.path.name}, {len(prompts)} prompts, torch {torch.__version__}")

    results: dict[str, list[PromptResult]] = {spec: [] for spec in candidates}
    for source, text in prompts:
        ids = ref.encode(text)
        cont = ref.generate([ids], params)[0].token_ids
        ref_nll, _ = nll_and_top1(score(ref.model, ids, cont, args.chunk), cont)
        for spec, llm in candidates.items():
            own = llm.generate([ids], params)[0].token_ids
            matched = common_prefix(own, cont)
            nll, top1 = nll_and_top1(score(llm.model, ids, cont, args.chunk), cont)
            r = PromptResult(source, len(ids), len(cont), own == cont, matched, top1, nll, ref_nll)
            results[spec].append(r)
            print(
                f"  {spec:14} {source:28} prompt {len(ids):4} ref {len(cont):3} "
                f"matched {matched:3} top1 {top1:.3f} nll {nll:.4f} (fp32 {ref_nll:.4f})",
                flush=True,
            )

    print(
        "\n| candidate | identical outputs | matched / reference tokens | mean matched prefix "
        "| teacher-forced top-1 | NLL | fp32 NLL | ΔNLL |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec, rs in results.items():
        total = sum(r.reference_tokens for r in rs)
        weights = [r.reference_tokens for r in rs]
        # Token-weighted means over all reference tokens of all prompts.
        nll = sum(r.nll * w for r, w in zip(rs, weights, strict=True)) / total
        ref_nll = sum(r.reference_nll * w for r, w in zip(rs, weights, strict=True)) / total
        top1 = sum(r.top1 * w for r, w in zip(rs, weights, strict=True)) / total
        same = sum(r.identical for r in rs)
        matched = sum(r.matched for r in rs)
        print(
            f"| {spec} | {same}/{len(rs)} | {matched}/{total} ({matched / total:.1%}) "
            f"| {statistics.mean(r.matched for r in rs):.1f} | {top1:.1%} | {nll:.4f} "
            f"| {ref_nll:.4f} | {nll - ref_nll:+.4f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({s: [asdict(r) for r in rs] for s, rs in results.items()}, indent=1)
        )


if __name__ == "__main__":
    main()
