"""Record every interpreted Triton launch so it can be compiled for a real GPU afterwards.

The Triton interpreter runs kernels in numpy and so misses errors only the compiler sees (say
inconsistent return types across constexpr branches). With this directory first on PYTHONPATH and
QSASERVE_TRITON_LAUNCHES=FILE set, every process that also has TRITON_INTERPRET=1 appends each
distinct launch (kernel, argument types, constexprs, options) to FILE as a JSON line; then
`python tests/triton_compile_check/compile_launches.py FILE` compiles each one to a cubin for
sm_90 (Triton ships its own LLVM and ptxas: no GPU needed). It cannot be done in the interpreted
process itself, which patches triton.language for the interpreter.

    PYTHONPATH=tests/triton_compile_check:src QSASERVE_TRITON_LAUNCHES=/tmp/launches.jsonl \
        python -m pytest tests/ops/test_attention_triton_interpret.py tests/ops/test_qsa_triton.py ...
    python tests/triton_compile_check/compile_launches.py /tmp/launches.jsonl
"""
import os

if os.environ.get("QSASERVE_TRITON_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    import inspect
    import json

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    _DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
               torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
               torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
    _OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
    _seen: set = set()
    _run = InterpretedFunction.run

    def _arg_type(v):
        if isinstance(v, torch.Tensor):
            return "*" + _DTYPES[v.dtype]
        if isinstance(v, bool):
            return "i1"
        if isinstance(v, int):
            return "i32" if -2**31 <= v < 2**31 else "i64"
        if isinstance(v, float):
            return "fp32"
        raise TypeError(f"no Triton type for {type(v).__name__}")

    def _record(fn, args, kwargs):
        params = inspect.signature(fn).parameters
        bound = dict(zip(params, args))
        bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
        signature, constexprs = {}, {}
        for name, p in params.items():
            v = bound.get(name, p.default)
            if "constexpr" in str(p.annotation) or v is None:
                signature[name] = "constexpr"
                constexprs[name] = v
            else:
                signature[name] = _arg_type(v)
        line = json.dumps({"module": fn.__module__, "name": fn.__qualname__, "signature": signature,
                           "constexprs": constexprs, "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}},
                          sort_keys=True)
        if line not in _seen:
            _seen.add(line)
            with open(os.environ["QSASERVE_TRITON_LAUNCHES"], "a") as f:
                f.write(line + "\n")

    def _recording_run(self, *args, grid, warmup, **kwargs):
        _record(self.fn, args, kwargs)
        return _run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = _recording_run
