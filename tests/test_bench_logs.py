"""The device logs' `bench` lines parse in every format gpu_bench has printed (pymla.tools.gpu_bench_json)."""

from __future__ import annotations

from pathlib import Path

from pymla.tools.gpu_bench_json import parse_bench_lines
from pymla.tools.peers import fp8_table, own_attention_us, parse

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def parsed(path: Path) -> list[dict]:
    return parse_bench_lines(path.read_text().splitlines())


def test_plain_lines():
    rows = parsed(RESULTS / "h200-2026-12-03-final" / "gpu_op_bench.log")
    assert rows and all(
        r["plan"] is None and r["default_plan"] and r["cache"] == "dtype" for r in rows
    )
    assert {(r["heads"], r["batch"]) for r in rows} >= {(128, 64), (16, 8)}


def test_lines_with_a_plan():
    rows = parsed(RESULTS / "h200-2026-12-05b" / "bench_pdl.log")
    assert len(rows) == 16  # 2 shapes x 4 plans x 2 rounds
    default = [r for r in rows if r["default_plan"]]
    assert len(default) == 4 and all(
        "PDL off" in r["plan"] and "merge" in r["plan"] for r in default
    )
    assert min(r["us"] for r in default if r["heads"] == 16) == 65.76172


def test_lines_with_a_cache_label():
    rows = parsed(RESULTS / "h200-2026-12-05b" / "bench_fp8.log")
    assert [r["cache"] for r in rows] == [
        "dtype",
        "fp8_ds_mla",
        "dtype",
        "dtype",
        "fp8_ds_mla",
        "dtype",
        "fp8_ds_mla",
    ]
    assert rows[-1]["us"] == 3288.654 and rows[-1]["batch"] == 128 and rows[-1]["context"] == 32768


def test_the_ops_step_5_line_in_both_formats():
    old = RESULTS / "h200-2026-12-03-attn" / "gpu_variants.log"
    new = RESULTS / "h200-2026-12-05e" / "var-sm90.log"
    old_us = [
        u for line in old.read_text().splitlines() if (u := own_attention_us(line)) is not None
    ]
    new_us = [
        u for line in new.read_text().splitlines() if (u := own_attention_us(line)) is not None
    ]
    assert old_us[0] == 2232.8251
    assert new_us[:2] == [684.5436, 119.96780000000001]
    # a pinned variant's line is not the op's
    assert (
        own_attention_us("  attention groups 4 kt 64 warps/group 0 : 346.1 us, 1 GB/s of cache")
        is None
    )


def test_the_ops_plan_is_a_cases_first_plan_whatever_the_defaults():
    """PDL has been on in the op's plan since the eleventh session: the plan gpu_bench prints first
    of a case's four (06s: PDL on, 362.028 us at 128 h b64 8k, against 366.394 with PDL off)."""
    rows = parsed(RESULTS / "h100-2026-12-06s-peers-branches" / "gpu" / "gpu_both.log")
    default = [r for r in rows if r["default_plan"]]
    assert default and all(
        "PDL on" in r["plan"] and "merge" in r["plan"] and "in q step" in r["plan"] for r in default
    )
    case = [r for r in default if (r["heads"], r["batch"], r["cache"]) == (128, 64, "dtype")]
    assert min(r["us"] for r in case) == 362.028
    turned = [r for r in rows if not r["default_plan"]]
    assert {r["plan"].split(" , ")[0] for r in turned} >= {"PDL off"}
    assert len(turned) == 3 * len(default)


def test_one_log_of_both_timings_keeps_the_cases_apart(tmp_path):
    """`gpu_bench both`: per shape, step 5 alone then the whole op, for the bf16 cache, then the fp8 cache
    and a one-long batch under the same sizes; issue 23's table takes the bf16 cache's uniform case,
    issue 24's the fp8 cache's; the one-long batch is in neither."""
    src = RESULTS / "h100-2026-12-05g"
    (tmp_path / "peers.json").write_text((src / "peers.json").read_text())
    plan = "PDL off, quantize in merge, schedule in q step"
    lines = ["copy 2995.9 GB/s (bytes read + written, 1 GiB device-to-device)"]
    for label, us in (
        ("dtype cache ", 51.0),
        ("fp8_ds_mla cache ", 77.0),
        ("dtype cache one-long ", 33.0),
    ):
        lines += [
            f"variants {label}B 8 H 16 L 8192",
            f"  attention op's plan ( {plan} ) : {us} us, 1 GB/s of cache",
            f"bench bfloat16 {label}B 8 H 16 L 8192 ( {plan} ,  split by work  ) : {us + 20} us per call,"
            " 1 GB/s of cache+weights, 1 TFLOP/s attention",
        ]
    (tmp_path / "gpu_both.log").write_text("\n".join(lines) + "\n")
    data = parse(tmp_path)
    row = next(r for r in data["rows"] if (r["heads"], r["batch"], r["context"]) == (16, 8, 8192))
    assert (row["pymla_attention_ms"], row["pymla_op_ms"], data["copy_gb_per_s"]) == (
        0.051,
        0.071,
        2995.9,
    )
    assert row["triton_ms"] is None  # the peers call ran FlashMLA alone
    # the fp8 cache's lines: issue 24's columns and table
    assert (row["pymla_fp8_attention_ms"], row["pymla_fp8_op_ms"]) == (0.077, 0.097)
    fp8_rows = [line for line in fp8_table(data).splitlines() if line.startswith("| 16 | 8 | 8k")]
    assert fp8_rows == [
        f"| 16 | 8 | 8k | {row['flashmla_ms']:.3f} | - | 0.071 | 0.077 | 0.097 | {0.097 / row['flashmla_ms']:.2f}x | - |"
    ]
