"""polyrl.rollout.gpu.graphs.GraphSets: which captured graphs a place of memory gets back (pure bookkeeping, CPU)."""

from polyrl.rollout.gpu.graphs import GraphSets


def test_two_alternating_places_keep_their_graphs_and_a_third_drops_the_oldest():
    sets = GraphSets(keep=2)
    sets.use((1, 2))
    sets.current["b128"] = "graph at A"
    sets.use((3, 4))
    assert sets.current == {}  # new place: nothing to replay
    sets.current["b128"] = "graph at B"
    for _ in range(3):  # weights that alternate between two places replay each place's own graphs
        sets.use((1, 2))
        assert sets.current == {"b128": "graph at A"}
        sets.use((3, 4))
        assert sets.current == {"b128": "graph at B"}
    assert sets.resets == 0
    sets.use((5, 6))  # a third place drops the set used least recently
    assert sets.resets == 1 and list(sets.sets) == [(3, 4), (5, 6)]
    sets.use((3, 4))  # using a place makes it the newest: the next new place drops (5, 6)
    sets.use((7, 8))
    assert list(sets.sets) == [(3, 4), (7, 8)] and sets.current == {} and sets.resets == 2


def test_get_captures_once_per_key_and_place_and_drain_counts_since_the_last_read():
    sets = GraphSets(keep=1)
    made: list[str] = []

    def capture(name):
        made.append(name)
        return name
    sets.use(("a",))
    assert sets.get(8, lambda: capture("a8")) == "a8" and sets.get(8, lambda: capture("again")) == "a8"
    sets.get(16, lambda: capture("a16"))
    assert made == ["a8", "a16"] and sets.drain() == (2, 0) and sets.drain() == (0, 0)
    sets.use(("b",))  # keep=1: a's set goes
    assert sets.get(8, lambda: capture("b8")) == "b8" and sets.drain() == (1, 1) and sets.captures == 3
