"""The planner with a total-length hint (issue 23, ragged batches): uniform batches plan exactly
as before the hint existed, ragged ones split their long sequences more. Pure functions of
shapes and hints, checked without a GPU."""

import pytest

import cupa
from cupa.bench.ragged import ragged_batch
from cupa.decode_plan import check_inputs, convert_inputs, host_contents
from cupa.gpu import planner
from cupa.gpu.planner import batch_fill, make_plan
from cupa.problem import DecodeOptions

from cases import make_case
from test_plan import H200_SMS, shape

MAIN_SHAPES = ((1, 4096), (1, 32768), (8, 4096), (16, 16384), (32, 2048), (64, 4096),
               (128, 1024), (256, 2048))

# (partition_size, max_partitions, cluster_merge) of the main table's shapes on the H200 (sm_90,
# 132 multiprocessors, 2 resident workgroups), computed before the total-length hint existed;
# docs/performance.md, "What that means for the main table". Since v23 1 x 32768 takes one
# workgroup a multiprocessor (planner.ONE_PER_SM_DENSITY): 16 partitions of 2048, not 32 of 1024.
# Since v26 1 x 4096's 16 partitions merge in one cluster, a small launch (planner.SMALL_LAUNCH_*).
# Since v36 16 x 16384 runs the wide form (dispatch.wide_form) in one partition, not two.
MAIN_PLANS = {
    (1, 4096): (256, 16, True), (1, 32768): (2048, 16, False), (8, 4096): (2048, 2, True),
    (16, 16384): (16384, 1, False), (32, 2048): (2048, 1, False), (64, 4096): (4096, 1, False),
    (128, 1024): (1024, 1, False), (256, 2048): (2048, 1, False),
}
# The same for the breadth configurations and the fp8 cache, over MAIN_SHAPES in order
# (no residency given: as on a machine without the occupancy query).
LIKE_THE_MAIN_TABLE = [(256, 16, True), (2048, 16, False), (2048, 2, True), (16384, 1, False),
                       (2048, 1, False), (4096, 1, False), (1024, 1, False), (2048, 1, False)]
# Head 64 keeps two workgroups a multiprocessor at 1 x 32768 (level or slower at one, v23) and
# has no wide form: 16 x 16384 in cluster pairs.
LIKE_THE_MAIN_TABLE_HEAD64 = [{1: (1024, 32, False), 3: (8192, 2, True)}.get(i, p)
                              for i, p in enumerate(LIKE_THE_MAIN_TABLE)]
OTHER_PLANS = {
    "mha": (dict(heads=32, kv_heads=32), [  # 1 x 32768: the wide form since v36
        (1024, 4, False), (8192, 4, False), (4096, 1, False), (16384, 1, False),
        (2048, 1, False), (4096, 1, False), (1024, 1, False), (2048, 1, False)]),
    "head256": (dict(head_size=256), [
        (256, 16, False), (2048, 16, False), (2048, 2, True), (16384, 1, False),
        (2048, 1, False), (4096, 1, False), (1024, 1, False), (2048, 1, False)]),
    # The first three as row chunks of the 8-column kernel since v21 (two per KV head); since
    # v24 16 x 16384 on the 16-row kernel at one workgroup a multiprocessor, a cluster pair
    # (planner.ONE_TILE_ROWS: 143.1 us against 144.0 in 4 partitions).
    "group16": (dict(heads=64, kv_heads=4), [
        (256, 16, False), (1024, 32, False), (1024, 4, False), (8192, 2, True),
        (2048, 1, False), (4096, 1, False), (1024, 1, False), (2048, 1, False)]),
    "group4": (dict(heads=32, kv_heads=8), LIKE_THE_MAIN_TABLE),
    "bf16": (dict(dtype="bfloat16"), LIKE_THE_MAIN_TABLE),
    "block32": (dict(block_size=32), LIKE_THE_MAIN_TABLE),
    "head64": (dict(head_size=64), LIKE_THE_MAIN_TABLE_HEAD64),
    "fp8": (dict(kv_format="fp8_e4m3"), LIKE_THE_MAIN_TABLE),
}

def described(plan):
    return plan.partition_size, plan.max_partitions, plan.cluster_merge


@pytest.fixture(autouse=True)
def default_switches(switch):
    switch("CUPA_MERGE", None)
    switch("CUPA_KERNEL", None)


@pytest.mark.parametrize("batch, seq_len", MAIN_SHAPES)
@pytest.mark.parametrize("total", ["none", "exact", "over"])
def test_the_main_tables_plans_did_not_move(batch, seq_len, total):
    """No total, the exact total of a uniform batch, or a total past it: the plans of before."""
    hint = {"none": None, "exact": batch * seq_len, "over": 3 * batch * seq_len}[total]
    for residency in (lambda v: 2, None):
        plan = make_plan(shape(batch=batch, seq_len=seq_len), H200_SMS, arch="sm_90",
                         max_seq_len=seq_len, total_seq_len=hint, residency=residency)
        assert described(plan) == MAIN_PLANS[batch, seq_len]


