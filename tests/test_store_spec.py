"""StoreSpec's backend capabilities: one table of protocols in zstore.store, read as properties."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from zstore.codecs import is_remote
from zstore.store import CAPABILITIES, StoreSpec

#: url -> (is_local, is_memory, is_remote, is_object_store, atomic_conditional_writes,
#:         cheap_listing)
EXPECTED = {
    "memory://rb": (False, True, False, False, False, True),
    "/tmp/zstore-rb": (True, False, False, False, False, True),
    "file:///tmp/zstore-rb": (True, False, False, False, False, True),
    "local:///tmp/zstore-rb": (True, False, False, False, False, True),  # (fsspec: local files)
    "s3://bucket/rb": (False, False, True, True, True, False),
    "s3a://bucket/rb": (False, False, True, True, True, False),
    "gs://bucket/rb": (False, False, True, True, False, False),
    "gcs://bucket/rb": (False, False, True, True, False, False),
    "az://container/rb": (False, False, True, True, False, False),
    "abfs://container/rb": (False, False, True, True, False, False),
    "oss://bucket/rb": (False, False, True, True, False, False),
    "adl://store/rb": (False, False, True, False, False, False),  # Gen1: no bucket in the path
    "http://host/rb": (False, False, True, False, False, False),
    "https://host/rb": (False, False, True, False, False, False),
}


@pytest.mark.parametrize("url", EXPECTED)
def test_capabilities(url):
    spec = StoreSpec.parse(url)
    got = (spec.is_local, spec.is_memory, spec.is_remote, spec.is_object_store,
           spec.atomic_conditional_writes, spec.cheap_listing)
    assert got == EXPECTED[url]
    assert is_remote(spec) == spec.is_remote  # codecs' remote default reads the same property
    assert spec.local_path == (Path("/tmp/zstore-rb") if spec.is_local else None)


def test_capabilities_do_not_depend_on_options_or_read_only():
    spec = StoreSpec.parse("s3://bucket/rb", {"anon": True}, read_only=True)
    assert spec.is_object_store and spec.atomic_conditional_writes and not spec.cheap_listing


def test_one_table():
    # every capability named in the table is read by a property, and vice versa
    names = set().union(*CAPABILITIES.values())
    assert names == {"local", "memory", "object_store", "atomic_conditional_writes",
                     "cheap_listing"}
    assert {p for p, caps in CAPABILITIES.items() if "atomic_conditional_writes" in caps} <= \
        {p for p, caps in CAPABILITIES.items() if "object_store" in caps}


def test_lease_objects_follow_the_properties():
    from zstore import conditional

    assert type(conditional.objects_for(StoreSpec.parse("memory://rb"))).__name__ == "MemoryObjects"
    assert type(conditional.objects_for(StoreSpec.parse("s3://b/rb"))).__name__ == "S3Objects"
    assert type(conditional.objects_for(StoreSpec.parse("gs://b/rb"))) is conditional.ConditionalObjects


def test_a_memory_store_reads_on_the_event_loop(monkeypatch):
    """A ``memory://`` read answers as zarr's FsspecStore does (whole, ranged, from an offset,
    a suffix, missing), without the worker thread zarr gives a synchronous filesystem's calls."""
    import asyncio
    import uuid

    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync
    from zarr.storage import FsspecStore

    url = f"memory://zstore-tests/loop-{uuid.uuid4().hex[:8]}"
    store = StoreSpec.parse(url, {}).open()
    prototype = default_buffer_prototype()
    payload = bytes(range(256)) * 40
    sync(store.set("c/0", prototype.buffer.from_bytes(payload)))
    reference = FsspecStore.from_url(url)  # zarr's own, on the same memory filesystem
    hops = []
    to_thread = asyncio.to_thread

    async def counted(func, *args, **kwargs):
        hops.append(func)
        return await to_thread(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    for byte_range in (None, RangeByteRequest(10, 2000), OffsetByteRequest(9000),
                       SuffixByteRequest(300), RangeByteRequest(0, 0)):
        ours = sync(store.get("c/0", prototype, byte_range)).to_bytes()
        hops_before = len(hops)
        assert ours == sync(reference.get("c/0", prototype, byte_range)).to_bytes()
        assert len(hops) > hops_before  # the reference hopped: the counter counts
    assert sync(store.get("c/1", prototype)) is None
    assert len(hops) == 5  # one per read of the reference, none of ours


@pytest.mark.parametrize("url", ["s3://bucket//rb", "s3://bucket/a//rb", "s3:///rb", "gs://b//rb"])
def test_an_empty_path_segment_of_an_object_store_is_refused(url):
    """The S3 clients read ``bucket//rb`` differently (an obstore writer split one buffer)."""
    with pytest.raises(ValueError, match="empty path segment") as info:
        StoreSpec.parse(url, {"anon": True})
    assert url in str(info.value) and url.replace("//", "/").replace(":/", "://") in str(info.value)


@pytest.mark.parametrize("url, parsed", [("s3://bucket/rb/", "s3://bucket/rb"),
                                         ("s3://bucket/", "s3://bucket"),
                                         ("s3://bucket", "s3://bucket"),
                                         ("memory://zstore-tests//rb", "memory://zstore-tests//rb")])
def test_a_trailing_slash_and_the_bucket_root_parse(url, parsed):
    assert StoreSpec.parse(url).url == parsed


@pytest.mark.parametrize("options", [{"endpoint_url": "127.0.0.1:9000"},
                                     {"client_kwargs": {"endpoint_url": "127.0.0.1:9000"}}])
@pytest.mark.parametrize("transport", ["fsspec", "obstore"])
def test_an_endpoint_without_a_scheme_is_refused(options, transport):
    """s3fs said "not a zstore buffer", obstore panicked: both now refuse it before a request."""
    with pytest.raises(ValueError, match=r"'127\.0\.0\.1:9000'.*'http://127\.0\.0\.1:9000'"):
        StoreSpec.parse("s3://bucket/rb", {**options, "transport": transport})


def test_a_misspelled_s3_option_is_named_with_the_likely_one(s3_options, s3_bucket):
    """``{"secrett": ...}`` reached botocore's session: ``zstore.open`` said the store was
    "not a zstore buffer: AioSession.__init__() got an unexpected keyword argument", and
    creating a storage raised a bare TypeError. Now it is refused before any request."""
    import zstore

    url = f"s3://{s3_bucket}/typo"
    storage = zstore.LazyMemmapStorage(4, scratch_dir=url, storage_options=s3_options)
    storage.set(torch.arange(2), TensorDict(x=torch.ones(2), batch_size=[2]))
    storage.close()
    typo = {**s3_options, "secrett": s3_options["secret"]}
    for attempt in (lambda: zstore.open(url, typo, mode="r"),
                    lambda: zstore.LazyMemmapStorage(4, scratch_dir=f"{url}-new",
                                                     storage_options=typo)):
        with pytest.raises(ValueError, match=r"unknown storage option\(s\) 'secrett' "
                                             r"\(did you mean 'secret'\?\)"):
            attempt()
    options = {**s3_options, "use_listings_cache": False, "skip_instance_cache": True,
               "profile": None, "region": "us-east-1", "config_kwargs": {}}
    assert len(zstore.open(url, options, mode="r")) == 2  # every option it takes passes


def test_region_is_s3fs_region_name():
    """``region`` (the obstore transport's) reaches s3fs as ``client_kwargs["region_name"]``."""
    spec = StoreSpec.parse("s3://bucket/rb", {"anon": True, "region": "eu-west-3"})
    fs, _ = spec.filesystem()
    assert fs.client_kwargs["region_name"] == "eu-west-3" and "region" not in fs.kwargs
    same = {"region": "eu-west-3", "client_kwargs": {"region_name": "eu-west-3"}}
    assert StoreSpec.parse("s3://bucket/rb", same).filesystem()[0].client_kwargs == \
        {"region_name": "eu-west-3"}
    with pytest.raises(ValueError, match="'eu-west-3'.*'us-east-1'"):
        StoreSpec.parse("s3://bucket/rb", {"region": "eu-west-3",
                                           "client_kwargs": {"region_name": "us-east-1"}})


def test_fsspec_gets_a_deep_copy_of_the_options():
    """s3fs and botocore change nested option dicts in place: never the caller's."""
    options = {"anon": True, "config_kwargs": {"retries": {"max_attempts": 2}}}
    spec = StoreSpec.parse("s3://bucket/rb", options)
    given = spec._fsspec_options()
    given["config_kwargs"]["retries"]["mode"] = "changed"
    assert options == {"anon": True, "config_kwargs": {"retries": {"max_attempts": 2}}}


def test_a_local_path_with_dot_dot_is_one_folder_and_an_ensemble_of_it_reopens(tmp_path):
    """``x/../member`` was kept as spelled: an ensemble recorded it, then refused its own
    record ("malformed StorageEnsemble block") at every ``zstore.open``."""
    import zstore

    (tmp_path / "x").mkdir()
    assert StoreSpec.parse(tmp_path / "x" / ".." / "member").url == os.path.realpath(tmp_path / "member")
    member = zstore.LazyMemmapStorage(10, scratch_dir=f"{tmp_path}/x/../member")
    member.set(torch.arange(3), TensorDict(obs=torch.zeros(3, 2), batch_size=[3]))
    member.flush()
    zstore.StorageEnsemble(member, scratch_dir=str(tmp_path / "ens"))
    reopened = zstore.open(str(tmp_path / "ens"), mode="r")
    (again,) = reopened._storages
    assert len(again) == 3 and again.scratch_dir == os.path.realpath(tmp_path / "member")


@pytest.mark.parametrize("url", ["https://user:hunter2@host/ds", "http://hunter2@host:80/ds"])
def test_credentials_in_a_url_are_never_shown(url):
    """Basic auth in an HTTP dataset's URL was printed in errors, ``repr`` and ``redacted()``."""
    spec = StoreSpec.parse(url, {"client_kwargs": {}})
    for shown in (spec.redacted(), repr(spec), spec.shown_url):
        assert "hunter2" not in shown and "***@host" in shown
    assert spec.url == url  # (the client still gets them)


def test_credentials_in_an_object_store_bucket_name_are_refused_unshown():
    with pytest.raises(ValueError, match=r"s3://\*\*\*@bucket/rb' holds credentials .* storage "
                                         r"options") as info:
        StoreSpec.parse("s3://AKIAX:hunter2@bucket/rb")
    assert "hunter2" not in str(info.value)


def test_options_in_an_object_store_url_s_query_are_refused_naming_storage_options():
    """``s3://b/rb?endpoint_url=http://host`` was refused for its empty path segment, with
    ``http:/host`` as the fix."""
    with pytest.raises(ValueError, match=r"has a query string, .* as storage options"):
        StoreSpec.parse("s3://bucket/rb?endpoint_url=http://127.0.0.1:9000")
    assert StoreSpec.parse("s3://bucket/what?").url == "s3://bucket/what?"  # (a key may hold '?')


def test_dot_dot_after_a_symlink_is_resolved_as_the_os_resolves_it(tmp_path):
    """``link/../rb`` with ``link`` a symlink into another folder is the ``rb`` next to the
    link's target, as the OS reads it (a lexical ``..`` would make it another folder)."""
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "link").symlink_to(tmp_path / "real" / "deep")
    spelled = tmp_path / "other" / "link" / ".." / "rb"
    assert StoreSpec.parse(spelled).url == os.path.realpath(spelled) == \
        os.path.realpath(tmp_path / "real" / "rb")
    assert StoreSpec.parse(tmp_path / "other" / "link").url == str(tmp_path / "other" / "link")
