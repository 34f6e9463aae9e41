"""Concurrent use on the GPU: a variant's first use from many threads compiles it once, two
streams decoding from two caches at once are both right, and two processes compiling the same
variant at once leave a disk cache a third process can use. Every result is compared with the
float64 reference (outputs poisoned with NaN before each run). Skips without a GPU.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.reference import paged_decode_reference

from cases import DTYPES, REL_BOUND, make_case, rel_error

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

REPO = Path(cupa.__file__).resolve().parent.parent
THREADS = 8


def run_threads(work, count, timeout=300):
    """work(i) in `count` threads started together; re-raises the first exception of any."""
    barrier = threading.Barrier(count)
    errors = [None] * count

    def target(i):
        try:
            barrier.wait(timeout=60)
            work(i)
        except BaseException as exc:  # reported below, in the test's thread
            errors[i] = exc
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    for i, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"thread {i} failed: {type(exc).__name__}: {exc}") from exc


def test_first_use_from_eight_threads_compiles_once(rng, monkeypatch):
    """cupa's compiled-module cache emptied (for this test only), then eight threads decode with
    the same variant at the same moment: one RawModule is built, and all eight results are
    right. The lock in cupa.gpu.compiler.kernels is what makes this hold."""
    import cupy
    from cupa.gpu import compiler
    monkeypatch.setattr(compiler, "_modules", {})
    cupa.clear_plan_cache()  # a kept plan would not ask for the kernels again
    built = collections.Counter()
    real = cupy.RawModule

    def counting(*args, **kwargs):
        built[(kwargs.get("code", args[0] if args else None), kwargs.get("options"))] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(cupy, "RawModule", counting)

    # An unusual variant (float32, head size 80, 3 query heads per KV head: portable kernel);
    # the same shapes in every thread, each with its own contents.
    cases = [make_case(rng, dtype="float32", head_size=80, block_size=16, num_kv_heads=2,
                       group=3, seq_lens=(1, 77, 300)) for _ in range(THREADS)]
    refs = [paged_decode_reference(*c.args(), **c.options())[0] for c in cases]
    inputs = [[cupy.asarray(x) for x in c.args()] for c in cases]
    cupy.cuda.get_current_stream().synchronize()  # uploads done before other streams read
    outs = [cupy.full(c.query.shape, np.nan, dtype=c.query.dtype) for c in cases]

    def work(i):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            assert cupa.decode(*inputs[i], out=outs[i]) is outs[i]
            stream.synchronize()
    try:
        run_threads(work, THREADS)
    finally:
        cupa.clear_plan_cache()  # its plans hold kernels of the emptied cache
    assert sum(built.values()) >= 1
    assert set(built.values()) == {1}, f"modules built more than once: {list(built.values())}"
    assert len(compiler._modules) == sum(built.values())
    for i, (out, ref) in enumerate(zip(outs, refs)):
        got = cupy.asnumpy(out)
        assert np.isfinite(got).all(), f"thread {i}: rows left unwritten"
        assert rel_error(got, ref) <= REL_BOUND["float32"], f"thread {i}"


# Two decode loops, each on its own cache and stream: (dtype, head size, GQA group, block size,
# lengths).
LOOPS = (("float16", 128, 4, 16, [1, 17, 300, 1031]),
         ("bfloat16", 64, 8, 32, [5, 64, 700]))
STEPS = 6


def test_two_streams_decoding_from_two_caches_at_once(rng):
    """Two threads, each with its own PagedKVCache (NaN in every slot before any write) and its
    own non-blocking stream, each run a decode loop (append a token to every sequence, write
    its K/V, decode) at the same time; every step of both is right. Everything a thread does,
    from allocating its cache to the last decode, is on its stream."""
    import cupy
    plans = []
    for dtype, head_size, group, block_size, lengths in LOOPS:  # all random draws up front
        kv_heads = 2
        def rows(n, heads):
            return (rng.standard_normal((n, heads, head_size)) * 2).astype(DTYPES[dtype])
        plans.append(dict(
            dtype=dtype, head_size=head_size, group=group, block_size=block_size,
            lengths=lengths, kv_heads=kv_heads,
            prefill=(rows(sum(lengths), kv_heads), rows(sum(lengths), kv_heads)),
            steps=[(rows(len(lengths), kv_heads), rows(len(lengths), kv_heads),
                    rows(len(lengths), kv_heads * group)) for _ in range(STEPS)]))
    results = [None] * len(plans)

    def work(i):
        p = plans[i]
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            blocks = sum(-(-(n + STEPS) // p["block_size"]) for n in p["lengths"]) + 4
            cache = cupa.PagedKVCache(1, blocks, p["block_size"], p["kv_heads"], p["head_size"],
                                      p["dtype"], backend="gpu")
            cache.key_cache(0).fill(np.nan)
            cache.value_cache(0).fill(np.nan)
            ids = [f"{i}-{s}" for s in range(len(p["lengths"]))]
            cache.write(0, cache.extend(ids, p["lengths"]), *p["prefill"])
            outs = []
            for k, v, q in p["steps"]:
                slots = cache.extend(ids, 1)
                cache.write(0, cupy.asarray(slots), cupy.asarray(k), cupy.asarray(v))
                out = cupy.full(q.shape, np.nan, dtype=q.dtype)
                assert cache.decode(0, cupy.asarray(q), ids, out=out) is out
                outs.append(out)
            rows = [cache.block_table(s) for s in ids]
            tables = np.full((len(ids), max(map(len, rows))), -1, np.int32)
            for row, blocks in zip(tables, rows):
                row[:len(blocks)] = blocks
            stream.synchronize()
            results[i] = dict(outs=[cupy.asnumpy(o) for o in outs], tables=tables,
                              keys=cupy.asnumpy(cache.key_cache(0)),
                              values=cupy.asnumpy(cache.value_cache(0)))
    run_threads(work, len(plans))
    for p, r in zip(plans, results):
        lengths = np.asarray(p["lengths"], np.int32)
        for step, ((_, _, q), out) in enumerate(zip(p["steps"], r["outs"])):
            # Later steps only add tokens: the final cache and tables hold this step's.
            ref, _ = paged_decode_reference(q, r["keys"], r["values"], r["tables"],
                                            lengths + step + 1)
            where = f"{p['dtype']} loop, step {step}"
            assert np.isfinite(out.astype(np.float32)).all(), where
            err = rel_error(out, ref)
            assert err <= REL_BOUND[p["dtype"]], f"{where}: rel error {err:.3g}"


# A child process: decode the case in WORK/case.npz into a NaN-poisoned out once every process of
# its round is ready, save the result and the compiler calls cupy made (those of cupy's compile
# entry points that exist in this cupy version, counted; a disk-cache hit calls none).
CHILD = r"""
import json, sys, time
from pathlib import Path
import numpy as np
import cupy
import cupy.cuda.compiler as cc
import cupa

