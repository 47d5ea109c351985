"""Store format 2: records packed back to back at 64 bytes in a segment (not padded to 4 KiB
pages). The tiny layout's records span 1,792 bytes, so most of them start mid-page and many
straddle a page boundary: every read and write must still be whole pages at page offsets
(O_DIRECT), and a footer that places a record off the 64-byte grid or over another record
must never be trusted."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dsv41.cache import io
from dsv41.cache.store import format as sf

from .helpers import B, LAYOUT, key, load_all, open_store, rand_tokens, token_rows, write_chain

PAGE = sf.PAGE


def segments(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if sf.parse_segment_name(n))


def _span() -> int:
    return sf.record_geometry(B, len(key()), LAYOUT.block_bytes)[2]


class _AlignedIO:
    """Wraps a store's engine: records every read op and chunk write, and fails the test
    on one that is not whole pages at a page offset into a page-aligned buffer position
    (what O_DIRECT needs; on a filesystem without O_DIRECT the engine would not refuse)."""

    def __init__(self, st, monkeypatch):
        self.reads, self.writes = [], []
        eng = st._eng
        real_submit, real_pread, inner = eng.submit_write, eng.pread, eng._eng
        outer = self

        def submit_write(fd, offset, buf, buf_offset, length):
            assert offset % PAGE == 0 and length % PAGE == 0 and buf_offset % PAGE == 0 and length > 0
            outer.writes.append((offset, length))
            return real_submit(fd, offset, buf, buf_offset, length)

        def pread(ops):
            for op in ops:
                assert op[1] % PAGE == 0 and op[2] % PAGE == 0 and op[4] % PAGE == 0, op[:3]
                outer.reads.append((op[1], op[2]))
            return real_pread(ops)

        class Inner:
            def read_records(self, ops, *a):
                for fd, off, length, buf, boff, specs in ops:
                    assert off % PAGE == 0 and length % PAGE == 0 and boff % PAGE == 0, (off, length, boff)
                    outer.reads.append((off, length))
                return inner.read_records(ops, *a)

            def __getattr__(self, name):
                return getattr(inner, name)

        monkeypatch.setattr(eng, "submit_write", submit_write)
        monkeypatch.setattr(eng, "pread", pread)
        monkeypatch.setattr(eng, "_eng", Inner())


def _check_packed(path, st) -> list[dict]:
    """Every segment's records (all live) lie back to back from 4096, each at the previous
    one's end; its fill after record_bytes and the gap up to the footer page are zeros.
    Returns the record infos."""
    infos = [st.record_info(r) for r in st.record_ids()]
    span = _span()
    rb = sf.record_geometry(B, len(key()), LAYOUT.block_bytes)[1]
    for name in {i["segment"] for i in infos}:
        offs = sorted(i["offset"] for i in infos if i["segment"] == name)
        assert all(i["span_bytes"] == span for i in infos)
        data = (path / name).read_bytes()
        trailer = sf.decode_trailer(data[-PAGE:])
        assert offs == [PAGE + k * span for k in range(len(offs))]  # (every record is live)
        end = offs[-1] + span
        assert trailer.footer_offset == io.align_up(end) and not any(data[end: trailer.footer_offset])
        for o in offs:
            assert o % sf.RECORD_ALIGN == 0 and not any(data[o + rb: o + span])
    return infos


@pytest.mark.parametrize("chunk", [1, 3 * PAGE, None])
def test_packed_segments_round_trip_reopen_verify_compact_and_scan(tmp_path, monkeypatch, chunk):
    """chunk 1: every record is a chunk of its own, so most chunks hold less than a page
    after their carried bytes and write nothing (all carried on); 3 pages: records split
    across chunk writes; None: one 4 MiB chunk."""
    from dsv41.cache.store import writer
    if chunk is not None:
        monkeypatch.setattr(writer, "WRITE_CHUNK", chunk)
    rng = np.random.default_rng(21)
    chains = [rand_tokens(rng, n * B) for n in (5, 9, 3, 7)]
    with open_store(tmp_path, durability="fsync") as st:
        spy = _AlignedIO(st, monkeypatch)
        written = [write_chain(st, t, key(), commit=False) for t in chains]
        st.commit()
        assert spy.writes
        infos = _check_packed(tmp_path, st)
        offs = sorted(i["offset"] for i in infos)
        assert offs == [PAGE + k * _span() for k in range(24)]  # one segment, packed
        assert any(o % PAGE for o in offs)
        for t, (_, rids, pays) in zip(chains, written):
            got, out = load_all(st, t, key())
            assert got == rids and np.array_equal(out, pays)
        assert all(o % PAGE == 0 and n % PAGE == 0 for o, n in spy.reads)
    with open_store(tmp_path) as st:  # from the footer
        assert st.counts["damaged_segments"] == 0 and len(st) == 24
        spy = _AlignedIO(st, monkeypatch)
        assert st.verify()["corrupt"] == 0
        for t, (_, rids, pays) in zip(chains, written):
            got, out = load_all(st, t, key())
            assert got == rids and np.array_equal(out, pays)
        # Compaction copies the live records into a new segment, packed the same way.
        st._delete(written[0][1][0], "explicit")
        rep = st.gc(compact_dead_fraction=0.01)  # any dead bytes: compact
        assert rep["segments_compacted"] == 1 and len(st) == 19
        assert len(segments(tmp_path)) == 1
        infos = _check_packed(tmp_path, st)
        assert sorted(i["offset"] for i in infos) == [PAGE + k * _span() for k in range(19)]
    # A crash-damaged trailer: recovery scans the record headers and finds them all.
    name = segments(tmp_path)[0]
    with open(tmp_path / name, "r+b") as f:
        f.seek(os.path.getsize(tmp_path / name) - 100)
        f.write(b"\xde\xad")
    with open_store(tmp_path) as st:
        assert st.counts["damaged_segments"] == 1 and len(st) == 19
        assert sorted(st.record_info(r)["offset"] for r in st.record_ids()) == \
            [PAGE + k * _span() for k in range(19)]
        for t, (_, rids, pays) in list(zip(chains, written))[1:]:
            got, out = load_all(st, t, key())
            assert got == rids and np.array_equal(out, pays)
        assert st.verify()["corrupt"] == 0


def test_a_scan_resyncs_on_the_next_64_bytes_after_a_damaged_header(tmp_path):
    rng = np.random.default_rng(22)
    t = rand_tokens(rng, 8 * B)
    with open_store(tmp_path) as st:
        hashes, rids, pays = write_chain(st, t, key())
        info = st.record_info(rids[3])
    name = segments(tmp_path)[0]
    with open(tmp_path / name, "r+b") as f:
        f.seek(info["offset"] + 20)  # record 3's header fails its CRC
        f.write(b"\xff\xff")
        f.seek(os.path.getsize(tmp_path / name) - 100)  # and the trailer: scan
        f.write(b"\xde\xad")
    with open_store(tmp_path) as st:
        assert st.counts["damaged_segments"] == 1
        # Records 4-7 are found again (resync) but are orphans without record 3.
        assert sorted(st.record_ids()) == rids[:3]
        got, out = load_all(st, t, key())
        assert got == rids[:3] and np.array_equal(out, pays[:3])


def test_records_straddling_pages_and_groups_starting_mid_page_read_whole(tmp_path, monkeypatch):
    rng = np.random.default_rng(23)
    t = rand_tokens(rng, 12 * B)
    with open_store(tmp_path) as st:
        hashes, rids, pays = write_chain(st, t, key())
        spy = _AlignedIO(st, monkeypatch)
        offs = [st.record_info(r)["offset"] for r in rids]
        span = _span()
        straddle = [i for i, o in enumerate(offs) if o % PAGE and o // PAGE != (o + span - 1) // PAGE]
        assert straddle, offs
        toks = token_rows(t, 12)
        for i in straddle:  # one record alone: the pages around it are read
            out = np.zeros((1, LAYOUT.block_bytes), np.uint8)
            assert st.read([rids[i]], toks[i: i + 1], key(), out) == ["ok"]
            assert np.array_equal(out[0], pays[i])
            lo, n = spy.reads[-1]
            assert lo == offs[i] // PAGE * PAGE and lo + n == io.align_up(offs[i] + span)
        # A group whose first record starts mid-page, on the host and the device path.
        k = straddle[0]
        spy.reads.clear()
        out = np.zeros((12 - k, LAYOUT.block_bytes), np.uint8)
        assert st.read(rids[k:], toks[k:], key(), out) == ["ok"] * (12 - k)
        assert np.array_equal(out, pays[k:])
        assert spy.reads == [(offs[k] // PAGE * PAGE, io.align_up(offs[-1] + span) - offs[k] // PAGE * PAGE)]
        dst = torch.zeros(12 - k, LAYOUT.block_bytes, dtype=torch.uint8)
        assert st.load(key(), hashes[k:], toks[k:], dst, parent=rids[k - 1]) == rids[k:]
        assert np.array_equal(dst.numpy(), pays[k:])
        assert all(o % PAGE == 0 and n % PAGE == 0 for o, n in spy.reads)


def test_a_short_read_of_a_straddling_record_is_truncated(tmp_path):
    """The file cut inside a record that straddles a page: the aligned read comes back
    short, the record is 'truncated' (never served), the records before it load."""
    rng = np.random.default_rng(24)
    t = rand_tokens(rng, 6 * B)
    with open_store(tmp_path) as st:
        hashes, rids, pays = write_chain(st, t, key())
        offs = [st.record_info(r)["offset"] for r in rids]
        span = _span()
        i = next(i for i, o in enumerate(offs) if o % PAGE and o // PAGE != (o + span - 1) // PAGE)
        seg = tmp_path / st.record_info(rids[i])["segment"]
        os.truncate(seg, (offs[i] + span - 1) // PAGE * PAGE)  # its last page is gone
        out = np.zeros((6, LAYOUT.block_bytes), np.uint8)
        got = st.load(key(), hashes, token_rows(t, 6), out)
        assert got == rids[:i] and np.array_equal(out[:i], pays[:i]) and not out[i:].any()
        assert st.metrics.checksum_failures.value(kind="truncated") >= 1


def _rewrite_footer(seg_path, edit) -> None:
    """Applies edit(entries) to a segment's footer entries and writes the footer back with
    a valid CRC and a matching trailer: only the offsets' rule can reject it."""
    data = bytearray(seg_path.read_bytes())
    trailer = sf.decode_trailer(bytes(data[-PAGE:]))
    entries, keys = sf.decode_footer(bytes(data[trailer.footer_offset: trailer.footer_offset + trailer.footer_bytes]))
    edit(entries)
    footer = sf.encode_footer(entries, keys)
    assert len(footer) == trailer.footer_bytes
    data[trailer.footer_offset: trailer.footer_offset + len(footer)] = footer
    trailer.footer_crc = io.crc32c(footer)
    data[-PAGE:] = sf.encode_trailer(trailer)
    seg_path.write_bytes(bytes(data))


