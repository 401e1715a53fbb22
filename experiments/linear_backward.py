"""Seed 000 analysis: loss 5, dl/dy_p [[1], [3]], dl/dx [[2], [6]], weight grad [[7]]."""
from hookrun.experiments._cli import open_run


def main(argv=None):
    cap = open_run(argv)
    print("loss   :", cap.batches.loss.iloc[0])
    print("dl/dy_p:", cap.load(hook="bwd", role="grad_output.0").tolist())
    print("dl/dx  :", cap.load(hook="bwd", role="grad_input.0").tolist())
    print("grad   :", cap.load(hook="weight_grad", layer="weight", role="grad")[0].tolist())


if __name__ == "__main__":
    main()
