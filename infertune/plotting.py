"""matplotlib for the commands' --plot options. It is optional (the [plot] and [test] extras install it): it is
imported only when a plot is asked for, and a command checks for it before its long work, not after."""

from __future__ import annotations

_MISSING = "--plot needs matplotlib: pip install matplotlib"


def require_matplotlib(error: type[Exception] = ValueError) -> None:
    """Raise `error` with the install hint where matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise error(_MISSING) from None


def pyplot(error: type[Exception] = ValueError):
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    require_matplotlib(error)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
