"""Load: 100 concurrent streaming clients, a fifth of them hanging up mid-stream at random points.

No 5xx; every completed stream equals the offline greedy output; every hang-up is aborted in
the engine; once idle, zero blocks are referenced and the block pool's integrity holds.
Short prompts and few tokens keep it to seconds on two CPU cores.
"""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from tests.server_harness import (
    MODEL, PROMPTS, aborted_total, async_openai_client, check_integrity, greedy_references, ledger_history,
    shared_server, wait_idle,
)

N_CLIENTS = 100
N_DISCONNECT = 20
MAX_TOKENS = 8  # clients that stay
LONG_TOKENS = 64  # clients that hang up ask for more than they will read


@pytest.mark.slow
def test_100_streaming_clients_with_disconnects_leak_nothing():
    server = shared_server()
    expected = greedy_references(PROMPTS, MAX_TOKENS)
    rng = random.Random(20240601)
    leavers = dict.fromkeys(rng.sample(range(N_CLIENTS), N_DISCONNECT))
    for i in leavers:
        leavers[i] = rng.randint(1, 5)  # hang up after this many chunks
    wait_idle(server)
    aborted_before = aborted_total(server.url)
    t_start = time.time()
    client = async_openai_client(server)

    async def one(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        leave_after = leavers.get(i)
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, temperature=0, stream=True,
                max_tokens=LONG_TOKENS if leave_after else MAX_TOKENS,
                extra_body={"ignore_eos": True} if leave_after else None)
            text, chunks = "", 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    chunks += 1
                if leave_after and chunks >= leave_after:
                    await stream.close()
                    return "left", prompt, text
            return "done", prompt, text
        except openai.APIStatusError as err:
            return f"http {err.status_code}", prompt, str(err)
        except openai.APIConnectionError as err:
            return "connection error", prompt, str(err)

    async def everyone():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(N_CLIENTS))), timeout=240)

    results = asyncio.run(everyone())  # wait_for fails the test past 240 s

    outcomes = [r[0] for r in results]
    assert outcomes.count("left") == N_DISCONNECT, outcomes
    assert outcomes.count("done") == N_CLIENTS - N_DISCONNECT, [r for r in results if r[0] not in ("left", "done")]
    for status, prompt, text in results:
        if status == "done":
            assert text == expected[prompt], (prompt, text, expected[prompt])

    ledger = wait_idle(server)
    assert ledger["blocks_allocated"] == 0, ledger
    assert ledger["tokens_used"] == 0 and ledger["num_running"] == 0 and ledger["num_waiting"] == 0
    check_integrity(server)
    # each hang-up reached the engine as an abort (none of them could finish its 64 tokens first)
    assert aborted_total(server.url) - aborted_before == N_DISCONNECT
    # and they really were served together: the ledger saw most of them running at once
    peak = max((s["num_running"] for s in ledger_history(server) if s["t"] >= t_start), default=0)
    assert peak >= N_CLIENTS // 2, f"peak running {peak}"
