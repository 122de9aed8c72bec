"""Triton's interpreter (``TRITON_INTERPRET=1``) runs each kernel program as Python over
numpy. Each launch patches ``triton.language`` for the interpreter, and so does every call
of a ``@triton.jit`` helper inside a program (``tl.sum``, ``tl.max``, ``tl.cdiv`` are such
helpers), re-listing every builtin with ``inspect.getmembers``: about 7 ms a call, most of
a small kernel's time. Here a launch patches both language modules once (``triton.language``
and ``triton.language.core``, which the helpers use) and helpers inside it skip the
redundant patching; the launch restores everything as before. Only the interpreter is
touched: a GPU never runs this."""

import inspect


class _AlreadyPatched:
    def restore(self) -> None:
        pass


class _Scopes:
    def __init__(self, scopes, on_restore):
        self.scopes, self.on_restore = scopes, on_restore

    def restore(self) -> None:
        for scope in reversed(self.scopes):
            scope.restore()
        self.on_restore()


def patch_once_per_launch() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_patched_once_per_launch", False) or not all(
        hasattr(interpreter, name) for name in ("_patch_lang", "_patch_builtin", "_patch_attr")
    ):
        return  # done, or a Triton whose interpreter is laid out differently: left as it is
    original = interpreter._patch_lang
    core_user = tl.standard.sum.fn  # a function whose globals hold triton.language.core
    listed: dict[int, list] = {}
    active = [False]

    def patch_builtin(pkg, builder, scope):  # the builtins never change: list them once
        if id(pkg) not in listed:
            listed[id(pkg)] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member in listed[id(pkg)]:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    def patch_lang(fn):
        if active[0]:  # a helper called inside a running launch: already patched
            return _AlreadyPatched()
        active[0] = True
        return _Scopes([original(fn), original(core_user)], lambda: active.__setitem__(0, False))

    interpreter._patch_builtin = patch_builtin
    interpreter._patch_lang = patch_lang
    interpreter._patched_once_per_launch = True
