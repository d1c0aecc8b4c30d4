"""What the native build reports about itself."""

import hytrain


def test_build_info_fields():
    info = hytrain.build_info()
    assert info["version"] == hytrain.__version__
    assert "scalar" in info["simd_compiled"]
    assert info["simd_selected"] in info["simd_compiled"]
    assert info["openmp"] is None or info["openmp"] >= 201307
    if info["cuda"] is not None:
        assert info["cuda_architectures"]  # e.g. "80,90"
    else:
        assert info["cuda_architectures"] is None


def test_cuda_available_is_a_bool_and_consistent():
    avail = hytrain.cuda_available()
    assert isinstance(avail, bool)
    if not avail:
        assert hytrain.build_info()["cuda_devices"] == []


def test_host_bandwidth_probe_measures_something():
    r = hytrain.native().measure_host_bandwidth(1 << 20, 1, 2)
    assert r["copy_gbps"] > 0.1 and r["triad_gbps"] > 0.1