@pytest.mark.parametrize("config", list(OTHER_PLANS))
def test_other_uniform_configurations_did_not_move(config):
    options, expected = OTHER_PLANS[config]
    for (batch, seq_len), plans in zip(MAIN_SHAPES, expected):
        for hint in (None, batch * seq_len):
            plan = make_plan(shape(batch=batch, seq_len=seq_len, **options), H200_SMS,
                             arch="sm_90", max_seq_len=seq_len, total_seq_len=hint)
            assert described(plan) == plans, (config, batch, seq_len)


def test_window_and_multi_token_plans_did_not_move():
    for batch, expected in ((1, (256, 128, False)), (8, (1024, 32, False))):
        plan = make_plan(shape(batch=batch, seq_len=32768, window=4096), H200_SMS,
                         arch="sm_90", max_seq_len=32768, residency=lambda v: 2)
        assert described(plan) == expected
    for (batch, seq_len), expected in (((1, 32768), (1024, 32, False)),
                                       ((8, 4096), (1024, 4, False)),
                                       ((32, 2048), (2048, 1, False)),
                                       ((64, 4096), (4096, 1, False))):
        plan = make_plan(shape(batch=batch, seq_len=seq_len), H200_SMS, arch="sm_90",
                         max_seq_len=seq_len, total_seq_len=batch * seq_len, max_query_len=4,
                         residency=lambda v: 2)
        assert described(plan) == expected


def ragged_plan(name, hinted=True):
    batch = ragged_batch(name, block_size=16)
    problem = shape(batch=batch.num_seqs, seq_len=batch.longest)
    plan = make_plan(problem, H200_SMS, arch="sm_90", max_seq_len=batch.longest,
                     total_seq_len=batch.total if hinted else None, residency=lambda v: 2)
    return batch, plan


