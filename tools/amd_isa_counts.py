"""Instruction counts of the decode kernels' main loop on AMD targets, from their assembly.

No AMD GPU is needed: the assembly comes from the same clang command the offline compile runs
(cupa.gpu.offline.assembly_for: hip_command with -S). For each variant and gfx target the tool
finds the phase-1 kernel (`variant.partition_name`), its main loop, counts what one pass of
that loop issues by instruction class, and divides by the KV bytes the pass consumes.

Which loop. clang annotates every basic block of a loop in the assembly ("in Loop: Header=...",
"Loop Header: Depth=..."). The main loop is the outermost loop whose blocks hold the most
instructions: the tile loop of decode.cu, the `for (int t0 ...)` loop of decode_matrix.cu.

What one iteration counts (the counting rule). The loop body is a graph of basic blocks; one
iteration is one path through it from the loop header back to it, and the counts are those of
the path a wavefront takes in the steady state of a long context:
  - every row of the row tile is live (h < nh for every h), every token of the tile readable,
    soft cap off. On the path this means: a divergent branch (s_cbranch_execz/execnz around
    masked code) is never taken to skip, as some lane is always active. At a uniform branch
    (s_cbranch_scc*/vcc*) the path keeps off a side whose code, up to where the two sides
    join, holds the soft cap's division (v_div_scale_f32, the only division in these loops);
    otherwise it takes the side with more vector work (a full tile executes every head's
    code), ties going to the shorter side.
  - an inner loop counts as its body's path times its trip count. Trip counts come from the
    kernel's compile-time constants, not from the assembly (portable_trip_counts below; the
    source of each is named there). Inner loops that are fully unrolled are not loops in the
    assembly and need none. The matrix kernel's loop keeps at most its S^T chunk loop, where
    its loads do not go ahead (two chunks an iteration: head_size / 32 iterations,
    matrix_trip_counts); the tool fails on an inner loop it has no trip count for rather than
    guess.
  - counts are per wavefront: one instruction issued by one wavefront is 1, whatever its
    width. A pass of the portable loop is run by all CUPA_THREADS / warp wavefronts of the
    workgroup on one 128-token tile, so one wavefront's pass stands for warp tokens (64 on
    CDNA, 32 on RDNA); the head loop of its softmax step is split over the wavefronts, so its
    trip count is the average per wavefront (rows / wavefronts), and where the compiler made
    it an `if` (rows <= wavefronts) what the `if` holds counts as that share of a wavefront.
    A pass of the matrix loop is one wavefront's own 16-token tile, or its half of the
    head's columns where two wavefronts share the tile (decode_matrix.cu's SPLIT: the only
    matrix loops with a barrier in them, the pair adding its halves of S^T through LDS).
KV bytes of one pass: tokens x the head columns the pass reads (matrix_columns) x cache element
bytes x 2 (K and V), for one KV head.
Counts are reported per pass, per 16 tokens and per KV byte.

Classes: valu (vector ALU, less the ones below), trans (v_exp/v_log/v_rcp/v_rsq/v_sqrt/v_sin/
v_cos), lane (v_readlane/v_writelane/v_readfirstlane), accvgpr (CDNA's AGPR moves), mfma,
wmma, lds (ds_*, cross-lane permutes included), vmem_load (global/buffer/flat loads), vmem_store,
scratch (spills), smem (s_load), salu, waitcnt, branch, barrier, nop (s_nop, s_delay_alu,
s_clause: wait states and hints, no work). lds_bytes and vmem_load_bytes are the bytes the
lanes of those instructions move (width x wavefront size), vmcnt_waits the s_waitcnt that wait
for vector memory, valu_cvt the conversions (v_cvt_*) among valu.

Round trips (round_trips): the counted path's instructions in issue order, run as a steady
state in which a load takes one round trip and only the waits take time; the memory round
trips one pass waits through, its dependent chain. Loads issued together count once, a load
asked for a pass ahead nothing. The model's latency check divides the pass's bytes by it.

Usage:
    python3 tools/amd_isa_counts.py                     # the default variants, gfx942 gfx1100
    python3 tools/amd_isa_counts.py --targets gfx90a,gfx942,gfx1100,gfx1201 --json out.json
    python3 tools/amd_isa_counts.py --model            # adds the predicted bandwidth fractions
    python3 tools/amd_isa_counts.py --explain matrix-f16 --targets gfx942   # the counted path
    python3 tools/amd_isa_counts.py --model --head-size 96   # the variants at head 96
docs/performance.md ("AMD: predicted, not measured") explains the model and its sources.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupa.gpu import catalogue, offline  # noqa: E402
from cupa.gpu.catalogue import DecodeMatrixVariant, DecodeVariant  # noqa: E402
from cupa.gpu.device import Target  # noqa: E402

# The variants of issue 21, by a short name.
DEFAULT_VARIANTS = {
    "portable-f16-gqa8": DecodeVariant("float16", 128, 8),
    "portable-f16-mha": DecodeVariant("float16", 128, 1),
    "portable-f16-fp8kv": DecodeVariant("float16", 128, 8, catalogue.FP8_CACHE),
    "matrix-f16": DecodeMatrixVariant("float16", 128, 1),
    "matrix-f16-fp8kv": DecodeMatrixVariant("float16", 128, 1, catalogue.FP8_CACHE),
    # the target's own fp8 conversion (gfx94x: e4m3fnuz, gfx12: OCP e4m3; not on gfx90a/gfx11)
    "matrix-f16-fp8hw": DecodeMatrixVariant("float16", 128, 1, catalogue.FP8_AMD_NATIVE),
    "matrix-bf16": DecodeMatrixVariant("bfloat16", 128, 1),
}
DEFAULT_TARGETS = ("gfx942", "gfx1100")

CLASSES = ("valu", "trans", "lane", "accvgpr", "mfma", "wmma", "lds", "vmem_load", "vmem_store",
           "scratch", "smem", "salu", "waitcnt", "branch", "barrier", "nop")
# What the path choice weighs (see the docstring): work on the vector side of the machine.
VECTOR_CLASSES = ("valu", "trans", "lane", "accvgpr", "mfma", "wmma", "lds", "vmem_load",
                  "vmem_store", "scratch")
EXTRA_KEYS = ("lds_bytes", "vmem_load_bytes", "vmcnt_waits", "valu_cvt")
TRANSCENDENTAL = re.compile(r"v_(exp|log|rcp|rsq|sqrt|sin|cos)_")
HINTS = ("s_nop", "s_delay_alu", "s_wait_alu", "s_clause", "s_setprio", "s_sleep",
         "s_set_inst_prefetch_distance")
# The soft cap's tanh divides (fast_div is a plain division on HIP); nothing else in the loops
# does, so a block holding the division is on the soft-cap path.
SOFT_CAP_MARK = "v_div_scale_f32"
# The lazy max's rescale (decode_matrix.cu) starts with the row-max shuffles across lanes; no
# other uniform branch of the loops holds a cross-lane permute.
LAZY_RESCALE_MARKS = ("ds_bpermute", "ds_swizzle", "v_permlane")
# What ends a __syncthreads: s_barrier, or its second half on gfx12 (signal, then wait).
BARRIER_WAITS = ("s_barrier", "s_barrier_wait")


def instruction_class(mnemonic: str) -> str:
    if mnemonic.startswith(("v_mfma", "v_smfmac")):
        return "mfma"
    if mnemonic.startswith(("v_wmma", "v_swmmac")):
        return "wmma"
    if mnemonic.startswith(("v_readlane", "v_writelane", "v_readfirstlane")):
        return "lane"
    if mnemonic.startswith("v_accvgpr"):
        return "accvgpr"
    if TRANSCENDENTAL.match(mnemonic):
        return "trans"
    if mnemonic.startswith("v_"):
        return "valu"
    if mnemonic.startswith("ds_"):
        return "lds"
    if mnemonic.startswith("scratch_"):
        return "scratch"
    if mnemonic.startswith(("global_load", "buffer_load", "flat_load")):
        return "vmem_load"
    if mnemonic.startswith(("global_store", "buffer_store", "flat_store", "global_atomic",
                            "flat_atomic", "buffer_atomic")):
        return "vmem_store"
    if mnemonic.startswith(("s_load", "s_buffer_load")):
        return "smem"
    if mnemonic.startswith(("s_waitcnt", "s_wait_")) and mnemonic != "s_wait_alu":
        return "waitcnt"  # s_wait_*cnt: gfx12's split counters
    if mnemonic.startswith(("s_cbranch", "s_branch", "s_setpc", "s_endpgm")):
        return "branch"
    if mnemonic.startswith("s_barrier"):
        return "barrier"
    if mnemonic.startswith(HINTS):
        return "nop"
    return "salu"  # every other s_* (and anything unforeseen: none in these kernels)


# Bytes one lane moves, by the width suffix of a load or LDS mnemonic (CDNA and RDNA spellings).
_WIDTHS = {"dword": 4, "dwordx2": 8, "dwordx3": 12, "dwordx4": 16, "b32": 4, "b64": 8, "b96": 12,
           "b128": 16, "ubyte": 1, "sbyte": 1, "u8": 1, "i8": 1, "ushort": 2, "sshort": 2,
           "u16": 2, "i16": 2, "short": 2, "b16": 2}


def lane_bytes(mnemonic: str) -> int:
    """Bytes one lane reads or writes: ds_read2_b64 is two 8-byte accesses."""
    parts = mnemonic.split("_")
    width = next((_WIDTHS[p] for p in reversed(parts) if p in _WIDTHS), 4)
    return width * (2 if re.search(r"_(read|write|load|store)2", mnemonic) else 1)


@dataclass
class Block:
    name: str
    instructions: list = field(default_factory=list)  # (mnemonic, operands)
    loop: str | None = None        # innermost loop header (the block itself for a header)
    header_depth: int = 0          # > 0: this block heads a loop of that depth
    parent_loops: dict = field(default_factory=dict)  # depth -> header, for a header
    # (target block, how it is reached): "execz"/"execnz" (divergent: taken when no / some
    # lane is active), "uniform" (a scalar or vcc condition), "branch" (s_branch) or "fall"
    edges: list = field(default_factory=list)

    @property
    def successors(self) -> list:
        return [target for target, _ in self.edges]

    def counts(self, wave: int) -> Counter:
        c = Counter()
        for mnemonic, operands in self.instructions:
            cls = instruction_class(mnemonic)
            c[cls] += 1
            if mnemonic.startswith("v_cvt"):
                c["valu_cvt"] += 1  # of valu: the conversions, for the doc's rate caveat
            if cls == "lds":
                c["lds_bytes"] += lane_bytes(mnemonic) * wave
            elif cls == "vmem_load":
                c["vmem_load_bytes"] += lane_bytes(mnemonic) * wave
            elif cls == "waitcnt" and re.search(r"vmcnt|loadcnt", mnemonic + operands):
                c["vmcnt_waits"] += 1
        return c

    def on_soft_cap_path(self) -> bool:
        return any(m == SOFT_CAP_MARK for m, _ in self.instructions)

    def starts_lazy_rescale(self) -> bool:
        return any(m.startswith(LAZY_RESCALE_MARKS) for m, _ in self.instructions)


_LABEL = re.compile(r"^\.L(BB\d+_\d+):(.*)$")
_FALLTHROUGH_LABEL = re.compile(r"^; %bb\.(\d+):(.*)$")
_HEADER = re.compile(r"Loop Header: Depth=(\d+)")
_IN_LOOP = re.compile(r"in Loop: Header=(BB\d+_\d+) Depth=\d+")
_PARENT = re.compile(r"Parent Loop (BB\d+_\d+) Depth=(\d+)")
_BRANCH_TARGET = re.compile(r"\.L(BB\d+_\d+)")


def _function_span(lines: list[str], name: str) -> tuple[int, int]:
    """Line numbers of function `name`'s label and of its .Lfunc_end label."""
    start = next((i for i, line in enumerate(lines) if line.startswith(f"{name}:")), None)
    if start is None:
        raise RuntimeError(f"no function {name} in the assembly")
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(".Lfunc_end")), None)
    if end is None:
        raise RuntimeError(f"no end of function {name} in the assembly")
    return start, end


