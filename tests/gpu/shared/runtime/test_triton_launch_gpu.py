"""RepeatLaunch on the GPU (GPU machine only): a kept compiled kernel gives what Triton's
JIT dispatch gives, on other tensors of the same kind, and a call specialised otherwise
(an unaligned pointer where the kept kernel assumed alignment) is not sent to it. The
paged-attention plan of a step launches its later layers through kept kernels and
matches a fresh launch per layer bitwise."""

from __future__ import annotations

import pytest
import torch

from policy.kernel_options import KernelOptions
from shared.runtime.kernel_options import use_kernel_options
from shared.runtime.triton_launch import RepeatLaunch
from shared.runtime.triton_utils import tl, triton

pytestmark = pytest.mark.gpu


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def _count_jit_calls(monkeypatch, kernel) -> list:
    calls = []
    run = kernel.run

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    return calls


def test_kept_kernel_equals_the_jit_on_other_tensors(monkeypatch):
    n = 4096
    launch = RepeatLaunch(_scale_kernel, (n // 256,), BLOCK=256)
    calls = _count_jit_calls(monkeypatch, _scale_kernel)
    for _ in range(4):
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        launch(x, y, n, 3.0)
        torch.testing.assert_close(y, x * 3.0, rtol=0, atol=0)
    assert len(calls) == 1  # the later three launched the kept kernel


def test_an_unaligned_pointer_is_not_sent_to_a_kernel_kept_for_aligned_ones(monkeypatch):
    n = 4096
    launch = RepeatLaunch(_scale_kernel, (n // 256,), BLOCK=256)
    calls = _count_jit_calls(monkeypatch, _scale_kernel)
    base = torch.randn(n + 1, device="cuda")
    y = torch.empty(n + 1, device="cuda")
    launch(base[:n], y[:n], n, 2.0)
    launch(base[1:], y[1:], n, 2.0)  # 4 bytes off: a vectorised load would fault
    torch.cuda.synchronize()
    torch.testing.assert_close(y[1:], base[1:] * 2.0, rtol=0, atol=0)
    assert len(calls) == 2


@pytest.mark.parametrize("splits", [1, 4])
def test_a_steps_plan_over_many_layers_equals_a_fresh_launch_per_layer(monkeypatch, splits):
    from shared.attention import unified_attention_kernels
    from shared.attention.triton_unified_attention import PagedAttentionPlan, paged_attention

    torch.manual_seed(0)
    dev, dt, layers = torch.device("cuda"), torch.bfloat16, 4
    T, R, H, Hkv, D, bs, ctx = 16, 8, 16, 8, 128, 16, 300
    lens = [1] * (R - 1) + [T - (R - 1)]  # decode rows and one prefill row: both mappings
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([ctx + q for q in lens], dtype=torch.int32, device=dev)
    blocks = (ctx + T) // bs + 1
    table = torch.randperm(R * blocks, device=dev).to(torch.int32).view(R, blocks)
    caches = [torch.randn(2, R * blocks, bs, Hkv, D, dtype=dt, device=dev) for _ in range(layers)]
    queries = [torch.randn(T, H, D, dtype=dt, device=dev) for _ in range(layers)]
    args = (qsl, seq_lens, table, 0.088)
    with use_kernel_options(KernelOptions(repeat_launches=True)):
        plan = PagedAttentionPlan.build(queries[0], caches[0][0], caches[0][1],
                                        torch.empty_like(queries[0]), *args, True, True, splits)
    calls = _count_jit_calls(monkeypatch, unified_attention_kernels.paged_attention_kernel)
    kept = []
    for q, cache in zip(queries, caches):
        out = torch.zeros_like(q)
        plan.launch(q, cache[0], cache[1], out)
        kept.append(out)
    assert len(calls) == 2  # the first layer's two mappings; the rest were kept kernels
    monkeypatch.undo()
    for q, cache, got in zip(queries, caches, kept):
        ref = torch.zeros_like(q)
        paged_attention(q, cache[0], cache[1], ref, *args, run_single_query=True,
                        run_multi_query=True, num_splits=splits)
        assert torch.equal(got, ref)
