"""The single-writer lease and the conditional commit, on memory://, local and S3 stores.

"Another writer" here is a :class:`zstore.lease.Lease` of its own (another owner,
exactly what another process holds); tests/test_multiwriter.py does the same
with real processes. Time is driven through ``zstore.lease.clock``: no sleeps.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
import warnings

import pytest
import torch
from tensordict import TensorDict

import zstore
from zstore import lease as lease_mod
from zstore.errors import LeaseError
from zstore.conditional import objects_for
from zstore.lease import LEASE_NAME, METADATA_NAME, WRITER_ATTR, Lease
from zstore.store import StoreSpec

T0 = 1_000_000.0


@pytest.fixture
def clock(monkeypatch):
    """A settable clock for the lease (``clock.now = ...``)."""

    class Clock:
        now = T0

        def __call__(self) -> float:
            return self.now

    fake = Clock()
    monkeypatch.setattr(lease_mod, "clock", fake)
    return fake


def rows(start: int, n: int) -> TensorDict:
    return TensorDict(x=torch.arange(start, start + n, dtype=torch.int64), batch_size=[n])


def lease_record(url: str, options: dict) -> dict | None:
    found = objects_for(StoreSpec.parse(url, options)).read(LEASE_NAME)
    return None if found is None else json.loads(found[0])


def committed(url: str, options: dict) -> list[int]:
    return zstore.open(url, options, mode="r")[:]["x"].tolist()


def test_first_write_takes_the_lease_close_releases_it(location, clock):
    url = location.new()
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options)
    assert lease_record(url, location.options) is None  # constructing writes nothing
    storage.set(torch.arange(3), rows(0, 3))
    record = lease_record(url, location.options)
    assert record["ttl"] == lease_mod.DEFAULT_TTL and record["renewed"] == T0
    host, pid, _ = record["owner"].split("/")
    assert (record["host"], record["pid"]) == (host, int(pid))
    clock.now = T0 + 7
    storage.flush()  # a commit renews
    assert lease_record(url, location.options)["renewed"] == T0 + 7
    assert lease_record(url, location.options)["acquired"] == T0
    storage.close()
    assert lease_record(url, location.options) is None
    assert committed(url, location.options) == [0, 1, 2]


def test_second_writer_is_refused_and_readers_are_not(location, clock):
    url = location.new()
    spec = StoreSpec.parse(url, location.options)
    other = Lease(spec, ttl=30)
    other.ensure()  # another process is writing here
    storage = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options)
    with pytest.raises(LeaseError) as info:
        storage.set(torch.arange(3), rows(0, 3))
    message = str(info.value)
    assert url in message and other.owner in message and "ttl 30 s" in message
    wait = float(re.search(r"this one: in ([0-9.]+) s, if its holder renews it no more", message)[1])
    assert 0 < wait <= 30  # when the next writer may take it over
    assert "secret" not in location.options or location.options["secret"] not in message
    assert spec.is_empty(ignore=(LEASE_NAME,))  # refused before anything was written
    other.release()
    storage.set(torch.arange(3), rows(0, 3))
    storage.flush()
    other = Lease(spec, ttl=30)
    with pytest.raises(LeaseError, match="one writer per store"):
        other.ensure()
    reader = zstore.open(url, location.options, mode="r")  # readers never look at the lease
    assert reader[:]["x"].tolist() == [0, 1, 2]
    also = zstore.open(url, location.options)  # r+ takes nothing until it writes
    assert len(also) == 3
    storage.close()


def test_a_lease_renewed_while_the_refused_writer_asked_reads_as_renewed_now(location, clock):
    """The refused writer reads its clock before the request that finds the lease; one
    renewed meanwhile was "renewed -0.9 s ago"."""
    spec = StoreSpec.parse(location.new(), location.options)
    other = Lease(spec, ttl=30)
    other.ensure()
    clock.now -= 0.9  # the refused writer's reading: before the holder's renewal
    storage = zstore.LazyMemmapStorage(16, scratch_dir=spec.url, storage_options=location.options)
    with pytest.raises(LeaseError, match=r"renewed 0\.0 s ago, ttl 30 s"):
        storage.set(torch.arange(3), rows(0, 3))
    other.release()


def written_and_reopened(location):
    """A buffer with rows 0 and 1 committed by one storage, and a second storage object of
    the same process opened on it: ``(url, first, second)``."""
    url = location.new()
    first = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options)
    first.set(torch.arange(2), rows(0, 2))
    first.flush()
    return url, first, zstore.open(url, location.options)


def test_writers_of_one_process_share_its_lease(location, clock):
    url, first, second = written_and_reopened(location)
    second.set(torch.arange(2, 4), rows(2, 2))
    second.flush()
    first.close()  # the process's lease stays while `second` uses it
    assert lease_record(url, location.options) is not None
    second.close()
    assert lease_record(url, location.options) is None
    assert committed(url, location.options) == [0, 1, 2, 3]


def test_stale_lease_is_taken_over_and_the_old_holder_is_fenced(location, clock):
    url = location.new()
    spec = StoreSpec.parse(url, location.options)
    writer = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options)
    writer.set(torch.arange(3), rows(0, 3))
    writer.flush()
    writer.close()
    old = Lease(spec, ttl=2)
    old.ensure()
    old.read_metadata()  # the old holder has opened the buffer, then stalls
    taker = zstore.open(url, location.options, lease_ttl=5)
    clock.now = T0 + 2  # exactly at the ttl: still valid
    with pytest.raises(LeaseError, match="being written by"):
        taker.set(3, TensorDict(x=torch.tensor(3), batch_size=[]))
    clock.now = T0 + 2.5
    with pytest.warns(UserWarning, match="took over the stale write lease"):
        taker.set(3, TensorDict(x=torch.tensor(3), batch_size=[]))
    record = lease_record(url, location.options)
    assert record["owner"] != old.owner and record["ttl"] == 5
    # the old holder wakes up: neither its renewal nor its commit goes through
    stale = json.loads(objects_for(spec).read(METADATA_NAME)[0])  # the holder's commit names
    stale["attributes"][WRITER_ATTR] = old.owner  # its writer: never another writer's bytes
    stale_commit = json.dumps(stale).encode()
    with pytest.raises(LeaseError, match="changed by another writer"):
        old.write_metadata(stale_commit)
    with pytest.raises(LeaseError, match="lost the write lease"):
        old.renew()
    taker.flush()
    assert committed(url, location.options) == [0, 1, 2, 3]
    group_attrs = json.loads(objects_for(spec).read(METADATA_NAME)[0])["attributes"]
    assert group_attrs[WRITER_ATTR] == record["owner"]
    taker.close()


def committed_two_rows(location) -> tuple[str, StoreSpec, zstore.LazyMemmapStorage]:
    """A writer (ttl 1 s, no autocommit) that committed rows 0 and 1: ``(url, spec, writer)``."""
    url = location.new()
    writer = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options,
                                      lease_ttl=1, autocommit_seconds=1e9)
    writer.set(torch.arange(2), rows(0, 2))
    writer.flush()
    return url, StoreSpec.parse(url, location.options), writer


def test_an_attribute_set_with_zarr_while_a_writer_lives_is_kept(location, clock):
    """format.md §5: other keys of the group's attributes are kept on every commit. One set
    with plain Zarr while a writer lived made its next commit fail ("changed by another
    writer", the lease still held), and the commit after that dropped it. Now the commit is
    rebased on that version (zstore.rebase): the key stays, through close()."""
    import zarr

    url = location.new()
    writer = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options,
                                      autocommit_seconds=1e9)
    writer.set(torch.arange(4), rows(0, 4))
    writer.flush()

    def group():
        return zarr.open_group(url, mode="r+", storage_options=location.options or None)

    group().attrs["note"] = "hello"
    writer.set(torch.arange(4, 6), rows(4, 2))
    writer.flush()
    assert group().attrs["note"] == "hello" and committed(url, location.options) == list(range(6))
    group().attrs["note"] = "edited"  # again, between two commits, and consolidated as
    with warnings.catch_warnings():  # (zarr's about zstore's objects and consolidation)
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(group().store)  # format.md §6 tells tools to
    writer.set(torch.arange(6, 8), rows(6, 2))
    writer.flush()
    assert group().attrs["note"] == "edited" and committed(url, location.options) == list(range(8))
    writer.close()
    assert group().attrs["note"] == "edited" and committed(url, location.options) == list(range(8))


def test_a_compressed_list_storage_keeps_a_users_attribute_too(location, clock):
    """A CompressedListStorage committed only its own block: an attribute set with plain
    Zarr was dropped by its next commit."""
    import zarr

    url = location.new()
    storage = zstore.CompressedListStorage(8, scratch_dir=url, storage_options=location.options,
                                           autocommit_seconds=1e9)
    storage.set(0, torch.arange(3))
    storage.flush()
    zarr.open_group(url, mode="r+", storage_options=location.options or None).attrs["note"] = "hi"
    for i in (1, 2):  # a commit that rebases, then one that does not need to
        storage.set(i, torch.arange(3) + i)
        storage.flush()
    storage.close()
    assert zarr.open_group(url, mode="r", storage_options=location.options or None
                           ).attrs["note"] == "hi"
    assert [t.tolist() for t in zstore.open(url, location.options, mode="r").get([0, 1, 2])] \
        == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]


def test_a_stale_zarr_handle_does_not_revert_the_writers_commits(location, clock):
    """A plain-Zarr handle opened before the writer's last commit rewrites the whole
    ``zarr.json`` from its stale copy when it sets an attribute: the zstore block went back
    to the earlier length. The writer, still holding the lease, now rebases its next commit
    on that version: its own block wins, the attribute stays, no committed row is lost."""
    import zarr

    url, spec, writer = committed_two_rows(location)
    stale = zarr.open_group(url, mode="r+", storage_options=location.options or None)
    writer.set(torch.arange(2, 4), rows(2, 2))
    writer.flush()
    stale.attrs["note"] = "hello"  # zarr.json as the handle read it: 2 rows
    assert json.loads(objects_for(spec).read(METADATA_NAME)[0])["attributes"]["zstore"][
        "length"] == 2
    writer.set(torch.arange(4, 6), rows(4, 2))
    writer.flush()
    assert committed(url, location.options) == list(range(6))
    writer.close()
    assert committed(url, location.options) == list(range(6))
    assert zarr.open_group(url, mode="r", storage_options=location.options or None
                           ).attrs["note"] == "hello"


def test_a_writer_that_lost_its_lease_cannot_commit_and_stays_refused(location, clock):
    """Once refused, a writer whose lease another writer took (a pause past its ttl) took a
    new lease at its next write once the other had released it, reloaded the other's
    commit and went on without a word: its rows since its last commit gone, and a TorchRL
    writer's cursor, its own, writing over the other's rows. It is refused until the store
    is reopened, as the error says."""
    url, spec, writer = committed_two_rows(location)
    clock.now = T0 + 10
    thief = Lease(spec, ttl=60)
    with pytest.warns(UserWarning, match="took over"):
        thief.ensure()
    with pytest.raises(LeaseError, match="lost the write lease"):
        writer.set(torch.arange(2, 4), rows(2, 2))  # the write renews first: it fails, writes nothing
    writer.flush()  # nothing of its own to commit
    assert committed(url, location.options) == [0, 1]
    assert len(writer) == 2
    thief.release()  # (the other writer closed)
    with pytest.raises(LeaseError, match="lost the write lease .* Reopen the store"):
        writer.set(torch.arange(2, 4), rows(2, 2))
    assert committed(url, location.options) == [0, 1] and lease_record(url, location.options) is None
    writer.close()
    reopened = zstore.open(url, location.options)
    reopened.set(torch.arange(2, 4), rows(2, 2))
    reopened.close()
    assert committed(url, location.options) == [0, 1, 2, 3]


def test_lease_record_of_a_storage_is_never_copied(tmp_path, clock):
    storage = zstore.CompressedListStorage(8)  # memory://, pickled as its chunks
    storage.set(0, torch.arange(3))
    storage.flush()
    copy = pickle.loads(pickle.dumps(storage))
    copy.set(1, torch.arange(4))  # its own store: no inherited lease
    assert [t.tolist() for t in copy.get([0, 1])] == [[0, 1, 2], [0, 1, 2, 3]]


def test_compressed_list_storage_takes_one_lease_on_its_root(location, clock):
    url = location.new()
    spec = StoreSpec.parse(url, location.options)
    storage = zstore.CompressedListStorage(8, scratch_dir=url, storage_options=location.options)
    storage.set(0, TensorDict(obs=torch.ones(3), ragged=torch.ones(2), batch_size=[]))
    storage.set(1, TensorDict(obs=torch.ones(3), ragged=torch.ones(5), batch_size=[]))
    storage.flush()
    assert lease_record(url, location.options) is not None
    fs, root = spec.filesystem()
    leases = [p for p in fs.find(root) if p.endswith(LEASE_NAME)]
    assert len(leases) == 1  # the inner tables have none: the root's fences their stores
    inner = [storage._table, storage._ragged["ragged"].index, storage._ragged["ragged"].values]
    for table in (st.table for st in inner):
        assert all(group.lease is storage._lease for group in getattr(table, "groups", ()))
    other = Lease(spec)
    with pytest.raises(LeaseError):
        other.ensure()
    storage.cleanup()
    assert lease_record(url, location.options) is None


def test_lease_ttl_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="lease_ttl"):
        zstore.LazyMemmapStorage(4, scratch_dir=str(tmp_path / "rb"), lease_ttl=0)


def test_releasing_after_the_store_is_gone_does_not_recreate_it(tmp_path):
    """Garbage collection may release a lease after a temporary store was deleted."""
    import shutil

    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(8, scratch_dir=url)
    storage.set(0, TensorDict(x=torch.tensor(1), batch_size=[]))
    shutil.rmtree(url)
    storage._lease.release()
    assert not (tmp_path / "rb").exists()


def test_a_read_only_buffer_refuses_writes_without_taking_the_lease(tmp_path):
    url = str(tmp_path / "rb")
    storage = zstore.LazyMemmapStorage(8, scratch_dir=url)
    storage.set(torch.arange(2), rows(0, 2))
    storage.close()
    path = tmp_path / "rb" / METADATA_NAME
    meta = json.loads(path.read_text())
    meta["attributes"]["zstore"]["read_only"] = True
    path.write_text(json.dumps(meta))
    before = path.read_bytes()
    with pytest.raises(zstore.ReadOnlyError):
        zstore.open(url).set(2, TensorDict(x=torch.tensor(2), batch_size=[]))
    assert lease_record(url, {}) is None and path.read_bytes() == before


def test_a_storage_that_wrote_nothing_never_commits_its_stale_view(location):
    """Two objects of one process share the lease; flushing the one that only reads must not
    commit the length it saw when it opened over the other's newer commit."""
    url, writer, reader = written_and_reopened(location)
    writer.set(torch.arange(2, 4), rows(2, 2))
    writer.flush()
    reader.flush()
    pickle.dumps(reader)  # pickling flushes too
    assert committed(url, location.options) == [0, 1, 2, 3]
    writer.close()
    reader.close()
    assert lease_record(url, location.options) is None


def test_a_second_storage_of_the_process_writes_on_from_the_others_commit(location):
    """The second storage object wrote under the lease the process already held without
    reloading: it committed the length it saw at its open (2) over the first one's commit
    of 6 rows, and rows 2..5 were gone from the store."""
    url, first, second = written_and_reopened(location)
    first.set(torch.arange(2, 6), rows(2, 4))
    first.flush()
    writer = zstore.RoundRobinWriter()
    writer.register_storage(second)
    writer.extend(rows(100, 2))
    second.flush()
    assert committed(url, location.options) == [0, 1, 2, 3, 4, 5, 100, 101]
    first.close()
    second.close()


@pytest.mark.parametrize("then", ["writes", "closes"])
def test_a_storage_superseded_in_its_process_stores_and_commits_nothing(location, then):
    """Regression: after a second storage object of the process wrote and committed rows
    2..3, the first one, still open, wrote over them and committed its own length: the
    last commit won and the other's committed rows were gone ("resuming" in a notebook with
    the first buffer alive). Its next write, or its close with rows it had not committed,
    now raises LeaseError and stores nothing; the close releases it all the same."""
    url, first, second = written_and_reopened(location)
    first.set(torch.arange(2, 4), rows(50, 2))  # not committed
    second.set(torch.arange(2, 4), rows(2, 2))
    second.flush()
    with pytest.raises(LeaseError, match="another storage object of this process"):
        if then == "writes":
            first.set(torch.arange(4, 6), rows(60, 2))
            first.flush()
        else:
            first.close()
    assert committed(url, location.options) == [0, 1, 2, 3]
    second.set(torch.arange(4, 5), rows(4, 1))  # the writer writes on
    second.close()
    if then == "writes":  # its rows not committed are dropped, and its close says so
        with pytest.raises(LeaseError, match="another storage object of this process"):
            first.close()
    first.close()  # closed: nothing more is committed
    assert committed(url, location.options) == [0, 1, 2, 3, 4]
    assert lease_record(url, location.options) is None


def test_a_superseded_storage_with_nothing_to_commit_flushes_as_a_no_op(location):
    """A storage whose rows were all committed before a second one of the process wrote
    raised LeaseError at its next ``flush()`` (docs/scaling.md: only one "with rows it has
    not committed" does), so a StorageEnsemble listing it could not be recorded."""
    url, first, second = written_and_reopened(location)
    second.set(torch.arange(2, 4), rows(2, 2))
    second.close()
    first.flush()  # nothing of its own to commit: nothing happens
    zstore.StorageEnsemble(first, scratch_dir=location.new("ensemble"),
                           storage_options=location.options)  # (it flushes every member)
    assert committed(url, location.options) == [0, 1, 2, 3]
    with pytest.raises(LeaseError, match="another storage object of this process"):
        first.set(torch.arange(4, 5), rows(70, 1))  # a write is still refused
    first.close()
    assert committed(url, location.options) == [0, 1, 2, 3]


def test_a_superseded_compressed_list_storage_with_nothing_to_commit_flushes_as_a_no_op(location):
    """The same for a CompressedListStorage: its ``flush()``, and so its ``repr`` (a Jupyter
    cell showing it), ``nbytes`` and pickling (a copied buffer) raised LeaseError."""
    url = location.new()
    first = zstore.CompressedListStorage(8, scratch_dir=url, storage_options=location.options)
    for i in range(3):
        first.set(i, TensorDict(x=torch.tensor(i)))
    first.flush()
    second = zstore.open(url, location.options)
    second.set(3, TensorDict(x=torch.tensor(3)))
    second.flush()
    first.flush()
    assert "len=3" in repr(first) and first.nbytes > 0
    assert pickle.loads(pickle.dumps(first)).get(3)["x"].item() == 3  # (reopens the store)
    with pytest.raises(LeaseError, match="another storage object of this process"):
        first.set(4, TensorDict(x=torch.tensor(70)))  # a write is still refused
    first.close()
    second.close()
    assert [item["x"].item() for item in zstore.open(url, location.options, mode="r")[:]] == \
        [0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "CompressedListStorage", "StorageEnsemble"])
