"""The split and offset planner: pure arithmetic, checked with Hypothesis."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorio._plan import Mode, piece_size, plan_pieces

ALIGN = 4096


@settings(max_examples=400, deadline=None)
@given(
    offset=st.integers(0, 1 << 40),
    nbytes=st.integers(0, 1 << 24),
    buf_addr=st.integers(0, 1 << 40),
    block_size=st.integers(1, 4096).map(lambda k: k * 512),
    direct=st.booleans(),
)
def test_pieces_tile_the_request_and_respect_alignment(offset, nbytes, buf_addr, block_size, direct):
    pieces = plan_pieces(offset=offset, nbytes=nbytes, buf_addr=buf_addr, block_size=block_size,
                         direct=direct, align=ALIGN)
    # Exact tiling, in file order, with buffer offsets that follow the file offsets.
    position = offset
    for piece in pieces:
        assert piece.file_offset == position
        assert piece.buf_offset == piece.file_offset - offset
        assert 0 < piece.length <= piece_size(block_size, direct, ALIGN)
        position += piece.length
    assert position == offset + nbytes
    if not direct:
        assert all(p.mode is Mode.BUFFERED for p in pieces)
        return
    body = [p for p in pieces if p.mode is not Mode.BUFFERED]
    for piece in body:
        assert piece.file_offset % ALIGN == 0 and piece.length % ALIGN == 0
        assert (piece.mode is Mode.DIRECT) == ((buf_addr + piece.buf_offset) % ALIGN == 0)
    if body:  # only an unaligned head and tail go through the page cache, each shorter than a page
        heads_tails = [p for p in pieces if p.mode is Mode.BUFFERED]
        assert len(heads_tails) <= 2 and all(p.length < ALIGN for p in heads_tails)
    direct_pages = {page for p in pieces if p.mode is not Mode.BUFFERED
                    for page in range(p.file_offset // ALIGN, (p.file_offset + p.length) // ALIGN)}
    buffered_pages = {page for p in pieces if p.mode is Mode.BUFFERED
                      for page in range(p.file_offset // ALIGN, (p.file_offset + p.length - 1) // ALIGN + 1)}
    assert not direct_pages & buffered_pages


def test_examples():
    aligned = plan_pieces(offset=0, nbytes=3 * ALIGN, buf_addr=ALIGN * 10, block_size=2 * ALIGN, direct=True,
                          align=ALIGN)
    assert [(p.file_offset, p.length, p.mode) for p in aligned] == [(0, 8192, Mode.DIRECT), (8192, 4096, Mode.DIRECT)]
    odd = plan_pieces(offset=7, nbytes=2 * ALIGN, buf_addr=ALIGN, block_size=ALIGN, direct=True, align=ALIGN)
    assert [(p.file_offset, p.length, p.mode) for p in odd] == [
        (7, 4089, Mode.BUFFERED), (4096, 4096, Mode.STAGED), (8192, 7, Mode.BUFFERED)]
    assert plan_pieces(offset=5, nbytes=0, buf_addr=0, block_size=512, direct=True, align=ALIGN) == []
