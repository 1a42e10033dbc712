"""Property test: the scheduler and KV cache manager under random arrivals, steps, finishes and aborts.

No model runs: a step's sampled token is drawn from a tiny vocabulary, so prompts and outputs
repeat and share prefixes. After every schedule: ``check_integrity()`` holds, the token budget
and ``max_num_seqs`` hold, every scheduled token has a slot, and a request admitted while
another running request holds cached blocks of the same prefix hits them. At the end every
block is free with a zero reference count, and a repeated prompt hits its cached prefix.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.kvcache.block_pool import BlockPool
from kvledger.config import EngineConfig
from kvledger.kvcache.groups import first_live_block, kv_cache_groups
from kvledger.kvcache.manager import KVCacheManager
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.scheduler import Scheduler
from kvledger.engine.sequence import Request


class Sim:
    def __init__(self, data, block_size, num_blocks, budget, max_num_seqs, caching, groups=None):
        self.data = data
        self.bs = block_size
        self.pool = BlockPool(num_blocks, caching)
        self.kv = KVCacheManager(self.pool, block_size, groups)
        self.sched = Scheduler(EngineConfig(block_size=block_size, max_num_batched_tokens=budget,
                                            max_num_seqs=max_num_seqs, enable_prefix_caching=caching), self.kv)
        self.budget, self.max_num_seqs, self.caching = budget, max_num_seqs, caching
        self.live: dict[str, Request] = {}
        self.n = 0
        self.hits_expected = 0

    def arrive(self, prompt, max_tokens):
        request = Request(f"r{self.n}", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), self.n)
        self.n += 1
        self.live[request.request_id] = request
        self.sched.add(request)
        return request

    def _cached_prefix_tokens(self, new: Request, snapshot) -> int:
        """Tokens of ``new`` that running requests held in cached blocks before this schedule."""
        best = 0
        limit = new.num_tokens - 1
        for tokens, table in snapshot:
            common = 0
            for a, b in zip(tokens, new.all_token_ids[:limit]):
                if a != b:
                    break
                common += 1
            n = 0
            while (n < len(table) and self.pool.blocks[table[n]].block_hash is not None
                   and (n + 1) * self.bs <= common):
                n += 1
            best = max(best, n * self.bs)
        return best

    def step(self):
        snapshot = [(r.all_token_ids[:r.num_computed_tokens], list(self.kv.block_tables.get(r.request_id, [])))
                    for r in self.sched.running]
        running_before = {id(r) for r in self.sched.running}
        out = self.sched.schedule()
        self.kv.check_integrity()
        assert out.num_tokens <= self.budget
        assert len(self.sched.running) <= self.max_num_seqs
        for s in out.scheduled:
            table = self.kv.block_tables[s.request.request_id]
            assert len(table) * self.bs >= s.request.num_computed_tokens + s.num_new_tokens
            assert s.num_new_tokens >= 1
            if self.caching and not out.preempted and id(s.request) not in running_before and not self.kv.hybrid:
                expected = self._cached_prefix_tokens(s.request, snapshot)
                assert s.request.num_computed_tokens >= expected, (s.request.num_computed_tokens, expected)
                self.hits_expected += expected
        self.sched.update(out)
        for s in out.scheduled:
            r = s.request
            for g, group in enumerate(self.kv.groups):  # a sliding group holds only what its window needs
                first = first_live_block(r.num_computed_tokens, group.sliding_window, self.bs)
                assert self.kv._first_live[g].get(r.request_id, 0) == (first if group.sliding_window else 0)
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(self.data.draw(st.integers(0, 2), label="token"))
                if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                    self.sched.finish(r, "length")
                    del self.live[r.request_id]
        self.kv.check_integrity()
        return out

    def drain(self, max_steps):
        """Step until every request finished (within ``max_steps``: nothing hangs); then every
        block is free with a zero count and no table of any group remains."""
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished()
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)
        assert all(tables == {} for tables in self.kv.group_tables)
        self.kv.check_integrity()

    def abort(self, index):
        if self.live:
            rid = sorted(self.live)[index % len(self.live)]
            self.sched.finish(self.live.pop(rid), "abort")
            self.kv.check_integrity()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_traffic_keeps_the_pool_consistent(data):
    bs = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    num_blocks = data.draw(st.integers(3, 40), label="num_blocks")
    capacity = bs * num_blocks
    sim = Sim(data, bs, num_blocks, budget=data.draw(st.integers(1, 64), label="budget"),
              max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"),
              caching=data.draw(st.booleans(), label="caching"))
    prefixes = [data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=max(1, capacity // 2)), label="prefix")
                for _ in range(2)]
    for _ in range(data.draw(st.integers(1, 80), label="events")):
        action = data.draw(st.sampled_from(["arrive", "step", "step", "step", "abort"]), label="action")
        if action == "arrive":
            prefix = prefixes[data.draw(st.integers(0, 1))]
            prompt = prefix + data.draw(st.lists(st.integers(0, 3), max_size=8))
            prompt = prompt[:capacity - 1]
            max_tokens = data.draw(st.integers(1, capacity - len(prompt)))
            sim.arrive(prompt, max_tokens)
        elif action == "abort":
            sim.abort(data.draw(st.integers(0, 100)))
        else:
            sim.step()
    sim.drain(10 * capacity + 100)

    # a prompt seen again hits every full block of its cached prefix
    prompt = prefixes[0] + [3] * (bs + 1)
    prompt = prompt[:capacity - 1]
    first = sim.arrive(prompt, 1)
    while sim.sched.has_unfinished():
        sim.step()
    second = sim.arrive(prompt, 1)
    sim.step()
    expected = (len(prompt) - 1) // bs * bs if sim.caching else 0
    assert second.num_cached_tokens == expected
    assert first.num_cached_tokens <= expected
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.pool.num_free_blocks == num_blocks


def test_preemption_by_recompute_resumes_with_the_same_tokens():
    """Two requests that cannot both fit: the later one is preempted, recomputed, and finishes."""
    class Data:
        def draw(self, strategy, label=None):
            return 1

    sim = Sim(Data(), block_size=2, num_blocks=4, budget=16, max_num_seqs=4, caching=True)
    a = sim.arrive([0, 1, 2], 5)
    b = sim.arrive([0, 1, 3], 5)
    preempted = 0
    while sim.sched.has_unfinished():
        preempted += len(sim.step().preempted)
    assert preempted >= 1 and b.num_preemptions >= 1
    assert a.output_token_ids == [1] * 5 and b.output_token_ids == [1] * 5
    assert sim.pool.num_free_blocks == 4


def _best_hybrid_hit(kv, request) -> int:
    """The oracle for a hybrid prefix hit: the most whole blocks (leaving one token to compute)
    for which every full group has every block cached and every sliding group the blocks its
    window needs, checked one length at a time."""
    bs = kv.block_size
    hashes = kv._block_hashes(request, (request.num_tokens - 1) // bs)
    for n in range(len(hashes), -1, -1):
        if all(kv.pool.lookup(kv._key(hashes[i], g)) is not None
               for g, group in enumerate(kv.groups)
               for i in range(first_live_block(n * bs, group.sliding_window, bs), n)):
            return n * bs
    return 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_traffic_keeps_a_hybrid_pool_consistent(data):
    """The same traffic over KV-cache groups (full and sliding-window layers in one pool): every
    table consistent, sliding groups holding only their window, every block free at the end, and
    a repeated prompt hitting exactly what the groups' cached blocks allow."""
    bs = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    pattern = data.draw(st.sampled_from([("s", "s", "f"), ("s", "f"), ("s", "s", "s", "s", "s", "f")]), label="layers")
    layer_types = ["full_attention" if t == "f" else "sliding_attention" for t in pattern * 2]
    window = data.draw(st.integers(1, 3 * bs + 2), label="window")
    groups = kv_cache_groups(layer_types, window)
    num_blocks = data.draw(st.integers(3 * len(groups), 40 * len(groups)), label="num_blocks")
    capacity = bs * (num_blocks // len(groups))  # a request that holds every block in every group fits
    caching = data.draw(st.booleans(), label="caching")
    sim = Sim(data, bs, num_blocks, budget=data.draw(st.integers(1, 64), label="budget"),
              max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"), caching=caching, groups=groups)
    prefixes = [data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=max(1, capacity // 2)), label="prefix")
                for _ in range(2)]
    for _ in range(data.draw(st.integers(1, 80), label="events")):
        action = data.draw(st.sampled_from(["arrive", "step", "step", "step", "abort"]), label="action")
        if action == "arrive":
            prompt = (prefixes[data.draw(st.integers(0, 1))] + data.draw(st.lists(st.integers(0, 3), max_size=8)))
            prompt = prompt[:capacity - 1]
            sim.arrive(prompt, data.draw(st.integers(1, capacity - len(prompt))))
        elif action == "abort":
            sim.abort(data.draw(st.integers(0, 100)))
        else:
            sim.step()
    sim.drain(10 * capacity + 100)

    prompt = (prefixes[0] + [3] * (bs + 1))[:capacity - 1]
    sim.arrive(prompt, 1)
    while sim.sched.has_unfinished():
        sim.step()
    second = sim.arrive(prompt, 1)
    expected = _best_hybrid_hit(sim.kv, second) if caching else 0
    sim.step()
    assert second.num_cached_tokens == expected
    while sim.sched.has_unfinished():
        sim.step()
    assert sim.pool.num_free_blocks == num_blocks
