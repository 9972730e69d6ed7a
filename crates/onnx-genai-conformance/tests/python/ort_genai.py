"""Greedy generation and timing with ONNX Runtime GenAI on a package.

Usage:
  ort_genai.py generate PACKAGE IDS STEPS
      prints the greedy token ids after the comma-separated prompt IDS
  ort_genai.py bench PACKAGE THREADS PREFILL REPEATS CONTEXT STEPS VOCAB
      loads the package, then runs one round per line on stdin and prints
      each round's prefill (the median of REPEATS prefills) and decode
      tokens/s as a JSON line (rounds.py)
"""
import json
import statistics
import sys
import time

import onnxruntime_genai as og

import rounds


def load(path, threads=None):
    config = og.Config(path)
    if threads is not None:
        options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def generator(model, max_length):
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=max_length)
    return og.Generator(model, params)


def generate(path, ids, steps):
    model = load(path)
    gen = generator(model, len(ids) + steps)
    gen.append_tokens(ids)
    out = []
    while not gen.is_done() and len(out) < steps:
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    print(",".join(map(str, out)))


def bench(path, threads, prefill, repeats, context, steps, vocab):
    model = load(path, threads)
    # The token ids native-cpu's run feeds (xtask bench_real::measure).
    prompt = [(i * 7919 + 13) % vocab for i in range(max(prefill, context))]

    def one_round():
        prefills = []
        for _ in range(repeats):
            gen = generator(model, prefill + 1)
            t = time.perf_counter()
            gen.append_tokens(prompt[:prefill])
            prefills.append(time.perf_counter() - t)
        prefill_rate = prefill / statistics.median_high(prefills)
        gen = generator(model, context + steps + 1)
        gen.append_tokens(prompt[:context])
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            gen.generate_next_token()
            times.append(time.perf_counter() - t)
        # The upper median, as native-cpu's (the middle of an odd count).
        return prefill_rate, 1.0 / statistics.median_high(times)

    rounds.serve(one_round, {})


if __name__ == "__main__":
    if sys.argv[1] == "generate":
        generate(sys.argv[2], [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]))
    elif sys.argv[1] == "bench":
        bench(sys.argv[2], *map(int, sys.argv[3:9]))
    else:
        sys.exit(__doc__)
