"""The CPU paths of step 5 (PYMLA_CPU_PATH): what the compiled kernel has, forcing, and odd sizes.

The parity grid (tests/test_op_parity.py) runs on every path the compiled
kernel has; here: the compile target's choice where LLVM misnames the host
(an Intel Xeon guest taken for rocketlake), the paths read from the compiled
kernel against the target's features, a refused PYMLA_CPU_PATH that leaves
everything as it was, and sizes that leave tails in every register block of
the bf16 path (kv_lora_rank not a multiple of 32, key_dim not a multiple of
32, head and token counts that leave partial row blocks), and the AMX path's
tile layouts on any CPU (tests/cpu/amx_check.mojo, with the tile
instructions emulated; on the unit too where the CPU has AMX).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pymla import cpu_paths
from pymla.cpu_paths import (
    CANDIDATE_TARGETS,
    PATH_FEATURES,
    PATHS,
    choose_cpu_target,
    compile_target_name,
    cpu_flags,
    cpu_model,
    cpu_signature,
    kernel_cpu_paths,
    llvm_target,
    missing_codegen_features,
    resolve_cpu_path,
)
from pymla.graph import mojo_binary

from helpers import TARGETS, check_parity, make_case

CPU_TARGETS = [t for t in TARGETS if t.startswith("cpu")]

ZEN4_LIKE = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
# The flags of a Sapphire Rapids guest as KVM shows them (no waitpkg, uintr, tsxldtrk, ...).
SPR_GUEST_CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pdcm pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch cpuid_fault ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq la57 rdpid cldemote movdiri movdir64b fsrm md_clear serialize amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities
"""
SPR_GUEST_FLAGS = cpu_flags(SPR_GUEST_CPUINFO)
COOPERLAKE_LIKE_FLAGS = (SPR_GUEST_FLAGS - {"amx_bf16", "amx_tile", "amx_int8", "avx512_fp16"}) - {
    "avx_vnni", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "gfni", "vaes", "vpclmulqdq",
    "avx512_bitalg", "avx512_vpopcntdq", "sha_ni",
}  # fmt: skip


def test_cpuinfo_parsing():
    assert cpu_model(ZEN4_LIKE) == "AMD EPYC 9R14"
    assert "avx512_bf16" in cpu_flags(ZEN4_LIKE)
    assert cpu_flags("") == set()


def test_cpu_signature_tells_apart_cpus_of_one_model_name():
    """Zen 3 and Zen 4 guests both report "AMD EPYC"; the signature names the family, model, stepping
    and the bf16 units the CPU paths use."""
    zen3 = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: avx2 fma\n"
    zen4 = zen3.replace("model\t\t: 1\n", "model\t\t: 17\n").replace("avx2 fma", "avx2 avx512_bf16")
    assert cpu_model(zen3) == cpu_model(zen4) == "AMD EPYC"
    assert cpu_signature(zen3) == "family 25 model 1 stepping 1, no bf16 unit"
    assert cpu_signature(zen4) == "family 25 model 17 stepping 1, avx512_bf16"
    spr = "cpu family\t: 6\nmodel\t\t: 143\nstepping\t: 8\n" + SPR_GUEST_CPUINFO
    assert cpu_signature(spr) == "family 6 model 143 stepping 8, avx512_bf16, amx_bf16, amx_tile"
    assert cpu_signature("") == "unknown, no bf16 unit"


def test_a_guest_taken_for_rocketlake_compiles_for_sapphirerapids():
    """The Intel guest of issue 20: LLVM names the host rocketlake, without AVX512-BF16 or AMX."""
    candidates = {c: llvm_target(c)[1] for c in CANDIDATE_TARGETS}
    rocketlake = llvm_target("rocketlake")[1]
    assert "avx512bf16" not in rocketlake and "amx-bf16" not in rocketlake
    assert not missing_codegen_features(candidates["sapphirerapids"], SPR_GUEST_FLAGS)
    assert choose_cpu_target(rocketlake, SPR_GUEST_FLAGS, candidates) == "sapphirerapids"
    # Without AMX the guest gets the AVX512-BF16 CPU, never one whose features it lacks.
    assert choose_cpu_target(rocketlake, COOPERLAKE_LIKE_FLAGS, candidates) == "cooperlake"
    assert "avx512fp16" in missing_codegen_features(
        candidates["sapphirerapids"], COOPERLAKE_LIKE_FLAGS
    )
    # A host LLVM names right keeps the host's target; a CPU without the features too.
    assert choose_cpu_target(llvm_target("sapphirerapids")[1], SPR_GUEST_FLAGS, candidates) == ""
    assert choose_cpu_target(llvm_target("znver4")[1], cpu_flags(ZEN4_LIKE), candidates) == ""
    assert choose_cpu_target(rocketlake, {"avx2", "fma"}, candidates) == ""


def test_paths_come_from_the_compiled_kernel():
    """The probe kernel's features are those of the LLVM CPU the op is compiled for."""
    target_features = llvm_target(compile_target_name())[1]
    expected = tuple(p for p in PATHS if set(PATH_FEATURES[p]) <= target_features)
    assert kernel_cpu_paths() == expected
    assert kernel_cpu_paths()[0] == "f32"
    assert resolve_cpu_path("auto", torch.bfloat16) == expected[-1]
    assert resolve_cpu_path(None, torch.float16) == "f32"
    assert resolve_cpu_path("f32", torch.bfloat16) == "f32"


