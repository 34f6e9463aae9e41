"""The ragged bench rows (cupa/bench/ragged.py) without a GPU: the lengths each seed fixes, the
paged layout cupa and FlashInfer share (and the head sizes FlashInfer is asked at), the row's
fields, the command line, and one pass of the row's timing code on the numpy backend with a
stand-in for cupy and the timer."""

import argparse
import types

import numpy as np
import pytest

from cupa.bench import ragged
from cupa.bench.features import selected_features
from cupa.bench.harness import copy_floor_us, kv_read_bytes
from cupa.bench.main import add_arguments
from cupa.bench.peers import (FLASHINFER_HEAD_SIZES, flashinfer_page_arrays, flashinfer_peer,
                              prepare_peer)
from cupa.problem import DecodeShape
from cupa.validation import check_table_contents

BLOCK = 16


def bench_args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_longtail64_lengths():
    batch = ragged.ragged_batch("longtail64", BLOCK)
    lens = batch.seq_lens
    assert lens.dtype == np.int32 and len(lens) == 64
    assert lens.min() >= 16 and lens.max() == 32768
    assert (lens == 32768).sum() >= 2           # the forced long tail
    assert 900 <= np.median(lens) <= 1300       # median ~1k
    # What RAGGED_SEED fixes (the module docstring and docs/perf-log.md v17 quote it):
    assert (int(np.median(lens)), batch.total, int((lens >= 16384).sum())) == (1134, 232078, 3)


def test_mixed128_lengths():
    batch = ragged.ragged_batch("mixed128", BLOCK)
    lens = batch.seq_lens
    assert sorted(np.unique(lens, return_counts=True)[1]) == [8, 120]
    assert set(lens.tolist()) == {512, 32768} and batch.total == 8 * 32768 + 120 * 512
    long_at = np.flatnonzero(lens == 32768)
    assert long_at.tolist() != list(range(8)) and long_at.tolist() != list(range(120, 128))
    assert round(batch.padded_ratio, 1) == 13.0


@pytest.mark.parametrize("name", list(ragged.RAGGED_BATCHES))
def test_batches_are_fixed_by_the_seed(name):
    one, two = ragged.ragged_batch(name, BLOCK), ragged.ragged_batch(name, BLOCK)
    assert np.array_equal(one.seq_lens, two.seq_lens)
    assert np.array_equal(one.block_tables, two.block_tables)
    other = ragged.ragged_batch(name, BLOCK, seed=ragged.RAGGED_SEED + 1)
    assert not np.array_equal(one.block_tables, other.block_tables)