def test_a_with_block_closes_the_storage_and_releases_its_lease(location, kind):
    """``with storage:`` worked for a LazyMemmapStorage only; the other two raised TypeError."""
    url = location.new()
    make = getattr(zstore, "CompressedListStorage" if kind != "LazyMemmapStorage" else kind)
    with make(8, scratch_dir=url, storage_options=location.options) as storage:
        storage.set(0, TensorDict(x=torch.tensor(7)))
        if kind == "StorageEnsemble":
            storage = zstore.StorageEnsemble(storage, scratch_dir=location.new("ensemble"),
                                             storage_options=location.options)
            with storage as ensemble:
                assert ensemble is storage
        assert lease_record(url, location.options) is not None or kind == "StorageEnsemble"
    assert lease_record(url, location.options) is None
    assert zstore.open(url, location.options, mode="r").get(0)["x"].item() == 7


def test_a_refused_write_of_a_second_storage_supersedes_nothing(location):
    """Only rows written make a storage the process's writer: a second storage whose first
    write was refused (a wrong dtype here; a read-only folder in test_errors.py) stored
    nothing, and the first writes and commits on."""
    url, first, second = written_and_reopened(location)
    with pytest.raises(zstore.SchemaError):
        second.set(torch.arange(2, 4), TensorDict(x=torch.zeros(2, dtype=torch.int8),
                                                  batch_size=[2]))
    first.set(torch.arange(2, 4), rows(2, 2))
    first.close()
    assert committed(url, location.options) == [0, 1, 2, 3]
    second.close()


