"""Seed 003 analysis: x.grad after a hook doubles it: [2, 2, 2, 2] (1s without the edit)."""
from hookrun.experiments._cli import open_run


def main(argv=None):
    cap = open_run(argv)
    print("x.grad:", cap.load(hook="x_grad", role="grad.0")[0].tolist())


if __name__ == "__main__":
    main()
