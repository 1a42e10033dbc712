"""The vLLM side of ``bench/bench_vs_vllm.py``: run with the vLLM peer's own Python, never kvledger's.

    PREFIX/venv/bin/python bench/vllm_peer.py MODEL_DIR DTYPE MAX_MODEL_LEN

Loads ``vllm.LLM`` once (its defaults, as a user would run it), then answers one JSON request per
line on stdin: ``{"prompts": [[ids...], ...], "max_tokens": [n, ...]}`` runs one ``generate``
(greedy, ``ignore_eos``) and answers ``{"seconds": wall time of generate, "tokens": [[ids...], ...]}``
on stdout, on a line that starts with ``RESULT``; everything vLLM prints goes to stderr. An empty
line ends it. The benchmark times both engines through this same call shape.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    model_dir, dtype, max_model_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's own prints and logs stay off the answer channel
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=0)
    print("RESULT " + json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in request["max_tokens"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(r.outputs[0].token_ids) for r in results]
        print("RESULT " + json.dumps({"seconds": seconds, "tokens": tokens}), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
