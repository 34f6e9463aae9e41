"""Registers, spills and the chunk loop's instruction mix of the tensor-core decode kernels, on a
machine without a GPU: NVRTC (cupy) -> PTX -> ptxas -> cuobjdump -sass.

ptxas and cuobjdump come from PATH or from the PyPI wheels (no CUDA toolkit needed):
    python3 -m pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump
    python3 tools/kernel_sass.py [--arch sm_90] [--kernel cupa_decode_mma8_f16_d128 ...] [--dump DIR]

The loop reported is the smallest backward-branch loop that holds HMMA instructions: the per-chunk
loop of the partition kernels (including paths not taken at run time, e.g. soft-capping).
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
    found = shutil.which(name)
    if found:
        return found
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for path in sorted(glob.glob(os.path.join(root, "*", "bin", name)), reverse=True):
            return path
    sys.exit(f"{name} not found: pip install nvidia-cuda-nvcc nvidia-cuda-cuobjdump")


def ptx(variant, arch):
    from cupy.cuda import nvrtc
    program = nvrtc.createProgram(catalogue.batch_source([variant]), "k.cu", [], [])
    virtual = "compute_" + arch.split("_", 1)[1]
    nvrtc.compileProgram(program, list(Target(arch).defines()) +
                         ["--std=c++17", f"--gpu-architecture={virtual}"])
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


def chunk_loop(code):
    best = None
    for address, text in code:
        targets = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
        if targets and int(targets[-1], 16) < address:
            start = int(targets[-1], 16)
            body = [t for a, t in code if start <= a <= address]
            if any("HMMA" in t for t in body) and (best is None or len(body) < len(best)):
                best = body
    return best or []


def opcode(text):
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--kernel", action="append", help="partition kernel name (default: all mma)")
    p.add_argument("--dump", metavar="DIR", help="also write each kernel's SASS there")
    args = p.parse_args()
    ptxas, cuobjdump = tool("ptxas"), tool("cuobjdump")
    chosen = [v for v in catalogue.all_mma_variants()
              if not args.kernel or v.partition_name in args.kernel]
    with tempfile.TemporaryDirectory() as tmp:
        for v in chosen:
            name = v.partition_name
            src, obj = os.path.join(tmp, name + ".ptx"), os.path.join(tmp, name + ".cubin")
            Path(src).write_text(ptx(v, args.arch))
            info = subprocess.run([ptxas, f"-arch={args.arch}", "-v", src, "-o", obj],
                                  capture_output=True, text=True, check=True).stderr
            usage = re.search(rf"Compiling entry function '{name}'[\s\S]*?(\d+) bytes spill "
                              rf"stores[\s\S]*?Used (\d+) registers", info)
            sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True,
                                  check=True).stdout
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                Path(args.dump, name + ".sass").write_text(sass)
            loop = chunk_loop(instructions(sass, name))
            mix = collections.Counter(opcode(t) for t in loop).most_common(8)
            spills, used = (usage.group(1), usage.group(2)) if usage else ("?", "?")
            print(f"{name:36s} regs {used:>3s} spill {spills:>3s} B | loop {len(loop):4d}: "
                  + " ".join(f"{op} {n}" for op, n in mix))


if __name__ == "__main__":
    main()
