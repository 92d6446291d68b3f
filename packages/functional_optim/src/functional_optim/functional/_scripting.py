"""Make ``torch.jit.script(FunctionalX)`` work from any caller.

``torch.jit.script(cls)`` resolves the names a class uses (helper functions, kernels) in the
*caller's* frame, which is why torch decorates its ``_FunctionalX`` classes at definition time.
Scripting at import would cost every user a compile and a deprecation warning, so instead each
class defines::

    @staticmethod
    def __prepare_scriptable__() -> type:
        return prepare_class(FunctionalX)

``torch.jit.script`` calls that hook first; it compiles the class once, resolving names in the
class's own module, and the rest of ``torch.jit.script`` then finds it compiled. Scripting a
function or class that merely uses ``FunctionalX`` already resolves names this way.
"""

from torch._jit_internal import _qualified_name, createResolutionCallbackForClassMethods
from torch.jit._recursive import _compile_and_register_class
from torch.jit._state import _get_script_class


def prepare_class(cls: type) -> type:
    """Compile ``cls`` for TorchScript (once), resolving names in its module; return ``cls``."""
    if _get_script_class(cls) is None:  # type: ignore[no-untyped-call]
        rcb = createResolutionCallbackForClassMethods(cls)
        _compile_and_register_class(cls, rcb, _qualified_name(cls))  # type: ignore[no-untyped-call]
    return cls