def function_lines(assembly: str, name: str) -> list[str]:
    """The lines of function `name`, from its label to its .Lfunc_end label."""
    lines = assembly.splitlines()
    start, end = _function_span(lines, name)
    return lines[start:end]


def kernel_summary(assembly: str, name: str) -> dict:
    """What clang's comment block after the kernel says: VGPRs (AGPRs included), scratch bytes
    a lane (non-zero: spills) and occupancy (wavefronts a SIMD, as registers and LDS allow)."""
    lines = assembly.splitlines()
    _, end = _function_span(lines, name)
    found = {}
    for line in lines[end:]:
        m = re.match(r"; (TotalNumVgprs|NumVgprs|ScratchSize|Occupancy): (\d+)", line)
        if m and m.group(1) not in found:
            found[m.group(1)] = int(m.group(2))
        if "Occupancy" in found:
            break
    return {"vgprs": found.get("TotalNumVgprs", found.get("NumVgprs")),
            "scratch_bytes": found.get("ScratchSize"), "occupancy": found.get("Occupancy")}


def parse_blocks(lines: list[str]) -> list[Block]:
    """Basic blocks in layout order, with loop annotations and successors."""
    number = next((m.group(1).split("_")[0] for m in map(_BRANCH_TARGET.search, lines) if m),
                  "BB0")
    blocks = [Block(f"{number}_0")]

    def annotate(block: Block, comment: str) -> None:
        if (m := _HEADER.search(comment)):
            block.header_depth = int(m.group(1))
            block.loop = block.name
        if (m := _IN_LOOP.search(comment)):
            block.loop = m.group(1)
        if (m := _PARENT.search(comment)):
            block.parent_loops[int(m.group(2))] = m.group(1)

    for line in lines[1:]:
        if (m := _LABEL.match(line)) or (m := _FALLTHROUGH_LABEL.match(line)):
            name = m.group(1) if line.startswith(".L") else f"{number}_{m.group(1)}"
            blocks.append(Block(name))
            annotate(blocks[-1], m.group(2))
        elif line.lstrip().startswith(";"):
            annotate(blocks[-1], line)  # a header's continued comment (parent, child loops)
        elif line.startswith("\t") and not line.startswith("\t."):
            text = line.split(";")[0].strip()
            if text:
                mnemonic, _, operands = text.partition(" ")
                blocks[-1].instructions.append((mnemonic, operands.strip()))
    for i, block in enumerate(blocks):
        falls_through = True
        for mnemonic, operands in block.instructions:
            if mnemonic.startswith(("s_cbranch", "s_branch")):
                kind = ("branch" if mnemonic == "s_branch" else
                        mnemonic[len("s_cbranch_"):] if "exec" in mnemonic else "uniform")
                block.edges += [(t, kind) for t in _BRANCH_TARGET.findall(operands)]
            if mnemonic in ("s_branch", "s_endpgm", "s_setpc_b64"):
                falls_through = False
        if falls_through and i + 1 < len(blocks):
            block.edges.append((blocks[i + 1].name, "fall"))
    return blocks


