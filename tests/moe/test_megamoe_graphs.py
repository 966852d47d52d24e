"""MegaMoE's graphs as plans (hyperparallel.moe.megamoe_graphs): the waves of a rank's experts,
the interleaved order of the exchanges, the sizes of a uniform routing, the tasks of the forward
and backward graphs with their bytes and FLOPs, and the wave count the cost model picks. (That
the graphs compute the sequential layer is tests/dist/test_moe_dispatch.py's.)"""

from __future__ import annotations

import pytest

from hyperparallel.moe import MoEShape, default_waves, plan_graphs
from hyperparallel.moe.megamoe_graphs import interleaved, uniform_layout, wave_ranges
from hyperparallel.multicore import CostModel, simulate


def test_waves_are_contiguous_ranges_differing_by_at_most_one_with_empty_ones_last():
    assert wave_ranges(8, 3) == [(0, 3), (3, 3), (6, 2)]
    assert wave_ranges(4, 4) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert wave_ranges(2, 3) == [(0, 1), (1, 1), (2, 0)]
    assert wave_ranges(5, 1) == [(0, 5)]


def test_the_next_dispatch_is_issued_before_the_last_combine():
    assert interleaved(1) == [("in", 0), ("work", 0), ("out", 0)]
    assert interleaved(3) == [("in", 0), ("work", 0), ("in", 1), ("out", 0), ("work", 1), ("in", 2), ("out", 1),
                              ("work", 2), ("out", 2)]


def test_a_uniform_layout_sends_every_rank_its_share_of_each_wave():
    # 100 tokens x top-2 over 8 experts: 25 rows per expert; 2 ranks of 4 experts, 2 waves of 2
    layout = uniform_layout(100, 2, 8, 2, 2)
    assert layout.waves == [(0, 2), (2, 2)]
    assert layout.send == [[50, 50], [50, 50]] and layout.recv == [[50, 50], [50, 50]]
    assert layout.send_starts() == [0, 100, 200]
    assert layout.expert_rows(1) == [50, 50]
    assert layout.link_rows(0) == 50  # what leaves for (and arrives from) the other rank


SHAPE = MoEShape(tokens=64, hidden=32, intermediate=16, experts=8, top_k=2, shared_intermediate=24)


def test_the_planned_forward_graph_has_five_tasks_a_wave_and_the_shared_experts_first():
    forward, _ = plan_graphs(SHAPE, ep=2, waves=2)
    names = [t.name for t in forward.tasks]
    # the shared experts right after the first dispatch: the compute lane has nothing else until it lands
    assert names == ["dispatch 0", "shared experts", "regroup 0", "experts 0", "unregroup 0", "dispatch 1",
                     "combine 0", "regroup 1", "experts 1", "unregroup 1", "combine 1"]
    by_name = {t.name: t for t in forward.tasks}
    rows = 64  # each wave: 64 of this rank's 128 rows arrive, 32 from each rank
    assert by_name["experts 0"].flops == 6 * rows * 32 * 16
    assert by_name["dispatch 0"].bytes == 32 * 32 * 4  # 32 rows of fp32 [32] cross the link
    assert by_name["shared experts"].flops == 2 * 64 * 3 * 32 * 24
    # the combine of wave 0 waits for its work; the dispatch of wave 1 does not
    assert by_name["combine 0"].deps == {by_name["unregroup 0"].index}
    assert not by_name["dispatch 1"].deps


def test_the_planned_backward_graph_puts_each_wave_s_weight_gradients_one_wave_behind():
    _, backward = plan_graphs(SHAPE, ep=2, waves=2)
    names = [t.name for t in backward.tasks]
    assert names == ["combine grad 0", "shared experts grad", "regroup grad 0", "dgrad 0", "unregroup grad 0",
                     "combine grad 1", "dispatch grad 0", "regroup grad 1", "dgrad 1", "unregroup grad 1", "wgrad 0",
                     "dispatch grad 1", "wgrad 1"]
    by_name = {t.name: t for t in backward.tasks}
    assert by_name["wgrad 0"].deps == {by_name["dgrad 0"].index}  # it may run as soon as dgrad 0 is done


def test_default_waves_is_the_fastest_prediction_and_one_when_communication_is_free():
    free_links = CostModel(matmul_flops=1e9, memory_bytes_per_s=1e12, link_bytes_per_s=1e18, link_latency_s=0.0)
    assert default_waves(SHAPE, 2, free_links) == 1
    slow_links = CostModel(matmul_flops=1e9, memory_bytes_per_s=1e12, link_bytes_per_s=2e7, link_latency_s=1e-6)

    def predicted(waves: int) -> float:
        forward, backward = plan_graphs(SHAPE, 2, waves)
        return simulate(forward, slow_links).overlapped_s + simulate(backward, slow_links).overlapped_s

    times = {waves: predicted(waves) for waves in range(1, 5)}
    chosen = default_waves(SHAPE, 2, slow_links)
    assert chosen > 1 and times[chosen] == pytest.approx(min(times.values()), rel=0.01)
