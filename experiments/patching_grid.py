"""patching_grid analysis: the grid's mean over pairs (layers x positions), its last-position column, and the
heatmap RUN_DIR/plots/patching_grid.png (normalised: 1 = the clean answer restored, 0 = still corrupt)."""
from pathlib import Path

from hookrun import plot
from hookrun.experiments._cli import grid_table, open_run


def write_picture(cap, name: str) -> Path:
    """plot.patching_grid, normalised, as RUN_DIR/plots/<name>.png."""
    out = cap.path.parent / "plots" / f"{name}.png"
    out.parent.mkdir(exist_ok=True)
    plot.patching_grid(cap, normalised=True).savefig(out, dpi=110)
    return out


def main(argv=None):
    cap = open_run(argv)
    grid = cap.grid()
    print(f"{grid.metric}: clean {grid.source.mean():.3f}, corrupt {grid.target.mean():.3f} "
          f"(mean over {len(grid.scores)} pairs); patched {grid.roles[0]} -> {grid.roles[1]}")
    print(f"\nmean {grid.metric} with one site patched (layers x positions):")
    print(grid_table(cap, grid, grid.scores).round(3).to_string())
    normalised = grid_table(cap, grid, grid.normalised())
    print("\nnormalised (1 = the clean answer restored):")
    print(normalised.round(3).to_string())
    print("\nlast-position patching (normalised):")
    print(normalised.iloc[:, -1].round(3).to_string())
    print(f"\n{write_picture(cap, 'patching_grid')}")


if __name__ == "__main__":
    main()
