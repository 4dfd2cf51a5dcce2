"""``python -m numaserve.worker``: see ``numaserve.worker.main``."""

from numaserve.worker.main import main

if __name__ == "__main__":
    raise SystemExit(main())
