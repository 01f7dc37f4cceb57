"""Test helpers shipped with zstore (loopback servers and the like), for zstore's own tests
and benchmarks and for projects testing code built on zstore.

Submodules are imported on their own (``from zstore.testing.s3 import moto_s3``): each
needs packages that zstore itself does not, and names the one that is missing.
"""
