"""The CPU paths of step 5 (PYMLA_CPU_PATH): detection, forcing, and the odd sizes their blocking must handle.

The parity grid (tests/test_op_parity.py) runs on every path this machine
has; here: sizes that leave tails in every register block of the bf16 path
(kv_lora_rank not a multiple of 32, key_dim not a multiple of 32, head and
token counts that leave partial row blocks), and the error for a path the
CPU lacks or a misspelt one.
"""

from __future__ import annotations

import pytest
import torch

from pymla.cpu_paths import PATHS, available_cpu_paths, cpu_flags, cpu_model

from helpers import TARGETS, check_parity, make_case, on_target, run_op_poisoned

CPU_TARGETS = [t for t in TARGETS if t.startswith("cpu")]

ZEN4_LIKE = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
NO_AVX512 = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu sse avx2 fma
"""


def test_paths_from_cpuinfo():
    assert available_cpu_paths(ZEN4_LIKE) == ("f32", "avx512bf16")
    assert available_cpu_paths(NO_AVX512) == ("f32",)
    assert available_cpu_paths("") == ("f32",)
    assert cpu_model(ZEN4_LIKE) == "AMD EPYC 9R14"
    assert "avx512_bf16" in cpu_flags(ZEN4_LIKE)
    assert set(available_cpu_paths()) <= set(PATHS)


@pytest.mark.parametrize("target", CPU_TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sizes_with_tails(dtype, target):
    """rank 100 (3 x 32 + 4), key_dim 114 (3 x 32 + 18), 5 heads x uneven tokens, 40-odd keys."""
    check_parity(
        make_case(
            4101,
            dtype=dtype,
            kv_lora_rank=100,
            nope_dim=48,
            rope_dim=14,
            v_head_dim=40,
            num_heads=5,
            page_size=16,
            cache_lengths=(37, 0, 70),
            new_tokens=(3, 1, 2),
            granularity=(1, 32, 32),
        ),
        target,
    )


@pytest.mark.parametrize("path", ["avx512bf16", "no-such-path"])
def test_unavailable_or_unknown_path_raises(path):
    if path in available_cpu_paths():
        pytest.skip(f"this CPU has {path}")
    case = make_case(4102, num_heads=2)
    with on_target(f"cpu:{path}"), pytest.raises(Exception, match="PYMLA_CPU_PATH"):
        run_op_poisoned(case)
