"""The README's torch example runs as written and matches the reference."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_torch_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    namespace: dict = {}
    exec(blocks[0], namespace)  # the "From torch" example
    out = namespace["out"]
    assert out.shape == (1, namespace["H"], 128) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    assert namespace["cache"].length(0) == 1001
