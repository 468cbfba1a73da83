"""`eaglespec bench`: speculative decoding methods against plain decoding on one loaded target.

  questions.py    FastChat question files -> Question (id, category, user turns)
  lineup.py       method names -> BenchMethod (a proposer or none, chain length, tree shape)
  llamacpp.py     the llama.cpp reference method (llama-cpp-python, same GGUF, greedy; opt-in)
  memory.py       peak memory per generation (CUDA allocator, or the process's peak RSS)
  runner.py       warm-up, then every question at batch 1 with the methods interleaved;
                  multi-turn questions continue with each method's own answers -> Generation
  aggregate.py    Generations -> per method and per category statistics, the losslessness check
  environment.py  what ran where: torch, threads, device, dtype, CPU, model hashes, git commit
  results.py      results.json
  report.py       report.md (tables)
  plots.py        PNG plots (matplotlib, Agg)
  command.py      the command line: add_bench_parser, cmd_bench

The engine does the tensor work; this package only orchestrates, counts and reports.
"""
