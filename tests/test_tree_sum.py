"""The deterministic sum (recover.runtime.tree_sum): the tree's shape, and the reduce over a real
gloo group giving the same bits as one process summing every leaf, for any plan."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from recover.runtime.collective import EpochGroup
from recover.runtime.collective_config import CollectiveConfig
from recover.runtime.tree_sum import TreeSum, decompose, node_ids, ordered_reduce, tree_levels


def _leaves(M: int, numel: int, seed: int = 0) -> list[torch.Tensor]:
    """Leaves whose sum depends on the order of addition: magnitudes spread over 2**-20..2**20."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.pow(2.0, torch.randint(-20, 21, (M, numel), generator=g).float())
    return list(torch.randn(M, numel, generator=g) * scale)


def _root(leaves: list[torch.Tensor], order) -> torch.Tensor:
    tree = TreeSum(len(leaves))
    for j in order:
        tree.add_leaf(j, leaves[j].clone())
    return tree.root()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70), st.data())
def test_any_set_of_ids_splits_into_whole_nodes_covering_it_once(M: int, data) -> None:
    ids = data.draw(st.sets(st.integers(0, M - 1)))
    nodes = decompose(sorted(ids), M)
    covered = [j for node in nodes for j in node_ids(node, M)]
    assert sorted(covered) == sorted(ids)
    assert nodes == decompose(sorted(ids, reverse=True), M)  # the order of the leaves is moot
    if len(ids) == M:
        assert nodes == [(tree_levels(M), 0)]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.integers(1, 5), st.randoms(use_true_random=False))
def test_the_root_is_the_same_bits_in_any_order_of_leaves(M: int, parts: int, rnd) -> None:
    leaves = _leaves(M, 16, seed=M)
    expected = _root(leaves, range(M))
    order = list(range(M))
    rnd.shuffle(order)
    assert _root(leaves, order).numpy().tobytes() == expected.numpy().tobytes()


def test_the_data_is_order_sensitive_so_the_checks_above_can_fail() -> None:
    leaves = _leaves(8, 4096)
    left_fold = leaves[0].clone()
    for leaf in leaves[1:]:
        left_fold += leaf
    assert not torch.equal(left_fold, _root(leaves, range(8)))


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="M must be"):
        TreeSum(0)
    with pytest.raises(ValueError, match="not in 0..3"):
        decompose([4], 4)
    tree = TreeSum(4)
    tree.add_leaf(1, torch.zeros(2))
    with pytest.raises(ValueError, match="added twice"):
        tree.add_leaf(1, torch.zeros(2))
    with pytest.raises(ValueError, match="lacks ids"):
        tree.root()


def _reduce_in_threads(leaves: list[torch.Tensor], plan: list[list[int]]) -> list[torch.Tensor]:
    """ordered_reduce over a real gloo group of len(plan) ranks, one thread each."""
    world = len(plan)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=20),
    )  # fmt: skip
    config = CollectiveConfig(build_timeout_s=10, op_deadline_s=10, pg_timeout_s=20)
    out: list = [None] * world

    def rank(r: int) -> None:
        try:
            group = EpochGroup.build(store, epoch=0, rank=r, world_size=world, config=config)
            tree = TreeSum(len(leaves))
            for j in plan[r]:
                tree.add_leaf(j, leaves[j].clone())
            kept = {node: v.clone() for node, v in tree.nodes.items()}
            out[r] = ordered_reduce(
                group, tree, plan, numel=leaves[0].numel(), should_abort=lambda: None
            )
            assert all(torch.equal(kept[n], v) for n, v in tree.nodes.items())  # untouched
            group.abandon()
        except BaseException as exc:  # re-raised by the test below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(world):
        if isinstance(out[r], BaseException):
            raise out[r]
    return out


@pytest.mark.inprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "plan",
    [
        [[0, 1], [2, 3], [4, 5], [6, 7]],  # each share one node
        [[0, 1, 2], [3, 4, 5], [6, 7]],  # three replicas: several nodes each
        [[0, 1, 5], [2, 3, 4, 6, 7], []],  # after a failure: reassigned ids; one holds none
    ],
)
def test_the_reduce_gives_every_rank_the_one_process_root_bit_for_bit(plan) -> None:
    torch.set_num_threads(1)
    leaves = _leaves(8, 1001)  # 1001: the shards are not all of one length
    expected = _root(leaves, range(8)).numpy().tobytes()
    for got in _reduce_in_threads(leaves, plan):
        assert got.numpy().tobytes() == expected


@pytest.mark.inprocess
@pytest.mark.timeout(60)
def test_a_buffer_shorter_than_the_group_is_padded_and_cut_back() -> None:
    torch.set_num_threads(1)
    leaves = _leaves(4, 3)  # 3 values over 4 ranks: the last rank's shard is all padding
    expected = _root(leaves, range(4)).numpy().tobytes()
    for got in _reduce_in_threads(leaves, [[0], [1], [2], [3]]):
        assert got.numel() == 3 and got.numpy().tobytes() == expected
