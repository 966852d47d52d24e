"""The device mesh's groups as a pure function of its shape (parallel/mesh.py): which ranks form
which group, rank by rank, without spawning. tests/dist/test_parallel_layouts.py checks that the
groups torch makes on 4 ranks are these."""

from __future__ import annotations

from hyperparallel.parallel.mesh import MeshShape, describe_groups


def test_hsdp_2x2_shards_within_consecutive_ranks_and_replicates_across():
    groups = MeshShape(2, 1, 1, dp_replicate=2).groups()
    assert groups["fsdp"] == [[0, 1], [2, 3]]
    assert groups["dp_replicate"] == [[0, 2], [1, 3]]
    assert groups["tp"] == groups["cp"] == [[0], [1], [2], [3]]


def test_tp_innermost_then_cp_then_dp_shard_then_dp_replicate():
    shape = MeshShape(dp_shard=2, cp=1, tp=2, ep=2, dp_replicate=2)
    groups = shape.groups()
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["fsdp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # within a replica, one tp coordinate
    assert groups["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # EP borrows dp_shard x cp within a replica; an expert's shards are replicated over the same
    # ranks as every other shard (the experts mesh's dp_replicate groups are the mesh's)
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["expert_shard"] == [[r] for r in range(8)]
    assert [shape.coordinates(r) for r in (0, 5)] == [{"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0},
                                                      {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}]


def test_every_rank_is_in_one_group_of_each_kind():
    shape = MeshShape(dp_shard=4, cp=2, tp=2, ep=4, dp_replicate=3)
    for name, groups in shape.groups().items():
        assert sorted(r for g in groups for r in g) == list(range(shape.world)), name


def test_the_summary_names_hsdps_groups_and_shard_groups_that_span_machines():
    # 64 GPUs, 8 machines of 8: shard within a machine, replicate across
    lines = describe_groups(MeshShape(8, 1, 1, dp_replicate=8), local_world=8)
    assert lines == ["HSDP: 8 replicas x FSDP over 8 rank(s); shard groups [0, 1, 2, 3, 4, 5, 6, 7] "
                     "[8, 9, 10, 11, 12, 13, 14, 15] [16, 17, 18, 19, 20, 21, 22, 23] [24, 25, 26, 27, 28, 29, 30, 31] "
                     "... (8 in all); replica groups [0, 8, 16, 24, 32, 40, 48, 56] [1, 9, 17, 25, 33, 41, 49, 57] "
                     "[2, 10, 18, 26, 34, 42, 50, 58] [3, 11, 19, 27, 35, 43, 51, 59] ... (8 in all)"]
    # FSDP over all 16 ranks of 2 machines: every all-gather crosses machines
    [line] = describe_groups(MeshShape(16, 1, 1), local_world=8)
    assert line.startswith("FSDP shard groups span 2 machines (8 ranks on each)") and "dp_replicate" in line
    assert describe_groups(MeshShape(4, 1, 1), local_world=None) == []


def test_without_expert_parallelism_the_fsdp_group_shards_the_experts_and_each_rank_splits_them_alone():
    groups = MeshShape(dp_shard=2, tp=2).groups()
    assert groups["expert_shard"] == groups["fsdp"] == [[0, 2], [1, 3]]
    assert groups["ep"] == [[0], [1], [2], [3]]


def test_a_layout_naming_no_dimension_is_ddp_over_the_ranks():
    class Parallel:  # (the trainer's parallel: section, every setting 1)
        dp_replicate = dp_shard = cp = tp = ep = 1

    ddp = MeshShape.of(Parallel, 4)
    assert (ddp.ddp, ddp.dp_replicate, ddp.world, ddp.fsdp_enabled, ddp.dp_size) == (True, 4, 4, False, 4)
    one = MeshShape.of(Parallel, 1)
    assert (one.ddp, one.world, one.fsdp_enabled) == (False, 1, False)
    assert [ddp.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]
