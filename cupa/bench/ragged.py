"""`python -m cupa bench --ragged`: batches of unequal lengths, cupa against FlashInfer (issue 23).

Two batches, each fixed by RAGGED_SEED, at the main table's heads, dtype and block size:

- longtail64: 64 lengths from a lognormal of median 1024 (sigma 1.5) clipped to [16, 32768],
  two of them set to 32768 (with this seed: median 1134, 232078 tokens, 3 sequences >= 16k);
- mixed128: 8 sequences of 32768 among 120 of 512, in a seeded order.

The cache holds the real lengths' blocks only, shuffled as in the main table; the block tables
are as wide as the longest sequence, -1 past each sequence's blocks. cupa gets both length hints
(max_seq_len, total_seq_len), which a serving loop has on the host, and is timed again with the
longest length alone (the plan cupa made for these batches before the ragged rule). FlashInfer's
paged decode gets the same pages as indptr / indices / last_page_len and balances the lengths
in its plan(). SDPA is left out: its dense KV would be padded to the longest sequence, 9.0x and
13.0x the bytes these batches read, which would measure the padding, not the kernel.

Everything but the timing is plain numpy (`ragged_batch`), so that the rows' construction is
tested without a GPU (tests/unit/test_bench_ragged.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np

from ..api import decode, plan_decode
from ..problem import DEFAULT_KV_LAYOUT
from .harness import copy_floor_us, eager_us, kv_read_bytes, random_kv, random_query
from .peers import flashinfer_page_arrays, flashinfer_peer, prepare_peer

RAGGED_SEED = 0
SDPA_SKIPPED = ("dense attention needs the KV padded to the longest sequence "
                "(padded / real bytes in padded_ratio)")


@dataclass(frozen=True)
class LongTail:
    """Lognormal lengths: most sequences short, a few up to `longest`."""
    num_seqs: int = 64
    median: int = 1024
    sigma: float = 1.5
    shortest: int = 16
    longest: int = 32768
    forced_longest: int = 2  # sequences set to `longest`, so that every draw has a long tail

    def lengths(self, rng) -> np.ndarray:
        drawn = rng.lognormal(np.log(self.median), self.sigma, self.num_seqs)
        lens = np.clip(np.rint(drawn), self.shortest, self.longest).astype(np.int32)
        lens[rng.choice(self.num_seqs, self.forced_longest, replace=False)] = self.longest
        return lens


@dataclass(frozen=True)
class Mixed:
    """A few long sequences among many short ones, in a random order."""
    long: int = 8
    long_len: int = 32768
    short: int = 120
    short_len: int = 512

    def lengths(self, rng) -> np.ndarray:
        lens = np.array([self.long_len] * self.long + [self.short_len] * self.short, np.int32)
        return rng.permutation(lens).astype(np.int32)


RAGGED_BATCHES = {"longtail64": LongTail(), "mixed128": Mixed()}


@dataclass(frozen=True)
class RaggedBatch:
    """A ragged batch's lengths and paged layout, as host (numpy) arrays."""
    name: str
    seq_lens: np.ndarray      # int32 [num_seqs]
    block_tables: np.ndarray  # int32 [num_seqs, blocks of the longest]; -1 past a sequence's
    num_blocks: int           # the cache's blocks: exactly the sequences' own
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def longest(self) -> int:
        return int(self.seq_lens.max())

    @property
    def total(self) -> int:
        return int(self.seq_lens.sum(dtype=np.int64))

    @property
    def padded_ratio(self) -> float:
        """The bytes of the batch padded to its longest sequence over its real bytes."""
        return self.num_seqs * self.longest / self.total

    def flashinfer_pages(self):
        """(indptr, indices, last_page_len) of the same pages, as FlashInfer's plan() takes them."""
        return flashinfer_page_arrays(self.block_tables, self.seq_lens, self.block_size)


