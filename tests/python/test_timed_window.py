"""bench/timed_window.py: the figures every benchmark reports for its timed window, against values
worked out by hand."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timed_window import thread_cpu, thread_cpu_figures, window_figures  # noqa: E402


def test_a_window_with_one_slow_iteration():
    times = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    f = window_figures(times, tokens_per_iteration=4096)
    assert f["iter_s_median"] == 1.0 and f["iter_s_max"] == 3.0
    assert f["iter_s_p90"] == 1.0  # nearest rank: the 9th of 10
    assert f["iter_s_mean"] == pytest.approx(1.2) and f["mean_over_median"] == pytest.approx(1.2)
    assert f["window_s"] == pytest.approx(12.0) and f["window_iterations"] == 10
    assert f["wall_tokens_per_s"] == pytest.approx(4096 * 10 / 12.0)  # not 4096 / median


def test_p90_by_nearest_rank_and_no_tokens():
    f = window_figures([0.5, 2.0, 1.0, 4.0, 3.0])  # sorted: 0.5 1 2 3 4; ceil(4.5) = 5th
    assert f["iter_s_p90"] == 4.0 and f["iter_s_median"] == 2.0 and f["p90_over_median"] == 2.0
    assert "wall_tokens_per_s" not in f
    assert window_figures([]) == {}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_thread_cpu_finds_a_busy_thread_by_name():
    import ctypes
    import threading
    import time

    libc = ctypes.CDLL(None)
    stop = threading.Event()

    def spin():
        libc.pthread_setname_np(ctypes.c_ulong(threading.get_ident()), b"busy-spinner")
        while not stop.is_set():
            pass

    before = thread_cpu()
    t0 = time.perf_counter()
    worker = threading.Thread(target=spin)
    worker.start()
    time.sleep(0.6)
    after = thread_cpu()
    stop.set()
    worker.join()
    f = thread_cpu_figures(before, after, time.perf_counter() - t0)
    # The spinner holds the GIL most of the time; it and the main thread share one core between them.
    assert "busy-spinner" in f and f["busy-spinner"]["threads"] == 1, f
    assert 0.2 < f["busy-spinner"]["cores"] + f.get("main", {}).get("cores", 0.0) < 1.3, f
    assert thread_cpu_figures(before, after, 0.0) == {}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_counters_see_the_page_faults_and_cpu_of_what_ran_between_two_readings():
    import ctypes
    import mmap
    import threading

    from timed_window import counter_deltas, counters

    def worker(stop):  # named as the update workers are (the kernel's name for the thread)
        ctypes.CDLL(None).prctl(15, b"hytrain-update", 0, 0, 0)  # PR_SET_NAME
        while not stop.is_set():
            sum(range(1000))

    stop = threading.Event()
    t = threading.Thread(target=worker, args=(stop,))
    t.start()
    try:
        before = counters()
        touched = mmap.mmap(-1, 64 << 20)  # 64 MiB of fresh anonymous pages, each written once
        for i in range(0, len(touched), 4096):
            touched[i] = 1
        touched.close()
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            pass
        after = counters()
    finally:
        stop.set()
        t.join()
    (delta,) = counter_deltas([before, after])
    assert delta["minflt"] >= 16  # 16384 small pages, or 32 huge ones where the kernel gives those
    assert 0 < delta["workers_cpu_s"] <= 1.0
    assert delta["steal_s"] >= 0 and delta["majflt"] >= 0