def test_a_target_without_the_unit_has_only_f32():
    """PYMLA_CPU_TARGET=rocketlake compiles as on the misnamed guest: forcing avx512bf16 is refused."""
    code = (
        "import os, torch\n"
        "from pymla import cpu_paths\n"
        "assert cpu_paths.kernel_cpu_paths() == ('f32',), cpu_paths.kernel_cpu_paths()\n"
        "assert cpu_paths.resolve_cpu_path('auto', torch.bfloat16) == 'f32'\n"
        "os.environ['PYMLA_CPU_PATH'] = 'avx512bf16'\n"
        "try:\n"
        "    cpu_paths.check_cpu_path()\n"
        "except ValueError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('not refused')\n"
    )
    env = {**os.environ, "PYMLA_CPU_TARGET": "rocketlake"}
    env.pop("PYMLA_CPU_PATH", None)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "PYMLA_CPU_PATH: expected a path the compiled kernel has (f32; compiled for rocketlake)"
        in (result.stdout)
    )


@pytest.mark.parametrize("value", ["bogus", "AVX512BF16", "avx512bf16", "amx"])
def test_refused_path_leaves_everything_as_it_was(value, monkeypatch):
    """Refused in Python before any kernel runs: cache bytes and outputs untouched."""
    if value in kernel_cpu_paths():
        pytest.skip(f"the compiled kernel has {value}")
    case = make_case(4102, num_heads=2)
    blocks = case.cache.blocks.clone()
    lengths, table = case.cache.cache_lengths.clone(), case.cache.lookup_table.clone()
    out = torch.full((case.q.shape[0], 2, 128), float("nan"), dtype=case.q.dtype)
    monkeypatch.setattr(cpu_paths, "_checked_request", None)
    monkeypatch.setenv("PYMLA_CPU_PATH", value)
    with pytest.raises(ValueError, match=r"^PYMLA_CPU_PATH: expected .*got '" + value):
        import pymla

        pymla.mla_decode_branch_fp8(*case.args(), **case.options, out=out)
    assert torch.equal(case.cache.blocks.view(torch.uint8), blocks.view(torch.uint8))
    assert torch.equal(case.cache.cache_lengths, lengths)
    assert torch.equal(case.cache.lookup_table, table)
    assert torch.isnan(out).all()
    monkeypatch.setenv("PYMLA_CPU_PATH", "f32")  # the retry is a clean call
    check_parity(case, "cpu:f32")


@pytest.mark.parametrize("target", CPU_TARGETS)
def test_projections_on_a_full_tile_of_tokens(target):
    """17 new tokens: where the path is amx, steps 3 and 6 take the AMX tiles (from 16 tokens,
    ``cpu/amx_matmul.mojo``'s AMX_PROJECTION_MIN_TOKENS; below, the AVX512-BF16 dots), so the op's
    tile branch runs here too, not only in tests/cpu/projection_check.mojo."""
    check_parity(
        make_case(
            4102,
            dtype=torch.bfloat16,
            num_heads=16,
            page_size=16,
            cache_lengths=(40, 25),
            new_tokens=(9, 8),
        ),
        target,
    )


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


# An AVX2 target (16 vector registers: the f32 path's smaller register blocks, simd.DOT_COLS) besides the op's.
AVX2_TARGET = "znver3"


@pytest.mark.parametrize("target", ["op", AVX2_TARGET])
def test_amx_tile_layouts(tmp_path, target):
    """tests/cpu/amx_check.mojo, built for the op's target: the AMX paths of steps 5, 3 and 6 on
    emulated tiles (and on the unit where the kernel and the CPU have AMX) against the f32 paths.
    Built for an AVX2 target too, where the CPU runs AVX2 code: the f32 path's AVX2 register blocks
    against the emulated tiles, on any CPU this suite runs on."""
    if target == AVX2_TARGET and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU runs no AVX2 code")
    root = Path(__file__).resolve().parents[1]
    binary = tmp_path / "amx_check"
    build = subprocess.run(
        [mojo_binary(), "build", "--target-cpu", compile_target_name() if target == "op" else target, "-I", str(root),
         str(root / "tests" / "cpu" / "amx_check.mojo"), "-o", str(binary)],
        capture_output=True, text=True, timeout=600,
        env=dict(os.environ),  # not the C environment: max.nn putenv()s PYTHONEXECUTABLE
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    result = subprocess.run([str(binary), "quick"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = result.stdout.splitlines()
    assert lines[-1] == "amx_check: 0 failed", lines[-5:]
    # every case with the values packed and with the values read in place
    assert sum(line.startswith("PASS amx-emulated packed") for line in lines) >= 30
    assert sum(line.startswith("PASS amx-emulated in-place") for line in lines) >= 30
    assert sum(line.startswith("PASS amx-emulated projection") for line in lines) >= 9  # steps 3, 6
    assert any(line.startswith("PASS divisor") for line in lines)  # the GPU quantizations' division
    if target == "op" and "amx" in kernel_cpu_paths() and "amx_tile" in cpu_flags():
        assert sum(line.startswith("PASS amx packed") for line in lines) >= 30
        assert sum(line.startswith("PASS amx in-place") for line in lines) >= 30
