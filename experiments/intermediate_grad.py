"""Seeds 000/003/004 analysis: the gradient of an intermediate y that autograd frees, kept by a hook.

Works for intermediate_grad (dz/dy = y = x + 2) and intermediate_grad_pow (dz/dy = 0.25 each).
"""
import numpy as np

from hookrun.experiments._cli import open_run


def main(argv=None):
    cap = open_run(argv)
    layer = cap.rows(hook="y_grad").layer.iloc[0]
    grad = cap.load(hook="y_grad", layer=layer, role="grad")[0]
    print("y_grad[0]:", grad.ravel().tolist())
    if len(cap.rows(hook="y")):
        y = cap.load(hook="y", layer=layer, role="output")[0]
        print("y:        ", y.ravel().tolist())
        print("dz/dy == y:", bool(np.allclose(grad, y)))
    print("z:", cap.batches.loss.iloc[0])


if __name__ == "__main__":
    main()
