"""Compile each Triton launch recorded by sitecustomize.py (see there) for a GPU target, no GPU
needed. Each launch carries the divisibility attrs the GPU JIT would give its arguments
(sitecustomize.py), so the compiled kernel, its pipelining and its shared memory are the GPU's.
Prints one line per distinct launch (with its shared-memory bytes) and exits non-zero if any fails
to compile or needs more shared memory than the SM has.

    python tests/triton_compile_check/compile_launches.py LAUNCHES.jsonl [--arch 90]
"""
import argparse
import importlib
import json
import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("launches")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--max-shared", type=int, default=232448, help="bytes per block (sm_90's opt-in limit)")
    args = ap.parse_args()
    lines = sorted(set(open(args.launches).read().splitlines()))
    failures = 0
    for line in lines:
        launch = json.loads(line)
        kernel = getattr(importlib.import_module(launch["module"]), launch["name"])
        # the JSON line's keys are sorted: index by the kernel's own parameter order
        signature = {name: launch["signature"][name] for name in kernel.arg_names}
        attrs = {(kernel.arg_names.index(k),): v for k, v in launch.get("attrs", {}).items()}
        src = ASTSource(fn=kernel, signature=signature, constexprs=launch["constexprs"], attrs=attrs)
        label = (f"{launch['module']}.{launch['name']} {launch['constexprs']} {launch['options']} "
                 f"divisible-by-16: {sorted(launch.get('attrs', {}))}")
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", args.arch, 32), options=launch["options"])
            if compiled.metadata.shared > args.max_shared:  # the launch would raise OutOfResources
                raise RuntimeError(f"needs {compiled.metadata.shared} bytes of shared memory, "
                                   f"the SM has {args.max_shared}")
            print("ok", compiled.metadata.shared, label, flush=True)
        except Exception:
            failures += 1
            print("FAILED", label, flush=True)
            traceback.print_exc(limit=0)
    print(f"{len(lines) - failures} of {len(lines)} launches compiled for sm_{args.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
