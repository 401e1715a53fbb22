"""attribution analysis: the attribution grid (AtP) beside the exact patching grid of the same run, their Pearson
correlation per cell and over the sites' means, the verified sites, and both heatmaps in RUN_DIR/plots."""
from hookrun import plot
from hookrun.experiments._cli import grid_table, open_run


def main(argv=None):
    cap = open_run(argv)
    estimate = cap.read("attribution")
    print(f"{estimate.metric}: clean {estimate.source.mean():.3f}, corrupt {estimate.target.mean():.3f} (mean over "
          f"{len(estimate.scores)} pairs); attribution ({estimate.method}) {estimate.roles[0]} -> {estimate.roles[1]}")
    print(f"\nestimated mean change of {estimate.metric} (layers x positions):")
    print(grid_table(cap, estimate, estimate.change()).round(3).to_string())
    if cap.attrs.get("patching"):
        exact = cap.grid()
        print("\nexact mean change (patching):")
        print(grid_table(cap, exact, exact.change()).round(3).to_string())
        print(f"\nPearson(AtP, exact): {estimate.corr(exact):.3f} per cell (sample x layer x position), "
              f"{estimate.corr(exact, mean=True):.3f} over the sites' means")
    if estimate.exact is not None:
        print("\nverified sites (the largest estimates of each batch, patched exactly; mean change):")
        print(estimate.verified().round(3).to_string(index=False))
    plots = cap.path.parent / "plots"
    plots.mkdir(exist_ok=True)
    for name, method in (("attribution", "attribution"), ("patching", "patching")):
        if method == "attribution" or cap.attrs.get("patching"):
            plot.patching_grid(cap, method=method).savefig(plots / f"{name}.png", dpi=110)
            print(plots / f"{name}.png")


if __name__ == "__main__":
    main()