class LoopNest:
    """The loops of one function, from clang's annotations."""

    def __init__(self, blocks: list[Block]):
        self.blocks = {b.name: b for b in blocks}
        self.order = [b.name for b in blocks]
        self.parent = {}
        for b in blocks:
            if b.header_depth:
                self.parent[b.name] = b.parent_loops.get(b.header_depth - 1)
        self._adopt_outside_latches()

    def _adopt_outside_latches(self) -> None:
        """Block placement can leave a piece of an inner loop's cycle in the loop around it, by
        its annotation: a block entered from inside the inner loop (and from before it) whose
        every edge goes into the inner loop, as where the matrix kernel's S^T chunk loop is
        rotated around a uniform test (decode_matrix.cu: the last step of an odd count of
        chunks). Such a block belongs to the inner loop's iteration; moved there, the loop's
        body without its back edges is acyclic again."""
        for header, outer in self.parent.items():
            if outer is None:
                continue
            inside = set(self.members(header))
            entered = {t for m in inside for t, _ in self.blocks[m].edges}
            for name in self.order:
                block = self.blocks[name]
                targets = [t for t, _ in block.edges]
                if (block.loop == outer and name in entered and targets
                        and all(t in inside for t in targets)):
                    block.loop = header

    def chain(self, name: str) -> list[str]:
        """The loops holding block `name`, innermost first."""
        loops, header = [], self.blocks[name].loop
        while header is not None:
            loops.append(header)
            header = self.parent.get(header)
        return loops

    def members(self, header: str) -> list[str]:
        return [n for n in self.order if header in self.chain(n)]

    def children(self, header: str) -> list[str]:
        return [h for h, p in self.parent.items() if p == header]

    def size(self, header: str) -> int:
        return sum(len(self.blocks[n].instructions) for n in self.members(header))

    def main_loop(self) -> str:
        outermost = [h for h, p in self.parent.items() if p is None]
        if not outermost:
            raise RuntimeError("no loop in the kernel")
        return max(outermost, key=self.size)

    def node_of(self, name: str, header: str) -> str | None:
        """What block `name` is within loop `header`: itself, the child loop holding it, or None
        when outside the loop."""
        chain = self.chain(name)
        if header not in chain:
            return None
        inner = chain[:chain.index(header)]
        return inner[-1] if inner else name

    def layout_from(self, header: str) -> list[str]:
        """The loop's blocks in program order: from the header on, then those laid out before it
        (a rotated loop's latch comes first in the layout)."""
        members = self.members(header)
        i = self.order.index(header)
        after = [n for n in self.order[i:] if n in members]
        return after + [n for n in self.order[:i] if n in members]