def test_a_store_deleted_under_a_live_storage_can_be_created_again(location):
    """Deleted (``shutil.rmtree``, a notebook's "start over") while a storage of the process
    still used it, the store could not be created again there: the process's lease still
    counted on the deleted lease and ``zarr.json``, and the creation's commit was refused
    with a LeaseError blaming "another writer"."""
    url = location.new()
    first = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options)
    first.set(torch.arange(2), rows(0, 2))
    first.flush()
    StoreSpec.parse(url, location.options).delete()
    again = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options)
    again.set(torch.arange(3), rows(50, 3))
    again.flush()
    assert committed(url, location.options) == [50, 51, 52]
    assert lease_record(url, location.options)["owner"] == again._lease.owner
    again.close()


def test_the_process_forgets_the_lease_of_a_store_no_storage_uses(tmp_path):
    """The process kept a lease object for every URL it ever wrote (about 1 KiB each, its
    spec and client), after close() and cleanup() too."""
    urls = [str(tmp_path / f"rb{i}") for i in range(30)]
    for url in urls:
        storage = zstore.LazyMemmapStorage(16, scratch_dir=url)
        storage.set(torch.arange(2), rows(0, 2))
        storage.close()
        del storage
    gc.collect()
    assert not set(urls) & set(lease_mod._PROCESS_LEASES.keys())


