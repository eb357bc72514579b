"""Test-wide setup. TRITON_INTERPRET must be set before any kernel module is imported,
so it is decided here, at the top, on machines without a CUDA GPU."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per test worker (and per process it starts: TP ranks, CLI
    # runs), as many workers as cores: two workers of two OpenMP threads each on the CI
    # machine's two cores made every small op wait for a descheduled thread.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def pytest_collection_modifyitems(config, items):
    # gpu-marked tests live under tests/gpu/ (mirroring the packages), and only they
    misplaced = [item.nodeid for item in items
                 if (item.get_closest_marker("gpu") is not None) != (GPU_TESTS in item.path.resolve().parents)]
    if misplaced:
        raise pytest.UsageError(
            "gpu-marked tests belong under tests/gpu/ and every test there is gpu-marked; "
            f"misplaced: {', '.join(misplaced[:10])}")
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine via scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def kernel_opts():
    """kernel_opts(pdl=False, ...): this test's KernelOptions (the defaults plus the changes;
    calls stack), installed where the kernel launchers read them, removed after the test."""
    import contextlib

    from shared.runtime.kernel_options import kernel_options, use_kernel_options

    with contextlib.ExitStack() as stack:
        def install(**changes):
            options = kernel_options().model_copy(update=changes)
            return stack.enter_context(use_kernel_options(options))

        yield install


@pytest.fixture
def torch_path(kernel_opts):
    """Force the PyTorch path (the oracle of the fused kernels) whatever the device."""
    kernel_opts(fused_ops=False)
