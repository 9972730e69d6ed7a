"""llama.cpp (through llama-cpp-python) as a peer of `cargo xtask bench
--peer llama.cpp`: the same GGUF the real packages are built from, the same
prompt, thread count and measurement as the native and ONNX Runtime GenAI
runs (tests/python/ort_genai.py):

    python llama_cpp_peer.py bench GGUF THREADS PREFILL REPEATS CONTEXT STEPS VOCAB

loads the GGUF, prints {"ready": true, "version": "..."}, then runs one
round per line on stdin and prints {"prefill": tok/s, "decode": tok/s} for
each (rounds.py) — prefill of PREFILL tokens from an empty cache (the
median of REPEATS); decode =
1 / median (upper, as native-cpu's) seconds of STEPS greedy steps after a
CONTEXT-token context; prompt ids (i * 7919 + 13) mod VOCAB, as native-cpu's.

(Not named llama_cpp.py: the script's folder comes first on sys.path and it
would import itself.)
"""

import statistics
import sys
import time

import llama_cpp
import numpy

import rounds


def bench(path, threads, prefill, repeats, context, steps, vocab):
    model = llama_cpp.Llama(
        model_path=path,
        n_ctx=max(prefill, context + steps) + 16,
        n_batch=max(prefill, context),
        n_ubatch=max(prefill, context),
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )
    # The token ids native-cpu's run feeds (xtask bench_real::measure).
    prompt = [(i * 7919 + 13) % vocab for i in range(max(prefill, context))]

    def one_round():
        prefills = []
        for _ in range(repeats):
            model.reset()
            t = time.perf_counter()
            model.eval(prompt[:prefill])
            prefills.append(time.perf_counter() - t)
        prefill_rate = prefill / statistics.median_high(prefills)
        model.reset()
        model.eval(prompt[:context])
        times = []
        for _ in range(steps):
            # Greedy, and timed as native-cpu's steps are: the forward pass,
            # not the argmax over the last row's logits.
            next_token = int(numpy.argmax(model.scores[model.n_tokens - 1]))
            t = time.perf_counter()
            model.eval([next_token])
            times.append(time.perf_counter() - t)
        return prefill_rate, 1.0 / statistics.median_high(times)

    rounds.serve(one_round, {"version": llama_cpp.__version__})


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "bench":
        bench(sys.argv[2], *map(int, sys.argv[3:9]))
    else:
        sys.exit(__doc__)