def stored_objects(spec: StoreSpec) -> dict[str, bytes]:
    """Every object of the store but the lease record, with its bytes."""
    fs, root = spec.filesystem()
    fs.invalidate_cache()
    return {path: fs.cat_file(path) for path in fs.find(root) if not path.endswith(LEASE_NAME)}


def written_past_two_committed(location, kind: str):
    """A writer of ``kind`` (ttl 1 s) that committed items 0 and 1, then wrote items 2 and 3
    (held in its cache: the chunk is not full): ``(url, spec, writer, the table they are in)``.

    Uploads it started meanwhile, under its valid lease (a CompressedListStorage's small
    cache stores its dirty chunk to make room), have landed: what a stalled writer must not
    store is what it still buffers, not a request already on the wire (scaling.md §2)."""
    if kind == "LazyMemmapStorage":
        url, spec, writer = committed_two_rows(location)
        writer.set(torch.arange(2, 4), rows(100, 2))
        table = writer.table
    else:
        url = location.new()
        writer = zstore.CompressedListStorage(16, scratch_dir=url,
                                              storage_options=location.options, lease_ttl=1)
        for i in range(4):
            writer.set(i, TensorDict(x=torch.arange(i, i + 3), batch_size=[]))
            if i == 1:
                writer.flush()
        spec, table = StoreSpec.parse(url, location.options), writer._table.table
    for group in table.groups:
        group.writes.drain()
    return url, spec, writer, table