@pytest.mark.parametrize("name, partition_size, partitions, busy, split_busy", [
    # fill 0.11: 2.8 x the uniform rule's 4.7 splits for the same work, 13
    ("longtail64", 2560, 13, 1048, 688),
    # fill 0.077: 2.85 x 3.3 splits, 10
    ("mixed128", 3328, 10, 1600, 640),
])
def test_the_bench_ragged_rows_split_their_long_sequences(name, partition_size, partitions, busy,
                                                          split_busy):
    batch, plan = ragged_plan(name)
    assert (plan.partition_size, plan.max_partitions) == (partition_size, partitions)
    assert plan.reduce_launch and not plan.cluster_merge
    # The grid gives every sequence max_partitions workgroups per KV head; those past a short
    # sequence's end exit at once. The workgroups with work: 4.0 / 6.1 waves of the 264 the
    # uniform rule aims at, 2.6 / 2.4 waves of them the partitions of the sequences that are
    # split, so that the last of those to start ends about a third of a share late.
    kv_heads = 8
    parts = -(-batch.seq_lens // plan.partition_size)
    assert kv_heads * int(parts.sum()) == busy
    assert kv_heads * int(parts[parts > 1].sum()) == split_busy
    grid = batch.num_seqs * kv_heads * plan.max_partitions
    assert grid <= planner.RAGGED_MAX_GRID_WAVES * 2 * H200_SMS
    # Without the total, the longest length alone plans a uniform batch of 64 / 128 sequences of
    # 32768 tokens: one partition, so the launch lasts as long as one workgroup's 32768 tokens.
    _, unhinted = ragged_plan(name, hinted=False)
    assert (unhinted.partition_size, unhinted.max_partitions) == (32768, 1)


def test_a_long_sequence_is_split_as_alone_by_the_uniform_rule():
    """A ragged batch's long sequence is split as it would be alone by the uniform rule of two
    workgroups a multiprocessor. Alone, a uniform batch of one, it takes one workgroup a
    multiprocessor (planner.ONE_PER_SM_DENSITY), which is for uniform batches only: in a
    ragged one the short sequences' workgroups share the machine."""
    lens = [32768] + [512] * 31
    ragged = make_plan(shape(batch=32, seq_len=32768), H200_SMS, arch="sm_90",
                       max_seq_len=32768, total_seq_len=sum(lens))
    assert described(ragged) == (1024, 32, False)
    alone = make_plan(shape(batch=1, seq_len=32768), H200_SMS, arch="sm_90", max_seq_len=32768)
    assert described(alone) == (2048, 16, False)
    alone_head64 = make_plan(shape(batch=1, seq_len=32768, head_size=64), H200_SMS,
                             arch="sm_90", max_seq_len=32768)
    assert described(alone_head64) == (1024, 32, False)


def test_a_mostly_empty_grid_is_capped():
    """One 32k sequence among 255 of 16 tokens: split as alone, it would get 32 partitions, a
    grid of 65536 workgroups (248 waves), nearly all of them empty; the cap keeps 64 waves."""
    plan = make_plan(shape(batch=256, seq_len=32768), H200_SMS, arch="sm_90",
                     max_seq_len=32768, total_seq_len=32768 + 255 * 16)
    assert (plan.partition_size, plan.max_partitions) == (4096, 8)
    wave = 2 * H200_SMS
    grid = 256 * 8 * plan.max_partitions
    assert grid <= planner.RAGGED_MAX_GRID_WAVES * wave < grid + 256 * 8


def test_splits_grow_as_the_batch_empties():
    partitions = []
    for fill in (1.0, 0.95, 0.8, 0.6, 0.4, 0.2, 0.1, 0.05):
        plan = make_plan(shape(batch=16, seq_len=32768), H200_SMS, arch="sm_90",
                         max_seq_len=32768, total_seq_len=int(fill * 16 * 32768))
        partitions.append(plan.max_partitions)
    # Uniform and nearly so: the wide form's one partition (dispatch.wide_form).
    assert partitions == sorted(partitions) and partitions[:2] == [1, 1] and partitions[-1] == 32


def test_nearly_uniform_batches_plan_as_uniform_ones():
    """One token short of uniform keeps the paired partitions and the wave-quantisation step."""
    for (batch, seq_len), expected in MAIN_PLANS.items():
        if batch == 1:  # one sequence is always uniform
            continue
        plan = make_plan(shape(batch=batch, seq_len=seq_len), H200_SMS, arch="sm_90",
                         max_seq_len=seq_len, total_seq_len=batch * seq_len - 1,
                         residency=lambda v: 2)
        assert described(plan) == expected, (batch, seq_len)
    fp8 = shape(batch=64, seq_len=4096, kv_format="fp8_e4m3")
    halves = make_plan(fp8, H200_SMS, arch="sm_90", total_seq_len=64 * 4096 - 1,
                       residency=lambda v: 3)
    assert (halves.partition_size, halves.max_partitions) == (2048, 2)


def test_ragged_batches_skip_the_uniform_only_steps():
    """Below NEARLY_UNIFORM_FILL: no pairing (8 sequences up to 4096, half of them short)."""
    half = make_plan(shape(batch=8, seq_len=4096), H200_SMS, arch="sm_90", max_seq_len=4096,
                     total_seq_len=4 * 4096 + 4 * 512)
    assert half.max_partitions > 2 and half.reduce_launch


def test_batch_fill():
    assert batch_fill(8, 4096, None) == 1.0
    assert batch_fill(0, 4096, 100) == 1.0
    assert batch_fill(8, 4096, 8 * 4096) == 1.0
    assert batch_fill(8, 4096, 10 ** 9) == 1.0         # past what the batch holds: full
    assert batch_fill(8, 4096, 4 * 4096) == 0.5
    assert batch_fill(8, 4096, 1) == batch_fill(8, 4096, 0) == 1 / 8  # at least the longest
    # A sliding window caps the longest length the planner sees, and so the total.
    windowed = make_plan(shape(batch=8, seq_len=32768, window=4096), H200_SMS, arch="sm_90",
                         max_seq_len=32768, total_seq_len=8 * 20000)
    plain = make_plan(shape(batch=8, seq_len=32768, window=4096), H200_SMS, arch="sm_90",
                      max_seq_len=32768)
    assert described(windowed) == described(plain)


def test_a_forced_partition_size_ignores_the_hints():
    plan = make_plan(shape(batch=64, seq_len=32768), H200_SMS, arch="sm_90",
                     partition_size=8192, max_seq_len=32768, total_seq_len=100000)
    assert (plan.partition_size, plan.max_partitions) == (8192, 4)


def test_host_lengths_give_both_hints(rng):
    case = make_case(rng, seq_lens=(5, 40, 300))
    raw = case.args() + (None, None, None)
    inputs = convert_inputs("numpy", raw)
    shape_, lengths = check_inputs(inputs, DecodeOptions(), host_contents("numpy", raw))
    assert (lengths.longest, lengths.total, lengths.most_new) == (300, 345, None)


def test_decode_and_plan_decode_pass_the_total_to_the_plan(rng, monkeypatch):
    """Host tables give the hints when none is passed; a passed hint wins."""
    seen = []

    class Recorder:
        def __init__(self, shape_, backend, options, **kwargs):
            seen.append((kwargs["max_seq_len"], kwargs["total_seq_len"]))

    monkeypatch.setattr(cupa.api, "DecodePlan", Recorder)
    case = make_case(rng, seq_lens=(5, 40, 300))
    cupa.plan_decode(*case.args(), backend="numpy")
    cupa.plan_decode(*case.args(), max_seq_len=512, total_seq_len=600, backend="numpy")
    assert seen == [(300, 345), (512, 600)]

