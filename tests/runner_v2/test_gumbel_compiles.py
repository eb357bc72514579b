"""The gumbel kernel's six variants compile for an sm_90 GPU, checked on the CPU: the
differential run of tests/shared/runtime/test_kernels_compile.py launches only the
float32 ones, and dfdd0a1's ALL_GREEDY variant, which the interpreter ran without
complaint, failed there at its first launch (tests/kernel_compile.py says why)."""

from __future__ import annotations

import itertools

from tests.kernel_compile import compile_for_sm90

_KERNEL = "runner_v2.sample.gumbel:_gumbel_sample_kernel"


def _variant(all_greedy: bool, has_threshold: bool, is_fp64: bool) -> dict:
    compute = "fp64" if is_fp64 else "fp32"
    signature = {
        "logits_ptr": "*fp64" if is_fp64 else "*bf16", "logits_stride": "i32",
        "idx_mapping_ptr": "*i32",
        # all-greedy launches pass idx_mapping (int32) as the positions, which stay unread
        "pos_ptr": "*i32" if all_greedy else "*i64",
        "temperature_ptr": "*fp32", "seeds_ptr": "*i64",
        "threshold_ptr": f"*{compute}" if has_threshold else "*fp64",
        "block_max_ptr": "*fp64", "block_arg_ptr": "*i64", "vocab_size": "i32",
        "num_blocks": "i32",
        "BLOCK": "constexpr", "HAS_THRESHOLD": "constexpr", "IS_FP64": "constexpr",
        "ALL_GREEDY": "constexpr",
    }
    constexprs = {"BLOCK": 1024, "HAS_THRESHOLD": has_threshold, "IS_FP64": is_fp64,
                  "ALL_GREEDY": all_greedy}
    return {"kernel": _KERNEL, "signature": signature, "constexprs": constexprs,
            "options": {"enable_fp_fusion": False}}


def test_every_gumbel_variant_compiles_for_sm90(tmp_path) -> None:
    variants = [_variant(*v) for v in itertools.product((True, False), repeat=3)
                if not (v[0] and v[1])]  # a threshold filters random rows only
    assert len(variants) == 6
    assert compile_for_sm90(variants, tmp_path) == []
