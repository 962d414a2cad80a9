"""bench_kvcache's workloads: the multi-turn chat replays each client's history in order, and the
long workload asks for as much as fits."""

from __future__ import annotations

from bench.kvcache_workloads import ChatSpec, LongSpec, chat_workload, long_workload


def test_chat_turns_extend_the_clients_history_and_tenants_share_a_system_prompt() -> None:
    spec = ChatSpec(tenants=4, clients=8, turns=3, system_tokens=40, message_tokens=5)
    workload = chat_workload(spec)
    assert len(workload) == 24 and set(workload.max_tokens) == {16}
    for i in range(8, 24):  # turn k of client c is request k * clients + c (turn-major)
        previous, this = workload.texts[i - 8], workload.texts[i]
        assert this.startswith(previous) and len(this) == len(previous) + 10  # reply + user
    for c in range(8):  # client c belongs to tenant c % 4 (serve_engine's tenant-{i % 4})
        same = workload.texts[c][:39] == workload.texts[(c + 4) % 8][:39]
        other = workload.texts[c][:39] == workload.texts[(c + 1) % 8][:39]
        assert same and not other
    assert len(workload.prompt_ids(0)) == 40 + 5  # BOS + system + the first user message


def test_long_requests_ask_for_everything_the_window_leaves() -> None:
    workload = long_workload(LongSpec(10, 4, (20, 40), (5, 9)), window=256)
    for i in range(10):
        n = len(workload.prompt_ids(i))
        assert 20 <= n <= 40 and workload.sampling(i).max_tokens == 256 - n
        assert 5 <= workload.answers[i] <= 9