def _work(c: Counter) -> tuple:
    return (sum(c[k] for k in VECTOR_CLASSES), -sum(c[k] for k in CLASSES))


def iteration(nest: LoopNest, header: str, trips: dict, wave: int,
              path: list | None = None, share: dict | None = None) -> Counter:
    """What one iteration of loop `header` issues, on the counted path (module docstring).
    trips: inner-loop header -> iterations per iteration of its parent; share: block or
    inner loop -> the fraction of wavefronts that run it (1 if absent). `path`, if given,
    collects (node, times) of what was counted: blocks, and inner loops as one node each."""
    share = share or {}

    def is_child(node: str) -> bool:
        return node in nest.parent and node != header

    def successors(node: str) -> list:
        """The nodes an iteration can go on to from `node`, less the divergent branches' cold
        sides: an execz branch skips code only when no lane is active, an execnz branch falls
        through only then; in a full tile some lane always is."""
        if is_child(node):
            inside = set(nest.members(node))
            edges = [(t, k) for name in inside for t, k in nest.blocks[name].edges
                     if t not in inside]  # its exits; its own edges are in its iteration
        else:
            edges = nest.blocks[node].edges
            kinds = {k for _, k in edges}
            if "execz" in kinds:
                edges = [(t, k) for t, k in edges if k != "execz"]
            elif "execnz" in kinds:
                edges = [(t, k) for t, k in edges if k != "fall"]
        out = {"END" if t == header else nest.node_of(t, header) for t, _ in edges}
        out.discard(None)  # an edge out of the loop: not part of an iteration
        return sorted(out)

    # The body without its back edges is acyclic: order it, ends first (a depth-first walk
    # with its own stack: a loop that spills has more blocks than Python's recursion allows).
    succ, order, state = {header: successors(header)}, [], {header: "open"}
    stack = [(header, 0)]
    while stack:
        node, i = stack.pop()
        if i == len(succ[node]):
            state[node] = "done"
            order.append(node)
            continue
        stack.append((node, i + 1))
        s = succ[node][i]
        if s == "END" or state.get(s) == "done":
            continue
        if state.get(s) == "open":
            raise RuntimeError(f"a cycle in loop {header}'s body besides its back edge")
        state[s], succ[s] = "open", successors(s)
        stack.append((s, 0))

    def weight(node: str):
        if is_child(node):  # an inner loop, counted trips times over
            if node not in trips:
                raise RuntimeError(f"inner loop {node} of {header} has no trip count: the "
                                   "compiler left a loop the counting rule does not know")
            body = iteration(nest, node, trips, wave)
            times = trips[node] * share.get(node, 1)
            return Counter({k: v * times for k, v in body.items()})
        block = nest.blocks[node]
        if block.on_soft_cap_path():
            return None
        return Counter({k: v * share.get(node, 1) for k, v in block.counts(wave).items()})

    weights = {node: weight(node) for node in order}

    # Post-dominators, to find where the two sides of a branch join again.
    pdom = {"END": frozenset(["END"])}
    for node in order:
        sets = [pdom[s] for s in succ[node]]
        pdom[node] = frozenset([node]).union(frozenset.intersection(*sets) if sets else ())

    def join(node: str):
        rest = pdom[node] - {node}
        return next((p for p in rest if pdom[p] == rest), None)

    def side_holds(start: str, stop, found) -> bool:
        """Whether the code from `start` up to the join `stop` holds a node `found` accepts."""
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node in seen or node in ("END", stop):
                continue
            seen.add(node)
            if found(node):
                return True
            todo += succ[node]
        return False

    def soft_cap(node: str) -> bool:
        return weights[node] is None

    def lazy_rescale(node: str) -> bool:
        return not is_child(node) and nest.blocks[node].starts_lazy_rescale()

    best = {"END": (Counter(), ())}
    for node in order:  # ends first, so every successor is done
        options = succ[node]
        if len(options) > 1:  # a uniform branch: off the soft cap's side, then the lazy max's
            stop = join(node)
            for off in (soft_cap, lazy_rescale):
                options = [s for s in options if not side_holds(s, stop, off)] or options
        options = [best[s] for s in options if best.get(s) is not None]
        if weights[node] is None or not options:
            best[node] = None
            continue
        rest, rest_path = max(options, key=lambda o: _work(o[0]))
        best[node] = (weights[node] + rest, (node,) + rest_path)
    if best[header] is None:
        raise RuntimeError(f"no path through loop {header}")
    counts, nodes = best[header]
    if path is not None:
        path += [(node, trips.get(node, 1) * share.get(node, 1)) for node in nodes]
    return counts


