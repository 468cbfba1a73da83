"""Plain decoding and verification on a GPU against the memory-bandwidth limit, for
Llama-architecture models of about 1B, 3B and 8B parameters with random weights built on the device.

    python benchmarks/gpu_decode.py [--sizes 1b 3b 8b] [--dtype bfloat16] [--tokens 64]
                                    [--prefix 128] [--verify 1 2 4 8 16 32 64 128]
                                    [--compile none|block|full] [--peer]

Random weights time exactly like trained ones (the same bytes stream through the same kernels), so
no checkpoint is needed. For each size:
- the device's streaming bandwidth, measured once (a device-to-device copy of 2 GiB, bytes read
  plus written), and the limit it sets on batch-1 decoding: the bytes a decode step must read (every
  weight but the embedding table, whose one row is read; the lm_head's matrix even when tied; the
  KV cache at the prefix) over that bandwidth;
- decode steps through `Transformer.forward` with the next token chosen on the device (argmax) and
  one host sync at the end: the model's own cost;
- decode through `generate.generate_stream`, the engine's plain loop (sampling, stop checks, one
  host sync per token): what a user gets;
- the verification curve: one forward over T new tokens after the prefix, x one token;
- with --peer, HF transformers' `generate()` on the same architecture (its own random weights,
  greedy, the same number of new tokens) as the side-by-side peer.
Times are medians over repeats (CUDA events for device work); each row says what it timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from eaglespec.config import ModelConfig, SamplingParams
from eaglespec.generate import generate_stream
from eaglespec.model.llama import Transformer
from eaglespec.requests import collect_outputs

# Llama 3.2 1B / 3B and Llama 3.1 8B shapes
SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
               num_kv_heads=8, head_dim=64, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
               num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
               num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip


class _Tokenizer:
    """Enough of a tokenizer for the engine's loop: no EOS, no text."""

    eos_ids: tuple[int, ...] = ()

    def stream_decoder(self, prompt_ids=()):  # noqa: ANN001, ANN201
        class _Decoder:
            def push(self, tid: int) -> str:
                return ""

            def flush(self) -> str:
                return ""

        return _Decoder()


def config(size: str) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position=4096,
        name=f"random-llama-{size}",
        **SIZES[size],  # type: ignore[arg-type]
    )


def build(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Transformer:
    """Random weights made on the device (nn.Linear's own init, then scaled so activations stay
    finite through the layers), cast to `dtype`."""
    with torch.device(device):
        model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    inv_freq = model.inv_freq  # RoPE frequencies stay fp32, as the loader keeps them
    model = model.to(dtype).eval()
    model.inv_freq = inv_freq
    return model


def step_bytes(model: Transformer, prefix: int) -> int:
    """Bytes one decode step must read: all weights but the embedding table (one row), the
    lm_head's matrix (also when tied), the KV cache over the prefix."""
    cfg = model.cfg
    el = model.dtype.itemsize
    total = sum(p.numel() for p in model.parameters()) * el
    total -= model.embed.weight.numel() * el  # only one row is read...
    total += cfg.hidden_size * el
    if cfg.tie_word_embeddings:  # ...but the tied lm_head reads the whole matrix
        total += model.lm_head.weight.numel() * el
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * prefix * el
    return total + kv


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting bytes read plus written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()  # host sync: timing
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * n / statistics.median(times[2:])


def decode_forward(model: Transformer, prefix: int, tokens: int, repeats: int) -> float:
    """Median seconds per decode step over `tokens` steps, next token argmax'ed on the device."""
    dev = model.device
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, prefix), device=dev, generator=gen)
    per_step = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            cache = model.new_cache(1, prefix + tokens + 1)
            out = model(ids, torch.arange(prefix, device=dev)[None], cache)
            cache.advance([prefix])
            nxt = out.logits[:, -1:].argmax(-1)  # (1, 1)
            torch.cuda.synchronize()  # host sync: timing
            start = time.perf_counter()
            for t in range(tokens):
                pos = torch.full((1, 1), prefix + t, device=dev)
                out = model(nxt, pos, cache)
                cache.advance([1])
                nxt = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()  # host sync: timing
            per_step.append((time.perf_counter() - start) / tokens)
    return statistics.median(per_step[1:])


def decode_engine(model: Transformer, prefix: int, tokens: int, repeats: int) -> float:
    """Median seconds per token of the engine's plain loop (prefill excluded by difference)."""
    prompt = torch.randint(0, model.cfg.vocab_size, (prefix,)).tolist()

    def run(n: int) -> float:
        params = [SamplingParams(max_tokens=n, ignore_eos=True)]
        torch.cuda.synchronize()  # host sync: timing
        start = time.perf_counter()
        out = collect_outputs(generate_stream(model, _Tokenizer(), [prompt], params))
        assert len(out[0].token_ids) == n
        return time.perf_counter() - start

    run(4)  # warm-up
    samples = [(run(tokens + 1) - run(1)) / tokens for _ in range(repeats)]
    return statistics.median(samples)


