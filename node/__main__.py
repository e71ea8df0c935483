"""`python -m node` and the needle-net command. Ctrl-C while the CLI's modules load (a second
or two) exits 130 without a traceback, as it does once they have loaded."""
import sys


def main() -> None:
    try:
        from node.cli import app
    except KeyboardInterrupt:
        sys.exit(130)
    app(prog_name="needle-net")


if __name__ == "__main__":
    main()
