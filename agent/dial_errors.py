"""Why a dial to a router failed, in one line an operator can act on.

py-libp2p 0.8.1 reports every failed dial as "unable to connect to <peer>, no addresses
established a successful connection" and keeps the reason (a refused certificate, a
proxy's 403, a refused port) three causes down, inside a MultiError.
"""

from __future__ import annotations

# Wrappers are shallow (dial → MultiError → transport error → ssl error); a cycle or
# a pathological chain stops here.
MAX_DEPTH = 12


def root_cause(exc: BaseException) -> BaseException:
    """The innermost cause: through __cause__, and a MultiError's or an exception
    group's first error."""
    node, depth = exc, 0
    while depth < MAX_DEPTH:
        # A MultiError keeps its errors in `errors`; trio's ExceptionGroups in `exceptions`.
        errors = getattr(node, "errors", None) or getattr(node, "exceptions", None)
        if isinstance(errors, list | tuple) and errors and isinstance(errors[0], BaseException):
            node = errors[0]
        elif node.__cause__ is not None:
            node = node.__cause__
        else:
            break
        depth += 1
    return node


def describe(exc: BaseException) -> str:
    root = root_cause(exc)
    text = f"{type(exc).__name__}: {exc}"
    if root is not exc:
        text += f" (cause: {type(root).__name__}: {root})"
    return text