work, tag, peers = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
round_name = tag.split("-")[0]
calls, hooks = [], []
for name in ("_compile_using_nvrtc_no_warning", "compile_using_nvrtc", "compile_using_hipcc",
             "compile_using_nvcc"):
    real = getattr(cc, name, None)
    if callable(real):
        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        setattr(cc, name, counted)
        hooks.append(name)
data = np.load(work / "case.npz")
args = [cupy.asarray(data[k]) for k in ("q", "k", "v", "tables", "lens")]
out = cupy.full(data["q"].shape, np.nan, dtype=data["q"].dtype)
cupy.cuda.get_current_stream().synchronize()
(work / f"ready-{tag}").touch()
deadline = time.monotonic() + 120
while len(list(work.glob(f"ready-{round_name}-*"))) < peers:
    if time.monotonic() > deadline:
        sys.exit("the other process never got ready")
    time.sleep(0.002)
assert cupa.decode(*args, out=out, partition_size=256) is out
np.save(work / f"out-{tag}.npy", cupy.asnumpy(out))
(work / f"calls-{tag}.json").write_text(json.dumps({"calls": calls, "hooks": hooks}))
"""


def cache_listing(cache_dir: Path) -> dict:
    """Every file of the disk cache: its size, modification time, inode and bytes."""
    return {p.relative_to(cache_dir).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns,
                                                  p.stat().st_ino, p.read_bytes())
            for p in sorted(cache_dir.rglob("*")) if p.is_file()}


def test_two_processes_compiling_one_variant_leave_a_good_disk_cache(rng, tmp_path):
    """A fresh CUPY_CACHE_DIR; two processes compile and decode the same variant at the same
    moment, then a third one: all three results are right, the cache holds files, and the
    third process compiles nothing and changes none of them (a cache hit, not a repair)."""
    cache_dir, work = tmp_path / "cupy-cache", tmp_path / "work"
    cache_dir.mkdir()
    work.mkdir()
    case = make_case(rng, dtype="float16", head_size=112, block_size=16, num_kv_heads=2,
                     group=3, seq_lens=(1, 300, 257, 1000))
    np.savez(work / "case.npz", q=case.query, k=case.key_cache, v=case.value_cache,
             tables=case.block_tables, lens=case.seq_lens)
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get(
                   "PYTHONPATH")] if p]))

    def start(tag, peers):
        return subprocess.Popen([sys.executable, "-c", CHILD, str(work), tag, str(peers)],
                                cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finish(process, tag):
        try:
            output, _ = process.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            pytest.fail(f"process {tag} did not finish:\n{output[-3000:]}")
        assert process.returncode == 0, f"process {tag} failed:\n{output[-3000:]}"
        got = np.load(work / f"out-{tag}.npy")
        assert np.isfinite(got).all(), f"process {tag}: rows left unwritten"
        err = rel_error(got, ref)
        assert err <= REL_BOUND["float16"], f"process {tag}: rel error {err:.3g}"
        return json.loads((work / f"calls-{tag}.json").read_text())

    racing = [start(f"first-{i}", 2) for i in range(2)]
    for i, process in enumerate(racing):
        finish(process, f"first-{i}")
    written = cache_listing(cache_dir)
    assert written, f"nothing in the disk cache {cache_dir}"
    assert not [name for name in written if name.startswith("tmp")], list(written)

    third = finish(start("again-0", 1), "again-0")
    assert cache_listing(cache_dir) == written, "the third process rewrote the disk cache"
    assert third["calls"] == [], f"the third process compiled: {third}"