@pytest.mark.parametrize("name", list(ragged.RAGGED_BATCHES))
def test_the_cache_holds_exactly_the_real_lengths_blocks(name):
    batch = ragged.ragged_batch(name, BLOCK)
    pages = -(-batch.seq_lens // BLOCK)
    tables = batch.block_tables
    assert tables.dtype == np.int32 and tables.shape == (batch.num_seqs, 32768 // BLOCK)
    owned = np.arange(tables.shape[1])[None, :] < pages[:, None]
    assert batch.num_blocks == pages.sum()
    assert np.array_equal(np.sort(tables[owned]), np.arange(batch.num_blocks))  # each once
    assert (tables[~owned] == -1).all()
    shape = DecodeShape(num_seqs=batch.num_seqs, num_tokens=batch.num_seqs, num_heads=64,
                        num_kv_heads=8, head_size=128, num_blocks=batch.num_blocks,
                        block_size=BLOCK, max_blocks_per_seq=tables.shape[1], dtype="float16",
                        scale=0.1, has_alibi=False)
    check_table_contents(shape, tables, batch.seq_lens)  # what cupa checks of host tables


@pytest.mark.parametrize("name", list(ragged.RAGGED_BATCHES))
def test_flashinfer_sees_the_same_pages(name):
    batch = ragged.ragged_batch(name, BLOCK)
    indptr, indices, last = batch.flashinfer_pages()
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))
    pages = -(-batch.seq_lens // BLOCK)
    assert np.array_equal(np.diff(indptr), pages) and indptr[-1] == len(indices)
    assert ((last >= 1) & (last <= BLOCK)).all()
    assert np.array_equal((pages - 1) * BLOCK + last, batch.seq_lens)
    for s in range(batch.num_seqs):  # token t of sequence s: the same block either way
        t = np.arange(0, batch.seq_lens[s], 7)
        assert np.array_equal(batch.block_tables[s, t // BLOCK],
                              indices[indptr[s] + t // BLOCK])


def test_flashinfer_arrays_of_a_uniform_batch():
    """One length for all: the arrays the uniform main table built before (arange indptr, the
    whole table in order, one last-page length)."""
    tables = np.random.default_rng(0).permutation(4 * 5).astype(np.int32).reshape(4, 5)
    indptr, indices, last = flashinfer_page_arrays(tables, 70, BLOCK)
    assert np.array_equal(indptr, np.arange(0, 21, 5))
    assert np.array_equal(indices, tables.reshape(-1))
    assert np.array_equal(last, np.full(4, 70 - 4 * BLOCK))
    # An empty sequence owns no page.
    indptr, indices, last = flashinfer_page_arrays(tables, [70, 0, 16, 1], BLOCK)
    assert indptr.tolist() == [0, 5, 5, 6, 7] and last.tolist() == [6, 0, 16, 1]
    assert indices.tolist() == tables[0].tolist() + [tables[2, 0], tables[3, 0]]


@pytest.mark.parametrize("head_size", [80, 96, 112])
def test_flashinfer_is_not_asked_at_head_sizes_where_it_faulted(head_size, capsys):
    """Heads 80 and 96 crashed FlashInfer 0.7.2's decode (an illegal address ends the process's
    CUDA context): the bench leaves FlashInfer out there, with the reason, before touching any
    array or importing it."""
    assert head_size not in FLASHINFER_HEAD_SIZES
    args = bench_args("--head-size", str(head_size))
    assert prepare_peer("flashinfer", flashinfer_peer, None, None, None, None, None, 4096,
                        args) is None
    assert f"head size {head_size} is not asked of FlashInfer" in capsys.readouterr().err


def test_a_row_carries_the_main_tables_fields_and_the_read_floor():
    args = bench_args()
    batch = ragged.ragged_batch("mixed128", BLOCK)
    figures = dict(cupa_us=400.0, cupa_eager_us=410.0, cupa_longest_hint_us=700.0,
                   flashinfer_us=600.0, flashinfer_eager_us=615.0, partition_size=3328,
                   max_partitions=10, merge="reduce", longest_hint_partition_size=32768,
                   longest_hint_max_partitions=1)
    row = ragged.ragged_row(batch, args, 4.3, figures)
    main_fields = ("batch", "seq_len", "num_heads", "num_kv_heads", "head_size", "dtype",
                   "block_size", "kv_bytes", "cupa_us", "sdpa_us", "flashinfer_us",
                   "cupa_eager_us", "sdpa_eager_us", "flashinfer_eager_us")
    assert set(main_fields) <= set(row)
    assert row["ragged"] == "mixed128" and row["seed"] == ragged.RAGGED_SEED
    assert row["kv_bytes"] == 2 * batch.total * 8 * 128 * 2 == kv_read_bytes(batch.total, args)
    assert row["read_floor_us"] == pytest.approx(row["kv_bytes"] / 4.3e12 * 1e6)
    assert row["read_floor_us"] == copy_floor_us(row["kv_bytes"], 4.3)
    assert row["read_floor_fraction"] == pytest.approx(row["read_floor_us"] / 400.0)
    assert row["vs_flashinfer_us"] == 1.5 and row["vs_flashinfer_eager_us"] == 1.5
    assert row["sdpa_us"] is None and "padded" in row["sdpa_skipped"]
    assert (row["batch"], row["seq_len"], row["total_seq_len"]) == (128, 32768, 323584)
    line = ragged.ragged_line(row)
    assert "mixed128" in line and "1.50x" in line and "3328 x 10 reduce" in line


def test_a_row_without_flashinfer_or_timings_still_prints():
    row = ragged.ragged_row(ragged.ragged_batch("longtail64", BLOCK), bench_args(), 4.3, {})
    assert row["flashinfer_us"] is None and row["vs_flashinfer_us"] is None
    assert row["read_floor_fraction"] is None
    assert "longtail64" in ragged.ragged_line(row)
    failed = dict(ragged="mixed128", error="RuntimeError: no kernel")
    assert "failed: RuntimeError: no kernel" in ragged.ragged_line(failed)


def test_the_command_line_selects_the_ragged_rows():
    assert ragged.selected_ragged(None, with_features=False) == []
    assert ragged.selected_ragged(None, with_features=True) == ["longtail64", "mixed128"]
    assert ragged.selected_ragged("all", with_features=False) == ["longtail64", "mixed128"]
    assert ragged.selected_ragged("none", with_features=True) == []
    assert ragged.selected_ragged("mixed128", with_features=False) == ["mixed128"]
    with pytest.raises(SystemExit, match="--ragged: unknown"):
        ragged.selected_ragged("mixed", with_features=False)
    assert bench_args("--ragged").ragged == "all"
    assert bench_args("--ragged", "longtail64").ragged == "longtail64"
    assert "ragged" in selected_features("all")
    assert selected_features("fp8") == ["fp8"] and selected_features(None) == []
    with pytest.raises(SystemExit, match="--features: unknown"):
        selected_features("window,bogus")


class FakeTimer:
    """median_us calls the launch once (so that it runs) and reports a fixed time."""
    def __init__(self, us):
        self.us, self.calls = us, 0

    def median_us(self, launch):
        launch()
        self.calls += 1
        return self.us


def fake_cupy(seed=0):
    """Just what the ragged rows ask of cupy, on numpy (so decode takes its numpy backend)."""
    rng = np.random.default_rng(seed)
    return types.SimpleNamespace(
        float32=np.float32, asarray=np.asarray, empty_like=np.empty_like,
        random=types.SimpleNamespace(
            standard_normal=lambda shape, dtype: rng.standard_normal(shape).astype(dtype)))


@pytest.mark.parametrize("kv_layout", ["HND", "NHD"])
def test_the_rows_timing_code_runs_end_to_end(monkeypatch, capsys, kv_layout):
    """The whole row on the numpy backend with two heads of size 64: cupa's two hint
    sets, the plans, the FlashInfer peer (not installed here, or failing without a GPU: left
    out of the row, never fatal), the printed lines; the caches in either layout."""
    monkeypatch.setattr(ragged, "eager_us", lambda cupy, launch: (launch(), 250.0)[1])
    args = bench_args("--heads", "2", "--kv-heads", "2", "--head-size", "64",
                      "--kv-layout", kv_layout)
    timer = FakeTimer(200.0)
    rows = ragged.ragged_rows(fake_cupy(), timer, args, 4.3, ["longtail64", "mixed128"])
    assert [r["ragged"] for r in rows] == ["longtail64", "mixed128"] and timer.calls == 4
    for row in rows:
        assert "error" not in row and row["kv_layout"] == kv_layout
        assert row["cupa_us"] == 200.0 and row["cupa_eager_us"] == 250.0
        assert row["cupa_longest_hint_us"] == 200.0 and row["flashinfer_us"] is None
        assert row["read_floor_fraction"] == pytest.approx(row["read_floor_us"] / 200.0)
    printed = capsys.readouterr()
    assert "longtail64" in printed.out and "[ragged 2/2 done" in printed.err


def test_a_failing_row_is_recorded_not_raised(monkeypatch, capsys):
    def broken(*a):
        raise RuntimeError("compile failed")
    monkeypatch.setattr(ragged, "time_ragged", broken)
    rows = ragged.ragged_rows(fake_cupy(), FakeTimer(1.0), bench_args(), 4.3, ["mixed128"])
    assert rows == [dict(ragged="mixed128", seed=ragged.RAGGED_SEED,
                         error="RuntimeError: compile failed")]
    assert "mixed128 failed: RuntimeError: compile failed" in capsys.readouterr().out
