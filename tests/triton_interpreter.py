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
