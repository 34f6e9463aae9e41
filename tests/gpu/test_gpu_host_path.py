"""The eager host path on the GPU: decode's plan cache, the prepared launches and the caller's own
kind of array coming back. Skips without a GPU.

Each check compares with the float64 reference on fresh random inputs and a NaN-poisoned output,
so a stale plan, a wrong pointer or a missed workspace shows as a wrong result, not only as a
crash.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.reference import paged_decode_reference

from cases import REL_BOUND, make_case, rel_error

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")


def device_case(rng, **kwargs):
    import cupy
    case = make_case(rng, **kwargs)
    ref, ref_lse = paged_decode_reference(*case.args(), **case.options())
    return case, [cupy.asarray(x) for x in case.args()], ref, ref_lse


@pytest.mark.parametrize("partition_size", [None, 256])
def test_cached_plans_give_fresh_outputs_and_follow_new_contents(rng, partition_size):
    """Back-to-back decode calls reuse one plan: each returns a new array, an `out` given is
    filled (with the workspace the reduce needs), and new contents of the same arrays are read."""
    import cupy
    case, args, ref, _ = device_case(rng, dtype="float16", head_size=128, group=8,
                                     seq_lens=(3000, 1, 700))
    first = cupa.decode(*args, partition_size=partition_size)
    second = cupa.decode(*args, partition_size=partition_size)
    assert first is not second
    out = cupy.full(args[0].shape, np.nan, dtype=args[0].dtype)
    assert cupa.decode(*args, partition_size=partition_size, out=out) is out
    for result in (first, second, out):
        assert rel_error(cupy.asnumpy(result), ref) <= REL_BOUND["float16"]
    # Same arrays, new query contents: the cached plan must read them.
    fresh = make_case(rng, dtype="float16", head_size=128, group=8, seq_lens=(3000, 1, 700))
    args[0][...] = cupy.asarray(fresh.query)
    ref_new, _ = paged_decode_reference(fresh.query, *case.args()[1:], **case.options())
    out.fill(np.nan)
    cupa.decode(*args, partition_size=partition_size, out=out)
    assert rel_error(cupy.asnumpy(out), ref_new) <= REL_BOUND["float16"]


def test_options_that_change_the_result_are_not_served_by_another_plan(rng):
    """A call differing only in an option (scale, window, return_lse) gets its own plan."""
    import cupy
    case, args, ref, _ = device_case(rng, dtype="bfloat16", head_size=64, group=4,
                                     seq_lens=(900, 17))
    plain = cupa.decode(*args)
    scaled = cupa.decode(*args, scale=0.05)
    ref_scaled, _ = paged_decode_reference(*case.args(), scale=0.05)
    windowed, lse = cupa.decode(*args, sliding_window=64, return_lse=True)
    ref_window, ref_lse = paged_decode_reference(*case.args(), sliding_window=64)
    assert rel_error(cupy.asnumpy(plain), ref) <= REL_BOUND["bfloat16"]
    assert rel_error(cupy.asnumpy(scaled), ref_scaled) <= REL_BOUND["bfloat16"]
    assert rel_error(cupy.asnumpy(windowed), ref_window) <= REL_BOUND["bfloat16"]
    np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-3, atol=1e-3)


def test_an_unhashable_option_is_named_by_validation(rng):
    """A device call's options key the plan cache; one that cannot be hashed is not cached and
    reaches validation, which names it (not a TypeError of the cache lookup)."""
    _, args, _, _ = device_case(rng, dtype="float16", head_size=128, group=8, seq_lens=(100,))
    with pytest.raises(ValueError, match="sliding_window"):
        cupa.decode(*args, sliding_window=[64])
    with pytest.raises(ValueError, match="logits_soft_cap"):
        cupa.decode(*args, logits_soft_cap={})


@pytest.mark.parametrize("seq_len, head_size", [(4000, 128), (2000, 64), (7000, 128)])
def test_small_launches_are_one_cluster_launch(rng, switch, seq_len, head_size):
    """One sequence of a few thousand tokens at 8 KV heads plans as a small launch: on sm_90 all
    its partitions (up to 16) merge in one cluster, with no reduce launch (planner.SMALL_LAUNCH_*);
    elsewhere the reduce merges them. Either way the output and lse match the reference, as they
    do with the reduce forced (CUPA_MERGE=reduce), on a NaN-poisoned output."""
    import cupy

    from cupa.gpu.catalogue import sm_number
    from cupa.gpu.device import device_info
    from cupa.gpu.dispatch import CLUSTER_MERGE_MIN_SM

    case, args, ref, ref_lse = device_case(rng, dtype="float16", head_size=head_size,
                                           num_kv_heads=8, group=8, seq_lens=(seq_len,))
    arch = device_info().target.arch
    clusters = not device_info().hip_runtime and sm_number(arch) >= CLUSTER_MERGE_MIN_SM
    for merge in (None, "reduce"):
        switch("CUPA_MERGE", merge)
        cupa.clear_plan_cache()
        plan = cupa.plan_decode(*args, return_lse=True)
        assert plan.max_partitions > 2
        expected = "cluster" if clusters and merge is None else "reduce"
        assert plan.merge == expected, (arch, plan.max_partitions, plan.partition_size)
        out = cupy.full(args[0].shape, np.nan, dtype=args[0].dtype)
        _, lse = cupa.decode(*args, out=out, return_lse=True)
        assert rel_error(cupy.asnumpy(out), ref) <= REL_BOUND["float16"]
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-3, atol=1e-3)
    cupa.clear_plan_cache()


@pytest.fixture
def plain_launches(switch):
    """Every launch through the driver's plain entry point (CUPA_LAUNCH=plain: cuLaunchKernel on
    CUDA, the call and argument list HIP's launches use), with the reduce merging partitions
    (the plain call carries no cluster attribute); the usual launches again afterwards."""
    from cupa.gpu import driver
    switch("CUPA_LAUNCH", "plain")
    switch("CUPA_MERGE", "reduce")
    driver.driver.cache_clear()
    cupa.clear_plan_cache()
    yield
    switch("CUPA_LAUNCH", None)
    switch("CUPA_MERGE", None)
    driver.driver.cache_clear()
    cupa.clear_plan_cache()


@pytest.mark.parametrize("seq_lens, head_size", [((3000, 1, 700), 128), ((4000,), 64),
                                                 ((600, 90), 256)])
def test_plain_driver_launches_decode_and_write_correctly(rng, plain_launches, seq_lens,
                                                          head_size):
    """HIP's launch code (prebuilt ctypes arguments, no argtypes) run on this device: phase 1,
    the reduce and the cache write, each against its oracle on NaN-poisoned outputs."""
    import cupy

    from cupa.gpu import driver
    from cupa.gpu.device import device_info
    loaded = driver.driver(device_info().hip_runtime)
    if loaded is None:
        pytest.fail("no driver library loaded: the launches would be cupy's, not the plain call")
    assert loaded.extended is None
    case, args, ref, ref_lse = device_case(rng, dtype="float16", head_size=head_size, group=8,
                                           seq_lens=seq_lens)
    plan = cupa.plan_decode(*args, return_lse=True, partition_size=256)
    assert plan.merge == "reduce"
    for _ in range(2):  # the second run: the same prepared launches with new pointers
        out = cupy.full(args[0].shape, np.nan, dtype=args[0].dtype)
        _, lse = plan.run(*args, out=out)
        assert rel_error(cupy.asnumpy(out), ref) <= REL_BOUND["float16"]
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-3, atol=1e-3)
    cache = cupa.PagedKVCache(1, 8, 16, 2, head_size, "float16", backend="gpu")
    slots = cache.extend([0], 20)
    rows = rng.standard_normal((2, 20, 2, head_size)).astype(np.float16)
    cache.key_cache(0).fill(np.nan)
    cache.value_cache(0).fill(np.nan)
    cache.write(0, slots, cupy.asarray(rows[0]), cupy.asarray(rows[1]))
    table = cupy.asarray(cache.block_table(0))
    for storage, want in ((cache.key_cache(0), rows[0]), (cache.value_cache(0), rows[1])):
        written = cupy.asnumpy(storage[table]).transpose(0, 2, 1, 3).reshape(-1, 2, head_size)
        np.testing.assert_array_equal(written[:20], want)


def test_an_out_of_the_wrong_layout_is_refused(rng):
    import cupy
    _, args, _, _ = device_case(rng, dtype="float16", head_size=128, group=8, seq_lens=(100,))
    cupa.decode(*args)
    rows, heads, head_size = args[0].shape
    wide = cupy.empty((rows, heads, 2 * head_size), dtype=cupy.float16)[:, :, :head_size]
    with pytest.raises(ValueError, match="out: must be C-contiguous"):
        cupa.decode(*args, out=wide)
    with pytest.raises(TypeError, match="out: dtype"):
        cupa.decode(*args, out=cupy.empty(args[0].shape, dtype=cupy.float32))


def test_threads_share_a_plan_safely(rng):
    """Eight threads decoding the same shapes at once (one plan, its packed arguments shared)
    each get their own correct result."""
    import cupy
    cases = [device_case(rng, dtype="float16", head_size=128, group=8, seq_lens=(1500, 40))
             for _ in range(8)]
    cupa.decode(*cases[0][1])  # plan and compile once up front
    results = [None] * len(cases)

    def work(i):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(5):
                results[i] = cupa.decode(*cases[i][1])
            stream.synchronize()
    cupy.cuda.get_current_stream().synchronize()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (_, _, ref, _), result in zip(cases, results):
        assert rel_error(cupy.asnumpy(result), ref) <= REL_BOUND["float16"]


def test_torch_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    case, args, ref, _ = device_case(rng, dtype="float16", head_size=128, group=4,
                                     seq_lens=(300, 2))
    tensors = [torch.from_dlpack(a) for a in args]
    out = cupa.decode(*tensors)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    assert rel_error(out.cpu().numpy(), ref) <= REL_BOUND["float16"]


def test_jax_in_jax_out(rng):
    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to the rest
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    case = make_case(rng, dtype="float32", head_size=64, group=2, seq_lens=(300, 2))
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    arrays = [jax.device_put(jnp.asarray(x), jax.devices("gpu")[0]) for x in case.args()]
    out = cupa.decode(*arrays)
    assert isinstance(out, jax.Array)
    assert rel_error(np.asarray(out), ref) <= REL_BOUND["float32"]


def test_numpy_in_numpy_out_with_lse(rng):
    """Host arrays are uploaded and checked on every call; the output, a host `out` and the
    lse come back as numpy arrays."""
    case = make_case(rng, dtype="float16", head_size=128, group=4, seq_lens=(300, 2, 0))
    ref, ref_lse = paged_decode_reference(*case.args(), **case.options())
    out, lse = cupa.decode(*case.args(), return_lse=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert rel_error(out, ref) <= REL_BOUND["float16"]
    given = np.full(case.query.shape, np.nan, dtype=case.query.dtype)
    result, lse = cupa.decode(*case.args(), return_lse=True, out=given)
    assert result is given and isinstance(lse, np.ndarray)
    assert rel_error(given, ref) <= REL_BOUND["float16"]
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-3)
    assert np.array_equal(np.isfinite(lse), finite)
