"""hytrain.host_rate: the host's update rate that `hytrain info`, cpu_adam.py and scale_bench report
as the floor beside each run."""

from hytrain import host_rate


def test_the_update_rate_is_measured_at_the_sizes_the_benchmarks_use():
    # 70 M parameters: each fp32 buffer takes a slab of its own and the bf16 ones share a 256 MiB
    # slab with room left over, which the pool's capacity must allow for (it once refused the last
    # buffer by 1.3 MB at scale_bench's 100 M).
    seconds = host_rate.update_seconds(70_000_000, passes=1, threads=2)
    assert 0 < seconds < 60
