"""End of seed 000 analysis: each batch's layer input next to its output gradient, joined in the index."""
import numpy as np

from hookrun.experiments._cli import open_run

KEYS = ["layer", "batch", "call", "sample_start", "sample_stop"]


def main(argv=None):
    cap = open_run(argv)
    acts = cap.rows(hook="in_data")
    grads = cap.rows(hook="out_grads")
    pairs = acts.merge(grads, on=KEYS, suffixes=("_in", "_grad"))
    print(pairs[KEYS + ["mean_in", "mean_grad"]].to_string(index=False))
    for row in pairs.itertuples():
        x = cap.read_row({"array": row.array_in, "row_start": row.row_start_in, "row_stop": row.row_stop_in,
                          "per_sample": row.per_sample_in})
        g = cap.read_row({"array": row.array_grad, "row_start": row.row_start_grad, "row_stop": row.row_stop_grad,
                          "per_sample": row.per_sample_grad})
        print(f"batch {row.batch}: in_data {x.ravel().tolist()}  out_grads {g.ravel().tolist()}  "
              f"sum(x * grad) = {float(np.sum(x * g)):g}")


if __name__ == "__main__":
    main()