@pytest.mark.parametrize("crafted", ["misaligned", "overlapping", "past_footer", "in_header"])
def test_a_crafted_footer_offset_is_corruption_never_served(tmp_path, crafted):
    rng = np.random.default_rng(25)
    t = rand_tokens(rng, 6 * B)
    with open_store(tmp_path) as st:
        hashes, rids, pays = write_chain(st, t, key())
    seg = tmp_path / segments(tmp_path)[0]
    span = _span()

    def edit(e):
        if crafted == "misaligned":
            e["offset"][5] += 8  # off the 64-byte grid, overlapping nothing (the last record)
        elif crafted == "overlapping":
            e["offset"][2] = e["offset"][1] + 64  # 64-aligned, over record 1's bytes
        elif crafted == "past_footer":
            e["offset"][5] += span  # runs into the footer page
        else:
            e["offset"][0] = PAGE - 64  # over the segment header

    _rewrite_footer(seg, edit)
    with open_store(tmp_path) as st:
        # The footer is not trusted: the segment is indexed by scanning the records'
        # headers, which finds every record at its real offset.
        assert st.counts["damaged_segments"] == 1 and len(st) == 6
        assert [st.record_info(r)["offset"] for r in rids] == [PAGE + k * span for k in range(6)]
        got, out = load_all(st, t, key())
        assert got == rids and np.array_equal(out, pays)
        assert st.metrics.checksum_failures.total() == 0 and st.verify()["corrupt"] == 0


def test_a_format_1_store_is_refused_at_its_manifest(tmp_path):
    """Store format 1 padded records to 4 KiB: a directory of that format is another
    format, refused (or opened as an empty tier) like any other manifest mismatch."""
    import json

    from dsv41.cache.errors import StoreMismatchError
    rng = np.random.default_rng(26)
    with open_store(tmp_path) as st:
        write_chain(st, rand_tokens(rng, 2 * B), key())
    m = tmp_path / sf.MANIFEST_NAME
    fields = json.loads(m.read_text())
    assert fields["store_format_version"] == sf.STORE_FORMAT_VERSION == 2
    fields["store_format_version"] = 1
    fields["checksum"] = sf.manifest_checksum(fields)
    m.write_text(json.dumps(fields))
    with pytest.raises(StoreMismatchError, match="store format version 1"):
        open_store(tmp_path)
    with pytest.warns(UserWarning, match="format"):
        with open_store(tmp_path, on_mismatch="empty") as st:
            assert len(st) == 0
    # Records keep their own format version: the remote tier's values are unchanged.
    assert sf.RECORD_FORMAT_VERSION == 1
