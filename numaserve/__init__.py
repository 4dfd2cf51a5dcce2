"""numaserve: a NUMA-aware serving supervisor for Python workloads."""

__version__ = "0.1.0"


def _import_structlog_without_rich() -> None:
    """Import structlog with ``rich`` hidden: ``structlog.dev`` imports rich and pygments
    (~10 MB, ~70 modules in every numaserve process) whenever they are installed, only for
    coloured tracebacks; ``numaserve.log`` imports rich itself when a terminal shows them."""
    import sys

    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]  # "import rich" raises ImportError meanwhile
    try:
        import structlog  # noqa: F401
    except ImportError:
        pass
    finally:
        if sys.modules.get("rich", 0) is None:
            del sys.modules["rich"]


_import_structlog_without_rich()

from numaserve.progress import report_progress  # noqa: E402  (public API: a load's progress, for status)

__all__ = ["__version__", "report_progress"]
