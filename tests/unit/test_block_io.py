"""The disk tier's batched block I/O, compiled (kvd_server.tiers.disk._blockio) and its pure-Python twin
(kvd_server/tiers/disk/block_io.py): on the same batches they write the same bytes and give the same
results (CRCs, good / corrupt / short / errors), and the compiled one refuses bad input with
an exception, never a crash. The twin runs everywhere; the compiled one where it was built (in
CI it is: `make test` builds it)."""

from __future__ import annotations

import errno
import os
import random
import zlib

import pytest

from kvd_server.tiers.disk import block_io

try:
    from kvd_server.tiers.disk import _blockio
except ImportError:                      # no compiler at install: the twin only
    _blockio = None

KINDS = ["python"] + (["compiled"] if _blockio is not None else [])
needs_native = pytest.mark.skipif(_blockio is None, reason="kvd_server.tiers.disk._blockio was not "
                                  "built (no C compiler or Python headers at install)")


def ops(kind: str):
    if kind == "python":
        return block_io.py_write_blocks, block_io.py_read_blocks
    return _blockio.write_blocks, _blockio.read_blocks


@pytest.fixture
def fd(tmp_path):
    f = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    yield f
    os.close(f)


def test_the_switch_names_what_is_in_use():
    assert (block_io.write_blocks is not block_io.py_write_blocks) == block_io.NATIVE
    assert block_io.error(-errno.ENOSPC).errno == errno.ENOSPC


_CRC_CHECK = """
import random, zlib
from kvd_server.tiers.disk import _blockio
rng = random.Random(5)
big = rng.randbytes(1 << 20)
for n in list(range(0, 200)) + [4095, 4096, 65536, 65536 + 3, 262144 + 13, 1 << 20]:
    for start in (0, 1, 7, 16):
        data = memoryview(big)[start:start + n]
        for value in (0, 1234, 0xFFFFFFFF):
            assert _blockio.crc32(data, value) == zlib.crc32(data, value), (n, start, value)
print(_blockio.CLMUL)
"""