def verify_curve(model: Transformer, prefix: int, sizes: list[int], repeats: int) -> dict:
    """Median ms of one forward over T new tokens after `prefix`, sizes round-robin."""
    dev = model.device
    cache = model.new_cache(1, prefix + max(sizes) + 1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, prefix + max(sizes)), device=dev)
    samples: dict[int, list[float]] = {T: [] for T in sizes}
    with torch.inference_mode():
        model(ids[:, :prefix], torch.arange(prefix, device=dev)[None], cache)
        cache.advance([prefix])
        for rep in range(repeats + 1):
            for T in sizes:
                pos = torch.arange(prefix, prefix + T, device=dev)[None]
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                model(ids[:, prefix : prefix + T], pos, cache)
                b.record()
                b.synchronize()  # host sync: timing
                if rep:
                    samples[T].append(a.elapsed_time(b))
    return {T: statistics.median(v) for T, v in samples.items()}


def peer_decode(cfg: ModelConfig, dtype: torch.dtype, prefix: int, tokens: int) -> float:
    """Seconds per new token of HF transformers' greedy generate() (prefill excluded)."""
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position,
    )
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, prefix), device="cuda")

    def run(n: int) -> float:
        torch.cuda.synchronize()  # host sync: timing
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()  # host sync: timing
        return time.perf_counter() - start

    run(4)
    samples = [(run(tokens + 1) - run(1)) / tokens for _ in range(3)]
    return statistics.median(samples)  # hf is freed on return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["1b", "3b", "8b"], choices=sorted(SIZES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--verify", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--compile", default="none", choices=["none", "block", "full"])
    ap.add_argument("--peer", action="store_true", help="also time HF transformers' generate()")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode.py needs a CUDA device")
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.dtype}, "
          f"compile {args.compile}; device copy {bw / 1e12:.2f} TB/s (read + write)")  # fmt: skip
    rows = []
    for size in args.sizes:
        cfg = config(size)
        model = build(cfg, dtype, device)
        if args.compile != "none":
            model.compile_steps(args.compile)
        params = sum(p.numel() for p in model.parameters())
        limit = step_bytes(model, args.prefix) / bw
        fwd = decode_forward(model, args.prefix, args.tokens, args.repeats)
        eng = decode_engine(model, args.prefix, args.tokens, args.repeats)
        curve = verify_curve(model, args.prefix, args.verify, args.repeats * 3)
        peer = None
        if args.peer:
            del model
            torch.cuda.empty_cache()
            peer = peer_decode(replace(cfg), dtype, args.prefix, args.tokens)
            torch.cuda.empty_cache()
        rows.append((size, params, limit, fwd, eng, curve, peer))
        print(
            f"{size}: {params / 1e9:.2f}B params, limit {limit * 1e3:.2f} ms/token "
            f"({1 / limit:.0f} tok/s); forward loop {fwd * 1e3:.2f} ms ({limit / fwd:.0%} of "
            f"limit); engine {eng * 1e3:.2f} ms ({limit / eng:.0%})"
            + (f"; HF generate {peer * 1e3:.2f} ms ({limit / peer:.0%})" if peer else ""),
            flush=True,
        )
        base = curve[args.verify[0]]
        print("  verify T: " + ", ".join(f"{T}: {ms:.2f} ms {ms / base:.2f}x"
                                         for T, ms in curve.items()), flush=True)  # fmt: skip
        model = None
        torch.cuda.empty_cache()
    print("\n| model | params | limit tok/s | forward loop tok/s (% limit) | engine tok/s (% limit)"
          " | HF generate tok/s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for size, params, limit, fwd, eng, _, peer in rows:
        hf = f"{1 / peer:.0f}" if peer else "-"
        print(
            f"| {size} | {params / 1e9:.2f}B | {1 / limit:.0f} | {1 / fwd:.0f} ({limit / fwd:.0%})"
            f" | {1 / eng:.0f} ({limit / eng:.0%}) | {hf} |"
        )
    print("\n| model | " + " | ".join(f"T={T}" for T in args.verify) + " |")
    print("|---|" + "---|" * len(args.verify))
    for size, _, _, _, _, curve, _ in rows:
        base = curve[args.verify[0]]
        print(f"| {size} | " + " | ".join(f"{curve[T]:.2f} ms ({curve[T] / base:.2f}x)"
                                          for T in args.verify) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
