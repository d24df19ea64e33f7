"""Helpers for tests that run Triton kernels under the interpreter (TRITON_INTERPRET=1)."""


def interpreter_numpy_shim() -> None:
    """Triton 3.6's interpreter turns a scalar tensor (a 1-element array) into an index with
    int(array), which NumPy >= 2.4 refuses: loops like range(start, end) then fail. Convert
    through the array's single element instead."""
    import triton.runtime.interpreter as interp

    patch = getattr(interp, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_qsaserve_shim", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._qsaserve_shim = True
    interp._patch_lang_tensor = patched


def interpreter_bf16_dot_shim() -> None:
    """Triton 3.6's interpreter stores bf16 as uint16 and multiplies those integers in tl.dot:
    decode bf16 operands to float32 first (as a GPU's bf16 MMA sees them). Call it in the
    interpreted process, before the kernels run."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    dot = interp.InterpreterBuilder.create_dot
    if getattr(dot, "_qsaserve_shim", False):
        return

    def f32(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)

    create_dot._qsaserve_shim = True
    interp.InterpreterBuilder.create_dot = create_dot


def interpreter_fp8_cast_shim() -> None:
    """Triton 3.6's interpreter rounds float32 -> E4M3 wrongly where rounding up carries into the
    exponent (127.4 -> 64, not 128): convert through torch instead, rounding to nearest-even as
    a GPU's cvt does."""
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as interp

    cast = interp.InterpreterBuilder.create_fp_to_fp
    if getattr(cast, "_qsaserve_shim", False):
        return

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar != tl.float32:
            return cast(self, src, dst_type, rounding_mode)
        data = torch.from_numpy(src.data).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interp.TensorHandle(data, dst_type.scalar)

    create_fp_to_fp._qsaserve_shim = True
    interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def run_under_interpreter(test_file: str, call: str, timeout: int = 600) -> str:
    """Run `call` (with the test module imported as `t`, e.g. "t._triton_checks('cpu')") in a fresh
    Python with TRITON_INTERPRET=1, which Triton reads when first imported; fail with its output.
    Then compile every kernel launch it made for sm_90 (triton_compile_check/: no GPU needed), so
    errors only the compiler sees, and launches needing more shared memory than an SM has, fail
    here too. Returns the call's stdout. Skips when triton is not installed."""
    import os
    import subprocess
    import sys
    import tempfile

    import pytest

    pytest.importorskip("triton", reason="triton is not installed (the gpu extra)")
    here = os.path.dirname(os.path.abspath(test_file))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    check_dir = os.path.join(tests_dir, "triton_compile_check")
    module = os.path.splitext(os.path.basename(test_file))[0]
    code = (f"import sys; sys.path[:0] = [{here!r}, {tests_dir!r}]; "
            "from triton_interpreter import interpreter_numpy_shim; interpreter_numpy_shim(); "
            f"import {module} as t; {call}; print('ok')")
    with tempfile.TemporaryDirectory() as tmp:
        launches = os.path.join(tmp, "launches.jsonl")
        path = os.pathsep.join(p for p in (check_dir, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=path,
                   QSASERVE_TRITON_LAUNCHES=launches)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
        if os.path.exists(launches):
            env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "QSASERVE_TRITON_LAUNCHES")}
            compiled = subprocess.run([sys.executable, os.path.join(check_dir, "compile_launches.py"), launches],
                                      env=env, capture_output=True, text=True, timeout=timeout)
            assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return proc.stdout


def triton_check_tests(test_file: str, checks):
    """The two tests of a module whose `checks(device)` compares its Triton kernels to their
    references: on CPU under the interpreter (a subprocess), and on a CUDA GPU (skipped without
    one). Assign the pair to module-level `test_*` names."""
    import pytest
    import torch

    def test_triton_kernels_under_interpreter():
        run_under_interpreter(test_file, f"t.{checks.__name__}('cpu')")

    @pytest.mark.gpu
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
    def test_triton_kernels_on_gpu():
        checks("cuda")

    return test_triton_kernels_under_interpreter, test_triton_kernels_on_gpu
