"""Registers, spills and the chunk loop's instruction mix of the tensor-core decode kernels, on a
machine without a GPU: NVRTC (cupy) -> PTX -> ptxas -> cuobjdump -sass.

ptxas, cuobjdump and the nvdisasm cuobjdump runs come from the PyPI wheels of NVRTC's version
(no CUDA toolkit needed), else from PATH:
    python3 -m pip install "nvidia-cuda-nvcc==13.5.*" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    python3 tools/kernel_sass.py [--arch sm_90] [--kernel cupa_decode_mma8_f16_d128 ...] [--dump DIR]

--ptxas PATH --ptx-version X.Y compiles with another ptxas, the PTX's .version set to what it
reads: the code an older compiler makes. The device's NVRTC 13.0 is such a one; with
`--ptxas /usr/local/cuda-13.0/bin/ptxas --ptx-version 9.0` its miscompile of v44 step 3's
cache-hinted copies shows (their LDGSTS read uniform registers nothing writes;
docs/perf-log.md v44 step 3).

The build is the runtime's (cupa.gpu.device.Target.runtime_options), so CUPA_EXTRA_OPTIONS
(e.g. -DCUPA_MMA_MIN_BLOCKS=3) applies here as it does on the device.

"loop" is the smallest backward-branch loop that holds HMMA instructions, with its instruction
mix: the 16-row kernel's 16-token step, the 8-column kernel's chunk (including paths not taken
at run time, e.g. soft-capping). "chunk" is the smallest such loop that also holds the ring's
barrier, and "+N" the instructions of it outside the first: a warp's work once a chunk besides
its steps, which the 16-row kernel's time follows (docs/perf-log.md v25 step 1).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupa.gpu import catalogue  # noqa: E402
from cupa.gpu.device import Target  # noqa: E402


def tool(name):
    """A CUDA tool from the PyPI wheels (their version is NVRTC's, so ptxas reads its PTX), else
    from PATH."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for path in sorted(glob.glob(os.path.join(root, "*", "bin", name)), reverse=True):
            return path
    found = shutil.which(name)
    if found:
        return found
    sys.exit(f"{name} not found: pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump "
             "nvidia-cuda-nvdisasm")


def with_ptx_version(text, version):
    """The PTX with its .version directive set to `version` ("9.0"), or unchanged for None."""
    if version is None:
        return text
    if not re.fullmatch(r"\d+\.\d+", version):
        raise ValueError(f"a PTX ISA version is MAJOR.MINOR, got {version!r}")
    out, count = re.subn(r"^\.version \d+\.\d+", f".version {version}", text, count=1,
                         flags=re.M)
    if count != 1:
        raise ValueError("no .version directive in the PTX")
    return out


def ptx(variant, arch):
    from cupy.cuda import nvrtc
    program = nvrtc.createProgram(catalogue.batch_source([variant]), "k.cu", [], [])
    virtual = "compute_" + arch.split("_", 1)[1]
    nvrtc.compileProgram(program, list(Target(arch).runtime_options()) +
                         [f"--gpu-architecture={virtual}"])
    text = nvrtc.getPTX(program)
    nvrtc.destroyProgram(program)
    return text if isinstance(text, str) else text.decode()


def instructions(sass, kernel):
    """(address, text) of every instruction of `kernel` in cuobjdump -sass output."""
    out, inside = [], False
    for line in sass.splitlines():
        if "Function : " in line:
            inside = line.strip().endswith(kernel)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if inside and m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def loops(code):
    """The backward-branch loops of `code`, as lists of their instructions' text."""
    found = []
    for address, text in code:
        targets = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
        if targets and int(targets[-1], 16) < address:
            start = int(targets[-1], 16)
            found.append([t for a, t in code if start <= a <= address])
    return found


def smallest_loop(code, *needles):
    """The smallest loop holding an instruction with each of `needles`, or []."""
    holding = [body for body in loops(code)
               if all(any(n in t for t in body) for n in needles)]
    return min(holding, key=len) if holding else []


def chunk_loop(code):
    return smallest_loop(code, "HMMA")


def ring_chunk(code):
    """The smallest loop holding both HMMA and the ring's barrier: the per-chunk loop."""
    return smallest_loop(code, "HMMA", "BAR.SYNC")


def opcode(text):
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--kernel", action="append", help="partition kernel name (default: all mma)")
    p.add_argument("--dump", metavar="DIR", help="also write each kernel's SASS there")
    p.add_argument("--ptxas", help="this ptxas instead of the wheels' (an older compiler's code)")
    p.add_argument("--ptx-version", help="the PTX's .version for that ptxas, e.g. 9.0")
    args = p.parse_args()
    ptxas, cuobjdump = args.ptxas or tool("ptxas"), tool("cuobjdump")
    chosen = [v for v in catalogue.all_mma_variants()
              if not args.kernel or v.partition_name in args.kernel]
    with tempfile.TemporaryDirectory() as tmp:
        for v in chosen:
            name = v.partition_name
            src, obj = os.path.join(tmp, name + ".ptx"), os.path.join(tmp, name + ".cubin")
            Path(src).write_text(with_ptx_version(ptx(v, args.arch), args.ptx_version))
            info = subprocess.run([ptxas, f"-arch={args.arch}", "-v", src, "-o", obj],
                                  capture_output=True, text=True, check=True).stderr
            usage = re.search(rf"Compiling entry function '{name}'[\s\S]*?(\d+) bytes spill "
                              rf"stores[\s\S]*?Used (\d+) registers", info)
            sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True,
                                  check=True).stdout
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                Path(args.dump, name + ".sass").write_text(sass)
            code = instructions(sass, name)
            loop, chunk = chunk_loop(code), ring_chunk(code)
            mix = collections.Counter(opcode(t) for t in loop).most_common(8)
            spills, used = (usage.group(1), usage.group(2)) if usage else ("?", "?")
            print(f"{name:36s} regs {used:>3s} spill {spills:>3s} B | chunk {len(chunk):4d} "
                  f"(+{len(chunk) - len(loop):3d}) | loop {len(loop):4d}: "
                  + " ".join(f"{op} {n}" for op, n in mix))


if __name__ == "__main__":
    main()
