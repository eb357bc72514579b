"""The persistent layer-stream kernel (shared.model.layer_stream) against the same stack
written with torch's own rms_norm, silu and matmuls in float64.

CPU: one program under the Triton interpreter (programs run one after another there, so
a second program would wait on the first forever), which still walks every phase, every
counter and the cross-phase preload. GPU (`gpu` mark): many resident programs, where the
counters actually order the phases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model import layer_stream


def _stack(layers, hidden, qkv, inter, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return layer_stream.LayerStack(
        w(layers, qkv, hidden, scale=hidden ** -0.5), w(layers, hidden, hidden, scale=0.5 * hidden ** -0.5),
        w(layers, 2 * inter, hidden, scale=hidden ** -0.5), w(layers, hidden, inter, scale=0.5 * inter ** -0.5),
        1 + w(layers, hidden, scale=0.1), 1 + w(layers, hidden, scale=0.1), 1e-5)


def _oracle(stack, x):
    h = x.double()
    for layer in range(stack.layers):
        n1 = F.rms_norm(h, (stack.hidden,), stack.norm1[layer].double(), stack.eps)
        q = (stack.w_qkv[layer].double() @ n1)[:stack.hidden]
        h = h + stack.w_o[layer].double() @ q
        n2 = F.rms_norm(h, (stack.hidden,), stack.norm2[layer].double(), stack.eps)
        gate, up = (stack.w_gu[layer].double() @ n2).split(stack.inter)
        h = h + stack.w_d[layer].double() @ (F.silu(gate) * up)
    return h


def _check(stack, programs, block_n, block_k, num_warps=4, ahead=1):
    x = torch.randn(stack.hidden, generator=torch.Generator().manual_seed(1)).to(stack.h.device)
    stack.h[0] = x
    got = stack.run(programs, block_n, block_k, num_warps, ahead).double().cpu()
    want = _oracle(stack, x).cpu()
    assert stack.error.item() == 0, "a program gave up waiting"
    assert stack.count.eq(programs).all(), stack.count
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # every phase's buffer was written: the stream did not stop early
    assert stack.g.abs().sum(1).gt(0).all() and stack.qkv.abs().sum(1).gt(0).all()


@pytest.mark.parametrize("block_n,block_k,ahead", [(8, 32, 1), (4, 16, 3), (8, 16, 3)])
def test_one_program_matches_torch(block_n, block_k, ahead):
    _check(_stack(2, 64, 96, 128, "cpu"), 1, block_n, block_k, ahead=ahead)


def test_shapes_that_do_not_divide_are_refused():
    stack = _stack(1, 64, 96, 128, "cpu")
    with pytest.raises(ValueError, match="BLOCK_N x programs"):
        stack.run(programs=5, block_n=8, block_k=32)
    with pytest.raises(ValueError, match="BLOCK_K"):
        stack.run(programs=1, block_n=8, block_k=96)
    with pytest.raises(ValueError, match="ahead"):
        stack.run(programs=1, block_n=8, block_k=32, ahead=2)
    with pytest.raises(ValueError, match="unrolled"):  # 64 / 32 = 2 chunks, not 4
        stack.run(programs=1, block_n=8, block_k=32, ahead=3)


@pytest.mark.gpu
@pytest.mark.parametrize("programs,block_n,block_k,num_warps,ahead",
                         [(64, 4, 128, 4, 1), (128, 2, 64, 4, 3), (32, 8, 64, 8, 3)])
def test_resident_programs_match_torch(programs, block_n, block_k, num_warps, ahead):
    # 4 layers of 512 / 768 / 1792: programs x BLOCK_N = 256 divides each
    _check(_stack(4, 512, 768, 1792, "cuda"), programs, block_n, block_k, num_warps, ahead)


@pytest.mark.gpu
def test_too_many_programs_are_refused_before_launch():
    # 512 programs of 1024 threads: an SM holds 2 (2048 threads), so 132 SMs hold 264
    stack = _stack(1, 2048, 3072, 7168, "cuda")
    with pytest.raises(ValueError, match="do not fit at once"):
        stack.run(programs=512, block_n=2, block_k=128, num_warps=32)
