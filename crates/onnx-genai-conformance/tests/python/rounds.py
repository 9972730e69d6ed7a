"""The round protocol of the peer scripts' bench mode (`cargo xtask bench
--peer`): a peer loads its model once, says it is ready, then runs one
round per line the bench writes to its stdin, so the bench can run every
runtime's rounds in turn, back to back, rather than all of one runtime's
rounds and then another's (on a machine whose neighbours come and go, a
burst then fell on whichever runtime was running, and the ratios with
it). Each answer is one JSON line on stdout.
"""

import json
import sys
import time

# After a round the peer's worker threads spin a while before they sleep
# (ONNX Runtime's and llama.cpp's pools both do); the answer waits this
# long, so the next runtime's round does not share the cores with them.
SETTLE_SECONDS = 0.1


def _say(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(one_round, details):
    """Runs `one_round()` once untimed (every buffer at its size before
    the timed rounds), says the model is ready (with `details`), then
    answers each round the bench asks for with what `one_round()` returns:
    its prefill and decode tokens/s. Returns when the bench closes stdin."""
    one_round()
    _say(dict(details, ready=True))
    for _ in sys.stdin:
        prefill, decode = one_round()
        time.sleep(SETTLE_SECONDS)
        _say({"prefill": prefill, "decode": decode})
