"""Every python block of the README's "## API" section runs as written, and does what it says."""

import re
from pathlib import Path

import pytest
import torch

from pymla.args import KVCacheTensors
from pymla.parity import CACHE_TOLERANCE, compare_output
from pymla.reference import mla_decode_branch_fp8_reference

README = Path(__file__).resolve().parent.parent / "README.md"


def api_blocks() -> list[str]:
    text = README.read_text()
    section = re.search(r"^## API\n(.*?)^## ", text, flags=re.S | re.M).group(1)
    return re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)


def check_one_call(ns: dict) -> None:
    out = ns["out"]
    assert out.shape == (1, ns["H"], 128) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    assert ns["cache"].length(0) == 1001


def check_serving_loop(ns: dict) -> None:
    """The last layer of the last step against the reference, from the cache before that step."""
    cache, offsets, layer = ns["cache"], ns["offsets"], ns["layer"]
    assert [cache.length(b) for b in range(cache.num_requests)] == [103, 903]
    before = torch.tensor(
        [cache.length(b) - 1 for b in range(cache.num_requests)], dtype=torch.uint32
    )
    kv = KVCacheTensors(cache.blocks.clone(), before, cache.lookup_table)
    w = ns["weights"][layer].tensors
    ref = mla_decode_branch_fp8_reference(
        ns["q"], offsets, ns["freqs_cis"], w["kv_norm_gamma"], kv, layer,
        w["w_uk"], w["w_uk_scale"], w["w_uv"], w["w_uv_scale"],
        scale=ns["options"].scale, epsilon=ns["options"].epsilon, new_rows=ns["rows"],
    )  # fmt: skip
    report = compare_output(ns["out"], ref)
    assert report.passed, report.describe()
    # The op stored the new rows the reference did (the slots reserve() made).
    slots = [
        (cache.pages_of(b)[p // cache.page_size], p % cache.page_size)
        for b, p in enumerate(before.tolist())
    ]
    stored = torch.stack([cache.blocks[page, 0, layer, i, 0] for page, i in slots]).float()
    expected = torch.stack([kv.blocks[page, 0, layer, i, 0] for page, i in slots]).float()
    tolerance = CACHE_TOLERANCE[torch.bfloat16] * expected.abs().max()
    assert (stored - expected).abs().max() <= tolerance


CHECKS = {"From torch, one call": check_one_call, "Serving loop": check_serving_loop}


def test_every_api_block_is_checked():
    assert len(api_blocks()) == len(CHECKS)


@pytest.mark.parametrize("index, check", list(enumerate(CHECKS.values())), ids=list(CHECKS))
def test_api_block_runs_as_written(index, check):
    namespace: dict = {}
    exec(api_blocks()[index], namespace)
    check(namespace)
