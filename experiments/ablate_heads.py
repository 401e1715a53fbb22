"""ablate_heads analysis: the change of the metric when each head is zeroed (layers x heads, mean over samples),
the heads that matter most, and the heatmap RUN_DIR/plots/ablate_heads.png."""
from matplotlib.figure import Figure
import numpy as np

from hookrun.experiments._cli import grid_table, open_run


def picture(table, title: str) -> Figure:
    """A layers x heads heatmap of the mean change, diverging and centred at 0."""
    fig = Figure(figsize=(3.5 + 0.8 * table.shape[1], 1.6 + 0.45 * table.shape[0]), layout="constrained")
    ax = fig.subplots()
    bound = float(np.abs(table.to_numpy()).max()) or 1.0
    image = ax.imshow(table.to_numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    ax.set_xticks(range(table.shape[1]), [f"head {h}" for h in table.columns], fontsize=8)
    ax.set_yticks(range(table.shape[0]), table.index, fontsize=8)
    ax.set(xlabel="head", ylabel="layer")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="mean change")
    return fig


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
    title = f"{grid.metric} with one head zeroed - unablated\n(mean over {len(grid.scores)} samples)"
    picture(change, title).savefig(out, dpi=110)
    print(f"\n{out}")


if __name__ == "__main__":
    main()
