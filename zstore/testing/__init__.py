"""Test helpers shipped with zstore, for zstore's own tests and benchmarks and for projects
testing code built on zstore: loopback S3 servers (:mod:`zstore.testing.s3`) and the
contract suites every storage and compare-and-swap backend passes
(:mod:`zstore.testing.contract`).

Submodules are imported on their own (``from zstore.testing.s3 import moto_s3``): each
needs packages that zstore itself does not, and names the one that is missing.
"""