def path_instructions(nest: LoopNest, header: str, nodes: list, trips: dict, wave: int) -> list:
    """The instructions of one iteration of loop `header` on its counted path `nodes` (what
    `iteration` collected), in issue order: an inner loop's own path repeated its trip count
    (rounded; at least once)."""
    out = []
    for node, _ in nodes:
        if node in nest.parent and node != header:
            inner = []
            iteration(nest, node, trips, wave, inner)
            out += path_instructions(nest, node, inner, trips, wave) * max(1, round(trips[node]))
        else:
            out += nest.blocks[node].instructions
    return out


_VMCNT = re.compile(r"vmcnt\((\d+)\)")


def vmem_wait_limit(mnemonic: str, operands: str) -> int | None:
    """The loads a wait leaves outstanding, or None where it does not wait for loads. gfx9 to
    gfx11: s_waitcnt vmcnt(N); gfx12: s_wait_loadcnt N, or s_wait_loadcnt_dscnt with the load
    count in bits 13:8 (the DS count below)."""
    if mnemonic == "s_waitcnt":
        m = _VMCNT.search(operands)
        return int(m.group(1)) if m else None
    if mnemonic == "s_wait_loadcnt":
        return int(operands.split()[0], 0)
    if mnemonic == "s_wait_loadcnt_dscnt":
        return (int(operands.split()[0], 0) >> 8) & 0x3f
    return None


def round_trips(instructions: list, passes: int = 4) -> float:
    """Memory round trips one pass waits through, in the steady state: the loop's path run
    `passes` times, each load ready one round trip after its issue, each wait holding the
    wavefront until the loads it retires (oldest first: the counters count in order) are
    ready, and nothing else taking time. The last pass's growth of that clock is the count:
    18 serial waits are 18; loads issued together and waited for once are 1; a load issued a
    pass ahead (a prefetch) and waited for in the next costs nothing there. It counts the
    dependent chain, which bounds a wavefront's rate when memory latency dominates."""
    queue, now, ends = [], 0.0, []
    for _ in range(passes):
        for mnemonic, operands in instructions:
            if instruction_class(mnemonic) in ("vmem_load", "scratch") and "load" in mnemonic:
                queue.append(now + 1.0)
                continue
            limit = vmem_wait_limit(mnemonic, operands)
            while limit is not None and len(queue) > limit:
                now = max(now, queue.pop(0))
        ends.append(now)
    return ends[-1] - ends[-2]


# --- what the kernels' source says about their loops -------------------------------------------

def cache_bytes(variant) -> int:
    return 1 if variant.cache else 2


def portable_pv_batch() -> int:
    """decode.cu's PvLayout::BATCH (V vectors a PV thread loads before it uses the first), read
    from the source so that it is stated once."""
    found = re.search(r"static constexpr int BATCH = (\d+);",
                      (catalogue.KERNEL_DIR / "decode.cu").read_text())
    if found is None:
        raise RuntimeError("decode.cu: PvLayout::BATCH not found")
    return int(found.group(1))


