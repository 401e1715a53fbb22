"""ablate_heads analysis: the change of the metric when each head is zeroed (layers x heads, mean over samples),
the heads that matter most, and the heatmap RUN_DIR/plots/ablate_heads.png (hookrun.plot's, as
`python -m hookrun.plot RUN_DIR` draws it: each cell's value, the unablated mean in the title)."""
from hookrun import plot
from hookrun.experiments._cli import grid_table, open_run


def main(argv=None):
    cap = open_run(argv)
    grid = cap.grid()
    change = grid_table(cap, grid, grid.scores - grid.source[:, None, None])
    print(f"{grid.metric} without ablation: {grid.source.mean():.3f} (mean over {len(grid.scores)} samples)")
    print(f"\nmean change of {grid.metric} with one head zeroed (layers x heads):")
    print(change.round(3).to_string())
    ranked = change.stack().sort_values()
    print("\nthe heads whose ablation lowers it most:")
    print(ranked.head(3).round(3).to_string())
    out = cap.path.parent / "plots" / "ablate_heads.png"
    out.parent.mkdir(exist_ok=True)
    plot.patching_grid(cap).savefig(out, dpi=110)
    print(f"\n{out}")


if __name__ == "__main__":
    main()
