"""Entry point for `python -m vlm_retrofit`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
