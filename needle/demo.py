"""The main demo: train a small MLP on scikit-learn's bundled 8x8 digits on needle's C++ `cpu`
backend, with a progress bar per epoch, and print the test accuracy (well under a minute).

    python -m needle.demo [extra needle.train options, e.g. --epochs 3 --device cpu_numpy]
"""
import sys

from needle.train import main

DEFAULTS = ["--data", "digits", "--model", "mlp", "--device", "cpu", "--epochs", "5",
            "--optimizer", "adam", "--lr", "3e-3", "--batch-size", "64"]


def run(argv: list[str]) -> float:
    print("needle demo: MLP 64-128-10 on scikit-learn's digits (1797 8x8 images), cpu backend")
    history = main(DEFAULTS + argv, stream=sys.stdout)
    accuracy = history[-1]["test_acc"]
    print(f"test accuracy after {len(history)} epochs: {accuracy:.1%}")
    return accuracy


if __name__ == "__main__":
    run(sys.argv[1:])
