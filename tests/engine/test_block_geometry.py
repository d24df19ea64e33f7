"""Block geometry (cache/geometry.py): the page size the engine picks, the conflicts it names, the
snapshot interval and the split of a memory budget between KV pages and state snapshots."""
import pytest

from qsaserve.cache.geometry import (KERNEL_TILE_TOKENS, check_state_interval, choose_block_size,
                                     default_state_interval, split_cache_budget)
from qsaserve.errors import InvalidRequestError


@pytest.mark.parametrize("ratio, interleave, expected", [(1, 1, 16), (4, 1, 16), (3, 1, 48), (5, 1, 80), (3, 2, 48),
                                                         (4, 32, 32), (6, 4, 48)])
def test_default_block_size_is_the_least_common_multiple(ratio, interleave, expected):
    geometry = choose_block_size(None, ratio, interleave)
    assert geometry.block_size == expected
    assert geometry.block_size % KERNEL_TILE_TOKENS == 0
    if ratio > 1:
        assert f"compress ratio {ratio}" in geometry.reason


def test_a_requested_block_size_is_kept_when_it_fits_and_need_not_be_a_power_of_two():
    assert choose_block_size(24, 3, 2).block_size == 24
    assert choose_block_size(8, 4).block_size == 8
    assert choose_block_size(3).block_size == 3


def test_conflicts_name_the_parameter_and_a_size_that_fits():
    with pytest.raises(InvalidRequestError, match="compress ratio") as err:
        choose_block_size(16, 3)
    assert err.value.param == "block_size" and "48" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        choose_block_size(12, 3, 8)
    assert err.value.param == "dcp_interleave_size"


def test_state_interval_covers_a_snapshot_with_kv():
    assert default_state_interval(16, snapshot_bytes=1000, bytes_per_block=4096) == 16  # small state: every block
    assert default_state_interval(16, snapshot_bytes=4096, bytes_per_block=4096) == 16
    assert default_state_interval(16, snapshot_bytes=4097, bytes_per_block=4096) == 32
    check_state_interval(48, 16)
    with pytest.raises(InvalidRequestError) as err:
        check_state_interval(40, 16)
    assert err.value.param == "prefix_state_interval"


def test_budget_split_gives_one_snapshot_per_interval_of_kv():
    plain = split_cache_budget(1 << 20, bytes_per_block=4096, block_tokens=16)
    assert plain.num_blocks == 256 and plain.num_snapshots == 0
    split = split_cache_budget(1 << 20, bytes_per_block=4096, block_tokens=16, snapshot_bytes=8192, interval=32)
    assert split.num_snapshots == split.num_blocks * 16 // 32
    used = split.num_blocks * 4096 + split.num_snapshots * 8192
    assert used <= 1 << 20 and (1 << 20) - used < 4096 + 8192
