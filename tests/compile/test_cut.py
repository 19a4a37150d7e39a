"""The minimum vertex cut that picks zero bubble's bridge."""

from pipejax.compile.cut import min_vertex_cut


def test_the_cut_is_the_lightest_and_nearest_the_sinks():
    # s -> a -> b -> d and s -> c -> b. To part s from d, b and d (3 each)
    # beat a and c (2 + 2) and d is the nearer the sink; where b is a sink
    # too, b alone; where b weighs 5, a and c.
    arcs = [("s", "a"), ("a", "b"), ("s", "c"), ("c", "b"), ("b", "d")]
    weight = {"s": 9, "a": 2, "c": 2, "b": 3, "d": 3}
    assert min_vertex_cut(arcs, weight, ["s"], ["d"]) == {"d"}
    assert min_vertex_cut(arcs, weight, ["s"], ["b", "d"]) == {"b"}
    assert min_vertex_cut(arcs, {**weight, "b": 5}, ["s"], ["b"]) == {"a", "c"}


def test_a_vertex_both_source_and_sink_is_cut_and_a_free_one_is_not():
    arcs = [("x", "y")]
    assert min_vertex_cut(arcs, {"x": 4, "y": 1}, ["x"], ["x", "y"]) == {"x"}
    assert min_vertex_cut(arcs, {"x": 4, "y": 1}, [], ["y"]) == set()
