"""Seed 002 analysis: print the input and output values the seed's for_hook prints (input 1, output 2)."""
from hookrun.experiments._cli import open_run


def main(argv=None):
    cap = open_run(argv)
    print("input val:", cap.load(role="input.0").ravel().tolist())
    print("output val:", cap.load(role="output").ravel().tolist())


if __name__ == "__main__":
    main()
