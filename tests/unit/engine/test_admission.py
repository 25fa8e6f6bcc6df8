"""AdmissionQueue: per-client FIFO queues taken round robin, the limits and `Overloaded`;
`fair_quotas`: the max-min fair split of the batch."""

from __future__ import annotations

import random

import pytest

from avspec.engine.admission import AdmissionQueue, Overloaded, fair_quotas


def fill(queue: AdmissionQueue[str], counts: dict[str, int]) -> None:
    """Queue counts[c] items "c0", "c1", ... for each client c, client by client."""
    for client, n in counts.items():
        for i in range(n):
            queue.add(client, f"{client}{i}", free_slots=0)


def test_pop_is_round_robin_over_clients_fifo_within() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    fill(queue, {"A": 4, "B": 2, "": 1})  # "" (anonymous) is one client like any other
    assert [queue.pop(1) for _ in range(8)] == [
        ["A0"], ["B0"], ["0"], ["A1"], ["B1"], ["A2"], ["A3"], []
    ]  # fmt: skip
    assert not queue and len(queue) == 0 and queue.by_client() == {}


def test_pop_many_continues_the_rotation() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    fill(queue, {"A": 3, "B": 1, "C": 2})
    assert queue.pop(4) == ["A0", "B0", "C0", "A1"]
    assert queue.by_client() == {"C": 1, "A": 1}  # C is next: A went to the back
    assert queue.pop(10) == ["C1", "A2"]


def test_a_late_client_waits_at_most_one_round() -> None:
    """A head request is admitted within C admissions, C = clients with queued work then."""
    queue: AdmissionQueue[str] = AdmissionQueue()
    fill(queue, {"A": 640})
    queue.add("B", "B0", free_slots=0)
    assert queue.pop(2) == ["A0", "B0"]
    queue.add("C", "C0", free_slots=0)  # arrives later: queues behind A's turn
    assert queue.pop(2) == ["A1", "C0"]


def test_counts_and_iteration() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    assert not queue and list(queue) == []
    fill(queue, {"A": 2, "B": 1})
    assert queue and len(queue) == 3
    assert queue.by_client() == {"A": 2, "B": 1}
    assert list(queue) == ["A0", "A1", "B0"]


def test_remove() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    fill(queue, {"A": 2, "B": 1})
    assert queue.remove("A", "A1")
    assert not queue.remove("A", "A1")  # no longer there
    assert not queue.remove("B", "A0")  # not that client's
    assert not queue.remove("Z", "A0")  # unknown client
    assert queue.remove("B", "B0")
    assert queue.by_client() == {"A": 1}  # a client with nothing left leaves the rotation
    assert queue.pop(5) == ["A0"]


def test_limits_count_only_requests_beyond_the_free_slots() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_queued=3, max_queued_per_client=2)
    for i in range(4):
        queue.add("A", f"A{i}", free_slots=2)  # two of them fill free slots
    with pytest.raises(Overloaded, match=r"^overloaded: 2 requests queued for this client "
                       r"\(limit 2\); retry later$"):  # fmt: skip
        queue.add("A", "A4", free_slots=2)
    queue.add("B", "B0", free_slots=2)
    with pytest.raises(Overloaded, match=r"^overloaded: 3 requests queued \(limit 3\); retry"):
        queue.add("C", "C0", free_slots=2)
    assert queue.by_client() == {"A": 4, "B": 1}  # nothing queued by a refusal
    queue.add("C", "C0", free_slots=3)  # one more free slot: room again
    with pytest.raises(Overloaded, match="6 requests queued"):
        queue.add("D", "D0", free_slots=-5)  # an overfull batch gives no room, takes none


def test_unbounded_by_default() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    fill(queue, {"A": 1000})
    assert len(queue) == 1000


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_queued": 0}, "max_queued must be >= 1 or None, got 0"),
        ({"max_queued_per_client": -1}, "max_queued_per_client must be >= 1 or None, got -1"),
    ],
)
def test_limit_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdmissionQueue(**kwargs)


def test_pop_may_take_skips_a_client_without_losing_its_turn() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    fill(queue, {"A": 3, "B": 2, "C": 1})
    assert queue.pop(3, lambda client, item: client != "A") == ["B0", "C0", "B1"]
    assert queue.by_client() == {"A": 3}  # passed over, still first in the rotation
    assert queue.pop(5, lambda client, item: item != "A1") == ["A0"]  # A1 at the head: stop
    assert queue.pop(5) == ["A1", "A2"]


def test_push_front_puts_an_item_back_at_the_head() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_queued_per_client=1)
    fill(queue, {"A": 1, "B": 1})
    queue.push_front("A", "paused")  # past the per-client limit: it was admitted once
    queue.push_front("C", "C-paused")  # a client without a queue joins the rotation's end
    assert list(queue) == ["paused", "A0", "B0", "C-paused"]
    assert queue.pop(4) == ["paused", "B0", "C-paused", "A0"]


@pytest.mark.parametrize(
    ("demand", "slots", "holding", "quotas"),
    [
        ({"A": 64, "B": 1}, 64, {"A": 64}, {"A": 63, "B": 1}),  # B gets what it asks
        ({"A": 64, "B": 64}, 64, {"A": 64}, {"A": 32, "B": 32}),
        ({"A": 64, "B": 64, "C": 64}, 64, {"B": 30}, {"A": 21, "B": 22, "C": 21}),  # remainder
        ({"A": 40, "B": 24, "C": 1}, 64, {"A": 40, "B": 24}, {"A": 39, "B": 24, "C": 1}),
        ({"A": 3, "B": 2}, 64, {}, {"A": 3, "B": 2}),  # everyone fits: quota = demand
        ({"A": 5, "B": 0}, 4, {}, {"A": 4}),  # no demand, no quota
        ({"A": 9, "B": 9}, 0, {}, {"A": 0, "B": 0}),
    ],
)
def test_fair_quotas_water_fill(
    demand: dict[str, int], slots: int, holding: dict[str, int], quotas: dict[str, int]
) -> None:
    got = fair_quotas(demand, slots, holding)
    assert got == quotas
    assert sum(got.values()) == min(slots, sum(demand.values()))


def test_fair_quotas_guarantee_an_equal_share_or_the_demand() -> None:
    """Over random demands: every client gets min(demand, floor(slots / clients)) at least,
    no client more than it asks, and the quotas use min(slots, total demand)."""
    rng = random.Random(7)
    for _ in range(500):
        clients = [f"c{i}" for i in range(rng.randint(1, 9))]
        demand = {c: rng.randint(1, 80) for c in clients}
        slots = rng.randint(0, 70)
        holding = {c: rng.randint(0, 10) for c in clients}
        quotas = fair_quotas(demand, slots, holding)
        assert sum(quotas.values()) == min(slots, sum(demand.values()))
        for c in clients:
            assert min(demand[c], slots // len(clients)) <= quotas[c] <= demand[c]


def test_fair_quotas_refuse_negative_slots() -> None:
    with pytest.raises(ValueError, match="slots must be >= 0"):
        fair_quotas({"A": 1}, -1)
