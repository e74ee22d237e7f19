"""``python -m jaxtool``."""

from jaxtool.cli import main

if __name__ == "__main__":
    main()
