"""zstore.testing's contract suites, run for every storage class × store and every CAS backend.

Persistent storages run on memory://, a local directory and S3 on moto (the ``location``
fixture of conftest.py), and on rclone's S3 where ``all_s3_servers`` marks them; the in-RAM
storages run in RAM. Each backend of :mod:`zstore.conditional` runs the compare-and-swap suite.
"""

from __future__ import annotations

import contextlib
import uuid

import pytest

import zstore
from zstore.conditional import _ENFORCES_CONDITIONS, ConditionalObjects, objects_for
from zstore.store import StoreSpec
from zstore.testing.contract import ConditionalObjectsTests, StorageTests


class TestListStorage(StorageTests):
    records_cursor = validates_rows = checkpointable = False

    @pytest.fixture
    def make(self):
        return lambda max_size: zstore.ListStorage(max_size)


class TestLazyStackStorage(StorageTests):
    records_cursor = validates_rows = checkpointable = False

    @pytest.fixture
    def make(self):
        return lambda max_size: zstore.LazyStackStorage(max_size)


class TestLazyTensorStorage(StorageTests):
    @pytest.fixture
    def make(self):
        return lambda max_size: zstore.LazyTensorStorage(max_size)


class TestTensorStorage(StorageTests):
    @pytest.fixture
    def make(self):
        from zstore.testing.contract import rows

        def new(max_size: int):
            storage = zstore.TensorStorage(rows(0, max_size).zero_(), max_size)
            storage._empty()  # a preallocated container, not yet written
            return storage
        return new


@pytest.mark.all_s3_servers
class TestLazyMemmapStorage(StorageTests):
    persistent = True

    @pytest.fixture
    def make(self, location):
        return lambda max_size: zstore.LazyMemmapStorage(
            max_size, scratch_dir=location.new(), storage_options=location.options, chunks=4)


class TestLazyMemmapStorageZstd(StorageTests):
    persistent = True

    @pytest.fixture
    def make(self, location):
        return lambda max_size: zstore.LazyMemmapStorage(
            max_size, scratch_dir=location.new(), storage_options=location.options, codec="zstd",
            chunks=4)


class TestCompressedListStorage(StorageTests):
    persistent = True
    records_cursor = validates_rows = False

    @pytest.fixture
    def make(self, location):
        return lambda max_size: zstore.CompressedListStorage(
            max_size, scratch_dir=location.new(), storage_options=location.options)


class TestMemoryObjects(ConditionalObjectsTests):
    @pytest.fixture
    def objects(self):
        return objects_for(StoreSpec.parse(f"memory://zstore-tests/cas-{uuid.uuid4().hex[:8]}"))


class TestLocalObjects(ConditionalObjectsTests):
    @pytest.fixture
    def objects(self, tmp_path):
        return objects_for(StoreSpec.parse(str(tmp_path / "cas")))


class TestS3Objects(ConditionalObjectsTests):
    @pytest.fixture
    def objects(self, s3_bucket, s3_options):
        return objects_for(StoreSpec.parse(f"s3://{s3_bucket}/cas-{uuid.uuid4().hex[:8]}", s3_options))


class TestPlainObjects(ConditionalObjectsTests):
    """The fallback for stores without conditional writes (GCS, Azure, HTTP ...), on memory://."""

    @pytest.fixture
    def objects(self):
        return ConditionalObjects(StoreSpec.parse(f"memory://zstore-tests/plain-{uuid.uuid4().hex[:8]}"))


def test_every_backend_and_storage_class_is_covered():
    """A new storage class or CAS backend must get its contract subclass here."""
    from zstore import conditional

    suites = {name[4:] for name, value in globals().items()
              if name.startswith("Test") and isinstance(value, type)}
    backends = {name for name, value in vars(conditional).items()
                if isinstance(value, type) and issubclass(value, ConditionalObjects)
                and value is not ConditionalObjects}
    assert backends <= suites
    storages = {name for name in zstore.__all__ if isinstance(getattr(zstore, name), type)
                and issubclass(getattr(zstore, name), zstore.Storage)}
    # the base, a composition (test_ensemble.py) and a read-only dataset (test_dataset*.py)
    storages -= {"Storage", "StorageEnsemble", "Dataset"}
    assert storages <= suites, sorted(storages - suites)


class TestRcloneS3Objects(ConditionalObjectsTests):
    """rclone's S3 server, which accepts conditional headers and ignores them: zstore finds
    that out and falls back to check-then-write (the concurrency test then skips)."""

    @pytest.fixture
    def objects(self, rclone_s3):
        objects = objects_for(StoreSpec.parse(f"s3://zstore-rclone/cas-{uuid.uuid4().hex[:8]}", rclone_s3))
        with pytest.warns(RuntimeWarning, match="ignores conditional writes") if \
                objects._endpoint() not in _ENFORCES_CONDITIONS else contextlib.nullcontext():
            assert objects.atomic is False
        return objects


def test_moto_enforces_conditional_writes_and_is_probed_once(s3_bucket, s3_options, recwarn):
    objects = objects_for(StoreSpec.parse(f"s3://{s3_bucket}/cas-{uuid.uuid4().hex[:8]}", s3_options))
    assert objects.atomic is True
    assert _ENFORCES_CONDITIONS[objects._endpoint()] is True
    assert not [w for w in recwarn if "conditional" in str(w.message)]


def test_a_probe_object_left_by_a_killed_process_does_not_block_a_new_buffer(s3_bucket, s3_options):
    """A process killed between the probe's create and delete leaves its scratch object:
    the location still counts as empty for a new buffer."""
    import s3fs
    import torch
    from tensordict import TensorDict

    from zstore.conditional import PROBE_PREFIX

    url = f"s3://{s3_bucket}/probe-{uuid.uuid4().hex[:8]}"
    fs = s3fs.S3FileSystem(**s3_options, skip_instance_cache=True)
    fs.pipe_file(f"{url[5:]}/{PROBE_PREFIX}deadbeef", b"probe")
    storage = zstore.LazyMemmapStorage(8, scratch_dir=url, storage_options=s3_options)
    storage.set(torch.arange(3), TensorDict(obs=torch.arange(3.0), batch_size=[3]))
    storage.close()
    assert zstore.open(url, s3_options, mode="r").get(torch.arange(3))["obs"].tolist() == [0.0, 1.0, 2.0]
    other = StoreSpec.parse(f"s3://{s3_bucket}/probe-other-{uuid.uuid4().hex[:8]}", s3_options)
    fs.pipe_file(f"{other.url[5:]}/unrelated.bin", b"x")
    assert not other.is_empty(ignore=(PROBE_PREFIX,))  # anything else still counts
