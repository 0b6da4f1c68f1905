"""pymla's tooling, apart from the op: ``import pymla`` imports none of it.

The commands of ``python -m pymla`` (:mod:`pymla.__main__` imports them when
one runs): ``demo`` (:mod:`.demo`), ``bench`` (:mod:`.bench`), ``overhead``
and ``step`` (:mod:`.overhead`); what they share: random inputs on a paged
cache (:mod:`.scenario`, also the tests'), the plain-torch baseline
(:mod:`.plain_torch`) and wall-clock timing (:mod:`.timing`).

GPU harnesses, each ``python -m pymla.tools.NAME`` (scripts/README.md):
:mod:`.max_builtin` (MAX's built-in MLA decode op against the reference and
pymla's op, on the device), :mod:`.peers` (pymla beside FlashMLA and vLLM's
Triton MLA, from one device call's logs) and :mod:`.gpu_bench_json` (the
``bench`` lines of a ``gpu_smoke`` log as JSON).
"""
