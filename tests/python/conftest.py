import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # Decided at run time, not at import: collecting the tests never touches a GPU.
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    have_gpu = None
    for item in items:
        if "gpu" in item.keywords:
            if have_gpu is None:
                import hytrain

                have_gpu = hytrain.cuda_available() and torch.cuda.is_available()
            if not have_gpu:
                item.add_marker(skip_gpu)
