"""Logit dumps: real safetensors files, read in chunks, and every way a pair can be wrong."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import save_file

from orbitctl.align.dumps import check_pair, iter_rows, open_dump
from orbitctl.errors import EXIT_BAD_INPUT, InputFileError


def write(path, **tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


@pytest.fixture
def pair(tmp_path):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 7, generator=gen)
    ids = torch.randint(0, 7, (10,), generator=gen)
    a = write(tmp_path / "a.safetensors", logits=logits, token_ids=ids)
    b = write(tmp_path / "b.safetensors", logits=(logits + 0.01).to(torch.bfloat16), token_ids=ids.to(torch.int32))
    return a, b, logits, ids


def test_open_dump_reads_the_header(pair):
    a, b, _, _ = pair
    da, db = open_dump(a), open_dump(b)
    assert (da.n_tokens, da.vocab, da.dtype, da.has_token_ids) == (10, 7, "F32", True)
    assert (db.n_tokens, db.vocab, db.dtype, db.has_token_ids) == (10, 7, "BF16", True)
    check_pair(da, db)  # same shape, same ids (int64 against int32)


def test_iter_rows_streams_chunks_that_rebuild_the_tensor(pair):
    a, _, logits, ids = pair
    chunks = list(iter_rows(open_dump(a), rows_per_chunk=4))
    assert [start for start, _, _ in chunks] == [0, 4, 8]
    assert [tuple(chunk.shape) for _, chunk, _ in chunks] == [(4, 7), (4, 7), (2, 7)]
    assert torch.equal(torch.cat([chunk for _, chunk, _ in chunks]), logits)
    assert torch.equal(torch.cat([chunk_ids for _, _, chunk_ids in chunks]), ids)


def test_single_floating_matrix_under_another_name_and_no_ids(tmp_path):
    path = write(tmp_path / "d.safetensors", scores=torch.zeros(3, 5, dtype=torch.float16),
                 positions=torch.arange(3), bias=torch.zeros(5))
    dump = open_dump(path)
    header = (dump.logits_key, dump.n_tokens, dump.vocab, dump.dtype, dump.has_token_ids)
    assert header == ("scores", 3, 5, "F16", False)
    ((start, chunk, chunk_ids),) = list(iter_rows(dump, 100))
    assert start == 0 and chunk.dtype == torch.float16 and chunk_ids is None


def test_masked_logits_are_fine_nan_rows_are_named(tmp_path):
    logits = torch.zeros(9, 4)
    logits[2, 1] = float("-inf")  # a masked token
    logits[6, 3] = float("nan")
    dump = open_dump(write(tmp_path / "n.safetensors", logits=logits))
    rows = iter_rows(dump, 4)
    start, chunk, _ = next(rows)
    assert start == 0 and torch.isneginf(chunk[2, 1])
    with pytest.raises(InputFileError, match=r"n\.safetensors: logits row 6 holds NaN or \+inf — fix: "):
        next(rows)


BAD_DUMPS = [
    (lambda p: write(p, logits=torch.zeros(2, 3, 4)), r"tensor logits has rank 3 \[2, 3, 4\], not \[tokens, vocab\]"),
    (lambda p: write(p, logits=torch.zeros(2, 3, dtype=torch.int32)), r"tensor logits is I32, not floating point"),
    (lambda p: write(p, a=torch.zeros(2, 3), b=torch.zeros(2, 3)),
     r"no tensor named logits and 2 2-D floating tensors \(a, b\).* — fix: name the \[tokens, vocab\] tensor "
     r"'logits'"),
    (lambda p: write(p, ids=torch.zeros(2, 3, dtype=torch.int64)),
     r"no tensor named logits and no 2-D floating tensor"),
    (lambda p: write(p, logits=torch.zeros(2, 3), token_ids=torch.zeros(3, dtype=torch.int64)),
     r"tensor token_ids is I64 \[3\], not an integer \[2\]"),
    (lambda p: write(p, logits=torch.zeros(2, 3), token_ids=torch.zeros(2)), r"tensor token_ids is F32 \[2\]"),
    (lambda p: p.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops"), r"not a safetensors file \(.*\) — fix: save"),
]


@pytest.mark.parametrize("make, pattern", BAD_DUMPS)
def test_bad_dump_is_one_line_with_file_and_fix(tmp_path, make, pattern):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(InputFileError) as info:
        open_dump(path)
    message = info.value.render()
    assert message.startswith(f"{path}: ") and re.search(pattern, message), message
    assert "— fix: " in message and "\n" not in message and info.value.exit_code == EXIT_BAD_INPUT


def test_missing_dump(tmp_path):
    with pytest.raises(InputFileError, match=r"x\.safetensors: no such logit dump — fix: pass a \.safetensors"):
        open_dump(tmp_path / "x.safetensors")


def test_pair_with_different_shapes_is_refused(tmp_path):
    a = open_dump(write(tmp_path / "a.safetensors", logits=torch.zeros(4, 8)))
    b = open_dump(write(tmp_path / "b.safetensors", logits=torch.zeros(4, 16)))
    with pytest.raises(InputFileError, match=r"b\.safetensors: logits shape \[4, 16\] differs from .*a\.safetensors's "
                                             r"\[4, 8\] — fix: dump the same tokens"):
        check_pair(a, b)


def test_pair_with_different_token_ids_names_the_first_row(tmp_path):
    ids = torch.arange(6)
    other = ids.clone()
    other[3], other[5] = 40, 41
    a = open_dump(write(tmp_path / "a.safetensors", logits=torch.zeros(6, 50), token_ids=ids))
    b = open_dump(write(tmp_path / "b.safetensors", logits=torch.zeros(6, 50), token_ids=other))
    with pytest.raises(InputFileError, match=r"token_ids differ from .*a\.safetensors's first at row 3 \(40 vs 3\)"):
        check_pair(a, b)
    check_pair(a, open_dump(write(tmp_path / "c.safetensors", logits=torch.ones(6, 50))))  # ids on one side only