@pytest.mark.parametrize("kind", ["LazyMemmapStorage", "CompressedListStorage"])
@pytest.mark.parametrize("stalled", ["before its store", "inside its store"])
def test_a_writer_stalled_past_its_ttl_stores_none_of_its_buffered_chunks(location, clock,
                                                                          stalled, kind):
    """Also for CompressedListStorage's inner tables, which take no lease of their own:
    the root's fences their stores."""
    if location.kind == "local":
        pytest.skip("a local buffer's rows land in its memory-mapped files as they are written")
    url, spec, writer, table = written_past_two_committed(location, kind)
    if stalled == "inside its store":  # it renewed and started the store, then stalled
        for group in table.groups:
            group.writes.keepalive = None
    clock.now = T0 + 10  # the writer stalls past its ttl; another process takes the lease
    thief = Lease(spec, ttl=60)
    with pytest.warns(UserWarning, match="took over"):
        thief.ensure()
    before = stored_objects(spec)
    # the stalled writer wakes up and stores its buffered chunk without a commit (write-behind)
    expected = "lost the write lease" if stalled == "before its store" else "past its ttl of 1 s"
    with pytest.raises((OSError, LeaseError), match=expected):
        table.flush()
    with pytest.raises((OSError, LeaseError), match="lost the write lease|past its ttl"):
        table.flush()  # and again: a retry stores nothing either
    assert stored_objects(spec) == before  # the other writer's store is untouched
    assert len(zstore.open(url, location.options, mode="r")) == 2
    thief.release()