def portable_layout(variant, warp: int) -> dict:
    """decode.cu's PvLayout for this variant, and the loop constants (mirrors the source)."""
    vec = 16 // cache_bytes(variant) if variant.dtype != "float32" else 4
    chunks = variant.head_size // vec
    rows = catalogue.THREADS // chunks
    ht = variant.heads
    hpt = min(ht, max(2, (ht + rows - 1) // rows))
    slots = ht // hpt
    lanes = rows // slots
    return {"VEC": vec, "CHUNKS": chunks, "LANES": lanes, "HPT": hpt, "TILE": catalogue.THREADS,
            "NWARPS": catalogue.THREADS // warp, "rows": ht, "BATCH": portable_pv_batch()}


def portable_trip_counts(nest: LoopNest, header: str, variant, warp: int) -> tuple:
    """Trip counts of the portable tile loop's inner loops, told apart by the step of the tile
    they sit in (steps are separated by __syncthreads, s_barrier in the assembly):
      step 1, QK:  `for c < CHUNKS` with `#pragma unroll 4`: CHUNKS / 4 iterations;
      step 2, softmax: `for h = warp; h < nh; h += NWARPS`: rows / NWARPS per wavefront on
        average, holding `for j = lane; j < TILE; j += warp` twice: TILE / warp each;
      step 3, PV:  `for j0 = pv_lane; j0 < tile_len; j0 += BATCH * LANES`:
        TILE / (BATCH * LANES), at least 1.
    A loop the compiler unrolled fully is absent and needs no count. With rows <= NWARPS the
    compiler makes the head loop an `if (warp < nh)`: its j loops are then the tile loop's
    own, and what the `if` holds runs in rows of the NWARPS wavefronts (the share returned).
    Returns (trips, share) for iteration()."""
    k = portable_layout(variant, warp)
    heads_per_wave = k["rows"] / k["NWARPS"]
    step, first_in_step, step_ends = 0, {}, []
    for name in nest.layout_from(header):
        node = nest.node_of(name, header)
        if node != name or name in nest.children(header):  # a child loop's block
            first_in_step.setdefault(node, step)
            continue
        barriers = sum(1 for m, _ in nest.blocks[name].instructions if m in BARRIER_WAITS)
        if barriers:
            step_ends.append(name)
        step += barriers
    trips, share, per_step = {}, {}, Counter(first_in_step.values())
    for child, step in first_in_step.items():
        grandchildren = nest.children(child)
        if step == 0 and not grandchildren and per_step[0] == 1:
            trips[child] = k["CHUNKS"] / 4
        elif step == 1 and len(grandchildren) == 2 and per_step[1] == 1:
            trips[child] = heads_per_wave
            for inner in grandchildren:
                trips[inner] = k["TILE"] / warp
        elif step == 1 and not grandchildren and per_step[1] <= 2 and heads_per_wave <= 1:
            trips[child] = k["TILE"] / warp  # a j loop of the `if`; its share is set below
        elif step == 2 and not grandchildren and per_step[2] == 1:
            trips[child] = max(1.0, k["TILE"] / (k["BATCH"] * k["LANES"]))
        else:
            raise RuntimeError(f"portable tile loop: unexpected inner loop {child} in step "
                               f"{step + 1} (children {grandchildren}, loops per step "
                               f"{dict(per_step)})")
    if heads_per_wave < 1 and step_ends:
        for node in guarded_region(nest, header, step_ends[0]):
            share[node] = heads_per_wave
    return trips, share


def matrix_columns(nest: LoopNest, header: str, variant) -> int:
    """The head's columns one pass of the matrix tile loop reads: all of them, or half where
    two wavefronts share a tile (decode_matrix.cu's SPLIT), which is the only matrix loop with
    a barrier in it."""
    shared = any(m in BARRIER_WAITS for name in nest.members(header)
                 for m, _ in nest.blocks[name].instructions)
    return variant.head_size // 2 if shared else variant.head_size


def matrix_trip_counts(nest: LoopNest, header: str, columns: int) -> dict:
    """Trip counts of the matrix tile loop's inner loops: where a tile's loads do not go ahead
    (decode_matrix.cu's LOADS_AHEAD: RDNA3 above head 64, RDNA4's larger tiles) S^T's chunk
    loop is left a loop over CHUNKS = columns / 16 chunks: two chunks an iteration, in steps
    (STEPPED) or unrolled by 2 (the guarded loads), so CHUNKS / 2 iterations (at 80 and 112,
    and 96 split in two, the last holds one chunk: a half); every other loop there is
    unrolled."""
    children = nest.children(header)
    if not children:
        return {}
    if len(children) == 1 and not nest.children(children[0]):
        return {children[0]: columns // 16 / 2}
    raise RuntimeError(f"matrix tile loop: unexpected inner loops {children}")


def guarded_region(nest: LoopNest, header: str, block: str) -> set:
    """What the divergent `if` that `block` ends with holds: the nodes of loop `header`
    reached from its fall-through before its execz target (where the `if` ends)."""
    edges = nest.blocks[block].edges
    join = next((t for t, k in edges if k == "execz"), None)
    start = next((t for t, k in edges if k == "fall"), None)
    if join is None or start is None:
        return set()
    stop = nest.node_of(join, header)
    region, todo = set(), [nest.node_of(start, header)]
    while todo:
        node = todo.pop()
        if node is None or node in region or node in (stop, header):
            continue
        region.add(node)
        names = nest.members(node) if node in nest.children(header) else [node]
        todo += [nest.node_of(t, header) for n in names for t in nest.blocks[n].successors]
    return region


def tokens_per_pass(variant, warp: int) -> int:
    """Tokens one wavefront's pass of the main loop stands for (module docstring)."""
    if isinstance(variant, DecodeMatrixVariant):
        return 16
    return catalogue.THREADS // (catalogue.THREADS // warp)  # the tile, shared by the waves


@dataclass
class LoopCounts:
    name: str
    variant: object
    arch: str
    wave: int
    header: str
    trips: dict
    per_pass: Counter
    tokens: int
    columns: int  # of the head, that one pass reads (matrix_columns; the portable loop: all)
    summary: dict = field(default_factory=dict)
    share: dict = field(default_factory=dict)
    round_trips: float = 0.0  # the memory round trips a pass waits through (round_trips)

    @property
    def kv_bytes(self) -> int:
        return self.tokens * self.columns * cache_bytes(self.variant) * 2

    def per_16_tokens(self) -> dict:
        """Per 16 tokens of the whole head (the passes of a pair that shares a tile, summed)."""
        passes = 16 / self.tokens * self.variant.head_size / self.columns
        return {k: self.per_pass[k] * passes for k in CLASSES + EXTRA_KEYS}

    def per_kv_byte(self) -> dict:
        return {k: self.per_pass[k] / self.kv_bytes for k in CLASSES + EXTRA_KEYS}

    def as_json(self) -> dict:
        return {"name": self.name, "kernel": self.variant.partition_name, "arch": self.arch,
                "wavefront": self.wave, "loop_header": self.header,
                "inner_loop_trips": self.trips, "wavefront_share": self.share,
                "tokens_per_pass": self.tokens, "head_columns_per_pass": self.columns,
                "kernel_summary": self.summary, "round_trips_per_pass": self.round_trips,
                "kv_bytes_per_pass": self.kv_bytes,
                "per_pass": {k: self.per_pass[k] for k in CLASSES + EXTRA_KEYS},
                "per_16_tokens": self.per_16_tokens(), "per_kv_byte": self.per_kv_byte()}


def count_loop(name: str, variant, arch: str, assembly: str | None = None,
               path: list | None = None) -> LoopCounts:
    """The main loop's counts of `variant` on `arch` (assembly: given, or compiled here)."""
    wave = Target(arch).warp_size
    text = assembly if assembly is not None else offline.assembly_for(variant, arch)
    nest = LoopNest(parse_blocks(function_lines(text, variant.partition_name)))
    header = nest.main_loop()
    columns = variant.head_size
    if isinstance(variant, DecodeVariant):
        trips, share = portable_trip_counts(nest, header, variant, wave)
    else:
        columns = matrix_columns(nest, header, variant)
        trips, share = matrix_trip_counts(nest, header, columns), {}
    nodes = path if path is not None else []
    counts = iteration(nest, header, trips, wave, nodes, share)
    chain = round_trips(path_instructions(nest, header, nodes, trips, wave))
    return LoopCounts(name, variant, arch, wave, header, trips, counts,
                      tokens_per_pass(variant, wave), columns,
                      kernel_summary(text, variant.partition_name), share, chain)


# --- the throughput model (docs/performance.md, "AMD: predicted, not measured") ----------------

@dataclass(frozen=True)
class Machine:
    """Issue rates per SIMD, in clocks per wavefront instruction, and the machine's size."""
    name: str
    arch: str
    cus: int
    simds_per_cu: int
    clock_ghz: float
    hbm_tbs: float
    valu: float        # clocks a VALU instruction holds the SIMD's issue
    trans: float       # a transcendental (quarter rate)
    matrix: float      # one 16x16x16 f16/bf16 matrix instruction on its unit
    matrix_on_valu: bool  # the matrix op holds the VALU too (RDNA: no co-execution)
    salu: float        # clocks between SALU (or branch) issues of one SIMD
    lds_bytes_per_clock_cu: float


MACHINES = {
    # CDNA3: 4 SIMD16 a CU, wave64 over 4 clocks; the scheduler visits each SIMD every 4th
    # clock and issues at most one instruction of each category there; 16x16x16 f16 MFMA 16
    # clocks, VALU co-issue possible during 12 of them; LDS 32 banks x 4 B a clock a CU.
    "MI300X": Machine("MI300X", "gfx942", 304, 4, 2.1, 5.3, valu=4, trans=16, matrix=16,
                      matrix_on_valu=False, salu=4, lds_bytes_per_clock_cu=128),
    # RDNA3: 2 SIMD32 a CU, one wave32 VALU instruction a clock; WMMA 16x16x16 32 clocks and
    # not co-executed with VALU; transcendentals and LDS rate assumed as on CDNA (see doc).
    "RX 7900 XTX": Machine("RX 7900 XTX", "gfx1100", 96, 2, 2.5, 0.96, valu=1, trans=4,
                           matrix=32, matrix_on_valu=True, salu=1, lds_bytes_per_clock_cu=128),
}


def predict(counts: LoopCounts, machine: Machine) -> dict:
    """Seconds per KV byte on the whole GPU for each resource, and the fraction of HBM
    bandwidth the largest leaves: memory time over the largest. Plus a latency check the
    throughput bound cannot make: how long each of a pass's memory round trips (round_trips)
    may take on average for the waves resident to still stream at full bandwidth (Little's
    law)."""
    b = counts.per_kv_byte()
    simds = machine.cus * machine.simds_per_cu
    clock = machine.clock_ghz * 1e9
    matrix_ops = b["mfma"] + b["wmma"]
    valu_clocks = (machine.valu * (b["valu"] + b["lane"] + b["accvgpr"] + matrix_ops)
                   + machine.trans * b["trans"])
    if machine.matrix_on_valu:  # WMMA holds the SIMD for its whole duration
        valu_clocks += (machine.matrix - machine.valu) * matrix_ops
    times = {
        "memory": 1.0 / (machine.hbm_tbs * 1e12),
        "valu": valu_clocks / (simds * clock),
        "matrix": machine.matrix * matrix_ops / (simds * clock),
        "lds": b["lds_bytes"] / (machine.lds_bytes_per_clock_cu * machine.cus * clock),
        # SALU/SMEM and branches are separate issue categories (wait states and hints: none)
        "salu": machine.salu * (b["salu"] + b["smem"]) / (simds * clock),
        "branch": machine.salu * b["branch"] / (simds * clock),
    }
    binding = max(times, key=times.get)
    # Waves a SIMD holds: what the planner launches (workgroups_per_sm a CU), capped by what
    # registers and LDS allow (clang's occupancy).
    planned = counts.variant.workgroups_per_sm * (catalogue.THREADS // counts.wave)
    waves = min(planned / machine.simds_per_cu, counts.summary.get("occupancy") or planned)
    trips = counts.round_trips
    budget = (waves * simds * counts.kv_bytes / (trips * machine.hbm_tbs * 1e12)
              if trips else None)
    return {"machine": machine.name, "seconds_per_kv_byte": times, "binding": binding,
            "fraction_of_hbm": times["memory"] / times[binding], "waves_per_simd": waves,
            "round_trips_per_pass": trips, "round_trip_budget_seconds": budget}


# --- output ---------------------------------------------------------------------------------

TABLE_COLUMNS = ("valu", "trans", "accvgpr", "mfma", "wmma", "lds", "vmem_load", "scratch",
                 "salu", "waitcnt", "branch", "nop")


def table(results: list[LoopCounts]) -> str:
    head = (f"{'variant':18} {'arch':8} {'tok/pass':>8} {'KV B/16t':>8} " +
            " ".join(f"{c:>7}" for c in TABLE_COLUMNS) +
            f" {'LDS B':>7} {'vmem B':>7} {'vmcnt':>6} {'trips':>6} {'VALU/KB':>8} {'occ':>4}")
    lines = ["per 16 tokens of one KV head (wavefront instructions; LDS/vmem B: bytes moved "
             "by the lanes; vmcnt: waits for vector memory; trips: the memory round trips a "
             "pass waits through; VALU/KB: valu+trans per KiB of KV; occ: wavefronts a SIMD, "
             "by clang)", head]
    for r in results:
        p = r.per_16_tokens()
        kv16 = r.kv_bytes * 16 * r.variant.head_size // (r.tokens * r.columns)
        per_kb = (p["valu"] + p["trans"]) * 1024 / kv16
        lines.append(f"{r.name:18} {r.arch:8} {r.tokens:8d} {kv16:8d} " +
                     " ".join(f"{p[c]:7.1f}" for c in TABLE_COLUMNS) +
                     f" {p['lds_bytes']:7.0f} {p['vmem_load_bytes']:7.0f} "
                     f"{p['vmcnt_waits']:6.1f} {r.round_trips:6.1f} {per_kb:8.1f} "
                     f"{r.summary.get('occupancy') or 0:4d}")
    return "\n".join(lines)


def model_table(results: list[LoopCounts]) -> str:
    lines = ["predicted (instruction counts x issue rates; not measured): ns per MB of KV by "
             "resource, the binding one, fraction of HBM bandwidth; then the latency check: the "
             "longest average memory round trip that still streams at full bandwidth"]
    for r in results:
        for machine in MACHINES.values():
            if machine.arch != r.arch:
                continue
            p = predict(r, machine)
            t = "  ".join(f"{k} {v * 1e15:6.1f}" for k, v in p["seconds_per_kv_byte"].items())
            budget = p["round_trip_budget_seconds"]
            lines.append(f"{r.name:18} {machine.name:12} {t}  -> {p['binding']:6} "
                         f"{100 * p['fraction_of_hbm']:5.1f}% of HBM; {p['waves_per_simd']:g} "
                         f"waves/SIMD, {p['round_trips_per_pass']:g} round trips a pass: "
                         f"{budget * 1e9 if budget else 0:.0f} ns each at most")
    return "\n".join(lines)


def variants_at(head_size: int | None) -> dict:
    """DEFAULT_VARIANTS, at another head size where one is given (same names)."""
    if head_size is None:
        return DEFAULT_VARIANTS
    return {name: replace(v, head_size=head_size) for name, v in DEFAULT_VARIANTS.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"names among {', '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--json", metavar="FILE", help="write the counts (and model) as JSON")
    parser.add_argument("--model", action="store_true", help="print the predicted fractions")
    parser.add_argument("--explain", metavar="VARIANT",
                        help="print the counted path of one variant's loop, block by block")
    parser.add_argument("--head-size", type=int, default=None,
                        help="the variants at this head size instead of 128")
    args = parser.parse_args(argv)
    variants = variants_at(args.head_size)
    targets = offline.check_targets([t for t in args.targets.split(",") if t])
    if args.explain:
        for arch in targets:
            path: list = []
            r = count_loop(args.explain, variants[args.explain], arch, path=path)
            print(f"{r.variant.partition_name} on {arch}: loop {r.header}, inner-loop trips "
                  f"{r.trips}, wavefront shares {r.share}, {r.tokens} tokens a pass; path "
                  "(block or inner loop x times):")
            print("  " + " ".join(f"{node}x{times:g}" if times != 1 else node
                                  for node, times in path))
            print(f"  per pass: {dict((k, v) for k, v in r.per_pass.items() if v)}")
            print(f"  kernel: {r.summary}")
        return 0
    results = []
    for arch in targets:
        if (missing := offline.hip_toolchain_missing(arch)):
            print(f"{arch}: skipped ({missing})", file=sys.stderr)
            continue
        for name in args.variants.split(","):
            variant = variants[name]
            if isinstance(variant, DecodeMatrixVariant) and \
                    not catalogue.matrix_variant_exists(variant, arch):
                continue
            results.append(count_loop(name, variant, arch))
    print(table(results))
    if args.model:
        print()
        print(model_table(results))
    if args.json:
        payload = [dict(r.as_json(), model=[predict(r, m) for m in MACHINES.values()
                                            if m.arch == r.arch]) for r in results]
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
