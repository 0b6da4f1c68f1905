"""pymla's tooling, apart from the op: ``import pymla`` imports none of it.

The commands of ``python -m pymla`` (:mod:`pymla.__main__` imports them when
one runs): ``demo`` (:mod:`.demo`), ``bench`` (:mod:`.bench`), ``overhead``
and ``step`` (:mod:`.overhead`); what they share: random inputs on a paged
cache (:mod:`.scenario`, also the tests'), the plain-torch baseline
(:mod:`.plain_torch`) and wall-clock timing (:mod:`.timing`).
"""