@needs_native
@pytest.mark.parametrize("clmul", [True, False])
def test_the_compiled_crc_is_zlibs_at_every_length_start_and_seed(clmul):
    """The carry-less-multiply path (where the CPU has one) and zlib's own give zlib's
    values, whatever the length (under and over the 64 bytes the fast path needs), the
    buffer's alignment and the running value; KVD_NO_CLMUL=1 forces zlib's."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("KVD_NO_CLMUL", None)
    if not clmul:
        env["KVD_NO_CLMUL"] = "1"
    r = subprocess.run([sys.executable, "-c", _CRC_CHECK], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if not clmul:
        assert r.stdout.strip() == "0"


@pytest.mark.parametrize("kind", KINDS)
def test_writes_then_reads_give_the_same_results_on_both(kind, fd):
    """A batch written by one path reads back on the other: every good block whole, a
    corrupt or torn one refused, nothing copied into a destination unless good."""
    write, _ = ops(kind)
    rng = random.Random(kind)
    blocks = [bytearray(rng.randbytes(8192)) for _ in range(6)]
    lengths = [8192, 8000, 1, 0, 4096, 8191]
    crcs = write(fd, [(b, i * 8192, n) for i, (b, n) in enumerate(zip(blocks, lengths))])
    assert crcs == [zlib.crc32(bytes(b[:n])) for b, n in zip(blocks, lengths)]
    for other in KINDS:
        _, read = ops(other)
        bufs = [bytearray(8192) for _ in blocks]
        dests = [bytearray(8192) for _ in blocks]
        wrong = crcs[1] ^ 1
        items = [(bufs[0], 0, 8192, crcs[0], dests[0]),
                 (bufs[1], 8192, 8000, wrong, dests[1]),            # corrupt
                 (bufs[2], 2 * 8192, 1, crcs[2], None),              # no destination
                 (bufs[3], 3 * 8192, 0, crcs[3], dests[3]),
                 (bufs[4], 4 * 8192, 4096, crcs[4], dests[4]),
                 (bufs[5], 6 * 8192, 100, 0, dests[5])]              # past the end: short
        assert read(fd, items) == [1, 0, 1, 1, 1, 0]
        assert dests[0] == blocks[0] and bufs[2] == blocks[2]
        assert dests[1] == bytearray(8192) and dests[5] == bytearray(8192)
        assert dests[4][:4096] == blocks[4][:4096] and dests[4][4096:] == bytearray(4096)


@pytest.mark.parametrize("kind", KINDS)
def test_errors_are_per_block_and_negative(kind, fd, tmp_path):
    write, read = ops(kind)
    assert write(-1, [(b"x" * 16, 0, 16)]) == [-errno.EBADF]
    assert read(-1, [(bytearray(16), 0, 16, 0, None)]) == [-errno.EBADF]
    ro = os.open(tmp_path / "data", os.O_RDONLY)
    try:
        assert write(ro, [(b"x" * 16, 0, 16), (b"y" * 16, 16, 16)]) == [-errno.EBADF] * 2
    finally:
        os.close(ro)
    assert write(fd, []) == [] and read(fd, []) == []


@needs_native
@pytest.mark.parametrize("items, error", [
    ([(1, 2)], TypeError),                                  # not a 3-tuple
    ([(b"x", 0)], TypeError),
    ([(b"x", 0, 20)], ValueError),                          # length past the buffer
    ([(b"x", -1, 1)], ValueError),                          # a negative offset
    ([("text", 0, 1)], TypeError),                          # no buffer
    (5, TypeError),                                         # not a sequence
])
def test_compiled_writes_refuse_bad_items(items, error, fd):
    with pytest.raises(error):
        _blockio.write_blocks(fd, items)


@needs_native
@pytest.mark.parametrize("item, error", [
    ((b"read-only", 0, 1, 0, None), BufferError),           # a read needs a writable buffer
    ((bytearray(8), 0, 8, 1 << 40, None), (ValueError, OverflowError)),   # not a CRC-32
    ((bytearray(8), 0, 8, 0, bytearray(4)), ValueError),    # a destination too small
    ((bytearray(8), 0, 8, 0, b"ro-dest!"), BufferError),
])
def test_compiled_reads_refuse_bad_items(item, error, fd):
    with pytest.raises(error):
        _blockio.read_blocks(fd, [item])


@pytest.mark.parametrize("kind", KINDS)
def test_copy_into_copies_to_the_start_and_refuses_what_does_not_fit(kind):
    copy = block_io.py_copy_into if kind == "python" else _blockio.copy_into
    for n in (0, 5, 1 << 16, (1 << 16) + 3):                  # under and over the GIL release
        dest = bytearray(b"\xee" * (n + 8))
        data = random.Random(n).randbytes(n)
        copy(dest, memoryview(data))
        assert dest[:n] == data and dest[n:] == b"\xee" * 8
    with pytest.raises(ValueError, match="longer"):
        copy(bytearray(3), b"abcd")
    if kind == "compiled":
        with pytest.raises(TypeError):
            copy(b"read-only", b"x")


@pytest.mark.parametrize("kind", KINDS)
def test_back_to_back_blocks_move_as_one_request_with_the_same_results(kind, fd):
    """Blocks in consecutive places of the file (as demoted together) are read in one request
    (the compiled path; at most 64 a request) with per-block results as one by one: every
    byte where it belongs, a run cut by the file's end read whole up to it and short after."""
    write, read = ops(kind)
    rng = random.Random(7)
    blocks = [rng.randbytes(4096) for _ in range(70)]          # over one request's 64
    places = [i * 4096 for i in range(70)]
    places[40:] = [p + 8192 for p in places[40:]]                # a gap: two runs
    crcs = write(fd, list(zip(blocks, places, [4096] * 70)))
    assert crcs == [zlib.crc32(b) for b in blocks]
    for block, place in zip(blocks, places):
        assert os.pread(fd, 4096, place) == block
    bufs = [bytearray(4096) for _ in range(72)]
    end = places[-1] + 4096
    items = [(b, p, 4096, c, None) for b, p, c in zip(bufs, places, crcs)]
    items += [(bufs[70], end, 4096, 0, None), (bufs[71], end + 4096, 4096, 0, None)]
    assert read(fd, items) == [1] * 70 + [0, 0]                  # the last two: past the end
    assert [bytes(b) for b in bufs[:70]] == blocks
