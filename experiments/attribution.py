"""attribution analysis: the attribution grid (AtP) beside the exact patching grid of the same run, their Pearson
correlation per cell and over the sites' means, the verified sites, and both heatmaps in RUN_DIR/plots.

Every sites alternative of docs/attribution.md reads: layers x positions, layers x heads, layers x neurons (the
largest sites listed). The estimate is compared with the exact grid only over the same sites; a run whose exact
grid has other sites (the bundled experiment's layers x positions beside an estimate over heads) says so."""
from hookrun import plot
from hookrun.experiments._cli import grid_table, open_run

WIDE = 16  # grids with more sites than this a layer (neurons) print their largest sites instead of the table


def show(cap, grid, values, what: str) -> None:
    """The mean over samples (layers x sites), or for a wide grid its 10 largest sites by |mean|."""
    table = grid_table(cap, grid, values)
    if table.shape[1] <= WIDE:
        print(f"\n{what} (layers x {grid.axis}s):")
        print(table.round(3).to_string())
        return
    ranked = table.stack()
    ranked = ranked.reindex(ranked.abs().sort_values(ascending=False).index).head(10)
    print(f"\n{what}: the 10 largest of {table.size} sites (layers x {table.shape[1]} {grid.axis}s):")
    print(ranked.rename_axis(["layer", grid.axis]).rename("mean change").round(3).to_string())


def main(argv=None):
    cap = open_run(argv)
    estimate = cap.read("attribution")
    print(f"{estimate.metric}: clean {estimate.source.mean():.3f}, corrupt {estimate.target.mean():.3f} (mean over "
          f"{len(estimate.scores)} pairs); attribution ({estimate.method}) {estimate.roles[0]} -> {estimate.roles[1]}")
    show(cap, estimate, estimate.change(), f"estimated mean change of {estimate.metric}")
    exact = cap.grid() if cap.attrs.get("patching") else None
    if exact is not None:
        show(cap, exact, exact.change(), "exact mean change (patching)")
        same = (exact.layers, exact.axis, list(exact.labels)) == (estimate.layers, estimate.axis, list(estimate.labels))
        if same:
            print(f"\nPearson(AtP, exact): {estimate.corr(exact):.3f} per cell (sample x layer x {estimate.axis}), "
                  f"{estimate.corr(exact, mean=True):.3f} over the sites' means")
        else:
            print(f"\nnot compared: the exact grid is over {len(exact.layers)} layers x {len(exact.labels)} "
                  f"{exact.axis}s, the estimate over {len(estimate.layers)} layers x {len(estimate.labels)} "
                  f"{estimate.axis}s (give patching.sites the attribution's sites to compare them; the verified "
                  "sites below are exact)")
    if estimate.exact is not None:
        print("\nverified sites (the largest estimates of each batch, patched exactly; mean change):")
        print(estimate.verified().round(3).to_string(index=False))
    plots = cap.path.parent / "plots"
    plots.mkdir(exist_ok=True)
    for name, method in (("attribution", "attribution"), ("patching", "patching")):
        if method == "attribution" or exact is not None:
            plot.patching_grid(cap, method=method).savefig(plots / f"{name}.png", dpi=110)
            print(plots / f"{name}.png")


if __name__ == "__main__":
    main()
