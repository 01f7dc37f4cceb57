"""zstore.testing.s3's moto server in a child process (what bench_s3.py measures against):
it serves a buffer written and read back through zstore, enforces conditional writes as the
in-process one does, and its process ends with the server."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import StoreSpec
from zstore.errors import LeaseError
from zstore.lease import Lease

s3 = pytest.importorskip("zstore.testing.s3")


def test_moto_in_a_separate_process_serves_a_buffer_and_stops():
    try:
        server = s3.MotoS3(separate_process=True)
    except s3.MissingPackage as exc:
        pytest.skip(str(exc))
    with server:
        assert server._proc.poll() is None and server._server is None
        url = f"s3://{server.new_bucket()}/rb"
        data = TensorDict({"obs": torch.arange(24.0).reshape(8, 3),
                           "action": torch.arange(8)}, [8])
        storage = zstore.LazyMemmapStorage(16, scratch_dir=url,
                                           storage_options=server.storage_options)
        storage.set(torch.arange(8), data)
        storage.flush()
        other = Lease(StoreSpec.parse(url, server.storage_options), ttl=30)
        with pytest.raises(LeaseError, match="one writer per store"):  # If-None-Match refused
            other.ensure()
        storage.close()
        got = zstore.open(url, server.storage_options, mode="r").get(torch.arange(8))
        assert torch.equal(got["obs"], data["obs"]) and torch.equal(got["action"], data["action"])
    assert server._proc.returncode is not None
