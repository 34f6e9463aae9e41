"""A pytest plugin for test_rocm_simulated.py: after collection, write what would skip each item
and which CUDA-only facilities its test function uses, as JSON to the file named by
$CUPA_SELECTION_REPORT. Loaded with `-p selection_probe` in a child pytest (with
CUPA_SIMULATE_ROCM set), so that the skip conditions are evaluated as on that platform.

Every skipif condition is evaluated, not only the first that holds, because here the GPU tests'
module-wide "needs a GPU" skip holds too, and the question is what a node with a GPU would skip.
"""

from __future__ import annotations

import inspect
import json
import os

from _pytest.skipping import evaluate_condition

# What needs CUDA in the GPU tests: the example engine's graph steps (cupy's capture of its
# cuBLAS calls through llm/cublas.py: libcublas), and NVRTC itself. cupa's own plans capture
# on HIP too (cupy maps stream capture to hipStreamBeginCapture), so begin_capture is not here.
CUDA_ONLY_USES = ("GraphGemm", "libcublas", "graphs=True", "run_graph_case", "prepare_graphs",
                  "use_graphs is True", "from CUDA graphs", "cuda.nvrtc", "_compile_nvrtc")


def skip_reasons(item) -> list[str]:
    reasons = []
    for mark in item.iter_markers(name="skipif"):
        conditions = mark.args or (mark.kwargs["condition"],)
        for condition in conditions:
            holds, reason = evaluate_condition(item, mark, condition)
            if holds:
                reasons.append(reason)
    for mark in item.iter_markers(name="skip"):
        reasons.append(mark.kwargs.get("reason") or (mark.args[0] if mark.args else "skip"))
    return reasons


def pytest_collection_finish(session):
    path = os.environ.get("CUPA_SELECTION_REPORT")
    if not path:
        return
    report = {}
    for item in session.items:
        try:
            source = inspect.getsource(item.function)
        except (AttributeError, OSError, TypeError):
            source = ""
        report[item.nodeid] = {"skips": skip_reasons(item),
                               "uses": [u for u in CUDA_ONLY_USES if u in source]}
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