def ragged_batch(name: str, block_size: int, seed: int = RAGGED_SEED) -> RaggedBatch:
    """The batch `name` of RAGGED_BATCHES: its lengths, then its blocks in shuffled order, both
    drawn from one generator of `seed`."""
    if name not in RAGGED_BATCHES:
        raise ValueError(f"ragged batch: unknown {name!r}; choose from {list(RAGGED_BATCHES)}")
    rng = np.random.default_rng(seed)
    lens = RAGGED_BATCHES[name].lengths(rng)
    pages = -(-lens // block_size)
    num_blocks = int(pages.sum())
    ids = rng.permutation(num_blocks).astype(np.int32)
    tables = np.full((len(lens), int(pages.max())), -1, np.int32)
    owned = np.arange(tables.shape[1])[None, :] < pages[:, None]
    tables[owned] = ids  # row-major: each sequence takes the next pages[s] shuffled ids
    return RaggedBatch(name=name, seq_lens=lens, block_tables=tables, num_blocks=num_blocks,
                       block_size=block_size)


def selected_ragged(spec: str | None, with_features: bool) -> list[str]:
    """The batches `--ragged` asks for: "all" (also what --features brings), "none", or a
    comma-separated subset of RAGGED_BATCHES; checked before anything is timed."""
    if spec is None:
        return list(RAGGED_BATCHES) if with_features else []
    if spec == "none":
        return []
    wanted = list(RAGGED_BATCHES) if spec == "all" else [n.strip() for n in spec.split(",")]
    unknown = set(wanted) - set(RAGGED_BATCHES)
    if unknown:
        raise SystemExit(f"--ragged: unknown {sorted(unknown)}; choose from "
                         f"{list(RAGGED_BATCHES)}, all or none")
    return wanted


def ragged_row(batch: RaggedBatch, args, ceiling_tbs: float, figures: dict) -> dict:
    """A ragged row from its timings: `figures` holds cupa_us, cupa_eager_us,
    cupa_longest_hint_us, flashinfer_us, flashinfer_eager_us (None where not timed) and the
    plans' partition_size, max_partitions, merge, longest_hint_partition_size. The fields of a
    main-table row, plus the read floor: the K/V bytes of the real lengths at the copy ceiling,
    and that floor over cupa's time."""
    nbytes = kv_read_bytes(batch.total, args)
    floor = copy_floor_us(nbytes, ceiling_tbs)
    cupa_us = figures.get("cupa_us")
    row = dict(ragged=batch.name, seed=RAGGED_SEED, batch=batch.num_seqs,
               seq_len=batch.longest, total_seq_len=batch.total,
               median_seq_len=int(np.median(batch.seq_lens)), num_heads=args.heads,
               num_kv_heads=args.kv_heads, head_size=args.head_size, dtype=args.dtype,
               block_size=args.block_size, kv_layout=args.kv_layout, kv_bytes=nbytes,
               read_floor_us=floor,
               read_floor_fraction=floor / cupa_us if cupa_us else None,
               sdpa_us=None, sdpa_eager_us=None, sdpa_skipped=SDPA_SKIPPED,
               padded_ratio=batch.padded_ratio)
    row.update({key: figures.get(key) for key in (
        "cupa_us", "cupa_eager_us", "flashinfer_us", "flashinfer_eager_us",
        "cupa_longest_hint_us", "partition_size", "max_partitions", "merge",
        "longest_hint_partition_size", "longest_hint_max_partitions")})
    for column in ("us", "eager_us"):
        ours, theirs = row[f"cupa_{column}"], row[f"flashinfer_{column}"]
        row[f"vs_flashinfer_{column}"] = theirs / ours if ours and theirs else None
    return row


def ragged_arrays(cupy, batch: RaggedBatch, args, kv_layout: str = DEFAULT_KV_LAYOUT):
    """(query, key, value, block_tables, seq_lens, hints) of `batch` on the device: random query
    and K/V in `kv_layout`'s order, and both length hints, as a serving loop has them."""
    key, value = random_kv(cupy, batch.num_blocks, args, kv_layout)
    query = random_query(cupy, batch.num_seqs, args)
    tables, lens = cupy.asarray(batch.block_tables), cupy.asarray(batch.seq_lens)
    return query, key, value, tables, lens, dict(max_seq_len=batch.longest,
                                                 total_seq_len=batch.total)


def time_ragged(cupy, timer, batch: RaggedBatch, args, ceiling_tbs: float) -> dict:
    """Time cupa (both hints, then the longest alone) and FlashInfer on `batch`; its row."""
    query, key, value, tables, lens, hints = ragged_arrays(cupy, batch, args, args.kv_layout)
    out = cupy.empty_like(query)
    longest_only = dict(max_seq_len=batch.longest)

    def cupa(options):
        return lambda: decode(query, key, value, tables, lens, out=out,
                              partition_size=args.partition_size, kv_layout=args.kv_layout,
                              **options)
    figures = {}
    for prefix, options in (("", hints), ("longest_hint_", longest_only)):
        plan = plan_decode(query, key, value, tables, lens, partition_size=args.partition_size,
                           kv_layout=args.kv_layout, **options)
        figures[f"{prefix}partition_size"] = plan.partition_size
        figures[f"{prefix}max_partitions"] = plan.max_partitions
        if not prefix:
            figures["merge"] = plan.merge
    figures["cupa_us"] = timer.median_us(cupa(hints))
    figures["cupa_eager_us"] = eager_us(cupy, cupa(hints))
    figures["cupa_longest_hint_us"] = timer.median_us(cupa(longest_only))
    if not args.no_peers:
        launch = prepare_peer("flashinfer", flashinfer_peer, cupy, query, key, value,
                              batch.block_tables, batch.seq_lens, args)
        if launch is not None:
            figures["flashinfer_us"] = timer.median_us(launch)
            figures["flashinfer_eager_us"] = eager_us(cupy, launch)
        del launch
    del query, key, value, tables, lens, out
    return ragged_row(batch, args, ceiling_tbs, figures)


def _fmt(value, spec="9.1f", suffix=""):
    return f"{value:{spec}}{suffix}" if value is not None else "-".rjust(len(f"{0:{spec}}{suffix}"))


def ragged_line(row: dict) -> str:
    """One printed line of a ragged row (figures missing as '-')."""
    if row.get("error"):
        return f"{row['ragged']:>11} failed: {row['error']}"
    fraction = row["read_floor_fraction"]
    return (f"{row['ragged']:>11} {row['batch']:>5} {row['total_seq_len']:>8} "
            f"{row['seq_len']:>7} {row['kv_bytes'] / 1e6:8.1f} {_fmt(row['cupa_us'])} "
            f"{_fmt(None if fraction is None else 100 * fraction, '5.1f', '%')} "
            f"{_fmt(row['flashinfer_us'])} {_fmt(row['vs_flashinfer_us'], '6.2f', 'x')} | "
            f"eager {_fmt(row['cupa_eager_us'])} {_fmt(row['flashinfer_eager_us'])} "
            f"{_fmt(row['vs_flashinfer_eager_us'], '6.2f', 'x')} | "
            f"{row['partition_size']} x {row['max_partitions']} {row['merge']}; longest only "
            f"{row['longest_hint_partition_size']} x {row['longest_hint_max_partitions']}: "
            f"{_fmt(row['cupa_longest_hint_us'], '.1f')} us")


def ragged_rows(cupy, timer, args, ceiling_tbs: float, names: list[str]) -> list[dict]:
    """Time the ragged batches `names`; a batch that fails is reported and recorded with its
    error, never fatal (the rest of the bench and its JSON still come out)."""
    if not names:
        return []
    batches = [ragged_batch(name, args.block_size) for name in names]
    padded = sorted(b.padded_ratio for b in batches)
    print(f"ragged batches (seed {RAGGED_SEED}; {args.dtype}, heads {args.heads}/"
          f"{args.kv_heads}, head {args.head_size}, block {args.block_size}; SDPA skipped: "
          f"padded to the longest it would read {padded[0]:.1f}-{padded[-1]:.1f}x the bytes)")
    print(f"{'batch':>11} {'seqs':>5} {'tokens':>8} {'longest':>7} {'KV MB':>8} {'cupa us':>9} "
          f"{'floor':>6} {'fi us':>9} {'vs fi':>7} | eager: cupa, fi, vs fi | cupa's plan")
    rows = []
    for n, (name, batch) in enumerate(zip(names, batches), 1):
        start = time.perf_counter()
        print(f"  [ragged {n}/{len(names)} {name}: {batch.num_seqs} sequences, "
              f"{batch.total} tokens, {kv_read_bytes(batch.total, args) / 1e9:.2f} GB of K/V]",
              file=sys.stderr, flush=True)
        try:
            row = time_ragged(cupy, timer, batch, args, ceiling_tbs)
        except Exception as exc:  # reported in the row and the table, never fatal
            row = dict(ragged=name, seed=RAGGED_SEED, error=f"{type(exc).__name__}: "
                                                             f"{str(exc)[:300]}")
        rows.append(row)
        print(ragged_line(row), flush=True)
        print(f"  [ragged {n}/{len(names)} done in {time.perf_counter() - start:.1f} s]",
              file=sys.stderr, flush=True)
    ratios = [r["vs_flashinfer_us"] for r in rows if r.get("vs_flashinfer_us")]
    if ratios:
        print(f"ragged: geometric mean speed-up over FlashInfer (GPU time): "
              f"{float(np.exp(np.mean(np.log(ratios)))):.3f}x (goal >= 1.05x)")
    return rows
