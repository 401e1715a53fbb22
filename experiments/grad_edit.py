"""Seed 001 analysis: gradients after adding 2 to c's gradient: a 39, b 21, c 3 (without the edit 13, 7, 1)."""
from hookrun.experiments._cli import open_run


def main(argv=None):
    cap = open_run(argv)
    a = cap.load(hook="ab_grad", role="grad.0").item()
    b = cap.load(hook="ab_grad", role="grad.1").item()
    c = cap.load(hook="c_grad", role="grad").item()
    print(f"tensor({a:g}) tensor({b:g}) tensor({c:g})")


if __name__ == "__main__":
    main()
