"""Record every interpreted Triton launch so it can be compiled for a real GPU afterwards.

The Triton interpreter runs kernels in numpy and so misses errors only the compiler sees (say
inconsistent return types across constexpr branches). With this directory first on PYTHONPATH and
QSASERVE_TRITON_LAUNCHES=FILE set, every process that also has TRITON_INTERPRET=1 appends each
distinct launch (kernel, argument types, constexprs, divisibility attrs, options) to FILE as a
JSON line; then `python tests/triton_compile_check/compile_launches.py FILE` compiles each one to
a cubin for sm_90 (Triton ships its own LLVM and ptxas: no GPU needed). It cannot be done in the
interpreted process itself, which patches triton.language for the interpreter.

Each launch is specialized as the GPU JIT would (Triton's own binder, create_function_from_signature
with the CUDA backend): ints equal to 1 become constexprs, ints % 16 == 0 and 16-byte-aligned
tensors get `tt.divisibility=16` (unless do_not_specialize / do_not_specialize_on_alignment). That
matters: without the attrs the compiler cannot use async copies and does not pipeline the loads, so
it reports a fraction of the shared memory the GPU launch needs (the W8A16 decode tile 64 x 64,
4 x 128-deep K steps, 3 stages: 32768 bytes unspecialized, 278528 on the H200). A tensor counts as
aligned when its byte offset in its storage is a multiple of 16: CUDA storages start 256-byte
aligned, so that is what the GPU sees, whatever the CPU allocator's alignment.

    PYTHONPATH=tests/triton_compile_check:src QSASERVE_TRITON_LAUNCHES=/tmp/launches.jsonl \
        python -m pytest tests/ops/test_attention_triton_interpret.py tests/ops/test_qsa_triton.py ...
    python tests/triton_compile_check/compile_launches.py /tmp/launches.jsonl
"""
import os

if os.environ.get("QSASERVE_TRITON_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    import inspect
    import json

    import torch
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelParam, create_function_from_signature

    _OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
    _seen: set = set()
    _binders: dict = {}
    _run = InterpretedFunction.run

    def _binder(self):
        """The GPU JIT's argument binder for this kernel (JITFunction.__init__ / create_binder)."""
        if self.fn not in _binders:
            sig = inspect.signature(self.fn)
            dns = self.kwargs.get("do_not_specialize") or []
            dns_oa = self.kwargs.get("do_not_specialize_on_alignment") or []
            params = [KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
                      for i, p in enumerate(sig.parameters.values())]
            _binders[self.fn] = (params, create_function_from_signature(sig, params, CUDABackend))
        return _binders[self.fn]

    def _gpu_aligned(t: torch.Tensor) -> bool:
        return (t.data_ptr() - t.untyped_storage().data_ptr()) % 16 == 0

    def _record(self, args, kwargs):
        params, binder = _binder(self)
        bound, specialization, _ = binder(*args, **kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for kp, (ty, spec), v in zip(params, specialization, bound.values()):
            signature[kp.name] = ty
            if ty == "constexpr":
                constexprs[kp.name] = v
            elif isinstance(spec, str):  # specialized on alignment: "D" (divisible by 16) or ""
                if isinstance(v, torch.Tensor):
                    spec = "D" if _gpu_aligned(v) else ""
                if spec:
                    attrs[kp.name] = CUDABackend.parse_attr(spec)
        line = json.dumps({"module": self.fn.__module__, "name": self.fn.__qualname__, "signature": signature,
                           "constexprs": constexprs, "attrs": attrs,
                           "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}, sort_keys=True)
        if line not in _seen:
            _seen.add(line)
            with open(os.environ["QSASERVE_TRITON_LAUNCHES"], "a") as f:
                f.write(line + "\n")

    def _recording_run(self, *args, grid, warmup, **kwargs):
        _record(self, args, kwargs)
        return _run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = _recording_run