def test_a_long_write_renews_the_lease_as_its_stores_start(location, clock, monkeypatch):
    if location.kind == "local":
        pytest.skip("a local buffer's rows land in its memory-mapped files as they are written")
    from zstore.writeback import WriteBehind

    start = WriteBehind._start

    def slow_start(self, write):  # each store starts 0.3 s after the one before
        clock.now += 0.3
        start(self, write)

    monkeypatch.setattr(WriteBehind, "_start", slow_start)
    url = location.new()
    writer = zstore.LazyMemmapStorage(4096, scratch_dir=url, storage_options=location.options,
                                      lease_ttl=1, autocommit_seconds=1e9, cache_bytes=2 << 20)
    data = TensorDict(x=torch.arange(4096 * 1024, dtype=torch.float32).reshape(4096, 1024),
                      batch_size=[4096])
    # one extend of 16 MB through a 2 MB cache: its chunks are stored batch by batch
    writer.set(torch.arange(4096), data)
    writer.flush()
    assert clock.now > T0 + 2  # the extend's stores took over twice the ttl ...
    assert lease_record(url, location.options)["renewed"] > clock.now - 1  # ... and renewed it
    assert torch.equal(zstore.open(url, location.options, mode="r")[:]["x"], data["x"])
    writer.close()


def test_a_holder_in_another_pid_namespace_is_not_judged_dead(location, clock):
    """A lease whose holder has this machine's host name and boot id but another pid
    namespace (another container of the host, under ``--network host``) is refused while
    fresh, even where its pid names no process here: that pid is another process's. Without
    the namespace compared, a live writer in the other container was taken for dead and lost
    its lease at once, and its next extend wrote over the taker's rows. In this namespace,
    the same record with a pid that no longer runs is taken over at once, as is an earlier
    zstore's record, which names no namespace."""
    import socket

    from zstore.processes import boot_id, pid_namespace, runs_here

    url = location.new()
    first = zstore.LazyMemmapStorage(16, scratch_dir=url, storage_options=location.options)
    first.set(torch.arange(4), rows(0, 4))
    first.close()
    gone = next(pid for pid in range(2**22 - 1, 1, -1) if not runs_here(pid))
    objects = objects_for(StoreSpec.parse(url, location.options))
    other = f"{pid_namespace()}1"
    # an earlier zstore's record (no "pid_ns") is judged as before: by host and boot id
    for namespace, refused in ((other, True), (pid_namespace(), False), ("absent", False),
                               ("mine, other namespace", True)):
        record = {"version": 1, "owner": f"box/{gone}/abc", "host": socket.gethostname(),
                  "pid": gone, "boot_id": boot_id(), "pid_ns": namespace,
                  "acquired": clock.now, "renewed": clock.now, "ttl": 600.0}
        if namespace == "absent":
            del record["pid_ns"]
        elif namespace.startswith("mine"):  # this pid, in another container: not "this process"
            record.update(pid=os.getpid(), pid_ns=other)
        found = objects.read(LEASE_NAME)
        assert (objects.create(LEASE_NAME, json.dumps(record).encode()) if found is None else
                objects.replace(LEASE_NAME, json.dumps(record).encode(), found[1])) is not None
        again = zstore.open(url, location.options)
        if refused:
            with pytest.raises(LeaseError, match=f"box/{gone}/abc") as info:
                again.set(torch.arange(4, 8), rows(4, 4))
            assert "this process" not in str(info.value)
            assert lease_record(url, location.options)["owner"] == f"box/{gone}/abc"  # not taken
        else:
            with pytest.warns(UserWarning, match="took over the write lease .*no longer runs"):
                again.set(torch.arange(4, 8), rows(4, 4))
            again.close()
    # (each takeover's set() of rows 4..7 also counts 4 rows more, as TorchRL's set does)
    assert committed(url, location.options)[:8] == list(range(8))
